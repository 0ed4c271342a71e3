"""``ddpkit bench``: images per second for single, DP and DDP at 1, 2, ... devices, honestly timed.

    $ ddpkit bench                                     # CPU: net, single and ddp at 1 and 2 processes
    $ ddpkit bench --model resnet50 --precision bf16 --channels-last --nproc 1,2,4,8 --json out.json

Each (strategy, device count) runs in fresh processes started like ``ddpkit train`` (torchrun's agent).
In every process: warm-up steps, then ``repeats`` rounds of ``steps`` timed steps; each round times, in
turn, ddpkit's own training step (``Job.forward_backward`` and ``Job.step``: autocast, GradScaler, LR schedule),
the same step written by hand in plain PyTorch, and, for DDP, the hand step under ``no_sync`` (no
all-reduce). The device is synchronised before every clock read. A round's time is the slowest rank's. The order of
the variants alternates between rounds.
Reported: the median round and the spread (min, max); images/s of the whole job and per device;
efficiency against the one-device run; the share of a DDP step spent waiting on communication
(1 - no_sync time / time); peak memory per device; and ddpkit's step over the hand-written one.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ddpkit.strategies import create as create_strategy
from ddpkit.launch import nccl
from ddpkit.app import projection
from ddpkit.core.errors import EXIT_USAGE, UsageError
from ddpkit.core.logs import report_usage_error
from ddpkit.core.precision import AMP_DTYPES
from ddpkit.job import Job
from ddpkit.core.process_group import control_group, synchronize

STRATEGIES = ("single", "dp", "ddp")  # what the bench measures, in its table's order
LABELS = {"dp": "DP", "ddp": "DDP"}  # the tutorials' column names
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
DATA_SOURCES = ("synthetic", "loader")


@dataclasses.dataclass
class BenchOptions:
    """What ``ddpkit bench`` measures; one field per flag."""

    model: str | None = None  # None: resnet50 on GPU, net on CPU
    strategies: tuple[str, ...] = ("single", "dp", "ddp")  # dp is dropped without GPUs
    nproc: tuple[int, ...] | None = None  # None: 1 and every power of two up to the GPU count (1,2 on CPU)
    batch_size: int = 32  # per device
    device: str = "auto"
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    data: str = "synthetic"  # synthetic (on the device) | loader (pinned host memory -> device) | folder:P | shards:P
    decode: str = "auto"  # image files: cpu (loader processes) | gpu (nvJPEG) | auto (images.auto_decode)
    image_size: int | None = None
    static_graph: bool = False  # DDP's static_graph (the ddp rows only)
    gradient_as_bucket_view: bool = False  # DDP's gradient_as_bucket_view (the ddp rows only)
    warmup: int = 5
    steps: int = 20
    repeats: int = 3
    link_gbps: tuple[float, ...] = (100.0, 400.0)
    sweep: bool = False  # also time DDP per bucket size and per gradient-compression hook
    json_path: str | None = None
    csv_path: str | None = None
    plot_path: str | None = None

    def resolve(self, cuda_count: int) -> BenchOptions:
        """Fill the device-dependent defaults and refuse what this machine cannot run (one line each)."""
        device = _resolve_device(self.device, cuda_count)
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise UsageError(f"--strategies takes a comma list of {', '.join(STRATEGIES)}, got {','.join(self.strategies)!r}")
        strategies = runnable(self.strategies, cuda_count if device == "cuda" else 0,
                              asked=self.strategies != BenchOptions.strategies)
        nproc = self.nproc or _default_nproc(device, cuda_count)
        if any(n < 1 for n in nproc):
            raise UsageError(f"--nproc takes whole numbers of at least 1, got {','.join(map(str, nproc))}")
        if device == "cuda" and max(nproc) > cuda_count:
            raise UsageError(f"--nproc {max(nproc)} needs {max(nproc)} GPUs, {cuda_count} visible")
        if self.sweep and max(nproc) < 2:
            raise UsageError("--sweep times DDP's buckets and compression hooks, which one process does not use "
                             "(ddpkit runs it without DDP): give --nproc 2 or more, or drop --sweep")
        if self.precision not in PRECISIONS:
            raise UsageError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.precision in ("tf32", "fp16") and device != "cuda":
            raise UsageError(f"--precision {self.precision} is a GPU mode; on CPU use fp32 or bf16")
        decode = _resolve_decode(self.data, self.decode, device)
        for name, value, least in (("--batch-size", self.batch_size, 1), ("--steps", self.steps, 1),
                                   ("--repeats", self.repeats, 1), ("--warmup", self.warmup, 0)):
            if value < least:
                raise UsageError(f"{name} must be at least {least}, got {value}")
        if any(g <= 0 for g in self.link_gbps):
            raise UsageError(f"--link-gbps takes positive numbers, got {','.join(map(str, self.link_gbps))}")
        if self.plot_path:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise UsageError("--plot needs matplotlib: pip install matplotlib (or ddpkit[bench])") from None
        from ddpkit import zoo

        model = self.model or ("resnet50" if device == "cuda" else "net")
        zoo.check_model_name(model)
        if self.image_size is not None and self.image_size < 1:
            raise UsageError(f"--image-size must be at least 1, got {self.image_size}")
        # ImageNet's size for torchvision's classifiers, synthetic data too: images/s are quoted at 224 (at
        # ddpkit train's small default, ResNet-50's step is launch-bound and ten times shorter).
        _, image_size = zoo.model_input(model, "folder", self.image_size)
        return dataclasses.replace(self, model=model, device=device, strategies=strategies, image_size=image_size,
                                   nproc=tuple(sorted(set(nproc))), decode=decode)


def _resolve_device(requested: str, cuda_count: int) -> str:
    """"cpu" or "cuda" for --device ``requested`` (auto: cuda when a GPU is visible); UsageError if it cannot run."""
    device = requested
    if device == "auto":
        device = "cuda" if cuda_count else "cpu"
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda, got {requested!r}")
    if device == "cuda" and cuda_count == 0:
        raise UsageError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    return device


def _resolve_decode(data: str, decode: str, device: str) -> str:
    """The --decode for --data ``data`` on ``device``, checking that the data source is one that exists."""
    if data.partition(":")[0] in ("folder", "shards"):
        from ddpkit import zoo
        from ddpkit.data import images

        zoo.parse_data_spec(data)  # the folder must exist
        if data.startswith("shards:"):
            from ddpkit.data import shards

            shards.read_pack(shards.splits_of(data[len("shards:"):])[0])  # and be a whole pack
        if decode == "gpu" and device != "cuda":
            raise UsageError("--decode gpu needs --device cuda (nvJPEG); use --decode cpu or auto")
        decode = images.check_decode(decode, device)
    elif data not in DATA_SOURCES:
        raise UsageError(f"--data must be synthetic, loader, folder:PATH or shards:PATH, got {data!r}")
    return decode


def runnable(names: tuple[str, ...], cuda_count: int, *, asked: bool) -> tuple[str, ...]:
    """The strategies of ``names`` that can run on one process with ``cuda_count`` GPUs. One that cannot is dropped
    from the default list, and is an error when the user ``asked`` for it."""
    kept = []
    for name in names:
        try:
            create_strategy(name).check(world_size=1, cuda_count=cuda_count)
        except UsageError as error:
            if asked:  # the strategy's own reason, in this command's terms
                reason = str(error).split(";")[0].replace("`strategy` ", "--strategies ", 1)
                raise UsageError(f"{reason}; drop {name} from --strategies") from None
            continue
        kept.append(name)
    return tuple(kept)


def _default_nproc(device: str, cuda_count: int) -> tuple[int, ...]:
    if device == "cpu":
        return (1, 2)
    counts, n = [], 1
    while n <= cuda_count:
        counts.append(n)
        n *= 2
    return tuple(counts)


def parse_list(text: str, kind: type, flag: str) -> tuple:
    try:
        return tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"{flag} takes a comma-separated list, got {text!r}") from None


# --------------------------------------------------------------------------------------------- worker


class _Batches:
    """``steps`` batches per ``iter()``, taken from an endless iterator: one timed round's batches."""

    def __init__(self, source, steps: int):
        self.source, self.steps = source, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        return itertools.islice(self.source, self.steps)


