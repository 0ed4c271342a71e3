"""``ddpkit train``'s settings: ``TrainConfig``, whose fields are the command's flags (help, choices and defaults
declared once, ``app/config.py``), what it checks before any process starts, and what it derives for the run (the
strategy object, the optimizer, the learning-rate schedule). Nothing here trains; ``app/train/trainer.py`` does.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile

import torch

from ddpkit import strategies, zoo
from ddpkit.app import trackers
from ddpkit.app.config import flag_terms, option
from ddpkit.app.train.lr_schedule import SCHEDULES, Schedule
from ddpkit.core import logs, process_group
from ddpkit.core.errors import UsageError
from ddpkit.core.precision import AMP_DTYPES
from ddpkit.data import images
from ddpkit.strategies import STRATEGIES, Strategy
from ddpkit.strategies.pipeline import PIPELINE_SCHEDULES
from ddpkit.watch import heartbeat, replicas
from ddpkit.zoo import user_code

OPTIMIZERS = ("sgd", "adam", "adadelta")
DEFAULT_LR = {"sgd": 0.01, "adam": 1e-3, "adadelta": 1.0}
PARALLEL = "sharding and pipelines (docs/parallelism.md)"
CHECKPOINTS = "checkpoints (DIR/checkpoints)"
DDP_KNOBS = "DistributedDataParallel knobs"
# Every registered strategy but those that are another's ZeRO form (zero is --strategy ddp --zero).
CLI_STRATEGIES = tuple(name for name in STRATEGIES if name not in {kind.with_zero for kind in STRATEGIES.values()})
CHECKPOINT_FORMATS = ("auto", "full", "sharded")


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
        for field in self.strategy_settings():
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
        self.make_strategy().check_training(accumulate=self.accumulate, amp=self.amp)

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

    def strategy_settings(self) -> list[str]:
        """The fields that some strategy takes as a setting and that the command line set (away from the default)."""
        every = set().union(*(settings_of(kind) for kind in STRATEGIES.values()))
        return [field.name for field in dataclasses.fields(self)
                if field.name in every and getattr(self, field.name) != field.default]

    def make_strategy(self) -> Strategy:
        """The strategy object the settings describe (``--zero`` gives the strategy's ZeRO form: ddp's is zero)."""
        kind = STRATEGIES[self.strategy]
        name = kind.with_zero if self.zero and kind.with_zero else self.strategy
        settings = {field: getattr(self, field) for field in self.strategy_settings()}
        return strategies.create(name, strict=False, **settings)

    def check_for_replica_groups(self) -> None:
        """UsageError for settings that replica groups do not support yet."""
        strategy = self.make_strategy()
        if not strategy.in_replica_groups:
            raise UsageError(f"--replica-groups trains with --strategy ddp or fsdp inside each group (data parallel "
                             f"across the groups) for now, got {strategy.name}")
        if self.accumulate != 1:
            raise UsageError(f"--replica-groups takes one micro-step per optimizer step for now: drop --accumulate "
                             f"{self.accumulate}")

    def lr_schedule(self) -> Schedule:
        """The learning-rate schedule the settings describe."""
        return Schedule(self.schedule, self.epochs, self.warmup_steps, self.lr_step_epochs, self.lr_gamma)


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


# Library parameters that `ddpkit train` sets through flags of other names (TrainConfig's fields are flags).
OTHER_FLAGS = {"nproc_per_node": "--nproc-per-node", "timeout_s": "--timeout", "stall_timeout_s": "--stall-timeout"}


def in_train_flags():
    """A block whose UsageErrors say `ddpkit train`'s flags where the library names its parameters."""
    return flag_terms(TrainConfig, OTHER_FLAGS)
