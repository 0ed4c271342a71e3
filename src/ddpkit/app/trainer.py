"""The loop ``ddpkit train`` runs in every process: the reference for what the library does.

    >>> from ddpkit.app.trainer import TrainConfig, run
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
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit import checkpoint, data, strategies, zoo
from ddpkit.watch import heartbeat, replicas, status
from ddpkit.core import logs, preempt, process_group, ray_reports
from ddpkit.launch import nccl
from ddpkit.app import trackers
from ddpkit.zoo import user_code
from ddpkit.core.env import DistEnv
from ddpkit.app.config import flag_terms, option
from ddpkit.data import images
from ddpkit.core.errors import UsageError, disk_full, said_once
from ddpkit.core.precision import AMP_DTYPES
from ddpkit.job import Job
from ddpkit.core.logs import logger
from ddpkit.strategies import STRATEGIES, Strategy
from ddpkit.strategies.pipeline import PIPELINE_SCHEDULES

OPTIMIZERS = ("sgd", "adam", "adadelta")
DEFAULT_LR = {"sgd": 0.01, "adam": 1e-3, "adadelta": 1.0}
METRICS_FILE = status.METRICS_FILE
SCHEDULES = ("constant", "step", "cosine")


PARALLEL = "sharding and pipelines (docs/parallelism.md)"
CHECKPOINTS = "checkpoints (DIR/checkpoints)"
DDP_KNOBS = "DistributedDataParallel knobs"
# Every registered strategy but those that are another's ZeRO form (zero is --strategy ddp --zero).
CLI_STRATEGIES = tuple(name for name in STRATEGIES if name not in {kind.with_zero for kind in STRATEGIES.values()})
CHECKPOINT_FORMATS = ("auto", "full", "sharded")
LOGS_FOLDER = "logs"  # OUTPUT_DIR/logs/rank<N>.log: all each rank wrote (ddpkit.launch.rank_logs), or its ddpkit messages


@dataclasses.dataclass
class TrainConfig:
    """Everything one training run depends on. Each field is also ``ddpkit train``'s flag of the same name
    (``--batch-size`` for ``batch_size``): its help, choices and default are declared here only."""

    model: str = option("net", "net (MNIST CNN with BatchNorm), convnet (conv+linear, no BatchNorm), a torchvision "
                               "classifier such as resnet18, or your own: package.module:function, returning an "
                               "nn.Module (default: net)")
    data: str = option("digits", "digits (built in), synthetic[:N], mnist[:DIR], folder:PATH (class-per-folder images), "
                                 "shards:PATH (a folder packed by `ddpkit data pack`), or your own: "
                                 "package.module:function, returning (train, validation[, classes]) data sets of "
                                 "(input, class) pairs (default: digits)", metavar="SPEC")
    model_arg: tuple = option((), "a keyword argument for --model's function; VALUE is read as JSON where it can "
                                  "be (3, 0.5, true, [1, 2]), else as a string", metavar="KEY=VALUE", repeat=True)
    data_arg: tuple = option((), "a keyword argument for --data's function, as --model-arg", metavar="KEY=VALUE",
                             repeat=True)
    tracker: tuple = option((), "also send each epoch's metrics and the run's settings, from rank 0, to TensorBoard "
                                "(OUTPUT_DIR/tensorboard), MLflow (MLFLOW_TRACKING_URI or OUTPUT_DIR/mlruns), Weights "
                                "& Biases (offline without a key) or OUTPUT_DIR/metrics.csv", choices=trackers.TRACKERS,
                            metavar="{" + ",".join(trackers.TRACKERS) + "}", repeat=True)
    epochs: int = option(8, "default: 8")
    batch_size: int = option(32, "per process (with --strategy pipeline: per pipeline); the global batch is B x world "
                                 "size (pipelines) x accumulate (default: 32)", metavar="B")
    lr: float | None = option(None, "default: 0.01 sgd, 0.001 adam, 1.0 adadelta", kind=float)
    optimizer: str = option("adam", "default: adam", choices=OPTIMIZERS)
    strategy: str = option("ddp", "ddp: one process per device; dp: one process drives all GPUs; single: one device; "
                                  "fsdp: weights, gradients and optimizer state sharded over the processes; pipeline: "
                                  "the model cut into stages, one per process (default: ddp; see docs/parallelism.md)",
                           choices=CLI_STRATEGIES)
    backend: str = option("auto", "auto = nccl when each process has its own GPU, else gloo (default: auto)",
                          choices=process_group.BACKENDS)
    device: str = option("auto", "default: auto", choices=process_group.DEVICES)
    amp: str = option("off", "mixed precision; fp16 uses a GradScaler (default: off)", choices=tuple(AMP_DTYPES))
    sync_bn: bool = option(False, "BatchNorm statistics over the global batch (ddp only; works on CPU too)")
    accumulate: int = option(1, "micro-steps per optimizer step; the all-reduce runs on the last one only", metavar="K")
    workers: int | None = option(None, "data loader processes per rank (default: 0 for in-memory data, else a share "
                                       "of cores)", metavar="W", kind=int)
    decode: str = option("auto", "image folders and packs: where JPEGs are decoded and cropped: cpu (the loader "
                                 "processes) or gpu (nvJPEG, in the training process); auto = cpu, or on a CUDA device "
                                 "gpu when the loader processes are too few to keep nvJPEG's measured pace (default: "
                                 "auto)", choices=images.DECODES)
    seed: int = option(0, "weights, sample order and image crops depend only on this (default: 0)")
    output_dir: str = option("runs/ddpkit", "metrics.jsonl, model.pt and checkpoints/ go here (default: runs/ddpkit)",
                             metavar="DIR")
    timeout: float = option(process_group.DEFAULT_TIMEOUT_S, "how long a collective waits for the other ranks before "
                            "failing (default: 1800)", metavar="SECONDS")
    stall_timeout: float = option(heartbeat.DEFAULT_STALL_S, "end the job, naming the rank that holds it up and its "
                                  "stack, once no rank has advanced for this long (at least 20 typical steps, at most "
                                  "--timeout; 0: off) (default: 60)", metavar="SECONDS")
    check_replicas: int = option(replicas.DEFAULT_EVERY, "every N optimizer steps, compare an exact checksum of every "
                                 "rank's weights (ddp, zero) and stop the job naming a rank whose weights differ (0: "
                                 "off) (default: 1000)", metavar="N")
    image_size: int | None = option(None, "side of the square input (default: 28 net, 32 convnet, 224 torchvision on "
                                          "folders)", metavar="PIXELS", kind=int)
    schedule: str = option("constant", "learning-rate schedule, stepped every optimizer step (default: constant)",
                           choices=SCHEDULES)
    warmup_steps: int = option(0, "linear warm-up over the first N optimizer steps (default: 0)", metavar="N")
    lr_step_epochs: int = option(0, "step schedule: multiply the LR by --lr-gamma every E epochs (default: a third of "
                                    "--epochs)", metavar="E")
    lr_gamma: float = option(0.1, "step schedule factor (default: 0.1)", metavar="G")
    debug: bool = option(False, "every rank prints its PID and the device of its data and model (--log-level debug)")
    log_level: str | None = option(None, "debug: every rank's messages; info: rank 0's, and warnings and errors from "
                                         "every rank; warning; error (default: info, or DDPKIT_LOG_LEVEL)",
                                   choices=logs.LEVELS, kind=str, metavar="LEVEL")
    progress: bool = option(True, "no progress bar", flag="--no-progress")
    zero: bool = option(False, "with ddp: ZeroRedundancyOptimizer, each process keeps 1/world of the optimizer state",
                        group=PARALLEL)
    stages: int | None = option(None, "pipeline: stages per pipeline; world size / S pipelines run as data-parallel "
                                      "replicas (default: the world size)", metavar="S", kind=int, group=PARALLEL)
    microbatches: int | None = option(None, "pipeline: micro-batches per step, dividing --batch-size (default: 2 x "
                                            "stages)", metavar="M", kind=int, group=PARALLEL)
    pipeline_schedule: str = option("1f1b", "pipeline: gpipe (all forwards, then all backwards) or 1f1b (less "
                                            "activation memory) (default: 1f1b)", choices=PIPELINE_SCHEDULES,
                                    group=PARALLEL)
    split_at: str | None = option(None, "pipeline: comma-separated names of the pieces where stages 2, 3, ... begin, "
                                        "e.g. layer3 (default: balanced by parameter count)", metavar="NAMES",
                                  kind=str, group=PARALLEL)
    resume: str | None = option(None, "auto: continue from the newest complete checkpoint in --output-dir (a fresh "
                                      "start if there is none); PATH: a checkpoint file or folder, ddpkit's or the "
                                      "tutorials' format", metavar="auto|PATH", kind=str, group=CHECKPOINTS)
    checkpoint_every: int = option(0, "also checkpoint every N optimizer steps (default: 0, at each epoch's end only)",
                                   metavar="N", group=CHECKPOINTS)
    keep_checkpoints: int = option(3, "keep the newest K (default: 3)", metavar="K", group=CHECKPOINTS)
    checkpoint_format: str = option("auto", "full: one file, the state gathered to rank 0; sharded: a folder in which "
                                            "every rank writes its own part (torch.distributed.checkpoint), resumable "
                                            "on any number of processes; auto: sharded for fsdp and zero, full "
                                            "otherwise (default: auto)", choices=CHECKPOINT_FORMATS, group=CHECKPOINTS)
    async_checkpoint: bool = option(False, "write sharded checkpoints in the background: training waits only for the "
                                           "copy to host memory (implies --checkpoint-format sharded)",
                                    group=CHECKPOINTS)
    find_unused_parameters: bool = option(False, "allow parameters that get no gradient in a step (costs a graph walk "
                                                 "per step)", group=DDP_KNOBS)
    static_graph: bool = option(False, "the set of used parameters never changes", group=DDP_KNOBS)
    gradient_as_bucket_view: bool = option(False, "gradients share memory with the all-reduce buckets (saves a "
                                                  "gradient copy)", group=DDP_KNOBS)
    bucket_cap_mb: float | None = option(None, "all-reduce bucket size (default: PyTorch's, 25 MiB after a small first "
                                               "bucket)", metavar="MB", kind=float, group=DDP_KNOBS)

    def _validate_own_code(self) -> None:
        """The model and data names, and the user's functions importable and callable with their arguments."""
        spec = zoo.parse_data_spec(self.data)
        zoo.check_model_name(self.model)
        own_model, own_data = user_code.is_spec(self.model), spec.kind == zoo.USER_DATA
        if self.model_arg and not own_model:
            raise UsageError(f"--model-arg is for a --model package.module:function of your own, not {self.model}")
        if self.data_arg and not own_data:
            raise UsageError(f"--data-arg is for a --data package.module:function of your own, not {self.data}")
        if self.image_size is not None and own_data:
            raise UsageError("--image-size resizes the built-in data sets; a --data function of your own gives its "
                             "inputs at their own size")
        if own_model:
            user_code.find_function(self.model, "--model", self.model_arguments(), "--model-arg")
        if own_data:
            user_code.find_function(self.data, "--data", self.data_arguments(), "--data-arg")

    def model_arguments(self) -> dict:
        return user_code.parse_arguments(self.model_arg, "--model-arg")

    def data_arguments(self) -> dict:
        return user_code.parse_arguments(self.data_arg, "--data-arg")

    def _validate_parallelism(self) -> None:
        kind = STRATEGIES[self.strategy]
        if self.zero and kind.with_zero is None:
            takers = [name for name in CLI_STRATEGIES if STRATEGIES[name].with_zero]
            raise UsageError(f"--zero shards the optimizer state across DDP processes; it needs --strategy "
                             f"{' or '.join(takers)}, not {self.strategy}"
                             + (f" ({self.strategy} shards the optimizer state already)" if kind.shards_optimizer else ""))
        chosen = STRATEGIES[kind.with_zero] if self.zero else kind
        for field in strategy_fields(self):
            if field not in settings_of(chosen):
                takers = [name for name in CLI_STRATEGIES if field in settings_of(STRATEGIES[name])]
                raise UsageError(f"--{field.replace('_', '-')} is for --strategy {' or '.join(takers)}, not "
                                 f"{self.strategy}")
        if self.sync_bn and not chosen.replicated:
            takers = [name for name in CLI_STRATEGIES if STRATEGIES[name].replicated]
            raise UsageError(f"--sync-bn synchronises BatchNorm across DDP processes; it needs --strategy "
                             f"{' or '.join(takers)}, not {self.strategy}")
        if not chosen.can_shard_checkpoints and (self.checkpoint_format == "sharded" or self.async_checkpoint):
            raise UsageError("sharded checkpoints (--checkpoint-format sharded, --async-checkpoint) are not available "
                             f"for --strategy {self.strategy} yet; its checkpoints are full ones")
        strategy_for(self).check_training(accumulate=self.accumulate, amp=self.amp)

    def validate(self) -> None:
        """Raise UsageError for values no run could use (each message names the flag and the value)."""
        if self.epochs < 1:
            raise UsageError(f"--epochs must be at least 1, got {self.epochs}")
        if not self.output_dir:
            raise UsageError("--output-dir needs a folder, got an empty name")
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
        if self.decode not in images.DECODES:
            raise UsageError(f"--decode must be one of {', '.join(images.DECODES)}, got {self.decode!r}")
        if self.decode == "gpu" and (self.device == "cpu" or not torch.cuda.is_available()):
            raise UsageError("--decode gpu needs a CUDA GPU, and none is in use here; use --decode cpu (or auto)")
        with in_train_flags():
            process_group.check_timeout(self.timeout)
            heartbeat.stall_setting(self.stall_timeout)
            replicas.check_every(self.check_replicas)
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
        if self.async_checkpoint and self.checkpoint_format == "full":
            raise UsageError("--async-checkpoint writes sharded checkpoints; full ones are written in the background "
                             "by rank 0 already: drop --async-checkpoint or --checkpoint-format full")
        if self.resume == "":
            raise UsageError("--resume needs a value: auto, a checkpoint file, or a checkpoint folder")
        if self.resume not in (None, "auto") and not os.path.exists(self.resume):
            raise UsageError(f"--resume {self.resume}: no such file or folder (give a checkpoint file or folder, or auto)")
        with in_train_flags():
            self._validate_parallelism()  # builds the strategy, which checks its own settings
        self._validate_own_code()
        trackers.check(self.tracker)