def _slowest(seconds: float, runtime) -> float:
    """A round takes as long as its slowest rank."""
    if runtime.backend is None:
        return seconds
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=control_group(runtime))
    return float(value.item())


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _amp(precision: str) -> str:
    """The trainer's --amp for a --precision (tf32 and fp32 are not autocast)."""
    return precision if precision in ("fp16", "bf16") else "off"


def _device_batches(loader, memory_format: torch.memory_format, steps: int) -> _Batches:
    """``steps`` batches at a time from ddpkit's loader (already on the device), epoch after epoch."""
    return _Batches(((x.contiguous(memory_format=memory_format), y)
                     for x, y in itertools.chain.from_iterable(itertools.repeat(loader))), steps)


def measure(options: BenchOptions, job: Job) -> dict:
    """Time ddpkit's step, the hand-written step and (DDP) the no_sync step in this process."""
    from ddpkit import zoo

    runtime, device = job.runtime, job.device
    devices_here = job.strategy.devices_per_process(torch.cuda.device_count())
    if options.precision == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    kind, _, path = options.data.partition(":")
    from_files = kind in zoo.IMAGE_KINDS
    channels, image_size = zoo.model_input(options.model, "folder", options.image_size)
    files = zoo.load_images(kind, path, channels, image_size, decode=options.decode) if from_files else None
    num_classes = files.num_classes if files is not None else 10
    torch.manual_seed(0)
    model = zoo.build_model(options.model, in_channels=channels, num_classes=num_classes, image_size=image_size)
    memory_format = torch.channels_last if options.channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    wrapped, optimizer = job.setup(model, torch.optim.SGD, **SGD)
    if options.compile:
        wrapped = torch.compile(wrapped)
    per_step = options.batch_size * devices_here
    images = torch.randn(per_step, channels, image_size, image_size).to(device, memory_format=memory_format)
    labels = torch.randint(0, num_classes, (per_step,)).to(device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # ddpkit train steps one each step
    synthetic = _Batches(itertools.repeat((images, labels)), options.steps)
    batches, workers = synthetic, 0
    if from_files or options.data == "loader":
        from torch.utils.data import TensorDataset

        from ddpkit.data import default_workers, train_loader

        # ddpkit train's own loader: image files read, decoded and augmented as it does them, or tensors in
        # (pinned) host memory; either way every step copies its batch to the device.
        dataset = files.train if from_files else TensorDataset(images.cpu().repeat(4, 1, 1, 1), labels.cpu().repeat(4))
        workers = default_workers(runtime, None, dataset)
        loader = train_loader(dataset, batch_size=per_step, runtime=runtime, seed=0, workers=workers)
        batches = _device_batches(loader, memory_format, options.steps)
    rounds = _round_variants(job, wrapped, optimizer, scheduler, batches)
    times = {}
    if from_files:
        # Synthetic data first, in rounds of their own; then the loader's prefetched batches (queued while they ran)
        # are drained before the file rounds are timed, back to back, at the pace the loader keeps up.
        times = _timed_rounds({"synthetic": functools.partial(rounds["ddpkit"], synthetic)}, options, runtime)
        for _ in range(-(-workers * 2 // options.steps)):
            rounds["ddpkit"]()
    times.update(_timed_rounds(rounds, options, runtime))
    return {**_results(times, model, job, devices_here, per_step),
            **({"decode": files.train.decode} if from_files else {})}  # what --decode auto came to


def _round_variants(job: Job, wrapped, optimizer, scheduler, batches: _Batches) -> dict:
    """One round of each variant to time, by name: ddpkit's step (over ``batches``, or the batches it is given),
    the hand-written step and, for DDP over more than one process, the hand-written step under no_sync."""
    device = job.device

    def ddpkit_round(source: _Batches = batches) -> None:
        wrapped.train()
        for images, labels in source:
            job.forward_backward(wrapped, images, labels)
            job.step(optimizer, scheduler)

    def hand_round(no_sync: bool = False) -> None:
        _hand_steps(wrapped, optimizer, job.scaler, batches, device, job.amp, no_sync)

    rounds = {"ddpkit": ddpkit_round, "hand": hand_round}
    if job.strategy.replicated and job.runtime.world_size > 1:  # gradients all-reduced in backward: time it without
        rounds["no_sync"] = lambda: hand_round(no_sync=True)
    return rounds


def _results(times: dict, model, job: Job, devices_here: int, per_step: int) -> dict:
    """What ``measure`` returns: the rounds' times, peak memory, the gradients' size, the all-reduce's speed and
    the images of one step of the job (``per_step`` on this process)."""
    runtime, device = job.runtime, job.device
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {
        "times": times,
        # Every device this process drives (DataParallel's GPU 0 gathers outputs and holds more, as the tutorials warn).
        "peak_memory_bytes": ([int(torch.cuda.max_memory_allocated(i)) for i in range(devices_here)]
                              if devices_here > 1 else [_peak_memory_bytes(device)]),
        "grad_bytes": grad_bytes,
        "allreduce_bytes_per_s": _allreduce_bandwidth(grad_bytes, runtime) if runtime.world_size > 1 else None,
        "images_per_step": per_step * job.data_replicas,
    }


def _hand_steps(model, optimizer, scaler, batches, device: torch.device, amp: str, no_sync: bool = False) -> None:
    """The training step as the tutorials write it, once per batch of ``batches``."""
    dtype = AMP_DTYPES[amp]
    model.train()
    for x, y in batches:
        with model.no_sync() if no_sync else contextlib.nullcontext():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type=device.type, dtype=dtype) if dtype else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def _timed_rounds(rounds: dict, options: BenchOptions, runtime) -> dict[str, list[float]]:
    """Warm each variant up, then time ``repeats`` rounds of each, interleaved (AB, BA, ...)."""
    device = runtime.device
    for run_round in rounds.values():  # allocator, cuDNN autotuning, compile, DDP's first buckets
        for _ in range(max(1, -(-options.warmup // options.steps))):
            run_round()
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):  # all of them: DataParallel uses every GPU
            torch.cuda.reset_peak_memory_stats(index)
    times: dict[str, list[float]] = {name: [] for name in rounds}
    for repeat in range(options.repeats):
        order = list(rounds.items())
        # In reverse every other round: drift, and going first, hit every variant alike.
        for name, run_round in order if repeat % 2 == 0 else reversed(order):
            synchronize(device)
            started = time.perf_counter()
            run_round()
            synchronize(device)
            times[name].append(_slowest(time.perf_counter() - started, runtime))
    return times


SGD = {"lr": 0.01, "momentum": 0.9}  # ddpkit train's SGD
SWEEP_BUCKETS_MB = (1.0, 5.0, 25.0, 100.0)
SWEEP_HOOKS = ("fp16", "bf16", "powersgd")


def _comm_hook(model, name: str):
    """Register one of PyTorch's gradient-compression hooks on a DDP model."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        # Rank-1 PowerSGD after 2 plain steps (PowerSGD's own warm-up), within our warm-up.
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def sweep(options: BenchOptions, runtime) -> list[dict]:
    """The hand-written DDP step for each bucket size (no hook) and each hook (PyTorch's default buckets)."""
    from ddpkit import zoo, strategies

    channels, image_size = zoo.model_input(options.model, "synthetic", options.image_size)
    images = torch.randn(options.batch_size, channels, image_size, image_size).to(runtime.device)
    labels = torch.randint(0, 10, (options.batch_size,)).to(runtime.device)
    batches = _Batches(itertools.repeat((images, labels)), options.steps)
    configs = [(mb, "none") for mb in SWEEP_BUCKETS_MB] + [(None, hook) for hook in SWEEP_HOOKS]
    results = []
    for bucket_mb, hook in configs:
        torch.manual_seed(0)
        model = zoo.build_model(options.model, in_channels=channels, num_classes=10, image_size=image_size)
        ddp = strategies.create("ddp", bucket_cap_mb=bucket_mb).wrap(model, runtime)
        optimizer = torch.optim.SGD(ddp.parameters(), **SGD)
        scaler = torch.amp.GradScaler(runtime.device.type, enabled=options.precision == "fp16")
        row = {"bucket_cap_mb": bucket_mb, "hook": hook}
        try:
            if hook != "none":
                _comm_hook(ddp, hook)
            hand = functools.partial(_hand_steps, ddp, optimizer, scaler, batches, runtime.device, _amp(options.precision))
            times = _timed_rounds({"hand": hand}, options, runtime)["hand"]
        except RuntimeError as error:  # a hook the backend cannot run (gloo has no bf16 all-reduce, say)
            from ddpkit.core.errors import first_line

            row["error"] = first_line(error)
            results.append(row)
            continue
        rates = [options.batch_size * runtime.world_size * options.steps / t for t in times]
        row.update(images_per_sec=statistics.median(rates), spread=[min(rates), max(rates)])
        results.append(row)
    return results


def _allreduce_bandwidth(grad_bytes: int, runtime, repeats: int = 5) -> float:
    """Bus bandwidth of all-reducing the gradients once, in the training group: bytes/s per link."""
    import torch.distributed as dist

    tensor = torch.zeros(max(1, grad_bytes // 4), dtype=torch.float32, device=runtime.device)
    dist.all_reduce(tensor)
    synchronize(runtime.device)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        dist.all_reduce(tensor)
        synchronize(runtime.device)
        seconds.append(_slowest(time.perf_counter() - started, runtime))
    return projection.ring_allreduce_bytes(runtime.world_size, grad_bytes) / statistics.median(seconds)


def worker_main(argv: Sequence[str]) -> int:
    """One bench process: ``python -m ddpkit.app.bench OPTIONS_JSON STRATEGY OUT_JSON``; rank 0 writes OUT_JSON."""
    options = BenchOptions(**json.loads(argv[0]))
    strategy, out_path = argv[1], argv[2]
    try:
        return _worker(options, strategy, out_path)
    except UsageError as error:
        return report_usage_error(error)


def _worker(options: BenchOptions, strategy: str, out_path: str) -> int:
    # The sweep wraps its own DDP models, one per bucket size and hook.
    # DDP's settings, for the strategies that have them (the others ignore them: strict=False).
    chosen = create_strategy("ddp" if strategy == "sweep" else strategy, strict=False, static_graph=options.static_graph,
                             gradient_as_bucket_view=options.gradient_as_bucket_view)
    with Job(chosen, amp=_amp(options.precision), device=options.device) as job:
        runtime = job.runtime
        if strategy == "sweep":
            result = {"sweep": sweep(options, runtime)}
        else:
            result = measure(options, job)
            result["peak_memory_bytes"] = _gather_memory(result["peak_memory_bytes"], runtime)
        if runtime.is_main:
            with open(out_path, "w") as handle:
                json.dump(result, handle)
    return 0


def _gather_memory(mine: list[int], runtime) -> list[int]:
    """Every rank's peak memory per device, rank by rank."""
    if runtime.backend is None:
        return mine
    import torch.distributed as dist

    everyone: list = [None] * runtime.world_size
    dist.all_gather_object(everyone, mine, group=control_group(runtime))
    return [value for rank in everyone for value in rank]


# --------------------------------------------------------------------------------------------- parent


def _run_one(options: BenchOptions, strategy: str, nproc: int) -> dict:
    from ddpkit.launch.launcher import LaunchOptions, elastic
    from ddpkit.core.process_group import usable_cores

    # A fair share of the cores for each run's processes (the launcher would keep the first run's value).
    if "OMP_NUM_THREADS" not in _USER_ENV:
        os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cores() // nproc))
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-") as folder:
        out = os.path.join(folder, "result.json")
        command = ["-m", "ddpkit.app.bench", json.dumps(dataclasses.asdict(options)), strategy, out]
        status = elastic(LaunchOptions(nproc_per_node=nproc), command)
        if status == EXIT_USAGE:
            raise UsageError("a bench process refused its input (see above)", said_elsewhere=True)
        if status != 0 or not os.path.exists(out):
            raise RuntimeError(f"the {strategy} run on {nproc} device(s) failed (status {status}); its output is above")
        with open(out) as handle:
            return json.load(handle)


# Variables the user set before ``ddpkit bench`` started (these are kept as given for every run).
_USER_ENV = frozenset(os.environ)


def summarize(strategy: str, devices: int, raw: dict) -> dict:
    """One result row from a worker's raw timings."""
    row: dict = {"strategy": strategy, "devices": devices}
    per_round = raw["images_per_step"] * raw["steps"]
    for name, seconds in raw["times"].items():
        rates = [per_round / s for s in seconds]
        row[f"{name}_images_per_sec"] = statistics.median(rates)
        row[f"{name}_spread"] = [min(rates), max(rates)]
    row["images_per_sec"] = row["ddpkit_images_per_sec"]
    row["images_per_sec_per_device"] = row["images_per_sec"] / devices
    row["spread"] = row["ddpkit_spread"]
    row["ddpkit_over_hand"] = row["ddpkit_images_per_sec"] / row["hand_images_per_sec"]
    if "synthetic_images_per_sec" in row:  # image files: how close their pace comes to data already on the device
        row["fraction_of_synthetic"] = row["ddpkit_images_per_sec"] / row["synthetic_images_per_sec"]
    if "no_sync_images_per_sec" in row:
        # The share of a synchronised step spent waiting for the all-reduce (what no_sync removes).
        row["comm_share"] = max(0.0, 1.0 - row["hand_images_per_sec"] / row["no_sync_images_per_sec"])
    if "decode" in raw:
        row["decode"] = raw["decode"]
    row["peak_memory_bytes"] = raw["peak_memory_bytes"]
    row["grad_bytes"] = raw["grad_bytes"]
    row["allreduce_bytes_per_s"] = raw.get("allreduce_bytes_per_s")
    row["step_s"] = statistics.median(raw["times"]["ddpkit"]) / raw["steps"]
    if "no_sync" in raw["times"]:
        row["compute_step_s"] = statistics.median(raw["times"]["no_sync"]) / raw["steps"]
    return row


def add_efficiency(rows: list[dict]) -> None:
    """Efficiency = images/s per device over the one-device run's: that of the first strategy measured (single, by
    default)."""
    ones = [row for row in rows if row["devices"] == 1]
    for row in rows:
        reference = ones[0] if ones else None
        row["efficiency"] = (row["images_per_sec"] / (row["devices"] * reference["images_per_sec"])
                             if reference else None)


def environment() -> dict:
    env = {"torch": str(torch.__version__), "python": platform.python_version(), "machine": platform.machine(),
           "cpu_count": os.cpu_count(), "cuda": torch.version.cuda, "cudnn": None, "nccl": None, "devices": []}
    if torch.cuda.is_available():
        env["cudnn"] = torch.backends.cudnn.version()
        with contextlib.suppress(Exception):
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    env["variables"] = nccl.in_effect(prefixes=("NCCL_", "GLOO_", "OMP_NUM_THREADS"))
    return env


def run(options: BenchOptions) -> dict:
    """Measure every (strategy, device count), print the table, write the files; return the report."""
    options = options.resolve(torch.cuda.device_count())
    rows = []
    for devices in options.nproc:
        for strategy in options.strategies:
            chosen = create_strategy(strategy)
            if not chosen.one_process:
                raw = _run_one(options, strategy, devices)
            elif chosen.devices_per_process(devices) == devices:
                raw = _run_one_process(options, strategy, devices)
            else:
                continue  # one process on one device: measured at 1 only
            raw["steps"] = options.steps
            rows.append(summarize(strategy, devices, raw))
    add_efficiency(rows)
    report = {"environment": environment(), "options": dataclasses.asdict(options), "results": rows,
              "projection": _projection(options, rows)}
    print(format_table(options, rows))
    print(format_projection(report["projection"]))
    if options.sweep:
        report["sweep"] = _run_one(options, "sweep", max(options.nproc))["sweep"]
        print(format_sweep(report["sweep"], max(options.nproc)))
    write_outputs(options, report)
    return report


def _run_one_process(options: BenchOptions, strategy: str, devices: int) -> dict:
    """A strategy of one process (DataParallel over ``devices`` GPUs, or one device), launched like the others."""
    from ddpkit.launch.launcher import variables_set

    if options.device != "cuda":
        return _run_one(options, strategy, 1)
    with variables_set({"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(devices))}):
        return _run_one(options, strategy, 1)


def _projection(options: BenchOptions, rows: list[dict]) -> dict:
    """Projected DDP efficiency at 2/4/8 devices (and for --link-gbps links), and a check against this machine."""
    one = next((r for r in rows if r["devices"] == 1), None)
    if one is None:
        return {}
    measured_links = {}
    check = []
    for row in rows:
        if row.get("allreduce_bytes_per_s") and row.get("compute_step_s"):  # timed with and without the all-reduce
            measured_links[f"measured {row['devices']}-process all-reduce"] = row["allreduce_bytes_per_s"]
            # On this machine the processes share cores, so the compute time to project from is the
            # no_sync step at the same device count, not the one-device step.
            predicted = projection.project(
                world_sizes=[row["devices"]], compute_s=row["compute_step_s"], grad_bytes=row["grad_bytes"],
                global_batch_per_device=options.batch_size, links={"measured": row["allreduce_bytes_per_s"]})[0]
            check.append({"devices": row["devices"], "projected_step_s": predicted.step_s,
                          "measured_step_s": statistics.median([row["step_s"]]),
                          "projected_comm_share": 1 - predicted.compute_s / predicted.step_s,
                          "measured_comm_share": row.get("comm_share")})
    links = {f"{g:g} Gb/s": g * 1e9 / 8 for g in options.link_gbps}
    rows_out = projection.project(world_sizes=[2, 4, 8, 16], compute_s=one["step_s"], grad_bytes=one["grad_bytes"],
                                  global_batch_per_device=options.batch_size, links={**measured_links, **links})
    return {"compute_step_s": one["step_s"], "grad_bytes": one["grad_bytes"],
            "rows": [dataclasses.asdict(r) for r in rows_out], "check": check}


def format_table(options: BenchOptions, rows: list[dict]) -> str:
    """The tutorials' layout: one row per device count, images/s and efficiency per strategy."""
    strategies = [s for s in STRATEGIES if any(r["strategy"] == s for r in rows)]
    decoded = " or ".join(sorted({r["decode"] for r in rows if "decode" in r})) or options.decode
    if decoded != options.decode:
        decoded = f"{options.decode}: {decoded}"  # what auto came to
    header = ["devices"] + [f"{LABELS.get(s, s)} img/s (eff)" for s in strategies]
    header += ["DDP comm wait", "ddpkit/hand (DDP)"]
    lines = [f"ddpkit bench: {options.model}, {options.precision}"
             + (", channels_last" if options.channels_last else "") + (", compile" if options.compile else "")
             + (", DDP static_graph" if options.static_graph else "")
             + (", DDP gradient_as_bucket_view" if options.gradient_as_bucket_view else "")
             + f", {options.data} data{' (' + decoded + ' decoding)' if ':' in options.data else ''} {options.image_size}x{options.image_size}, batch {options.batch_size} per device, "
             f"{options.device}; "
             f"median of {options.repeats} x {options.steps} steps", "  ".join(f"{h:>18}" for h in header)]
    for devices in sorted({r["devices"] for r in rows}):
        cells = [f"{devices:>18}"]
        here = [r for r in rows if r["devices"] == devices]
        ddp = next((r for r in here if "comm_share" in r), None)  # the row timed without its all-reduce too
        for strategy in strategies:
            row = next((r for r in here if r["strategy"] == strategy), None)
            eff = f" ({row['efficiency']:.0%})" if row and row.get("efficiency") is not None else ""
            cells.append(f"{row['images_per_sec']:>12.0f}{eff:>6}" if row else f"{'-':>18}")
        cells.append(f"{ddp['comm_share']:>18.0%}" if ddp and "comm_share" in ddp else f"{'-':>18}")
        # ddpkit's step over the hand-written one, for the DDP row (else the single one).
        shown = ddp or next(r for r in rows if r["devices"] == devices)
        cells.append(f"{shown['ddpkit_over_hand']:>18.3f}")
        lines.append("  ".join(cells))
    from_files = [r for r in rows if "fraction_of_synthetic" in r]
    if from_files:
        lines.append(f"{options.data} ({decoded} decoding) against synthetic data on the device, same step:")
        lines += [f"  {LABELS.get(r['strategy'], r['strategy'])} x{r['devices']}: {r['images_per_sec']:.0f} of "
                  f"{r['synthetic_images_per_sec']:.0f} img/s = {r['fraction_of_synthetic']:.1%}" for r in from_files]
    return "\n".join(lines)


def format_projection(report: dict) -> str:
    if not report:
        return ""
    lines = ["", f"PROJECTION (not measured): DDP from a {report['compute_step_s'] * 1e3:.1f} ms step and "
                 f"{report['grad_bytes'] / 1e6:.1f} MB of gradients, ring all-reduce, 60% overlapped with backward"]
    for row in report["rows"]:
        lines.append(f"  {row['world_size']:>3} devices over {row['link']:<32} efficiency {row['efficiency']:.0%}, "
                     f"{row['images_per_sec']:.0f} images/s")
    for check in report["check"]:
        lines.append(f"  check on this machine, {check['devices']} processes: projected step "
                     f"{check['projected_step_s'] * 1e3:.1f} ms, measured {check['measured_step_s'] * 1e3:.1f} ms")
    return "\n".join(lines)


def format_sweep(rows: list[dict], devices: int) -> str:
    lines = ["", f"DDP tuning sweep on {devices} device(s), hand-written step: images/s median [min-max]"]
    for row in rows:
        what = f"bucket {row['bucket_cap_mb']:g} MB" if row["bucket_cap_mb"] else "default buckets"
        what += "" if row["hook"] == "none" else f", {row['hook']} hook"
        if "error" in row:
            lines.append(f"  {what:<32} not run: {row['error']}")
        else:
            lines.append(f"  {what:<32} {row['images_per_sec']:8.0f}  [{row['spread'][0]:.0f}-{row['spread'][1]:.0f}]")
    ran = [row for row in rows if "error" not in row]
    if ran:
        best = max(ran, key=lambda row: row["images_per_sec"])
        buckets = f"bucket {best['bucket_cap_mb']:g} MB" if best["bucket_cap_mb"] else "default buckets"
        others = [row for row in ran if row is not best]
        # Call it a tie when the best's slowest round is no faster than another's fastest.
        tied = any(best["spread"][0] <= row["spread"][1] for row in others)
        lines.append(f"  best: {buckets}, hook {best['hook']}" + (" (its spread overlaps others': a tie)" if tied else ""))
    return "\n".join(lines)


def write_outputs(options: BenchOptions, report: dict) -> None:
    if options.json_path:
        with open(options.json_path, "w") as handle:
            json.dump(report, handle, indent=2)
    if options.csv_path:
        fields = ["strategy", "devices", "images_per_sec", "images_per_sec_per_device", "efficiency", "comm_share",
                  "ddpkit_over_hand", "hand_images_per_sec", "step_s", "peak_memory_bytes"]
        with open(options.csv_path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            for row in report["results"]:
                writer.writerow({**row, "peak_memory_bytes": max(row["peak_memory_bytes"])})
    if options.plot_path:
        plot(report, options.plot_path)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, efficiency) = plt.subplots(1, 2, figsize=(10, 4))
    for strategy in STRATEGIES:
        rows = sorted((r for r in report["results"] if r["strategy"] == strategy), key=lambda r: r["devices"])
        if not rows:
            continue
        devices = [r["devices"] for r in rows]
        speed.plot(devices, [r["images_per_sec"] for r in rows], marker="o", label=strategy)
        efficiency.plot(devices, [100 * (r["efficiency"] or 0) for r in rows], marker="o", label=strategy)
    speed.set(xlabel="devices", ylabel="images/s", title="throughput")
    efficiency.set(xlabel="devices", ylabel="% of linear", title="scaling efficiency", ylim=(0, 110))
    for axes in (speed, efficiency):
        axes.legend()
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
