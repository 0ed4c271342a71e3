"""A training loop written for one device, timed step by step: what ``benchmarks/unchanged.py`` runs under
``ddpkit run --unchanged`` and, with ``--prepare``, on ``ddpkit.Job.prepare`` (each process taking its own batch of
``--batch-size``, so the driver halves it there to keep the global batch).

    python -m ddpkit run --unchanged --nproc-per-node 2 benchmarks/unchanged_loop.py --batch-size 64
    python -m ddpkit run --nproc-per-node 2 benchmarks/unchanged_loop.py --prepare --batch-size 32

Model: a torchvision ResNet (``--model``, default resnet18) on synthetic 3 x 64 x 64 images, SGD, a DataLoader over
a TensorDataset (no decoding: the step is the model's), on the GPU where there is one (``cuda``, as a one-device
script says it). Prints one JSON line (rank 0, or the one process): the median seconds per step after ``--warmup``
steps, with the quartiles, over ``--steps`` timed steps, and the GPUs the process sees.
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="resnet18")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--image-size", type=int, default=64)
parser.add_argument("--warmup", type=int, default=5)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--prepare", action="store_true", help="the loop on ddpkit.Job.prepare (a changed script)")
args = parser.parse_args()

torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as a one-device script picks it
model = torchvision.models.__dict__[args.model](num_classes=10).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
images = torch.randn(args.batch_size * 8, 3, args.image_size, args.image_size)
loader = DataLoader(TensorDataset(images, torch.randint(0, 10, (len(images),))), batch_size=args.batch_size,
                    shuffle=True, drop_last=True)
speaks = True
if args.prepare:
    import ddpkit

    job = ddpkit.Job()
    model, optimizer, loader = job.prepare(model, optimizer, loader)
    speaks = job.is_main

times = []
model.train()
while len(times) < args.warmup + args.steps:
    start = time.perf_counter()
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - start)
        start = now
        if len(times) == args.warmup + args.steps:
            break
timed = sorted(times[args.warmup:])
if speaks:
    quartiles = statistics.quantiles(timed, n=4)
    print(json.dumps({"median_s": statistics.median(timed), "q1_s": quartiles[0], "q3_s": quartiles[2],
                      "steps": len(timed), "device": str(device), "visible_gpus": torch.cuda.device_count()}))
