"""What a gathered loader's batch costs each way (``ddpkit run --unchanged``, docs/unchanged.md, "Whole batches, read
once"): gathering the collated shares against reading the whole batch on every process.

    .venv/bin/python benchmarks/gathered_batch.py [--batch 256] [--size 224] [--processes 2] [--json FILE]

1. **Gathering**: ``ddpkit.unchanged.loading.gathered_rows`` of an ImageNet-shaped batch (``--batch`` images of 3 ×
   ``--size`` × ``--size`` in float32, and their int64 labels), each of ``--processes`` processes holding its share,
   over a gloo group on this machine's loopback, as ddpkit's control group carries it: the median of 7, after 2.
2. **Reading**: one JPEG of 500 × 375 pixels (ImageNet's typical size) decoded with PIL and put through the ImageNet
   trainer's training transforms (``RandomResizedCrop(224)``, a flip, ``ToTensor``, ``Normalize``), on one thread:
   the median of 50. Reading the whole batch on every process costs each process (N-1)/N × batch × that more.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def gather_times(rank: int, world: int, port: int, batch: int, size: int, out: str) -> None:
    from ddpkit.data.split_batches import share_sizes
    from ddpkit.unchanged.loading import gathered_rows

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sizes = share_sizes(batch, world_size=world)
    mine = (torch.randn(sizes[rank], 3, size, size), torch.randint(0, 1000, (sizes[rank],)))
    times = []
    for _ in range(9):
        dist.barrier()
        start = time.perf_counter()
        whole = gathered_rows(mine, sizes=sizes, rank=rank)
        times.append(time.perf_counter() - start)
    assert whole[0].shape == (batch, 3, size, size)
    if rank == 0:
        Path(out).write_text(json.dumps(times[2:]))
    dist.destroy_process_group()


def read_time(size: int) -> float:
    from PIL import Image
    from torchvision import transforms

    encoded = io.BytesIO()
    Image.effect_noise((500, 375), 64).convert("RGB").save(encoded, format="JPEG", quality=90)
    pipeline = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(),
                                   transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    times = []
    for _ in range(50):
        start = time.perf_counter()
        pipeline(Image.open(io.BytesIO(encoded.getvalue())).convert("RGB"))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"gathered-batch-{os.getpid()}.json"
    mp.start_processes(gather_times, args=(args.processes, port, args.batch, args.size, str(out)),
                       nprocs=args.processes, start_method="spawn")
    gathered = statistics.median(json.loads(out.read_text()))
    out.unlink()
    image = read_time(args.size)
    world = args.processes
    megabytes = args.batch * (3 * args.size * args.size * 4 + 8) / 1e6
    result = {"command": " ".join(sys.argv), "cores": os.cpu_count(), "batch MB": round(megabytes, 1),
              "gather ms": round(gathered * 1e3, 1), "gather GB/s into each process":
              round(megabytes * (world - 1) / world / 1e3 / gathered, 2),
              "read ms an image": round(image * 1e3, 2),
              "reading whole, more ms of reading a process": round(image * args.batch * (world - 1) / world * 1e3, 1)}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
