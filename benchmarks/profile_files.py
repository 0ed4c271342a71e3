"""Where a training step's time goes when its batches come from image files: torch.profiler over a few steps.

    python benchmarks/profile_files.py --data folder:PATH [--decode gpu] [--model resnet50] [--batch 256]
        [--steps 10] [--warmup 10] [--trace trace.json.gz] [--json summary.json]

The same loop as `ddpkit bench --data folder:PATH` (ddpkit's loader, bf16 autocast and channels_last on CUDA, SGD),
one process, no DDP. After ``--warmup`` steps, ``--steps`` steps are profiled (CPU, and CUDA where there is one).
Printed: the step's wall time; the training process's time spent waiting for the loader's workers
(DataLoader.__next__), decoding (torchvision's decode_jpeg, nvJPEG on a GPU) and cropping (resized_crop,
interpolate), per step; then the operators with the most CPU time. The device's busy time per step (the sum of
its kernels) beside the wall time says whether the GPU waited. ``--trace`` writes a Chrome/Perfetto trace.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import ddpkit
from ddpkit import zoo
from ddpkit.core.process_group import synchronize
from ddpkit.data import default_workers

# (what, the profiler event names it sums): the training process's own time in each part of a file-fed step
PARTS = {
    "waiting for the loader's workers": ("enumerate(DataLoader)",),
    "decoding (decode_jpeg)": ("image::decode_jpegs_cuda", "image::decode_jpeg"),
    "cropping and resampling": ("aten::upsample_bilinear2d", "aten::_upsample_bilinear2d_aa"),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, metavar="folder:PATH|shards:PATH",
                        help="an image folder or a pack of one (ddpkit data make-images, ddpkit data pack)")
    parser.add_argument("--decode", default="auto", choices=("auto", "cpu", "gpu"),
                        help="who decodes: the loader processes (cpu) or nvJPEG (gpu); auto: ddpkit's choice (docs/data.md)")
    parser.add_argument("--model", default="resnet50", help="a model name of ddpkit's zoo (default: resnet50)")
    parser.add_argument("--image-size", type=int, default=224, help="crop size in pixels (default: 224)")
    parser.add_argument("--batch", type=int, default=256, help="images per step (default: 256)")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the profiled ones (default: 10)")
    parser.add_argument("--steps", type=int, default=10, help="profiled steps (default: 10)")
    parser.add_argument("--workers", type=int, default=None, help="loader processes (default: ddpkit's share)")
    parser.add_argument("--trace", default=None, metavar="FILE.json[.gz]", help="write the profiler's trace")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the summary as JSON")
    return parser.parse_args(argv)


def every_thread() -> dict:
    """torch.profiler's setting that records the CPU work of every thread, not only the one that started it: the
    loader's own thread, where nvJPEG decodes and the crops are made, is another (without it, the 2026-11-28 H200
    profile read 0 ms for both). Empty where this torch has no such setting."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except TypeError:
        return {}


def event_sum(events, names: tuple[str, ...], attribute: str) -> float:
    """Microseconds of ``attribute`` summed over the events whose name starts with one of ``names``."""
    return sum(getattr(e, attribute) for e in events if e.key.startswith(names))


def main(argv=None) -> int:
    args = parse_args(argv)
    kind, _, path = args.data.partition(":")
    if kind not in zoo.IMAGE_KINDS or not path:
        raise SystemExit(f"--data must be folder:PATH or shards:PATH, got {args.data!r}")
    with ddpkit.Job("single", amp="bf16" if torch.cuda.is_available() else "off", seed=0) as job:
        files = zoo.load_images(kind, path, 3, args.image_size, decode=args.decode)
        model = zoo.build_model(args.model, in_channels=3, num_classes=files.num_classes, image_size=args.image_size)
        cuda = job.device.type == "cuda"
        memory_format = torch.channels_last if cuda else torch.contiguous_format
        model, optimizer = job.setup(model.to(memory_format=memory_format), torch.optim.SGD, lr=0.1, momentum=0.9)
        workers = args.workers if args.workers is not None else default_workers(job.runtime, None, files.train)
        loader = job.train_loader(files.train, batch_size=args.batch, workers=workers)

        def batches():
            while True:
                yield from loader

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        source = batches()

        def train(steps: int) -> float:
            """Seconds per step over ``steps`` steps, the device synchronised at both ends."""
            synchronize(job.device)
            started = time.perf_counter()
            for _ in range(steps):
                images, labels = next(source)
                job.forward_backward(model, images.contiguous(memory_format=memory_format), labels, F.cross_entropy)
                job.step(optimizer)
            synchronize(job.device)
            return (time.perf_counter() - started) / steps

        train(args.warmup)
        with profile(activities=activities, **every_thread()) as prof:
            wall = train(args.steps)
        events = prof.key_averages()
        summary = {"data": args.data, "decode": getattr(files.train, "decode", args.decode),
                   "model": args.model, "batch": args.batch, "device": str(job.device), "steps": args.steps,
                   "workers": loader.loader.num_workers, "step_ms": wall * 1e3,
                   "images_per_sec": args.batch / wall, "per_step_ms": {}}
        for part, names in PARTS.items():
            summary["per_step_ms"][part] = event_sum(events, names, "cpu_time_total") / 1e3 / args.steps
        if cuda:
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            summary["per_step_ms"]["the GPU busy (its kernels' time)"] = (
                sum(e.self_device_time_total for e in kernels) / 1e3 / args.steps)
        print(f"{args.model}, batch {args.batch}, {args.data} ({summary['decode']} decoding), {job.device}, "
              f"{summary['workers']} workers: {wall * 1e3:.1f} ms per step, {args.batch / wall:.0f} images/s "
              f"(profiled, {args.steps} steps after {args.warmup})")
        for part, ms in summary["per_step_ms"].items():
            print(f"  {part:<36} {ms:8.1f} ms per step")
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(events.table(sort_by="self_cpu_time_total", row_limit=20))
        if cuda:
            print(events.table(sort_by=sort, row_limit=12))
        if args.trace:
            prof.export_chrome_trace(args.trace)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(summary, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
