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
import functools
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddpkit import checkpoint, data, nccl, preempt, process_group, zoo
from ddpkit.env import DistEnv
from ddpkit.errors import UsageError
from ddpkit.process_group import Runtime
from ddpkit.strategies import NEEDS_GROUP, STRATEGIES, DDPOptions, Pipeline, PipelineLayout, check_dp_batch, unwrap
from ddpkit.strategies import state as strategy_state
from ddpkit.strategies.pipeline import PIPELINE_SCHEDULES
from ddpkit.strategies.sync_bn import convert_sync_batchnorm

OPTIMIZERS = ("sgd", "adam", "adadelta")
DEFAULT_LR = {"sgd": 0.01, "adam": 1e-3, "adadelta": 1.0}
AMP_DTYPES = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}
METRICS_FILE = "metrics.jsonl"
SCHEDULES = ("constant", "step", "cosine")


@dataclasses.dataclass
class TrainConfig:
    """Everything one training run depends on; the CLI flags map one to one onto these fields."""

    model: str = "net"  # net, convnet, or a torchvision classifier name
    data: str = "digits"  # digits | synthetic[:N] | mnist[:DIR] | folder:PATH
    epochs: int = 8
    batch_size: int = 32  # per process (per pipeline); the global batch is batch_size * data replicas * accumulate
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
    schedule: str = "constant"  # constant | step | cosine, stepped once per optimizer step
    warmup_steps: int = 0  # linear warm-up from lr/warmup_steps to lr over this many optimizer steps
    lr_step_epochs: int = 0  # step schedule: multiply by lr_gamma every this many epochs (0: a third of --epochs)
    lr_gamma: float = 0.1
    resume: str | None = None  # None: fresh start; "auto": newest complete checkpoint in output_dir; or a path
    checkpoint_every: int = 0  # also checkpoint every N optimizer steps (0: at each epoch's end only)
    keep_checkpoints: int = 3
    zero: bool = False  # DDP with ZeroRedundancyOptimizer: each rank keeps 1/world of the optimizer state
    stages: int | None = None  # pipeline: stages per pipeline (None: the world size); world = stages x replicas
    microbatches: int | None = None  # pipeline: micro-batches per step (None: 2 x stages); must divide --batch-size
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b
    split_at: str | None = None  # pipeline: comma-separated piece names where stages begin (None: balanced)
    debug: bool = False  # every rank prints its PID and where its data and model live
    progress: bool = True  # a progress bar on global rank 0 (only when writing to a terminal)

    def _validate_parallelism(self) -> None:
        if self.zero and self.strategy != "ddp":
            raise UsageError(f"--zero shards the optimizer state across DDP processes; it needs --strategy ddp, not "
                             f"{self.strategy}" + (" (fsdp shards the optimizer state already)" if self.strategy == "fsdp" else ""))
        pipeline_only = [flag for flag, value in (("--stages", self.stages), ("--microbatches", self.microbatches),
                                                  ("--split-at", self.split_at)) if value is not None]
        if self.strategy != "pipeline":
            if pipeline_only:
                raise UsageError(f"{pipeline_only[0]} is for --strategy pipeline, not {self.strategy}")
            return
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise UsageError(f"--pipeline-schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {self.pipeline_schedule!r}")
        if self.accumulate > 1:
            raise UsageError("--accumulate with --strategy pipeline: the pipeline accumulates over its micro-batches "
                             "already; raise --microbatches and --batch-size instead")
        if self.amp != "off":
            raise UsageError(f"--amp {self.amp} is not supported with --strategy pipeline yet; use --amp off")
        for flag, value in (("--stages", self.stages), ("--microbatches", self.microbatches)):
            if value is not None and value < 1:
                raise UsageError(f"{flag} must be at least 1, got {value}")

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
        if self.schedule not in SCHEDULES:
            raise UsageError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise UsageError(f"--warmup-steps must be 0 or more, got {self.warmup_steps}")
        if self.lr_step_epochs < 0:
            raise UsageError(f"--lr-step-epochs must be 0 or more, got {self.lr_step_epochs}")
        if not 0 < self.lr_gamma <= 1:
            raise UsageError(f"--lr-gamma must be in (0, 1], got {self.lr_gamma}")
        if self.checkpoint_every < 0:
            raise UsageError(f"--checkpoint-every must be 0 (epoch ends only) or more, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise UsageError(f"--keep-checkpoints must be at least 1, got {self.keep_checkpoints}")
        if self.resume == "":
            raise UsageError("--resume needs a value: auto, a checkpoint file, or a checkpoint folder")
        if self.resume not in (None, "auto") and not os.path.exists(self.resume):
            raise UsageError(f"--resume {self.resume}: no such file or folder (give a checkpoint file or folder, or auto)")
        self._validate_parallelism()
        DDPOptions(bucket_cap_mb=self.bucket_cap_mb)
        zoo.parse_data_spec(self.data)
        zoo.check_model_name(self.model)


def make_optimizer(name: str, params, lr: float | None, *, zero: bool = False) -> torch.optim.Optimizer:
    """``zero``: PyTorch's ZeroRedundancyOptimizer around it (each rank steps and stores its share only)."""
    lr = DEFAULT_LR[name] if lr is None else lr
    kind, settings = {
        "sgd": (torch.optim.SGD, {"lr": lr, "momentum": 0.9}),
        "adam": (torch.optim.Adam, {"lr": lr}),
        "adadelta": (torch.optim.Adadelta, {"lr": lr}),
    }[name]
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=kind, **settings)
    return kind(params, **settings)


