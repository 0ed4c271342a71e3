"""The loop ``ddpkit train`` runs in every process: the reference for what the library does.

    >>> from ddpkit.trainer import TrainConfig, run
    >>> run(TrainConfig(model="net", data="digits", epochs=1))      # doctest: +SKIP
    {'epoch': 0, 'train_loss': ..., 'val_acc': ..., ...}

One optimizer step consumes ``batch_size`` samples on each of the ``world_size`` processes, for
``accumulate`` micro-steps: the global batch is ``batch_size * world_size * accumulate``. Gradients
are all-reduced only on the last micro-step (DDP's ``no_sync`` on the others).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpkit import checkpoint, data, process_group, zoo
from ddpkit.env import DistEnv
from ddpkit.errors import UsageError
from ddpkit.process_group import Runtime
from ddpkit.strategies import STRATEGIES, DDPOptions, check_dp_batch, unwrap
from ddpkit.strategies.sync_bn import convert_sync_batchnorm

OPTIMIZERS = ("sgd", "adam", "adadelta")
DEFAULT_LR = {"sgd": 0.01, "adam": 1e-3, "adadelta": 1.0}
AMP_DTYPES = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}
METRICS_FILE = "metrics.jsonl"


@dataclasses.dataclass
class TrainConfig:
    """Everything one training run depends on; the CLI flags map one to one onto these fields."""

    model: str = "net"  # net, convnet, or a torchvision classifier name
    data: str = "digits"  # digits | synthetic[:N] | mnist[:DIR] | folder:PATH
    epochs: int = 8
    batch_size: int = 32  # per process; the global batch is batch_size * world_size * accumulate
    lr: float | None = None  # None: the optimizer's default in DEFAULT_LR
    optimizer: str = "adam"
    strategy: str = "ddp"
    backend: str = "auto"  # auto: nccl when each process has its own GPU, gloo otherwise
    device: str = "auto"
    amp: str = "off"  # off | fp16 (with a GradScaler) | bf16
    sync_bn: bool = False
    accumulate: int = 1
    workers: int | None = None  # loader processes per rank; None: 0 for in-memory data, else a core share
    seed: int = 0
    output_dir: str = "runs/ddpkit"
    timeout: float = process_group.DEFAULT_TIMEOUT_S  # seconds a collective may wait before failing
    image_size: int | None = None  # None: the model's own (28 for net, 32 for convnet, ...)
    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float | None = None  # None: PyTorch's default buckets
    debug: bool = False  # every rank prints its PID and where its data and model live
    progress: bool = True  # a progress bar on global rank 0 (only when writing to a terminal)

    def validate(self) -> None:
        """Raise UsageError for values no run could use (each message names the flag and the value)."""
        if self.epochs < 0:
            raise UsageError(f"--epochs must be 0 or more, got {self.epochs}")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.accumulate < 1:
            raise UsageError(f"--accumulate must be at least 1, got {self.accumulate}")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise UsageError(f"--lr must be a positive number, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.strategy not in STRATEGIES:
            raise UsageError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.amp not in AMP_DTYPES:
            raise UsageError(f"--amp must be one of {', '.join(AMP_DTYPES)}, got {self.amp!r}")
        if self.workers is not None and self.workers < 0:
            raise UsageError(f"--workers must be 0 or more, got {self.workers}")
        if self.image_size is not None and self.image_size < 1:
            raise UsageError(f"--image-size must be at least 1, got {self.image_size}")
        if self.timeout <= 0:
            raise UsageError(f"--timeout must be a positive number of seconds, got {self.timeout}")
        if self.sync_bn and self.strategy != "ddp":
            raise UsageError(f"--sync-bn synchronises BatchNorm across DDP processes; it needs --strategy ddp, not {self.strategy}")
        DDPOptions(bucket_cap_mb=self.bucket_cap_mb)
        zoo.parse_data_spec(self.data)
        zoo.check_model_name(self.model)


def make_optimizer(name: str, params, lr: float | None) -> torch.optim.Optimizer:
    lr = DEFAULT_LR[name] if lr is None else lr
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.Adadelta(params, lr=lr)


def log(runtime: Runtime, message: str) -> None:
    """Print on global rank 0 only."""
    if runtime.is_main:
        print(message, flush=True)


def run(cfg: TrainConfig, environment: DistEnv | None = None) -> dict:
    """Set up this process's place in the job, train, and tear the process group down whatever happens.

    ``environment`` is read from the launcher's variables when not given (``mp.spawn`` passes its own).
    """
    cfg.validate()
    with process_group.distributed(
        backend=cfg.backend, device=cfg.device, timeout_s=cfg.timeout, force_group=cfg.strategy == "ddp",
        environment=environment,
    ) as runtime:
        return train(cfg, runtime)


def _autocast(runtime: Runtime, amp: str):
    dtype = AMP_DTYPES[amp]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=runtime.device.type, dtype=dtype)


def train(cfg: TrainConfig, runtime: Runtime) -> dict:
    if cfg.debug:
        # Before any data is loaded: a rank that hangs later can still be found and attached to.
        print(f"[rank {runtime.rank} local {runtime.local_rank} pid {os.getpid()}] process group up, "
              f"backend {runtime.backend or 'none'}, device {runtime.device}", flush=True)
    spec = zoo.parse_data_spec(cfg.data)
    channels, image_size = zoo.model_input(cfg.model, spec.kind, cfg.image_size)
    # Rank 0 first: a download (MNIST) happens once, the other ranks then read the files.
    with process_group.main_process_first(runtime):
        sets = zoo.load_data(spec, channels=channels, image_size=image_size)
    # The same seed on every rank and for every world size: identical initial weights.
    torch.manual_seed(cfg.seed)
    model = zoo.build_model(cfg.model, in_channels=channels, num_classes=sets.num_classes, image_size=image_size)
    if cfg.sync_bn:
        model = convert_sync_batchnorm(model, runtime)
    if cfg.strategy == "dp":
        check_dp_batch(cfg.batch_size, torch.cuda.device_count())
    ddp_options = DDPOptions(
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        bucket_cap_mb=cfg.bucket_cap_mb,
    )
    wrapped = STRATEGIES[cfg.strategy](model, runtime, ddp=ddp_options)
    optimizer = make_optimizer(cfg.optimizer, wrapped.parameters(), cfg.lr)
    scaler = torch.amp.GradScaler(runtime.device.type, enabled=cfg.amp == "fp16")

    loader = data.train_loader(sets.train, batch_size=cfg.batch_size, runtime=runtime, seed=cfg.seed, workers=cfg.workers)
    val_loader = data.eval_loader(sets.val, batch_size=cfg.batch_size, runtime=runtime, workers=cfg.workers)
    steps_per_epoch = len(loader) // cfg.accumulate
    if steps_per_epoch == 0 and cfg.epochs > 0:
        raise UsageError(
            f"one epoch has {len(loader)} batches per process, fewer than --accumulate {cfg.accumulate}; "
            "lower --accumulate or --batch-size"
        )
    global_batch = _global_batch(cfg, runtime)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        runtime,
        f"ddpkit: {runtime.world_size} process(es) via {runtime.env.launcher}, backend "
        f"{runtime.backend or 'none'}, device {runtime.device.type}, strategy {cfg.strategy}; "
        f"model {cfg.model} ({n_params:,} parameters); data {cfg.data}: {len(sets.train)} train / "
        f"{len(sets.val)} val; batch {cfg.batch_size} per process x {runtime.world_size} processes"
        + (f" x {cfg.accumulate} micro-steps" if cfg.accumulate > 1 else "")
        + f" = global batch {global_batch}; {steps_per_epoch} steps per epoch",
    )
    metrics_path = os.path.join(cfg.output_dir, METRICS_FILE)
    if runtime.is_main:
        os.makedirs(cfg.output_dir, exist_ok=True)
        open(metrics_path, "w").close()

    record: dict = {}
    for epoch in range(cfg.epochs):
        loader.set_epoch(epoch)
        started = time.perf_counter()
        train_loss = _train_epoch(cfg, runtime, wrapped, optimizer, scaler, loader, steps_per_epoch, epoch)
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        elapsed = time.perf_counter() - started
        if cfg.strategy == "ddp":
            # DDP copies rank 0's buffers (BatchNorm running stats) to the others at the *start* of each
            # forward, so after the last step each rank holds its own. Evaluate, everywhere, the model
            # that model.pt will hold: rank 0's.
            process_group.broadcast_buffers(unwrap(wrapped), runtime)
        # DataParallel is one process: evaluate through it; DDP ranks evaluate their own bare replica,
        # because ranks may hold different numbers of validation batches (no collective may run inside).
        val_loss, val_acc, val_count = evaluate(wrapped if cfg.strategy == "dp" else unwrap(wrapped), val_loader, runtime, cfg.amp)
        record = {
            "epoch": epoch,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "val_acc": val_acc,
            "val_count": val_count,
            "images_per_sec": steps_per_epoch * global_batch / elapsed,
            "epoch_time_s": elapsed,
            "world_size": runtime.world_size,
            "global_batch": global_batch,
            "steps": steps_per_epoch,
            "lr": optimizer.param_groups[0]["lr"],
        }
        if runtime.is_main:
            with open(metrics_path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        log(
            runtime,
            f"epoch {epoch + 1}/{cfg.epochs}: train_loss {train_loss:.4f}  val_loss {val_loss:.4f}  "
            f"val_acc {val_acc:.2%} ({val_count} samples)  {record['images_per_sec']:.0f} images/s",
        )
    if runtime.is_main:
        checkpoint.atomic_save(checkpoint.model_state_dict(wrapped), os.path.join(cfg.output_dir, checkpoint.MODEL_FILE))
        log(runtime, f"saved {os.path.join(cfg.output_dir, checkpoint.MODEL_FILE)} and {metrics_path}")
    # Nobody leaves (and tears the group down) before rank 0 has written the model.
    process_group.barrier(runtime)
    return record


def _train_epoch(cfg, runtime, model, optimizer, scaler, loader, steps, epoch) -> float:
    model.train()
    progress = _progress_bar(runtime, cfg, steps, epoch)
    loss_sum = torch.zeros((), dtype=torch.float64, device=runtime.device)
    seen = 0
    batches = iter(loader)
    is_ddp = hasattr(model, "no_sync") and cfg.strategy == "ddp"
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(cfg.accumulate):
            images, labels = next(batches)
            if cfg.debug and step == 0 and micro == 0:
                print(
                    f"[rank {runtime.rank} local {runtime.local_rank} pid {os.getpid()}] "
                    f"data: {images.device}, model: {next(model.parameters()).device}",
                    flush=True,
                )
            last = micro == cfg.accumulate - 1
            # Skip the all-reduce on all but the last micro-step; gradients accumulate locally. With
            # static_graph DDP records the graph on its first backward, which must be synchronised.
            first_backward = epoch == 0 and step == 0 and micro == 0 and cfg.static_graph
            sync = contextlib.nullcontext() if (last or not is_ddp or first_backward) else model.no_sync()
            with sync:
                with _autocast(runtime, cfg.amp):
                    loss = F.cross_entropy(model(images), labels)
                scaler.scale(loss / cfg.accumulate).backward()
            loss_sum += loss.detach().double() * labels.shape[0]
            seen += labels.shape[0]
        scaler.step(optimizer)
        scaler.update()
        if progress is not None:
            progress.update(_global_batch(cfg, runtime))
    if progress is not None:
        progress.close()
    # The loss in any single rank's batches is a sample; the epoch's loss is the sum over all ranks.
    total, count = data.reduce_sums([loss_sum.item(), float(seen)], runtime)
    return total / max(count, 1.0)


def _progress_bar(runtime: Runtime, cfg: TrainConfig, steps: int, epoch: int):
    if not (runtime.is_main and cfg.progress):
        return None
    from tqdm import tqdm

    # disable=None: only on a terminal, so logs and CI output stay free of carriage returns.
    # Counted in global images, so the rate reads as images/s and the ETA as time left in the epoch.
    return tqdm(
        total=steps * _global_batch(cfg, runtime),
        desc=f"epoch {epoch + 1}/{cfg.epochs}",
        unit="img",
        unit_scale=True,
        disable=None,
        leave=False,
        file=sys.stderr,
    )


def _global_batch(cfg: TrainConfig, runtime: Runtime) -> int:
    return cfg.batch_size * runtime.world_size * cfg.accumulate


@torch.no_grad()
def evaluate(model: nn.Module, loader, runtime: Runtime, amp: str = "off") -> tuple[float, float, int]:
    """Mean loss, accuracy and sample count over the whole validation set, each sample counted once."""
    model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0.0
    for images, labels in loader:
        with _autocast(runtime, amp):
            output = model(images)
        loss_sum += F.cross_entropy(output.float(), labels, reduction="sum").item()
        correct += (output.argmax(dim=1) == labels).sum().item()
        count += labels.shape[0]
    loss_sum, correct, count = data.reduce_sums([loss_sum, correct, count], runtime)
    return loss_sum / max(count, 1.0), correct / max(count, 1.0), int(count)