def check_output_dir(folder: str) -> None:
    """Create ``folder`` if needed and write a file in it, before any process starts training: a folder that is
    a file, read-only or not permitted is one line at once, not a traceback from a worker after an epoch."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UsageError(f"--output-dir {folder} is a file, not a folder; give a folder (it is created if missing)")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise UsageError(f"--output-dir {folder}: cannot write there ({error.strerror}); give a folder you can "
                         "write to") from None


OPTIMIZER_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adadelta": torch.optim.Adadelta}


def optimizer_settings(name: str, lr: float | None) -> tuple[type, dict]:
    """The optimizer class and its settings for ``--optimizer name --lr lr`` (None: the default rate)."""
    settings = {"lr": DEFAULT_LR[name] if lr is None else lr}
    if name == "sgd":
        settings["momentum"] = 0.9
    return OPTIMIZER_CLASSES[name], settings


def settings_of(kind: type) -> set[str]:
    """The settings (dataclass fields) a strategy class takes."""
    return {field.name for field in dataclasses.fields(kind)}


def strategy_fields(cfg: TrainConfig) -> list[str]:
    """The fields of ``cfg`` that some strategy takes as a setting and that the command line set (away from the
    default)."""
    every = set().union(*(settings_of(kind) for kind in STRATEGIES.values()))
    return [field.name for field in dataclasses.fields(cfg)
            if field.name in every and getattr(cfg, field.name) != field.default]


def strategy_for(cfg: TrainConfig) -> Strategy:
    """The strategy object the settings describe (``--zero`` gives the strategy's ZeRO form: ddp's is zero)."""
    kind = STRATEGIES[cfg.strategy]
    name = kind.with_zero if cfg.zero and kind.with_zero else cfg.strategy
    return strategies.create(name, strict=False, **{field: getattr(cfg, field) for field in strategy_fields(cfg)})


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
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(factor_at, cfg, steps_per_epoch))


def factor_at(cfg: TrainConfig, steps_per_epoch: int, step: int) -> float:
    return lr_factor(cfg, step, steps_per_epoch)


def place_scheduler(scheduler, step: int) -> None:
    """Put a LambdaLR at ``step`` from its own base rates, as if stepped there (a resume, whatever wrote it)."""
    scheduler.last_epoch = step
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base  # a loaded optimizer state brings the checkpoint's
        group["lr"] = base * factor(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def run(cfg: TrainConfig, environment: DistEnv | None = None) -> dict:
    """Set up this process's place in the job, train, and tear the process group down whatever happens.

    ``environment`` is read from the launcher's variables when not given (``mp.spawn`` passes its own).
    """
    cfg.validate()
    replica = replica_group(cfg)
    logs_folder = os.path.join(cfg.output_dir, LOGS_FOLDER, *([f"group{replica.group}"] if replica else []))
    with in_train_flags():  # the library's errors name its parameters; this command's user knows its flags
        # replica_group=False: this command drives its ReplicaGroup itself (train's loop, not Job's).
        job = Job(strategy_for(cfg), replica_group=False, amp=cfg.amp, accumulate=cfg.accumulate, seed=cfg.seed,
                  sync_bn=cfg.sync_bn,
                  backend=cfg.backend, device=cfg.device, timeout_s=cfg.timeout, stall_timeout_s=cfg.stall_timeout,
                  check_replicas=cfg.check_replicas, status_file=os.path.join(cfg.output_dir, status.STATUS_FILE),
                  environment=environment,
                  log_level="debug" if cfg.debug else cfg.log_level)
    # Each rank's own messages, those the console leaves out too (ranks other than 0 say info lines there).
    with logs.kept_in_file(os.path.join(logs_folder, f"rank{job.rank}.log"), job.rank):
        with job, in_train_flags(), contextlib.ExitStack() as leaving:  # translated before the job's exit reports them
            if replica is not None:
                leaving.callback(replica.close)
            return train(cfg, job, replica)


def replica_group(cfg: TrainConfig):
    """This process's ``ReplicaGroup`` when ``ddpkit train --replica-groups R`` started it (None otherwise), its
    settings checked: the ddp or fsdp strategy, one micro-step per step."""
    from ddpkit.core.env import REPLICA_GROUP

    if REPLICA_GROUP not in os.environ:
        return None
    check_replica_settings(cfg)
    from ddpkit.strategies.replica_groups import ReplicaGroup, settings_for

    return ReplicaGroup(**settings_for(heartbeat.stall_setting(cfg.stall_timeout)))


def check_replica_settings(cfg: TrainConfig) -> None:
    """UsageError for settings that replica groups do not support yet."""
    strategy = strategy_for(cfg)
    if not strategy.in_replica_groups:
        raise UsageError(f"--replica-groups trains with --strategy ddp or fsdp inside each group (data parallel "
                         f"across the groups) for now, got {strategy.name}")
    if cfg.accumulate != 1:
        raise UsageError(f"--replica-groups takes one micro-step per optimizer step for now: drop --accumulate "
                         f"{cfg.accumulate}")


# Library parameters that `ddpkit train` sets through flags of other names (TrainConfig's fields are flags).
OTHER_FLAGS = {"nproc_per_node": "--nproc-per-node", "timeout_s": "--timeout", "stall_timeout_s": "--stall-timeout"}


def in_train_flags():
    """A block whose UsageErrors say `ddpkit train`'s flags where the library names its parameters."""
    return flag_terms(TrainConfig, OTHER_FLAGS)


