#!/usr/bin/env bash
# The GPU pass: ddpkit's GPU tests and its GPU numbers in one go, on any machine with a CUDA GPU.
#
#     benchmarks/gpu_pass.sh [RESULTS_DIR]        # default: benchmarks/results/gpu-<host>-<date>
#
# Writes into RESULTS_DIR, one file per step: env.txt (GPU, driver, torch, CUDA, NCCL), doctor.txt and
# doctor.json, pytest-gpu.txt (`pytest -m gpu`), bench-*.json and bench-*.txt (`ddpkit bench`, ResNet-50 on
# synthetic data at fp32, tf32, bf16, bf16 + channels_last, the same with torch.compile, DDP with
# gradient_as_bucket_view and static_graph, and from a folder of JPEGs and its pack, decoded by the loader's CPU
# processes and by nvJPEG), decode-gil.txt (benchmarks/decode_gil.py: whether nvJPEG's decode_jpeg lets go of the
# GIL), profile-folder-*.txt and .json (benchmarks/profile_files.py: where a file-fed step's
# time goes), checkpoint-blocking.txt and .json (benchmarks/checkpoint_blocking.py: full, sharded
# and sharded async saves of FSDP state from the GPU), loader-throughput.txt (benchmarks/loader_throughput.py), image-decode-cpu.txt
# (benchmarks/image_decode.py), train-*/ (`ddpkit train` resnet18 with --amp bf16/fp16
# under ddp, zero and fsdp: metrics.jsonl holds each rank's peak memory; and as two replica groups against one
# process on the same global batch), replica-groups-job.txt (tests/test_replica_groups_job.py on the GPU), sync-bn-cost.txt and
# .json (benchmarks/sync_bn_cost.py: ddpkit's BatchNorm over all ranks against PyTorch's on one GPU) and steps.txt
# (each step's exit status and seconds). `python benchmarks/gpu_tables.py RESULTS_DIR` turns them into docs/benchmarks.md's tables.
#
# Set-up: the project is used from this checkout. When `import ddpkit` fails, it is installed as the README
# says (pip install -e ".[test]"). On a machine that cannot reach a package registry but already holds torch,
# torchvision and pytest, run it as `PYTHONPATH=src benchmarks/gpu_pass.sh`.
# PYTHON: the interpreter (default python3). GPU_PASS_BUDGET_S: stop starting steps once this many seconds
# have passed (a step that would not fit is recorded as skipped); 0 (the default) never stops.
# ONLY: a regular expression; only the steps whose names match run (e.g. ONLY='^bench-').
# BATCH: images per GPU for ResNet-50 (default 256, the published anchors' batch).
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_PASS_BUDGET_S:-0}
BATCH=${BATCH:-256}
OUT_DIR=${1:-benchmarks/results/gpu-$(hostname -s)-$(date +%Y%m%d)}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
STARTED=$(date +%s)
export PYTHONUNBUFFERED=1

if ! "$PYTHON" -c "import ddpkit" 2>/dev/null; then
    "$PYTHON" -m pip install -q --retries 1 --timeout 10 -e ".[test]" >"$OUT_DIR/install.txt" 2>&1 \
        || { echo "pip install -e .[test] failed: see $OUT_DIR/install.txt (offline? PYTHONPATH=src $0)" >&2; exit 2; }
fi

# step NAME LIMIT_S NEEDS_S COMMAND...: run COMMAND (output to NAME.txt) for at most LIMIT_S seconds, when
# NEEDS_S more seconds fit in the budget; record its status and time.
step() {
    local name=$1 limit=$2 needs=$3; shift 3
    local now; now=$(date +%s)
    if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then return; fi
    if [ "$BUDGET" -gt 0 ] && [ $((now - STARTED + needs)) -gt "$BUDGET" ]; then
        echo "$name skipped (needs ${needs}s, $((BUDGET - (now - STARTED)))s of the budget left)" | tee -a "$OUT_DIR/steps.txt"
        return
    fi
    timeout -k 10 "$limit" bash -c '"$@"' "$name" "$@" >"$OUT_DIR/$name.txt" 2>&1  # bash: runs the functions below
    local status=$?
    echo "$name exit=$status seconds=$(($(date +%s) - now))" | tee -a "$OUT_DIR/steps.txt"
}

ddpkit() { "$PYTHON" -m ddpkit "$@"; }

environment() {
    nvidia-smi
    nvidia-smi topo -m
    "$PYTHON" - <<'EOF'
import os, platform, torch, torchvision
print("python", platform.python_version(), "torch", torch.__version__, "torchvision", torchvision.__version__)
print("cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "nccl", ".".join(map(str, torch.cuda.nccl.version())))
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu{i}", p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs")
print("cpus", os.cpu_count())
EOF
}

