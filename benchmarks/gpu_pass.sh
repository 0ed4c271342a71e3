#!/usr/bin/env bash
# The GPU pass: ddpkit's GPU tests and its GPU numbers in one go, on any machine with a CUDA GPU.
#
#     benchmarks/gpu_pass.sh [RESULTS_DIR]        # default: benchmarks/results/gpu-<host>-<date>
#
# Writes into RESULTS_DIR, one file per step: env.txt (GPU, driver, torch, CUDA, NCCL), doctor.txt and
# doctor.json, pytest-gpu.txt (`pytest -m gpu`), bench-*.json and bench-*.txt (`ddpkit bench`, ResNet-50 on
# synthetic data at fp32, tf32, bf16, bf16 + channels_last, the same with torch.compile, and from a folder
# of JPEGs decoded by the loader's CPU processes), train-*/ (`ddpkit train` resnet18 with --amp bf16/fp16
# under ddp, zero and fsdp: metrics.jsonl holds each rank's peak memory) and steps.txt (each step's exit
# status and seconds). `python benchmarks/gpu_tables.py RESULTS_DIR` turns them into docs/benchmarks.md's tables.
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

jpeg_folder() {  # a few thousand JPEGs of ImageNet's typical size, ten classes
    "$PYTHON" - "$1" <<'EOF'
import os, sys
from concurrent.futures import ProcessPoolExecutor
import numpy as np
from PIL import Image

root = sys.argv[1]

def write(i):
    rng = np.random.default_rng(i)
    # smooth colour fields with noise: about the size and entropy of a photograph's JPEG
    y, x = np.mgrid[0:375, 0:500] / 60.0
    base = np.stack([np.sin(x * rng.uniform(0.2, 2) + c) * np.cos(y * rng.uniform(0.2, 2)) for c in range(3)], -1)
    pixels = np.clip((base * 0.4 + 0.5) * 255 + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    folder = os.path.join(root, f"class{i % 10}")
    os.makedirs(folder, exist_ok=True)
    Image.fromarray(pixels).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)

with ProcessPoolExecutor() as pool:
    list(pool.map(write, range(3000), chunksize=50))
print("wrote 3000 JPEGs under", root)
EOF
}

train() {  # train NAME ARGS...: resnet18 on synthetic data, one GPU, into train-NAME/
    ddpkit train --model resnet18 --data synthetic:8192 --epochs 1 --batch-size 256 --nproc-per-node 1 \
        --no-progress --output-dir "$OUT_DIR/train-$1" "${@:2}"
}

export PYTHON BATCH OUT_DIR
export -f ddpkit environment bench jpeg_folder train
step env 60 5 environment
step doctor 60 10 ddpkit doctor
step doctor-json 60 10 ddpkit doctor --json "$OUT_DIR/doctor.json"
step pytest-gpu 240 120 "$PYTHON" -m pytest -m gpu -n 0 -p no:cacheprovider tests/test_gpu.py
# The headline first: bf16 + channels_last, no DDP vs DDP vs DataParallel on one GPU.
step bench-bf16-cl 150 50 bench bf16-cl --precision bf16 --channels-last --strategies single,ddp,dp
# torch.compile against the eager DDP row above (compiling takes a minute or two).
step bench-bf16-cl-compile 240 100 bench bf16-cl-compile --precision bf16 --channels-last --compile --strategies ddp
step bench-fp32 150 40 bench fp32 --precision fp32 --strategies single,ddp
step bench-tf32 120 30 bench tf32 --precision tf32 --strategies ddp
step bench-bf16 120 30 bench bf16 --precision bf16 --strategies ddp
step jpegs 120 15 jpeg_folder "$OUT_DIR/../gpu-pass-jpegs"
step bench-folder-cpu-decode 150 40 bench folder-cpu-decode --precision bf16 --channels-last --strategies ddp \
    --data "folder:$OUT_DIR/../gpu-pass-jpegs"
rm -rf "$OUT_DIR/../gpu-pass-jpegs"
for amp in bf16 fp16; do
    step "train-ddp-$amp" 120 25 train "ddp-$amp" --strategy ddp --amp "$amp"
    step "train-fsdp-$amp" 120 25 train "fsdp-$amp" --strategy fsdp --amp "$amp"
done
step train-zero-bf16 120 25 train zero-bf16 --strategy ddp --zero --amp bf16
# checkpoints are not results: keep metrics and logs only
find "$OUT_DIR" -path '*/train-*' -type f ! -name 'metrics.jsonl' ! -name '*.log' ! -name '*.txt' ! -name '*.toml' -delete
find "$OUT_DIR" -depth -type d -empty -delete
echo "total seconds=$(($(date +%s) - STARTED))" | tee -a "$OUT_DIR/steps.txt"