@dataclasses.dataclass
class Position:
    """Where training goes on: an epoch, the samples of it all ranks consumed, the optimizer steps so far."""

    epoch: int = 0  # the epoch to run next
    samples: int = 0  # samples of it all ranks together have consumed
    global_step: int = 0  # optimizer steps since the run began (names the checkpoints)
    partial: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # this rank's loss sum, count so far


@dataclasses.dataclass
class RunState:
    """What one training run works with, built once by ``start``."""

    cfg: TrainConfig
    job: Job
    model: nn.Module  # wrapped
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: data.DeviceLoader
    val_loader: data.DeviceLoader
    ckpt: checkpoint.Checkpointer
    steps_per_epoch: int
    position: Position
    replica: Any = None  # this process's ReplicaGroup under --replica-groups
    # A replica group restarted after the others finished the run: it stops, having asked nobody for anything.
    too_late: bool = False

    @property
    def global_batch(self) -> int:
        """Samples of one optimizer step, every replica group taking part."""
        groups = self.replica.groups if self.replica is not None else 1
        return self.cfg.batch_size * self.job.data_replicas * self.cfg.accumulate * groups

    @property
    def leads(self) -> bool:
        """Whether this process writes what the run keeps (checkpoints, metrics, model.pt): rank 0, and under
        replica groups rank 0 of the group that led the last step."""
        return self.job.is_main and (self.replica is None or self.replica.leads)

    def paused(self):
        """A block between steps (evaluation, a checkpoint) that the replica groups' fence does not time."""
        return self.replica.paused() if self.replica is not None else contextlib.nullcontext()