# bench NAME ARGS...: ResNet-50, synthetic data unless ARGS say otherwise, one GPU.
bench() {
    local name=$1; shift
    ddpkit bench --model resnet50 --image-size 224 --batch-size "$BATCH" --nproc 1 --warmup 5 --steps 10 --repeats 3 \
        --json "$OUT_DIR/bench-$name.json" "$@"
}

train() {  # train NAME ARGS...: resnet18 on synthetic data, one GPU, into train-NAME/
    ddpkit train --model resnet18 --data synthetic:8192 --epochs 1 --batch-size 256 --nproc-per-node 1 \
        --no-progress --output-dir "$OUT_DIR/train-$1" "${@:2}"
}

unchanged_one_process() {  # each round: plain python, then --unchanged on one process (reversed every other round)
    local loop=benchmarks/unchanged_loop.py args="--model resnet50 --image-size 224 --batch-size 128 --steps 40"
    for round in 0 1 2 3; do
        local plain=("$PYTHON" "$loop" $args) unchanged=("$PYTHON" -m ddpkit run --unchanged --seed 0 \
            --nproc-per-node 1 "$loop" $args)
        if [ $((round % 2)) = 0 ]; then
            echo "plain $("${plain[@]}" | tail -n 1)"; echo "unchanged $("${unchanged[@]}" | tail -n 1)"
        else
            echo "unchanged $("${unchanged[@]}" | tail -n 1)"; echo "plain $("${plain[@]}" | tail -n 1)"
        fi
    done
    # Two processes on a machine with more GPUs: each sees one.
    if [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        "$PYTHON" -m ddpkit run --unchanged --seed 0 --nproc-per-node 2 "$loop" $args
    fi
}

export PYTHON BATCH OUT_DIR
export -f ddpkit environment bench train unchanged_one_process
# In order of what is most wanted when the budget runs out (issue 45 first): the card; DDP at world size 1 (no
# DDP wrapper at one process now) against no DDP; from JPEGs against synthetic data; the GPU tests;
# --unchanged at one process; then the rest.
step env 60 5 environment
# The headline: bf16 + channels_last, no DDP vs DDP vs DataParallel on one GPU (goal: DDP >= 99% of no DDP).
step bench-bf16-cl 150 50 bench bf16-cl --precision bf16 --channels-last --strategies single,ddp,dp
# From JPEGs (ddpkit data make-images: 500x375, quality 90), beside synthetic data in the same processes: decoded by
# nvJPEG on the loader's own thread and stream, crops batched (gpu), by the loader processes (cpu), and from a pack
# of the same folder (gpu). 30,000 images: 117 steps of 256 an epoch, so a bench run crosses one epoch start at
# most (the first passes' 6,000 crossed one in most rounds), and the workers of image data now outlive an epoch.
JPEGS="$OUT_DIR/../gpu-pass-jpegs"
step jpegs 300 90 ddpkit data make-images "$JPEGS/folder" --images 30000 --val 0 --classes 100
step pack 240 40 ddpkit data pack "$JPEGS/folder" "$JPEGS/packed"
step bench-folder-gpu-decode 200 60 bench folder-gpu-decode --precision bf16 --channels-last --strategies ddp \
    --data "folder:$JPEGS/folder" --decode gpu --steps 20
step bench-folder-cpu-decode 200 60 bench folder-cpu-decode --precision bf16 --channels-last --strategies ddp \
    --data "folder:$JPEGS/folder" --decode cpu --steps 20
step bench-shards-gpu-decode 200 60 bench shards-gpu-decode --precision bf16 --channels-last --strategies ddp \
    --data "shards:$JPEGS/packed" --decode gpu --steps 20
step bench-shards-cpu-decode 200 60 bench shards-cpu-decode --precision bf16 --channels-last --strategies ddp \
    --data "shards:$JPEGS/packed" --decode cpu --steps 20
# What `--decode auto` picks on this machine (measured by rank 0 since 2026-11-28; its table says which), and its rate.
step bench-folder-auto-decode 200 60 bench folder-auto-decode --precision bf16 --channels-last --strategies ddp \
    --data "folder:$JPEGS/folder" --decode auto --steps 20
step pytest-gpu 240 70 "$PYTHON" -m pytest -m gpu -n 3 --dist load -p no:cacheprovider tests/test_gpu.py \
    tests/test_images.py
# ddpkit run --unchanged at one process against plain `python script.py` on the same GPU (goal: at most 1% slower), and
# the one GPU each process sees (issue 54): benchmarks/unchanged_loop.py, 4 rounds alternating which goes first.
step unchanged-one-process 150 60 unchanged_one_process
step sync-bn-cost 120 30 ddpkit run --nproc-per-node 1 benchmarks/sync_bn_cost.py --batch-size 128 \
    --json "$OUT_DIR/sync-bn-cost.json"
# Whether nvJPEG's decode_jpeg lets go of the GIL (a Python loop's pace beside a thread that decodes).
step decode-gil 60 15 "$PYTHON" benchmarks/decode_gil.py --device cuda --images 64
# Where a file-fed step's time goes (torch.profiler over 10 steps): the wait for the workers, nvJPEG, the crops,
# the GPU's busy time per step; and one host core's decoding (the ceiling of the CPU path is cores x this).
step profile-folder-gpu-decode 180 50 "$PYTHON" benchmarks/profile_files.py --data "folder:$JPEGS/folder" --decode gpu \
    --batch "$BATCH" --json "$OUT_DIR/profile-folder-gpu-decode.json" --trace "$OUT_DIR/profile-folder-gpu-decode.json.gz"
step profile-folder-cpu-decode 180 50 "$PYTHON" benchmarks/profile_files.py --data "folder:$JPEGS/folder" --decode cpu \
    --batch "$BATCH" --json "$OUT_DIR/profile-folder-cpu-decode.json"
step image-decode-cpu 120 30 "$PYTHON" benchmarks/image_decode.py --images 400 --repeats 5
# How long a save blocks training, and what a step costs while the write runs: full, sharded, sharded async.
step checkpoint-blocking 150 40 ddpkit run --nproc-per-node 1 benchmarks/checkpoint_blocking.py --strategy fsdp \
    --width 4096 --layers 8 --batch 2048 --rounds 3 --json "$OUT_DIR/checkpoint-blocking.json"
# DDP's settings at world size 1 no longer matter (no DDP there); kept to compare with the earlier passes.
step bench-bf16-cl-ddp-views 150 40 bench bf16-cl-ddp-views --precision bf16 --channels-last --strategies single,ddp \
    --gradient-as-bucket-view --static-graph
# Replica groups (issue 31, docs/replica-groups.md): two groups of one process each, which share the GPU when
# there is one (their all-reduce is gloo's, through host memory), against one process on the same global batch.
# Needs torchft (pip install 'ddpkit[ft]').
step train-replica-groups 150 45 train replica-groups --batch-size 128 --replica-groups 2
# The same with FSDP inside each group (HSDP's code path; with one process per group nothing is sharded).
step train-replica-groups-fsdp 150 45 train replica-groups-fsdp --batch-size 128 --replica-groups 2 --strategy fsdp
step train-one-process 90 20 train one-process
# A script of one's own on ddpkit.Job as two replica groups on the GPU: a group killed in the all-reduce, restarted
# twice, each time copying the live group's state before its loop (the join's zero buckets are CUDA tensors here).
step replica-groups-job 150 30 "$PYTHON" -m pytest -n 0 -p no:cacheprovider tests/test_replica_groups_job.py
# What the loader alone delivers to the GPU per decoding mode (no model): the ceiling of the runs from files.
step loader-throughput 240 60 "$PYTHON" benchmarks/loader_throughput.py --folder "$JPEGS/folder" --batch "$BATCH" \
    --batches 10 --repeats 3
# Each of DDP's two settings alone.
step bench-bf16-cl-ddp-bucket-view 150 40 bench bf16-cl-ddp-bucket-view --precision bf16 --channels-last \
    --strategies single,ddp --gradient-as-bucket-view
step bench-bf16-cl-ddp-static 150 40 bench bf16-cl-ddp-static --precision bf16 --channels-last \
    --strategies single,ddp --static-graph
# torch.compile (compiling takes a minute or two): from JPEGs with nvJPEG, then synthetic against the eager rows.
step bench-folder-gpu-decode-compile 300 110 bench folder-gpu-decode-compile --precision bf16 --channels-last \
    --compile --strategies ddp --data "folder:$JPEGS/folder" --decode gpu --steps 20
step bench-bf16-cl-compile 240 100 bench bf16-cl-compile --precision bf16 --channels-last --compile --strategies ddp
step doctor 60 10 ddpkit doctor
step doctor-json 60 10 ddpkit doctor --json "$OUT_DIR/doctor.json"
step bench-fp32 150 40 bench fp32 --precision fp32 --strategies single,ddp
step bench-tf32 120 30 bench tf32 --precision tf32 --strategies ddp
step bench-bf16 120 30 bench bf16 --precision bf16 --strategies ddp
rm -rf "$JPEGS"
for amp in bf16 fp16; do
    step "train-ddp-$amp" 120 25 train "ddp-$amp" --strategy ddp --amp "$amp"
    step "train-fsdp-$amp" 120 25 train "fsdp-$amp" --strategy fsdp --amp "$amp"
done
step train-zero-bf16 120 25 train zero-bf16 --strategy ddp --zero --amp bf16
# checkpoints are not results: keep metrics and logs only
find "$OUT_DIR" -path '*/train-*' -type f ! -name 'metrics.jsonl' ! -name '*.log' ! -name '*.txt' ! -name '*.toml' -delete
find "$OUT_DIR" -depth -type d -empty -delete
echo "total seconds=$(($(date +%s) - STARTED))" | tee -a "$OUT_DIR/steps.txt"
