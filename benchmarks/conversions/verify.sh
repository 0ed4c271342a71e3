#!/usr/bin/env bash
# Run every original (1 process) and every conversion (2 CPU processes, torchrun)
# briefly on the tiny offline data, one run at a time, each under nice -n 19.
#   bash benchmarks/conversions/verify.sh [WORKDIR]      (default /tmp/ddpkit-conversions)
# Prints the lines that show training, evaluation counts, checkpoints and resume.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY="$REPO/.venv/bin/python"
TR="$REPO/.venv/bin/torchrun --nproc-per-node 2"
W="${1:-/tmp/ddpkit-conversions}"
D="$W/data"
rm -rf "$W" && mkdir -p "$W"
run() { echo "\$ $*" | sed "s#$HERE/##g; s#$REPO/.venv/bin/##g" >&2; timeout 300 nice -n 19 "$@" 2>&1; }

echo "## data"
run $PY "$HERE/make_data.py" --out "$D"

echo "## imagenet"
IM="$D/imagefolder --num-classes 6 --image-size 64 -j 0 --lr 0.01 -p 5 --seed 0"
KEEP='^( \*|Epoch|=> (loading|loaded))|Error'
for v in original with_accelerate with_fabric; do
  mkdir -p "$W/imagenet_$v" && cd "$W/imagenet_$v"
  if [ $v = original ]; then L="$PY"; B="-b 16"; X=""; else L="$TR"; B="-b 8"; X=""; fi
  [ $v = with_fabric ] && X="--devices 2"
  run $L "$HERE/imagenet/$v.py" $IM $B --epochs 2 $X | grep -E "$KEEP" || true
  run $L "$HERE/imagenet/$v.py" $IM $B --epochs 3 --resume checkpoint.pth.tar $X | grep -E "$KEEP" || true
done
echo "-- the original's final checkpoint evaluated by each version (-e)"
for v in original with_accelerate with_fabric; do
  cd "$W/imagenet_$v"
  if [ $v = original ]; then L="$PY"; X=""; else L="$TR"; X=""; fi
  [ $v = with_fabric ] && X="--devices 2"
  run $L "$HERE/imagenet/$v.py" $IM -b 8 -e --resume "$W/imagenet_original/checkpoint.pth.tar" $X | grep -E '^ \*|Error' || true
done

echo "## vae"
for v in original with_accelerate with_fabric; do
  mkdir -p "$W/vae_$v" && cd "$W/vae_$v"
  if [ $v = original ]; then L="$PY"; B=32; X=""; else L="$TR"; B=16; X=""; fi
  [ $v = with_fabric ] && X="--devices 2"
  run $L "$HERE/vae/$v.py" --data "$D" --epochs 2 --batch-size $B --log-interval 20 $X | grep -E '^(Train|====>)|Error' || true
  ls results
done

echo "## nanogpt"
NG="--dataset $D/chargpt --n_layer 2 --n_head 2 --n_embd 64 --block_size 64 --batch_size 8 --gradient_accumulation_steps 4 \
--eval_interval 20 --eval_iters 10 --log_interval 10 --warmup_iters 5 --lr_decay_iters 40 --learning_rate 3e-3 --min_lr 3e-4 \
--compile False --dtype bfloat16 --device cpu"
KEEP='^(tokens|step|iter|saving|Resuming)|Error'
for v in original with_accelerate with_fabric; do
  cd "$W"
  if [ $v = original ]; then L="$PY"; X=""; else L="$TR"; X=""; fi
  [ $v = with_fabric ] && X="--devices 2"
  run $L "$HERE/nanogpt/$v.py" $NG --out_dir "gpt_$v" --max_iters 40 $X | grep -E "$KEEP" || true
  run $L "$HERE/nanogpt/$v.py" $NG --out_dir "gpt_$v" --max_iters 60 --init_from resume $X | grep -E "$KEEP" || true
done

echo "## evaluation counts (documented gather/all_reduce on range(N), 2 processes)"
cd "$HERE"
run $TR check_eval_counts.py accelerate | grep -E '^\|' || true
run $TR check_eval_counts.py fabric | grep -E '^\|' || true

echo "## line counts"
run $PY "$HERE/count.py"