def train(cfg: TrainConfig, job: Job, replica=None) -> dict:
    """The whole run in this process: build, resume, the epochs, model.pt. Returns the last epoch's metrics."""
    run_state = start(cfg, job, replica)
    if run_state.too_late:
        return others_finished(replica, {})
    metrics_path = os.path.join(cfg.output_dir, METRICS_FILE)
    if job.is_main and opens_the_run(replica):
        keep_metrics_before(metrics_path, run_state.position.epoch)
    record: dict = {}
    loop = EpochLoop(run_state)
    tracked = trackers.Trackers(cfg.tracker if job.is_main else (), cfg.output_dir, dataclasses.asdict(cfg))
    with preempt.stop_on_signal(job.runtime) as loop.stop, contextlib.closing(tracked):
        epoch = run_state.position.epoch
        while epoch < cfg.epochs:
            try:
                record = loop.run_epoch(epoch)
            except Rejoined as rejoined:  # this replica group copied the others' state: on from their step
                run_state.position = rejoined.position(run_state)
                epoch = run_state.position.epoch
                continue
            except OthersFinished:
                return others_finished(replica, record)
            ray_reports.report(record)  # under Ray: to ray.train.report, from every rank
            if run_state.leads:
                append_record(metrics_path, record)
                tracked.log(record)
                job.print(f"epoch {epoch + 1}/{cfg.epochs}: train_loss {record['train_loss']:.4f}  val_loss "
                          f"{record['val_loss']:.4f}  val_acc {record['val_acc']:.2%} ({record['val_count']} samples)  "
                          f"{record['images_per_sec']:.0f} images/s" + replicas_said(record))
            loop.save(epoch + 1, 0, [0.0, 0.0], if_idle=False)
            epoch += 1
    run_state.ckpt.wait()
    if replica is not None:
        replica.finish()
    if replica is None or replica.leads:  # under replica groups the leading group alone writes it
        job.save_model(run_state.model, os.path.join(cfg.output_dir, checkpoint.MODEL_FILE))  # a collective under fsdp, pipeline
        job.print(f"saved {os.path.join(cfg.output_dir, checkpoint.MODEL_FILE)} and {metrics_path}")
    # Nobody leaves (and tears the group down) before rank 0 has written the model.
    run_state.ckpt.wait()
    return record


