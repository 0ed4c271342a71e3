"""Images per second that ddpkit's image loader delivers to the device, with no model: the ceiling a training run
from image files can reach, per decoding mode, in one run.

    python benchmarks/loader_throughput.py                       # 1,000 generated JPEGs, --decode cpu (and gpu on CUDA)
    python benchmarks/loader_throughput.py --folder /data/imagenet/train --decode cpu,gpu --batch 256 --workers 15

For each mode: ``ddpkit.image_folder(decode=MODE)`` through ``Job.train_loader`` (training crops, 224, loader
processes as ``ddpkit train`` sizes them unless --workers says), one warm-up pass of --batches batches, then
--repeats timed passes; the device is synchronised before each clock read; medians reported as JSON. Compare it
with `ddpkit bench --data folder:...`'s synthetic rate: a loader slower than the model's synthetic rate is the
bottleneck, one faster leaves the rest to overlap.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time

import torch


def measure(folder: str, decode: str, batch: int, batches: int, repeats: int, workers: int | None) -> dict:
    import ddpkit
    from ddpkit.core.process_group import synchronize

    with ddpkit.Job("single") as job:
        data = ddpkit.image_folder(folder, decode=decode)
        loader = job.train_loader(data, batch_size=batch, workers="auto" if workers is None else workers)
        stream = itertools.chain.from_iterable(itertools.repeat(loader))
        rates = []
        for round_ in range(repeats + 1):  # the first is the warm-up: worker start, page cache, nvJPEG's set-up
            synchronize(job.device)
            started = time.perf_counter()
            for images, _ in itertools.islice(stream, batches):
                pass
            synchronize(job.device)
            if round_:
                rates.append(batches * batch / (time.perf_counter() - started))
        return {"decode": decode, "device": str(job.device), "workers": loader.loader.num_workers,
                "images_per_sec": round(statistics.median(rates), 1),
                "spread": [round(min(rates), 1), round(max(rates), 1)], "shape": list(images.shape)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", help="an ImageFolder tree (default: generate --images JPEGs)")
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--decode", default=None, help="comma list of cpu, gpu (default: cpu, and gpu on CUDA)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=10, help="per timed pass (default: 10)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None, help="loader processes (default: ddpkit's share)")
    args = parser.parse_args()
    modes = args.decode.split(",") if args.decode else ["cpu", "gpu"] if torch.cuda.is_available() else ["cpu"]
    with tempfile.TemporaryDirectory(prefix="ddpkit-jpegs-") as scratch:
        folder = args.folder
        if folder is None:
            from ddpkit.data.sample_images import write_folder

            folder = scratch
            write_folder(folder, images=args.images, classes=10)
        results = [measure(folder, mode, args.batch, args.batches, args.repeats, args.workers) for mode in modes]
    print(json.dumps({"torch": torch.__version__, "batch": args.batch, "batches": args.batches, "results": results},
                     indent=1))


if __name__ == "__main__":
    main()