def pipeline_layout(cfg: TrainConfig, world_size: int) -> PipelineLayout | None:
    """Stages and replicas of ``--strategy pipeline`` in a world of this size (None for the other strategies)."""
    if cfg.strategy != "pipeline":
        return None
    stages = cfg.stages or world_size
    return PipelineLayout(world_size=world_size, stages=stages, microbatches=cfg.microbatches or 2 * stages,
                          batch_size=cfg.batch_size)


def lr_factor(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """The multiplier of the base learning rate for optimizer step ``step`` (0-based) of the whole run.

    Warm-up rises linearly to 1 over ``warmup_steps``; then ``cosine`` decays to 0 at the last step of
    ``epochs``, ``step`` multiplies by ``lr_gamma`` every ``lr_step_epochs`` epochs, ``constant`` stays.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        total = max(cfg.epochs * steps_per_epoch - cfg.warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - cfg.warmup_steps, total) / total))
    if cfg.schedule == "step":
        every = cfg.lr_step_epochs or max(1, cfg.epochs // 3)
        return cfg.lr_gamma ** (step // max(steps_per_epoch, 1) // every)
    return 1.0


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int):
    """PyTorch's LambdaLR over ``lr_factor``: its state_dict is plain numbers, loadable with weights_only."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_factor_at, cfg, steps_per_epoch))


def _factor_at(cfg: TrainConfig, steps_per_epoch: int, step: int) -> float:
    return lr_factor(cfg, step, steps_per_epoch)


def place_scheduler(scheduler, step: int) -> None:
    """Put a LambdaLR at ``step`` from its own base rates, as if stepped there (a resume, whatever wrote it)."""
    scheduler.last_epoch = step
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base  # a loaded optimizer state brings the checkpoint's
        group["lr"] = base * factor(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


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
        backend=cfg.backend, device=cfg.device, timeout_s=cfg.timeout, force_group=cfg.strategy in NEEDS_GROUP,
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

    folder = os.path.join(cfg.output_dir, checkpoint.FOLDER)
    source = cfg.resume
    if runtime.env.restart_count > 0 and (source is None or checkpoint.list_checkpoints(folder)):
        # torchrun restarted the group after a failure: carry on from this run's newest checkpoint (a
        # --resume PATH was the starting point of the first attempt only).
        source = "auto"
        log(runtime, f"ddpkit: restart {runtime.env.restart_count} of the group: resuming from the newest checkpoint")
    if source is None and runtime.is_main:
        moved = checkpoint.set_aside(folder)
        if moved is not None:
            log(runtime, f"ddpkit: starting fresh (no --resume); the earlier run's checkpoints were moved to {moved}")
    ckpt = checkpoint.Checkpointer(folder, runtime, keep=cfg.keep_checkpoints, log=lambda text: log(runtime, text))
    # Weights go into the bare model, before wrapping; the rest once the optimizer exists.
    resumed = ckpt.load(source, model=model)
    if source == "auto" and resumed is None:
        log(runtime, f"ddpkit: --resume auto: no checkpoint in {folder}, starting fresh")

    ddp_options = DDPOptions(
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        bucket_cap_mb=cfg.bucket_cap_mb,
    )
    layout = pipeline_layout(cfg, runtime.world_size)
    wrapped = STRATEGIES[cfg.strategy](
        model, runtime, ddp=ddp_options, layout=layout, schedule=cfg.pipeline_schedule,
        split_at=cfg.split_at.split(",") if cfg.split_at else None,
        sample_input=torch.zeros(cfg.batch_size // layout.microbatches, channels, image_size, image_size) if layout else None,
    )
    optimizer = make_optimizer(cfg.optimizer, wrapped.parameters(), cfg.lr, zero=cfg.zero)
    scaler = torch.amp.GradScaler(runtime.device.type, enabled=cfg.amp == "fp16")

    # Pipeline stages of one pipeline share their data; only the replicas split it.
    replica = (layout.replica_of(runtime.rank), layout.replicas) if layout else None
    loader = data.train_loader(sets.train, batch_size=cfg.batch_size, runtime=runtime, seed=cfg.seed,
                               workers=cfg.workers, replica=replica)
    val_loader = data.eval_loader(sets.val, batch_size=cfg.batch_size, runtime=runtime, workers=cfg.workers,
                                  replica=replica)
    steps_per_epoch = len(loader) // cfg.accumulate
    if steps_per_epoch == 0 and cfg.epochs > 0:
        raise UsageError(
            f"one epoch has {len(loader)} batches per process, fewer than --accumulate {cfg.accumulate}; "
            "lower --accumulate or --batch-size"
        )
    scheduler = make_scheduler(cfg, optimizer, steps_per_epoch)
    global_batch = _global_batch(cfg, runtime)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        runtime,
        f"ddpkit: {runtime.world_size} process(es) via {runtime.env.launcher}, backend "
        f"{runtime.backend or 'none'}, device {runtime.device.type}, strategy {cfg.strategy}; "
        f"model {cfg.model} ({n_params:,} parameters); data {cfg.data}: {len(sets.train)} train / "
        f"{len(sets.val)} val; batch {cfg.batch_size} per "
        + (f"pipeline x {layout.replicas} pipeline(s) of {layout.stages} stages ({layout.microbatches} micro-batches, "
           f"{cfg.pipeline_schedule})" if layout else f"process x {runtime.world_size} processes")
        + (f" x {cfg.accumulate} micro-steps" if cfg.accumulate > 1 else "")
        + f" = global batch {global_batch}; {steps_per_epoch} steps per epoch",
    )
    position = _Position(epoch=0, samples=0, global_step=0)
    partial = [0.0, 0.0]
    if resumed is not None:
        position, partial = _restore(cfg, runtime, resumed, wrapped, optimizer, scheduler, scaler, steps_per_epoch)
    metrics_path = os.path.join(cfg.output_dir, METRICS_FILE)
    if runtime.is_main:
        _keep_metrics_before(metrics_path, position.epoch)

    record: dict = {}
    loop = _Loop(cfg, runtime, wrapped, optimizer, scheduler, scaler, loader, ckpt, steps_per_epoch, position)
    with preempt.stop_on_signal(runtime) as loop.stop:
        for epoch in range(position.epoch, cfg.epochs):
            start = position.samples if epoch == position.epoch else 0
            loader.load_state_dict({"epoch": epoch, "samples": start})
            started = time.perf_counter()
            train_loss, steps_run = loop.epoch(epoch, start, partial if start else [0.0, 0.0])
            if loop.stop.requested(now=True):
                # Signalled late in the epoch: stop before a long evaluation eats the grace period.
                loop.stop_now(epoch, loop.last_samples, loop.last_partial, None)
            process_group.synchronize(runtime.device)
            elapsed = time.perf_counter() - started
            if cfg.strategy in ("ddp", "fsdp") or (layout and layout.replicas > 1):
                # DDP copies rank 0's buffers (BatchNorm running stats) to the others at the *start* of each
                # forward, so after the last step each rank holds its own (FSDP never syncs them). Evaluate,
                # everywhere, the model that model.pt will hold: rank 0's (pipeline 0's, for each stage).
                process_group.broadcast_buffers(unwrap(wrapped), runtime,
                                                group=wrapped.replica_group if layout else None)
            val_loss, val_acc, val_count = evaluate(_evaluated(wrapped, cfg), val_loader, runtime, cfg.amp,
                                                    lockstep=cfg.strategy == "fsdp")
            record = {
                "epoch": epoch,
                "train_loss": train_loss,
                "val_loss": val_loss,
                "val_acc": val_acc,
                "val_count": val_count,
                "images_per_sec": steps_run * global_batch / elapsed,
                "epoch_time_s": elapsed,
                "world_size": runtime.world_size,
                "global_batch": global_batch,
                "steps": steps_per_epoch,
                "lr": optimizer.param_groups[0]["lr"],
                **_memory(runtime, wrapped, optimizer),
                "nccl": nccl.in_effect(),
            }
            if start:
                record["resumed_at_step"] = steps_per_epoch - steps_run
            if runtime.is_main:
                with open(metrics_path, "a") as handle:
                    handle.write(json.dumps(record) + "\n")
            log(
                runtime,
                f"epoch {epoch + 1}/{cfg.epochs}: train_loss {train_loss:.4f}  val_loss {val_loss:.4f}  "
                f"val_acc {val_acc:.2%} ({val_count} samples)  {record['images_per_sec']:.0f} images/s",
            )
            loop.save(epoch + 1, 0, [0.0, 0.0], if_idle=False)
    ckpt.wait()
    final = checkpoint.snapshot(strategy_state.full_model_state(wrapped, runtime))  # a collective under fsdp, pipeline
    if runtime.is_main:
        checkpoint.atomic_save(final, os.path.join(cfg.output_dir, checkpoint.MODEL_FILE))
        log(runtime, f"saved {os.path.join(cfg.output_dir, checkpoint.MODEL_FILE)} and {metrics_path}")
    # Nobody leaves (and tears the group down) before rank 0 has written the model.
    ckpt.wait()
    return record


@dataclasses.dataclass
class _Position:
    epoch: int  # the epoch to run next
    samples: int  # samples of it all ranks together have consumed
    global_step: int  # optimizer steps since the run began (names the checkpoints)


def _restore(cfg, runtime, resumed, model, optimizer, scheduler, scaler, steps_per_epoch) -> tuple[_Position, list[float]]:
    """Load the optimizer, schedule, scaler and RNG; say what changed; return where to continue."""
    contents = resumed.contents
    # The schedule is not loaded: it is a function of the step, placed there below, from this run's
    # --lr (the checkpoint's, unless --lr changed it), which the scheduler took when it was built.
    resumed.restore(optimizer=optimizer, scaler=scaler, model=model)
    global_batch = _global_batch(cfg, runtime)
    samples = resumed.samples
    step_in_epoch = samples // global_batch
    # The schedule counts optimizer steps of this run's size, whatever size wrote the checkpoint.
    place_scheduler(scheduler, resumed.epoch * steps_per_epoch + step_in_epoch)
    if resumed.epoch >= cfg.epochs:
        where = f"nothing left to train: it ends epoch {resumed.epoch} and --epochs is {cfg.epochs}"
    else:
        where = ("continuing at epoch " + str(resumed.epoch + 1)
                 + (f" after {samples} samples (step {step_in_epoch} of {steps_per_epoch})" if samples else ""))
    log(runtime, f"ddpkit: resumed from {resumed.path} ({contents.layout}): {where}")
    if contents.layout != "ddpkit":
        parts = ["weights"] + (["optimizer"] if contents.optimizer is not None else [])
        log(runtime, f"ddpkit: that file holds {' and '.join(parts)} only: no RNG or data position, so the run "
                     "continues from an epoch's start, not bit for bit")
    if contents.config:
        changed = [f"{key} {contents.config[key]!r} -> {value!r}" for key, value in dataclasses.asdict(cfg).items()
                   if key in contents.config and contents.config[key] != value and key not in _RESUME_FREE]
        if changed:
            log(runtime, f"ddpkit: settings differ from the checkpoint's run: {', '.join(changed)}")
    if resumed.global_batch is not None and resumed.global_batch != global_batch:
        per_process = _data_replicas(cfg, runtime) * cfg.accumulate
        keep = (f"; to keep global batch {resumed.global_batch}, pass --batch-size {resumed.global_batch // per_process}"
                if resumed.global_batch % per_process == 0 else "")
        log(runtime, f"ddpkit: the checkpoint was written with global batch {resumed.global_batch} "
                     f"({resumed.world_size} process(es)); this run's is {global_batch} ({runtime.world_size} x "
                     f"{cfg.batch_size}{f' x {cfg.accumulate}' if cfg.accumulate > 1 else ''}). The data order "
                     f"continues where it stopped; the learning rate is not rescaled{keep}")
    elif resumed.world_size is not None and not resumed.same_world_size:
        log(runtime, f"ddpkit: the checkpoint was written by {resumed.world_size} process(es), now "
                     f"{runtime.world_size}: the same global batch {global_batch}; the ranks' random states are not "
                     "restored (they continue from the seed)")
    partial = resumed.rank_state.get("partial") if resumed.same_world_size else None
    if partial is None:
        # Another world size: the epoch's running loss so far goes to rank 0, which adds it up anyway.
        totals = contents.extra.get("partial_total") if contents.extra else None
        partial = list(totals) if (totals and runtime.is_main) else [0.0, 0.0]
    position = _Position(epoch=resumed.epoch, samples=samples, global_step=resumed.global_step
                         or resumed.epoch * steps_per_epoch + step_in_epoch)
    return position, list(partial)


# Fields that may change between an interrupted run and its resumption without comment.
_RESUME_FREE = {"resume", "epochs", "debug", "progress", "workers", "output_dir", "timeout", "checkpoint_every",
                "keep_checkpoints"}


def _keep_metrics_before(path: str, epoch: int) -> None:
    """metrics.jsonl keeps the lines of the epochs before ``epoch`` (all of a fresh run's are dropped)."""
    kept = []
    if epoch > 0 and os.path.exists(path):
        with open(path) as handle:
            for line in handle:
                try:
                    if json.loads(line)["epoch"] < epoch:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a crash
    checkpoint.atomic_write(path, lambda handle: handle.write("".join(kept).encode()))


class _Loop:
    """The optimizer steps of one epoch, with mid-epoch checkpoints and the stop-signal check."""

    def __init__(self, cfg, runtime, model, optimizer, scheduler, scaler, loader, ckpt, steps_per_epoch, position):
        self.cfg, self.runtime, self.model = cfg, runtime, model
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.loader, self.ckpt, self.steps_per_epoch = loader, ckpt, steps_per_epoch
        self.global_step = position.global_step
        self.stop: preempt.StopSignal | None = None
        self.backward_done = False
        self.last_samples, self.last_partial = 0, [0.0, 0.0]  # where the last epoch() ended, for a stop there

    def save(self, epoch: int, samples: int, partial: list[float], *, if_idle: bool) -> None:
        totals = data.reduce_sums(partial, self.runtime) if samples else [0.0, 0.0]
        self.ckpt.save(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
            loader=self.loader, epoch=epoch, samples=samples, global_step=self.global_step,
            config=dataclasses.asdict(self.cfg), extra={"partial_total": totals},
            rank_state={"partial": [float(v) for v in partial]}, if_idle=if_idle,
            global_batch=_global_batch(self.cfg, self.runtime),
        )

    def epoch(self, epoch: int, start: int, partial: list[float]) -> tuple[float, int]:
        """Train from ``start`` samples into ``epoch``; return the epoch's mean loss and the steps run here."""
        cfg, runtime, model = self.cfg, self.runtime, self.model
        model.train()
        steps = len(self.loader) // cfg.accumulate
        global_batch = _global_batch(cfg, runtime)
        progress = _progress_bar(runtime, cfg, steps, epoch)
        loss_sum = torch.tensor(partial[0], dtype=torch.float64, device=runtime.device)
        seen = partial[1]
        batches = iter(self.loader)
        for step in range(steps):
            self.optimizer.zero_grad(set_to_none=True)
            for micro in range(cfg.accumulate):
                images, labels = next(batches)
                if cfg.debug and step == 0 and micro == 0:
                    print(
                        f"[rank {runtime.rank} local {runtime.local_rank} pid {os.getpid()}] "
                        f"data: {images.device}, model: {next(model.parameters()).device}",
                        flush=True,
                    )
                loss = self.forward_backward(images, labels, last=micro == cfg.accumulate - 1)
                if loss is not None:  # None: a pipeline stage other than the last has no loss
                    loss_sum += loss.detach().double() * labels.shape[0]
                    seen += labels.shape[0]
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            self.global_step += 1
            if progress is not None:
                progress.update(global_batch)
            done = start + (step + 1) * global_batch
            if self.stop is not None and self.stop.requested():
                self.stop_now(epoch, done, [loss_sum.item(), seen], progress)
            every = cfg.checkpoint_every
            if every and self.global_step % every == 0 and step + 1 < steps:
                self.save(epoch, done, [loss_sum.item(), seen], if_idle=True)
        if progress is not None:
            progress.close()
        self.last_samples, self.last_partial = start + steps * global_batch, [loss_sum.item(), seen]
        # The loss in any single rank's batches is a sample; the epoch's loss is the sum over all ranks.
        total, count = data.reduce_sums([loss_sum.item(), float(seen)], runtime)
        return total / max(count, 1.0), steps

    def forward_backward(self, images: torch.Tensor, labels: torch.Tensor, *, last: bool) -> torch.Tensor | None:
        """One micro-step's loss and gradients; gradients are synchronised on the ``last`` only."""
        cfg, model = self.cfg, self.model
        if isinstance(model, Pipeline):
            return model.train_step(images, labels)  # its micro-batches go through every stage
        # Skip the all-reduce on all but the last micro-step; gradients accumulate locally. With
        # static_graph DDP records the graph on its first backward (in this process, resumed or
        # not), which must be synchronised.
        first_backward = cfg.static_graph and not self.backward_done
        sync = contextlib.nullcontext()
        if cfg.strategy == "ddp" and not (last or first_backward):
            sync = model.no_sync()
        elif cfg.strategy == "fsdp":
            model.set_requires_gradient_sync(last)  # FSDP's no_sync: reduce-scatter on the last micro-step only
        with sync:
            with _autocast(self.runtime, cfg.amp):
                loss = F.cross_entropy(model(images), labels)
            self.scaler.scale(loss / cfg.accumulate).backward()
        self.backward_done = True
        return loss

    def stop_now(self, epoch: int, samples: int, partial: list[float], progress) -> None:
        """Every rank got here at the same step: write one checkpoint, wait for it, leave."""
        if progress is not None:
            progress.close()
        self.save(epoch, samples, partial, if_idle=False)
        self.ckpt.wait()
        # One write per line: the ranks print at the same moment into the same pipe.
        sys.stdout.write(f"ddpkit: rank {self.runtime.rank} stopped by {self.stop.signal_name} at epoch {epoch + 1}, "
                         f"step {self.global_step}; checkpoint {self.ckpt.last_path or 'written by rank 0'}\n")
        sys.stdout.flush()
        raise preempt.StopNow(self.stop.exit_code)


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


def _data_replicas(cfg: TrainConfig, runtime: Runtime) -> int:
    """How many ways the data is split: every process, except that the stages of a pipeline share theirs."""
    layout = pipeline_layout(cfg, runtime.world_size)
    return layout.replicas if layout else runtime.world_size


def _global_batch(cfg: TrainConfig, runtime: Runtime) -> int:
    return cfg.batch_size * _data_replicas(cfg, runtime) * cfg.accumulate


def _evaluated(wrapped: nn.Module, cfg: TrainConfig) -> nn.Module:
    """What runs the validation forwards: DDP ranks their own bare replica (ranks may hold different numbers
    of validation batches, so no collective may run inside); DataParallel, FSDP (which gathers each block's
    weights) and pipelines (whose stages pass activations on) through the wrapper."""
    return unwrap(wrapped) if cfg.strategy in ("ddp", "single") else wrapped


@torch.no_grad()
def evaluate(model: nn.Module, loader, runtime: Runtime, amp: str = "off", *,
             lockstep: bool = False) -> tuple[float, float, int]:
    """Mean loss, accuracy and sample count over the whole validation set, each sample counted once.

    ``lockstep``: every rank runs as many forwards as the rank with the most batches (a rank out of
    batches runs empty ones), for models whose forward is a collective (FSDP's all-gathers).
    """
    model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0.0
    for images, labels in _lockstep(loader, runtime) if lockstep else loader:
        with _autocast(runtime, amp):
            output = model(images)
        if output is None:  # a pipeline stage other than the last
            continue
        labels = labels.to(output.device)
        loss_sum += F.cross_entropy(output.float(), labels, reduction="sum").item()
        correct += (output.argmax(dim=1) == labels).sum().item()
        count += labels.shape[0]
    loss_sum, correct, count = data.reduce_sums([loss_sum, correct, count], runtime)
    return loss_sum / max(count, 1.0), correct / max(count, 1.0), int(count)


def _lockstep(loader, runtime: Runtime):
    """The loader's batches, then empty batches shaped like them until every rank has run as many."""
    batches = torch.tensor([len(loader)], device=runtime.device if runtime.backend == "nccl" else "cpu")
    dist.all_reduce(batches, op=dist.ReduceOp.MAX)
    last = None
    for last in loader:
        yield last
    for _ in range(int(batches.item()) - len(loader)):
        if last is None:  # this rank holds no validation sample (fewer than ranks): shape one like the set's first
            image, label = loader.loader.dataset.dataset[0]
            last = [torch.as_tensor(image)[None].to(runtime.device), torch.as_tensor(label)[None].to(runtime.device)]
        yield [item[:0] for item in last]


def _memory(runtime: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[float]]:
    """Per rank, in MiB: the peak memory (the GPU's allocated peak; on CPU the process's peak resident set)
    and what the training state takes (parameters, gradients, optimizer state: FSDP and ZeRO shrink it)."""
    if runtime.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(runtime.device)
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    mine = torch.tensor([peak, strategy_state.held_bytes(model, optimizer)], dtype=torch.float64) / 2**20
    every = [mine]
    group = process_group.control_group(runtime)
    if group is not None:
        every = [torch.empty_like(mine) for _ in range(runtime.world_size)]
        dist.all_gather(every, mine, group=group)
    return {"peak_memory_mb": [round(float(rank[0]), 1) for rank in every],
            "train_state_mb": [round(float(rank[1]), 3) for rank in every]}