def others_finished(replica, record: dict) -> dict:
    """Say that this replica group stops because the others finished the run; ``record``."""
    logger.info(f"replica group {replica.group}: the other groups have finished the run; this one stops here, "
                "writing nothing")
    return record


class OthersFinished(Exception):
    """The other replica groups trained to the end while this one was away: it stops, writing nothing."""


class Rejoined(Exception):
    """This replica group copied a healthy group's state at its last step and jumped to that group's step."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step

    def position(self, run_state: RunState) -> Position:
        """Where the groups stand at ``step``: its epoch, and the samples of it they have consumed."""
        epoch, step_in_epoch = divmod(self.step, run_state.steps_per_epoch)
        logger.info(f"replica group {run_state.replica.group} rejoined at step {self.step}: epoch {epoch + 1}, "
                    f"step {step_in_epoch} of {run_state.steps_per_epoch}")
        return Position(epoch=epoch, samples=step_in_epoch * run_state.global_batch, global_step=self.step)


def replicas_said(record: dict) -> str:
    """The epoch line's words on the replica groups that took part, when some did not."""
    words = status.replicas_words(record)
    return f"  {words}" if words else ""


def opens_the_run(replica) -> bool:
    """Whether this process prepares the output folder for a fresh run (sets the earlier run's checkpoints aside,
    drops metrics past the resumed epoch): every process of a plain run; under replica groups group 0's first
    process only, not a group that joins or rejoins a run under way."""
    return replica is None or (replica.group == 0 and replica.restarts == 0)


def start(cfg: TrainConfig, job: Job, replica=None) -> RunState:
    """Data, model, checkpoint to resume, wrapping, optimizer, loaders and schedule, in the order they need."""
    # Before any data is loaded: a rank that hangs later can still be found and attached to.
    logger.debug(f"local rank {job.local_rank}, pid {os.getpid()}: process group up, "
                     f"backend {job.backend or 'none'}, device {job.device}")
    spec = zoo.parse_data_spec(cfg.data)
    torch.manual_seed(cfg.seed)  # a data function of the user's own that draws random numbers draws the same on every rank
    # Rank 0 first: a download (MNIST) happens once, the other ranks then read the files.
    with process_group.main_process_first(job.runtime), said_once(job.is_main):
        sets, channels, image_size = zoo.load_for_model(cfg.model, spec, cfg.image_size, cfg.data_arguments(),
                                                        decode=images.check_decode(cfg.decode, job.device),
                                                        seed=cfg.seed)
    # The same seed on every rank and for every world size: identical initial weights.
    torch.manual_seed(cfg.seed)
    with said_once(job.is_main):
        model = zoo.build_model(cfg.model, in_channels=channels, num_classes=sets.num_classes, image_size=image_size,
                                arguments=cfg.model_arguments())
    job.strategy.check(world_size=job.world_size, cuda_count=torch.cuda.device_count(), batch_size=cfg.batch_size)
    ckpt, resumed = open_checkpoints(cfg, job, model, replica)
    optimizer_class, settings = optimizer_settings(cfg.optimizer, cfg.lr)
    example = zoo.example_batch(sets, cfg.batch_size, channels, image_size)
    wrapped, optimizer = job.setup(model, optimizer_class, example=example, **settings)
    if replica is not None:  # torchft's DDP across the groups and its optimizer, which commits only agreed steps
        wrapped, optimizer = replica.setup(wrapped, optimizer)
    # --workers, else a share of the cores (none for tensors already in memory).
    workers = data.default_workers(job.runtime, None, sets.train) if cfg.workers is None else cfg.workers
    # Under replica groups the training data is split over the groups: each reads its share of the global batch.
    split = {} if replica is None else {"replica": replica.data_part}
    loader = job.train_loader(sets.train, cfg.batch_size, workers=workers, **split)
    val_loader = job.eval_loader(sets.val, cfg.batch_size, workers=workers)
    steps_per_epoch = len(loader) // cfg.accumulate
    if steps_per_epoch == 0:
        raise UsageError(f"one epoch has {len(loader.loader)} batches per process, fewer than --accumulate "
                         f"{cfg.accumulate}; lower --accumulate or --batch-size", said_elsewhere=not job.is_main)
    run_state = RunState(cfg, job, wrapped, optimizer, make_scheduler(cfg, optimizer, steps_per_epoch), loader, val_loader,
                    ckpt, steps_per_epoch, Position(), replica)
    announce(run_state, sets, sum(p.numel() for p in model.parameters()))
    if resumed is not None:
        run_state.position = restore(run_state, resumed)
    job.global_step = run_state.position.global_step
    if replica is not None:
        replica.resume_at(job.global_step)
        # Restarted after the others finished: no quorum, whose background configuration would spend seconds on the
        # finished groups' stores, gone, and print torchft's tracebacks of it.
        run_state.too_late = replica.restarts > 0 and replica.others_finished()
        if not run_state.too_late:
            optimizer.zero_grad()  # asks for the first step's quorum (job.step asks for each next one as it ends)
    return run_state


def open_checkpoints(cfg: TrainConfig, job: Job, model: nn.Module, replica=None) -> tuple[checkpoint.Checkpointer, Any]:
    """The run's Checkpointer, and the checkpoint to resume (its weights loaded into the bare model), if any."""
    folder = os.path.join(cfg.output_dir, checkpoint.FOLDER)
    source = cfg.resume
    if replica is not None and replica.restarts > 0:
        # A replica group's process restarted: the others go on, and it copies their state at its first step; the
        # newest checkpoint only brings it close (less to copy when they have all died).
        source = "auto" if checkpoint.list_checkpoints(folder) else None
    elif job.env.restart_count > 0 and (source is None or checkpoint.list_checkpoints(folder)):
        # torchrun restarted the group after a failure: carry on from this run's newest checkpoint (a
        # --resume PATH was the starting point of the first attempt only).
        source = "auto"
        logger.info(f"restart {job.env.restart_count} of the group: resuming from the newest checkpoint")
    if source is None and job.is_main and opens_the_run(replica):
        moved = checkpoint.set_aside(folder)
        if moved is not None:
            logger.info(f"starting fresh (no --resume); the earlier run's checkpoints were moved to {moved}")
    sharded = {"auto": None, "full": False, "sharded": True}[cfg.checkpoint_format]
    ckpt = job.checkpointer(folder, keep=cfg.keep_checkpoints, sharded=sharded, async_save=cfg.async_checkpoint)
    # Weights go into the bare model, before wrapping; the rest once the optimizer exists.
    resumed = ckpt.load(source, model=model)
    if source == "auto" and resumed is None:
        logger.info(f"--resume auto: no checkpoint in {folder}, starting fresh")
    return ckpt, resumed


