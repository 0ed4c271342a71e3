#!/usr/bin/env bash
# Run every original (1 process) and every conversion (2 CPU processes: torchrun for Accelerate and Fabric, ddpkit run
# for ddpkit's) briefly on the tiny offline data, one run at a time, each under nice -n 19. The originals are read
# from the corpus beside the project (../shared/corpus); each conversion is written out onto its original first
# (convert.py), into the work folder.
#   bash benchmarks/conversions/verify.sh [WORKDIR]      (default /tmp/ddpkit-conversions)
# Prints the lines that show training, evaluation counts, checkpoints and resume.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY="$REPO/.venv/bin/python"
TR="$REPO/.venv/bin/torchrun --nproc-per-node 2"
DK="$REPO/.venv/bin/ddpkit run --nproc-per-node 2"
W="${1:-/tmp/ddpkit-conversions}"
D="$W/data"
rm -rf "$W" && mkdir -p "$W"
run() { echo "\$ $*" | sed "s#$W/##g; s#$REPO/.venv/bin/##g" >&2; timeout 300 nice -n 19 "$@" 2>&1; }
# The folder of one version of a script: the original's copy, or its conversion written out by convert.py.
lay_out() {  # SCRIPT VERSION -> the folder, with the script in it
  local folder="$W/$1_$2"
  if [ "$2" = original ]; then
    mkdir -p "$folder"
    case $1 in
      imagenet) cp "$REPO/../shared/corpus/pytorch-examples/imagenet/main.py" "$folder/" ;;
      vae) cp "$REPO/../shared/corpus/pytorch-examples/vae/main.py" "$folder/" ;;
      nanogpt) cp "$REPO/../shared/corpus/nanogpt/"{train,model,configurator}.py "$folder/" ;;
    esac
  else
    "$PY" "$HERE/convert.py" "$1" "$2" "$folder" >/dev/null
  fi
  echo "$folder"
}
launcher() {  # VERSION -> the command that starts it
  case $1 in original) echo "$PY" ;; ddpkit) echo "$DK" ;; *) echo "$TR" ;; esac
}

echo "## data"
run "$PY" "$HERE/make_data.py" --out "$D"

echo "## imagenet"
IM="$D/imagefolder -a shufflenet_v2_x0_5 -j 0 --lr 0.01 -p 5 --seed 0"
KEEP='^( \*|Epoch: \[[0-9]\]\[ *1/|=> (loading|loaded))|Error'
for v in original ddpkit accelerate fabric; do
  cd "$(lay_out imagenet $v)"
  B="-b 8"; X=""
  [ $v = original ] && B="-b 16"
  [ $v = fabric ] && X="--devices 2"
  run $(launcher $v) main.py $IM $B --epochs 2 $X | grep -E "$KEEP" || true
  run $(launcher $v) main.py $IM $B --epochs 3 --resume checkpoint.pth.tar $X | grep -E "$KEEP" || true
done
echo "-- the original's final checkpoint evaluated by each version (-e)"
for v in original ddpkit accelerate fabric; do
  cd "$W/imagenet_$v"
  X=""; [ $v = fabric ] && X="--devices 2"
  run $(launcher $v) main.py $IM -b 8 -e --resume "$W/imagenet_original/checkpoint.pth.tar" $X | grep -E '^ \*|Error' || true
done

echo "## vae (its MNIST from ../data, its images into results/)"
for v in original ddpkit accelerate fabric; do
  cd "$(lay_out vae $v)" && mkdir -p results && ln -sfn "$D" ../data
  B=16; X=""
  [ $v = original ] && B=32
  [ $v = fabric ] && X="--devices 2"
  run $(launcher $v) main.py --epochs 2 --batch-size $B --log-interval 20 $X | grep -E '^(Train|====>)|Error' || true
  ls results
done

echo "## nanogpt (its data from data/<dataset>, its configurator from the folder it runs in)"
NG="--dataset=chargpt --n_layer=2 --n_head=2 --n_embd=64 --block_size=64 --batch_size=8 --gradient_accumulation_steps=4
--eval_interval=20 --eval_iters=10 --log_interval=10 --warmup_iters=5 --lr_decay_iters=40 --learning_rate=3e-3
--min_lr=3e-4 --compile=False --dtype=float32 --device=cpu"
KEEP='^(tokens|step|iter|saving|Resuming)|Error'
for v in original ddpkit accelerate fabric; do
  cd "$(lay_out nanogpt $v)" && mkdir -p data && ln -sfn "$D/chargpt" data/chargpt
  run $(launcher $v) train.py $NG --out_dir=gpt --max_iters=40 | grep -E "$KEEP" || true
  run $(launcher $v) train.py $NG --out_dir=gpt --max_iters=60 --init_from=resume | grep -E "$KEEP" || true
done

echo "## evaluation counts (documented gather/all_reduce on range(N), 2 processes)"
cd "$HERE"
run $TR check_eval_counts.py accelerate | grep -E '^\|' || true
run $TR check_eval_counts.py fabric | grep -E '^\|' || true

echo "## line counts"
run "$PY" "$HERE/count.py"