def image_loading(data: images.ImageData, workers: int) -> str:
    """Where image files are decoded, and by how many loader processes (``announce``'s words)."""
    who = f"{workers} loader process{'es' if workers != 1 else ''}" if workers else "the training process"
    if data.decode == "gpu":
        return f" (JPEGs decoded on the GPU; files read by {who})"
    return f" (JPEGs decoded by {who})"


def announce(run_state: RunState, sets, n_params: int) -> None:
    cfg, job = run_state.cfg, run_state.job
    replicas = job.data_replicas
    stages = job.world_size // replicas
    split = (f"pipeline x {replicas} pipeline(s) of {stages} stages ({cfg.microbatches or 2 * stages} micro-batches, "
             f"{cfg.pipeline_schedule})" if replicas != job.world_size
             else f"process x {job.world_size} processes")
    say = logger.info if run_state.replica is None or run_state.replica.group == 0 else logger.debug  # said once
    say(
        f"{job.world_size} process(es) via {job.env.launcher}, backend {job.backend or 'none'}, device "
        f"{job.device.type}, strategy {cfg.strategy}; model {cfg.model} ({n_params:,} parameters); data {cfg.data}: "
        f"{len(sets.train)} train / {len(sets.val)} val"
        + (image_loading(sets.train, run_state.loader.loader.num_workers)
           if isinstance(sets.train, images.ImageData) else "")
        + f"; batch {cfg.batch_size} per {split}"
        + (f" x {run_state.replica.groups} replica groups" if run_state.replica is not None else "")
        + (f" x {cfg.accumulate} micro-steps" if cfg.accumulate > 1 else "")
        + f" = global batch {run_state.global_batch}; {run_state.steps_per_epoch} steps per epoch"
    )


def restore(run_state: RunState, resumed) -> Position:
    """Load the optimizer, schedule, scaler and RNG; say what changed; return where to continue."""
    cfg, job = run_state.cfg, run_state.job
    contents = resumed.contents
    # The schedule is not loaded: it is a function of the step, placed there below, from this run's
    # --lr (the checkpoint's, unless --lr changed it), which the scheduler took when it was built.
    resumed.restore(optimizer=run_state.optimizer, scaler=job.scaler, model=run_state.model)
    samples, steps_per_epoch = resumed.samples, run_state.steps_per_epoch
    step_in_epoch = samples // run_state.global_batch
    # The schedule counts optimizer steps of this run's size, whatever size wrote the checkpoint.
    place_scheduler(run_state.scheduler, resumed.epoch * steps_per_epoch + step_in_epoch)
    if resumed.epoch >= cfg.epochs:
        where = f"nothing left to train: it ends epoch {resumed.epoch} and --epochs is {cfg.epochs}"
    else:
        where = ("continuing at epoch " + str(resumed.epoch + 1)
                 + (f" after {samples} samples (step {step_in_epoch} of {steps_per_epoch})" if samples else ""))
    logger.info(f"resumed from {resumed.path} ({contents.layout}): {where}")
    if not contents.from_ddpkit:
        parts = ["weights"] + (["optimizer"] if contents.optimizer is not None else [])
        logger.info(f"that file holds {' and '.join(parts)} only: no RNG or data position, so the run "
                    "continues from an epoch's start, not bit for bit")
    say_what_changed(run_state, resumed)
    partial = resumed.rank_state.get("partial") if resumed.same_world_size else None
    if partial is None:
        # Another world size: the epoch's running loss so far goes to rank 0, which adds it up anyway.
        totals = contents.extra.get("partial_total") if contents.extra else None
        partial = list(totals) if (totals and job.is_main) else [0.0, 0.0]
    return Position(epoch=resumed.epoch, samples=samples, partial=list(partial),
                    global_step=resumed.global_step or resumed.epoch * steps_per_epoch + step_in_epoch)


def say_what_changed(run_state: RunState, resumed) -> None:
    """Settings and global batch that differ from the checkpoint's run, in one line each."""
    cfg, job, global_batch = run_state.cfg, run_state.job, run_state.global_batch
    config = resumed.contents.config
    if config:
        changed = [f"{key} {config[key]!r} -> {value!r}" for key, value in dataclasses.asdict(cfg).items()
                   if key in config and config[key] != value and key not in RESUME_FREE]
        if changed:
            logger.info(f"settings differ from the checkpoint's run: {', '.join(changed)}")
    if resumed.global_batch is not None and resumed.global_batch != global_batch:
        per_process = job.data_replicas * cfg.accumulate
        keep = (f"; to keep global batch {resumed.global_batch}, pass --batch-size {resumed.global_batch // per_process}"
                if resumed.global_batch % per_process == 0 else "")
        logger.info(f"the checkpoint was written with global batch {resumed.global_batch} "
                    f"({resumed.world_size} process(es)); this run's is {global_batch} ({job.world_size} x "
                    f"{cfg.batch_size}{f' x {cfg.accumulate}' if cfg.accumulate > 1 else ''}). The data order "
                    f"continues where it stopped; the learning rate is not rescaled{keep}")
    elif resumed.world_size is not None and not resumed.same_world_size:
        logger.info(f"the checkpoint was written by {resumed.world_size} process(es), now "
                    f"{job.world_size}: the same global batch {global_batch}; the ranks' random states are not "
                    "restored (they continue from the seed)")
    if resumed.world_size is not None and not resumed.same_world_size and not cfg.sync_bn and has_batchnorm(run_state.model):
        logger.warning(f"the model has BatchNorm, which normalises each process's own batch: {job.world_size} "
                       f"process(es) of {cfg.batch_size} now, {resumed.world_size} before, so the run does not go on "
                       "as it would have even with the same global batch; --sync-bn normalises over the global batch")


BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(module, BATCHNORMS) for module in model.modules())


# Fields that may change between an interrupted run and its resumption without comment.
RESUME_FREE = {"resume", "epochs", "decode", "debug", "log_level", "progress", "workers", "output_dir", "timeout", "stall_timeout",
               "check_replicas", "checkpoint_every", "keep_checkpoints"}


def append_record(path: str, record: dict) -> None:
    """``record`` as one more JSON line of ``path``; a full disk is said as such, naming the file."""
    try:
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
    except OSError as error:
        full = disk_full(error, writing=path)
        if full is None:
            raise
        raise full from None


def keep_metrics_before(path: str, epoch: int) -> None:
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


def skipped_samples(run: RunState) -> int | None:
    """Unreadable image files this rank's loaders have left out so far; None when the data are not image files."""
    counts = [dataset.skipped for dataset in (run.loader.dataset, run.val_loader.dataset)
              if isinstance(dataset, images.ImageData)]
    return sum(counts) if counts else None


class EpochLoop:
    """The optimizer steps of each epoch, with mid-epoch checkpoints and the stop-signal check, then the
    epoch's evaluation and metrics record; ``ddpkit train``'s loop, written on ``Job``."""

    def __init__(self, run_state: RunState):
        self.run = run_state
        self.stop: preempt.StopSignal | None = None
        self.last_samples, self.last_partial = 0, [0.0, 0.0]  # where the last steps() ended, for a stop there
        self.skipped_before = skipped_samples(run_state)  # unreadable images left out so far, on this rank
        self.participants: list[int] = []  # under replica groups: the groups in each step committed this epoch

    def save(self, epoch: int, samples: int, partial: list[float], *, if_idle: bool) -> None:
        run = self.run
        if run.replica is not None and not run.replica.leads:
            return  # the group that led the last step writes the run's checkpoints (every process of it)
        with run.paused():
            self._save(epoch, samples, partial, if_idle=if_idle)

    def _save(self, epoch: int, samples: int, partial: list[float], *, if_idle: bool) -> None:
        run = self.run
        totals = [0.0, 0.0]
        if samples:  # mid-epoch (an epoch's end was checked by run_epoch): never a checkpoint of a diverged model
            # Every rank's non-finite parameters, summed with the epoch's partial loss: one all-reduce for both.
            loss_total, seen, broken = run.job.reduce_sums([*partial, float(nonfinite_parameters(run.model))])
            self.check_finite(loss_total, broken, epoch)
            totals = [loss_total, seen]
        run.ckpt.save(
            model=run.model, optimizer=run.optimizer, scheduler=run.scheduler, scaler=run.job.scaler,
            loader=run.loader, epoch=epoch, samples=samples, global_step=run.job.global_step,
            config=dataclasses.asdict(run.cfg), extra={"partial_total": totals},
            rank_state={"partial": [float(v) for v in partial]}, if_idle=if_idle, global_batch=run.global_batch,
        )

    def run_epoch(self, epoch: int) -> dict:
        """Train the epoch (from where a resume left it), evaluate, and return its metrics record."""
        run, job = self.run, self.run.job
        position = run.position
        start = position.samples if epoch == position.epoch else 0
        run.loader.load_state_dict({"epoch": epoch, "samples": start})
        started = time.perf_counter()
        train_loss, steps_run = self.steps(epoch, start, position.partial if start else [0.0, 0.0])
        ranks = job.compare_ranks()  # each rank's own step time this epoch: the slowest named
        self.check_finite(train_loss, job.reduce_sums([float(nonfinite_parameters(run.model))])[0], epoch)
        if self.stop is not None and self.stop.requested(now=True):
            # Signalled late in the epoch: stop before a long evaluation eats the grace period.
            self.stop_now(epoch, self.last_samples, self.last_partial, None)
        process_group.synchronize(job.device)
        elapsed = time.perf_counter() - started
        with run.paused():
            val_loss, val_acc, val_count = job.evaluate(run.model, run.val_loader, report=False)  # the epoch's, below
        record = {
            "epoch": epoch, "train_loss": train_loss, "val_loss": val_loss, "val_acc": val_acc, "val_count": val_count,
            "images_per_sec": steps_run * run.global_batch / elapsed, "epoch_time_s": elapsed,
            "world_size": job.world_size, "global_batch": run.global_batch, "steps": run.steps_per_epoch,
            "lr": run.optimizer.param_groups[0]["lr"], **memory(job, run.model, run.optimizer), **ranks,
            "nccl": nccl.in_effect(),
        }
        if run.replica is not None:
            record.update(self.replicas_record(elapsed))
        if start:
            record["resumed_at_step"] = run.steps_per_epoch - steps_run
        skipped = skipped_samples(run)
        if skipped is not None:  # image files: how many this epoch's passes left out, all ranks together
            record["skipped_samples"] = int(job.reduce_sums([float(skipped - self.skipped_before)])[0])
            self.skipped_before = skipped
        return record

    def replicas_record(self, elapsed: float) -> dict:
        """The replica groups that took part in this epoch's steps run here: how many on average and at least, the
        mean global batch they trained on, and the images per second that makes."""
        taken = self.participants or [self.run.replica.last_participants]
        mean = sum(taken) / len(taken)
        per_group = self.run.cfg.batch_size * self.run.job.data_replicas
        return {"replica_groups": self.run.replica.groups, "replicas": mean, "replicas_min": min(taken),
                "effective_global_batch": per_group * mean, "images_per_sec": per_group * sum(taken) / elapsed}

    def stepped(self, before: int) -> bool:
        """After ``job.step`` under replica groups: whether the step was committed (False: dropped, to be tried again
        on the same batch). Raises ``Rejoined`` when this group copied the others' state and jumped to their step."""
        run = self.run
        now = run.replica.step
        run.job.global_step = now
        place_scheduler(run.scheduler, now)  # the schedule follows the committed steps, not the tries
        if now == before:
            return False
        if now != before + 1:
            raise Rejoined(now)
        if run.replica.last_participants < run.replica.groups and run.replica.others_finished():
            raise OthersFinished  # alone now because the others are done: training on would redo their steps
        self.participants.append(run.replica.last_participants)
        return True

    def steps(self, epoch: int, start: int, partial: list[float]) -> tuple[float, int]:
        """Train from ``start`` samples into ``epoch``; return the epoch's mean loss and the steps run here."""
        run, job, cfg = self.run, self.run.job, self.run.cfg
        run.model.train()
        steps = len(run.loader) // cfg.accumulate
        progress = progress_bar(run, steps, epoch)
        loss_sum = torch.tensor(partial[0], dtype=torch.float64, device=job.device)
        seen = partial[1]
        batches = iter(run.loader)
        self.participants = []
        for step in range(steps):
            for micro in range(cfg.accumulate):
                images, labels = next(batches)
                if step == 0 and micro == 0:
                    logger.debug(f"local rank {job.local_rank}, pid {os.getpid()}: data: {images.device}, "
                                 f"model: {next(run.model.parameters()).device}")
                while True:  # once, or under replica groups until a step on this batch is committed
                    before = job.global_step
                    loss = job.forward_backward(run.model, images, labels)
                    job.step(run.optimizer, run.scheduler)
                    if run.replica is None or self.stepped(before):
                        break
                if loss is not None:  # None: a pipeline stage other than the last has no loss
                    loss_sum += loss.detach().double() * labels.shape[0]
                    seen += labels.shape[0]
            if progress is not None:
                progress.update(run.global_batch)
            done = start + (step + 1) * run.global_batch
            if self.stop is not None and self.stop.requested():
                self.stop_now(epoch, done, [loss_sum.item(), seen], progress)
            every = cfg.checkpoint_every
            if every and job.global_step % every == 0 and step + 1 < steps:
                self.save(epoch, done, [loss_sum.item(), seen], if_idle=True)
        if progress is not None:
            progress.close()
        self.last_samples, self.last_partial = start + steps * run.global_batch, [loss_sum.item(), seen]
        # The loss in any single rank's batches is a sample; the epoch's loss is the sum over all ranks.
        total, count = job.reduce_sums([loss_sum.item(), float(seen)])
        return total / max(count, 1.0), steps

    def check_finite(self, loss: float, nonfinite: float, epoch: int) -> None:
        """Stop a diverged run before it writes anything more. ``loss`` and ``nonfinite`` (the parameters
        holding a NaN or infinity, summed over the ranks) are the same on every rank, so all stop together;
        rank 0 says why."""
        if math.isfinite(loss) and not nonfinite:
            return
        lr = self.run.optimizer.param_groups[0]["lr"]
        what = f"the train loss is {loss}" if not math.isfinite(loss) else "the model's parameters are not finite"
        raise UsageError(f"training diverged: {what} in epoch {epoch + 1}, by step {self.run.job.global_step}; "
                         f"no checkpoint or model.pt was written from there on. Lower `lr` (it is {lr:g} now), or "
                         "look for bad inputs", said_elsewhere=not self.run.job.is_main)

    def stop_now(self, epoch: int, samples: int, partial: list[float], progress) -> None:
        """Every rank got here at the same step: write one checkpoint, wait for it, leave."""
        if progress is not None:
            progress.close()
        self.save(epoch, samples, partial, if_idle=False)
        self.run.ckpt.wait()
        # Every rank says it (a warning): which ranks stopped where is the evidence of a clean stop.
        logger.warning(f"stopped by {self.stop.signal_name} at epoch {epoch + 1}, step {self.run.job.global_step}; "
                       f"checkpoint {self.run.ckpt.last_path or 'written by rank 0'}")
        raise preempt.StopNow(self.stop.exit_code)


def nonfinite_parameters(model: nn.Module) -> int:
    """How many of this rank's parameters (or shards of them) hold a NaN or an infinity."""
    flags = [torch.isfinite(p).all() for p in model.parameters()]
    return int((~torch.stack(flags)).sum().item()) if flags else 0


def progress_bar(run_state: RunState, steps: int, epoch: int):
    if not (run_state.job.is_main and run_state.cfg.progress):
        return None
    from tqdm import tqdm

    # disable=None: only on a terminal, so logs and CI output stay free of carriage returns. Where the launcher
    # keeps this rank's output in a file, the bar goes straight to the launcher's terminal, if it has one.
    # Counted in global images, so the rate reads as images/s and the ETA as time left in the epoch.
    stream = logs.launcher_terminal() or sys.stderr
    return tqdm(total=steps * run_state.global_batch, desc=f"epoch {epoch + 1}/{run_state.cfg.epochs}", unit="img",
                unit_scale=True, disable=None, leave=False, file=stream)


def memory(job: Job, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[float]]:
    """Per rank, in MiB: the peak memory (the GPU's allocated peak; on CPU the process's peak resident set)
    and what the training state takes (parameters, gradients, optimizer state: FSDP and ZeRO shrink it)."""
    if job.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(job.device)
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    mine = torch.tensor([peak, job.strategy.train_state_bytes(model, optimizer)], dtype=torch.float64) / 2**20
    every = [mine]
    group = process_group.control_group(job.runtime)
    if group is not None:
        every = [torch.empty_like(mine) for _ in range(job.world_size)]
        dist.all_gather(every, mine, group=group)
    return {"peak_memory_mb": [round(float(rank[0]), 1) for rank in every],
            "train_state_mb": [round(float(rank[1]), 3) for rank in every]}
