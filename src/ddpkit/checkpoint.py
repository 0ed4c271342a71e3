"""Checkpoints that survive crashes, kills and preemption, and resume as if nothing happened.

    >>> import tempfile, torch, ddpkit
    >>> from torch.utils.data import TensorDataset
    >>> with ddpkit.Job("single", device="cpu") as job:
    ...     model, optimizer = job.setup(torch.nn.Linear(4, 2), torch.optim.SGD, lr=0.1)
    ...     loader = job.train_loader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    ...     ckpt = job.checkpointer(tempfile.mkdtemp(), model=model, optimizer=optimizer, loader=loader)
    ...     print(ckpt.resume("auto"))                 # nothing saved yet: a fresh start
    ...     for x, y in loader:
    ...         job.backward(torch.nn.functional.cross_entropy(model(x), y))
    ...         stepped = job.step(optimizer)
    ...     print(ckpt.save().name)                    # every rank calls it; rank 0 writes in the background
    ...     ckpt.wait()                                # before exiting
    ...     print(ckpt.resume("auto").global_step, loader.epoch)
    None
    step-00000002.pt
    2 1

Files. ``atomic_save`` writes a temporary file in the target's folder, flushes and fsyncs it, then renames
it over the target: a crash at any moment leaves either the old file or the new one, never a torn one.
A checkpoint folder holds checkpoints named by the optimizer step, ``step-00000123.pt`` files (full) or
``step-00000123/`` folders (sharded), and ``latest``, a one-line pointer to the newest complete one,
replaced only after that checkpoint is on disk.

Full checkpoints (the default for single, dp, ddp and pipeline). The whole state is gathered to global
rank 0, which writes it in a background thread from a CPU copy taken at the step boundary: the other
ranks go on training instead of waiting (and timing out) on a slow disk.

Sharded checkpoints (the default for fsdp and zero; ``sharded=True`` for any strategy but pipeline).
Every rank writes its own part through torch.distributed.checkpoint (``ddpkit.sharded``) into a
``.tmp-step-…/`` folder; rank 0 then adds ``ddpkit.pt`` (the rest of the state and a CRC-32 of every
file) and renames the folder into place. ``async_save=True``: training waits only for the copy to host
memory, and the files are written in the background. A sharded checkpoint resumes on any world size.

Either way every rank contributes its own RNG states (torch, CUDA, numpy, python), gathered to rank 0.

Loading. ``torch.load(..., weights_only=True)`` only: a checkpoint is untrusted input and unpickling
runs code, so everything ddpkit writes is plain tensors, numbers, strings, lists and dicts. The
tutorials' formats load too: a plain state_dict, and ``{"model_state_dict", "optimizer_state_dict",
"epoch"}``, with or without DDP's ``module.`` prefix. A sharded checkpoint's files are checked against
their checksums before it is chosen, and its metadata is read without unpickling anything but DCP's own
records.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import re
import shutil
import tempfile
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from ddpkit import pace
from ddpkit.errors import CheckpointError, DiskFull, UsageError, disk_full, first_line, said_once
from ddpkit.logs import logger
from ddpkit.process_group import background_group, control_group
from ddpkit.snapshot import snapshot
from ddpkit.strategies import Strategy, strategy_of, unwrap
from ddpkit.strategies.base import is_shard

MODEL_FILE = "model.pt"
FOLDER = "checkpoints"  # inside the output folder
POINTER = "latest"
FORMAT = "ddpkit-checkpoint/1"
TEMP_PREFIX = ".tmp-"

# Keys of a ddpkit checkpoint.
KEY_FORMAT = "format"
KEY_MODEL = "model"
KEY_OPTIMIZER = "optimizer"
KEY_SCHEDULER = "scheduler"
KEY_SCALER = "scaler"
KEY_PROGRESS = "progress"  # epoch, step, samples, global_step, world_size, global_batch
KEY_RANKS = "ranks"  # one dict per rank: "rng" and whatever the caller passed as rank_state
KEY_CONFIG = "config"
KEY_VERSIONS = "versions"
KEY_EXTRA = "extra"
KEY_CHECKSUMS = "checksums"  # sharded: CRC-32 of each file in the folder
KEY_SHARDED = "sharded"  # set on reading a sharded checkpoint: its folder
# The tutorials' keys.
TUTORIAL_MODEL = "model_state_dict"
TUTORIAL_OPTIMIZER = "optimizer_state_dict"
TUTORIAL_EPOCH = "epoch"

_NAME = re.compile(r"^step-(\d+)(\.pt)?$")  # a file (full) or a folder (sharded)


# ---------------------------------------------------------------------------------------------- files


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(handle)`` on a temporary file beside ``path``, make it durable, rename it over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates the file readable by its owner only; give it the mode an open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException as error:
        os.unlink(tmp)
        full = disk_full(error, writing=path)
        if full is not None:  # not torch's "unexpected pos": say what happened, and that path is untouched
            raise full.and_("nothing was written to it") from None
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str | os.PathLike) -> None:
    """A rename is durable only once its folder's entry is on disk."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` that never leaves a half-written ``path``."""
    atomic_write(path, lambda handle: torch.save(obj, handle))


def checkpoint_name(global_step: int, sharded: bool = False) -> str:
    return f"step-{global_step:08d}" + ("" if sharded else ".pt")


def _is_checkpoint(entry: Path) -> bool:
    """A checkpoint's name, and what it names is there: a file for a full one, a folder for a sharded one."""
    match = _NAME.match(entry.name)
    return bool(match) and (entry.is_file() if match.group(2) else entry.is_dir())


def step_of(entry: Path) -> int:
    """The optimizer step a checkpoint's name says (``step-00000123.pt`` or ``step-00000123/``: 123)."""
    return int(_NAME.match(entry.name).group(1))


def list_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """The checkpoints (files and sharded folders) in ``folder``, newest (highest step) first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(step_of(entry), entry.name, entry) for entry in folder.iterdir() if _is_checkpoint(entry)]
    return [entry for _, _, entry in sorted(found, reverse=True)]


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def read_pointer(folder: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names, or None when there is no pointer (or it names nothing there)."""
    try:
        name = (Path(folder) / POINTER).read_text().strip()
    except OSError:
        return None
    target = Path(folder) / name
    return target if _is_checkpoint(target) else None


def write_pointer(folder: str | os.PathLike, target: Path) -> None:
    atomic_write(Path(folder) / POINTER, lambda handle: handle.write(f"{target.name}\n".encode()))


def prune(folder: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints (never the one ``latest`` names); return the deleted."""
    pinned = read_pointer(folder)
    removed = []
    for old in list_checkpoints(folder)[keep:]:
        if old != pinned:
            _remove(old)
            removed.append(old)
    return removed


def remove_partial_writes(folder: str | os.PathLike) -> list[Path]:
    """Delete temporary files and folders a killed writer left behind (they were never renamed into place)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    partial = [entry for entry in folder.iterdir() if entry.name.startswith(TEMP_PREFIX)]
    for entry in partial:
        _remove(entry)
    return partial


def set_aside(folder: str | os.PathLike) -> Path | None:
    """Move an earlier run's checkpoint folder to ``<folder>.prev`` (replacing an older one); return it."""
    folder = Path(folder)
    if not list_checkpoints(folder):
        return None
    previous = folder.with_name(folder.name + ".prev")
    if previous.exists():
        shutil.rmtree(previous)
    folder.rename(previous)
    return previous


# -------------------------------------------------------------------------------------------- reading


def load_file(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``; any failure becomes a one-line ``CheckpointError``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    if not zipfile.is_zipfile(path):  # torch.load's own error for these is a bare byte value ("101")
        raise CheckpointError(f"{path} is not a checkpoint: torch.save writes a zip archive and this file is not "
                              "one (truncated, or another kind of file)")
    damage = damaged_record(path)
    if damage is not None:
        raise CheckpointError(f"{path} is damaged and was not loaded: {damage}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch.load raises many types for a torn or foreign file
        text = first_line(error)
        if "Weights only load failed" in str(error):
            refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
            what = f" ({refused.group(1)})" if refused else ""
            raise CheckpointError(
                f"{path} holds Python objects{what} that weights_only loading refuses, because unpickling "
                "them could run any code; ddpkit reads only tensors, numbers, strings, lists and dicts"
            ) from None
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt?): {text}") from None


def load_checkpoint(path: str | os.PathLike, *, verify: bool = True) -> Any:
    """A checkpoint file (``load_file``) or a sharded checkpoint folder, read without running code.

    For a folder: its ``ddpkit.pt``, with the model's tensors as DCP's metadata records them (shapes and
    dtypes on the ``meta`` device: enough to check them against a model; ``Resumed.restore`` loads the
    values) and the folder under ``sharded``. ``verify``: check every file against its checksum first.
    """
    path = Path(path)
    if not path.is_dir():
        return load_file(path)
    from ddpkit import sharded

    sidecar = path / sharded.SIDECAR
    if not sidecar.is_file():
        raise CheckpointError(f"{path} is not a complete sharded checkpoint: it has no {sharded.SIDECAR}")
    obj = load_file(sidecar)
    if not (isinstance(obj, dict) and obj.get(KEY_FORMAT) == FORMAT):
        raise CheckpointError(f"{sidecar} is not a ddpkit checkpoint's {sharded.SIDECAR}")
    if verify:
        damage = sharded.damaged_files(path, obj.get(KEY_CHECKSUMS) or {})
        if damage is not None:
            raise CheckpointError(f"{path} is damaged and was not loaded: {damage}")
    obj[KEY_MODEL] = sharded.model_shapes(path)
    obj[KEY_SHARDED] = str(path)
    return obj


def damaged_record(path: str | os.PathLike) -> str | None:
    """Why the zip archive at ``path`` is damaged, or None when every record's bytes match the CRC-32
    checksum that ``torch.save`` wrote beside them (torch.load does not check them: a flipped bit in a
    tensor loads as a wrong weight)."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every record and compares its CRC-32
    except (zipfile.BadZipFile, EOFError, ValueError) as error:  # its table of records overwritten
        return f"its table of records is damaged ({first_line(error)})"
    if bad is None:
        return None
    what = " (a tensor's data)" if "/data/" in bad else ""
    return (f"its record {bad}{what} fails its CRC-32 checksum or header check (changed on disk or in a copy "
            "after it was written)")


@dataclasses.dataclass
class Contents:
    """A checkpoint of any supported layout, read into ddpkit's terms."""

    model: dict[str, torch.Tensor]
    optimizer: dict | None = None
    scheduler: dict | None = None
    scaler: dict | None = None
    progress: dict | None = None  # None: weights only, training starts at epoch 0
    ranks: list[dict] = dataclasses.field(default_factory=list)
    config: dict | None = None
    versions: dict | None = None
    extra: dict | None = None
    layout: str = "ddpkit"
    sharded: Path | None = None  # a sharded checkpoint's folder: ``model`` holds shapes only (meta tensors)

    @property
    def from_ddpkit(self) -> bool:
        """Written by ddpkit (full or sharded): it holds the data position and every rank's RNG states."""
        return self.layout.startswith("ddpkit")


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def read_contents(obj: Any, source: str | os.PathLike = "checkpoint") -> Contents:
    """Recognise a ddpkit checkpoint, the tutorials' dict layouts, or a plain state_dict."""
    if isinstance(obj, dict) and obj.get(KEY_FORMAT) == FORMAT:
        folder = obj.get(KEY_SHARDED)
        return Contents(
            model=obj[KEY_MODEL], optimizer=obj.get(KEY_OPTIMIZER), scheduler=obj.get(KEY_SCHEDULER),
            scaler=obj.get(KEY_SCALER), progress=obj.get(KEY_PROGRESS), ranks=list(obj.get(KEY_RANKS) or []),
            config=obj.get(KEY_CONFIG), versions=obj.get(KEY_VERSIONS), extra=obj.get(KEY_EXTRA),
            layout="ddpkit, sharded" if folder else "ddpkit", sharded=Path(folder) if folder else None,
        )
    if isinstance(obj, dict) and _is_state_dict(obj.get(TUTORIAL_MODEL)):
        # The tutorials save after finishing epoch N: training continues with epoch N+1.
        epoch = obj.get(TUTORIAL_EPOCH)
        progress = {"epoch": int(epoch) + 1, "step": 0, "samples": 0} if isinstance(epoch, int) else None
        return Contents(model=strip_prefix(obj[TUTORIAL_MODEL]), optimizer=obj.get(TUTORIAL_OPTIMIZER),
                        progress=progress, layout="tutorial")
    if isinstance(obj, dict) and _is_state_dict(obj.get(KEY_MODEL)):
        return Contents(model=strip_prefix(obj[KEY_MODEL]), optimizer=obj.get(KEY_OPTIMIZER), layout="model+optimizer")
    if _is_state_dict(obj):
        return Contents(model=strip_prefix(obj), layout="state_dict")
    raise CheckpointError(
        f"{source} is not a checkpoint ddpkit can read: expected a state_dict, a dict with "
        f"'{TUTORIAL_MODEL}' (and '{TUTORIAL_OPTIMIZER}', '{TUTORIAL_EPOCH}'), or a ddpkit checkpoint"
    )


def strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop DDP's / DataParallel's ``module.`` prefix (saved from the wrapper instead of the model)."""
    state = dict(state)
    consume_prefix_in_state_dict_if_present(state, "module.")
    return state


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def check_model_state(model: nn.Module, state: dict[str, torch.Tensor], source: str | os.PathLike = "checkpoint") -> None:
    """Raise one ``CheckpointError`` naming missing keys, unexpected keys and shape mismatches."""
    expected = unwrap(model).state_dict()
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    shapes = [
        f"{key} {list(state[key].shape)} vs {list(value.shape)}"
        for key, value in expected.items()
        if key in state and state[key].shape != value.shape
    ]
    if not (missing or unexpected or shapes):
        return
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s): {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s): {_listing(unexpected)}")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es), checkpoint vs model: {_listing(shapes, 3)}")
    raise CheckpointError(f"{source} is for another model: {'; '.join(problems)}")


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], source: str | os.PathLike = "checkpoint") -> None:
    """Load into the bare model (before wrapping, or through DDP/DP), refusing any mismatch up front."""
    state = strip_prefix(state)
    check_model_state(model, state, source)
    unwrap(model).load_state_dict(state)


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The bare model's weights on the CPU: no ``module.`` prefix, loadable with ``weights_only=True``.

    One process's own copy: under FSDP or a pipeline no process has the whole model, and
    ``ddpkit.full_model_state`` (a collective every rank calls) gathers it instead.
    """
    if strategy_of(model).shards_model:
        raise UsageError("model_state_dict holds one process's copy, and under FSDP or a pipeline no process holds "
                         "the whole model; call ddpkit.full_model_state(model, runtime) on every rank instead")
    return {key: value.detach().cpu() for key, value in unwrap(model).state_dict().items()}


def check_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict, source: str | os.PathLike = "checkpoint") -> None:
    """One ``CheckpointError`` when a saved optimizer state cannot drive ``optimizer`` (another kind, other params)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not groups:
        raise CheckpointError(f"{source}: its optimizer state has no param_groups")
    saved_counts = [len(group.get("params", [])) for group in groups]
    counts = [len(group["params"]) for group in optimizer.param_groups]
    if saved_counts != counts:
        raise CheckpointError(f"{source}: its optimizer state covers {saved_counts} parameters per group, this "
                              f"model's optimizer {counts}")
    # A setting this optimizer does not know marks another kind (SGD's momentum in an Adam, say); settings
    # only the new one has are filled in by PyTorch for states saved by older versions.
    foreign = sorted(set(groups[0]) - set(optimizer.param_groups[0]) - {"params", "initial_lr"})
    if foreign:
        raise CheckpointError(
            f"{source}: its optimizer state is for another optimizer than {type(optimizer).__name__} (it has "
            f"{', '.join(foreign)}); resume with the `optimizer` that wrote it"
        )


def find_resumable(folder: str | os.PathLike, warn: Callable[[str], None]) -> tuple[Path, Any] | None:
    """The newest complete, readable checkpoint in ``folder`` and its contents; None when there is none.

    ``latest`` is tried first, then every checkpoint from newest to oldest; each unreadable one is
    reported through ``warn`` and skipped. Checkpoints that exist but are all unreadable are an error.
    """
    candidates = list_checkpoints(folder)
    pointed = read_pointer(folder)
    if pointed is not None:
        candidates = [pointed] + [c for c in candidates if c != pointed]
    if not candidates:
        return None
    reasons = []
    for candidate in candidates:
        try:
            obj = load_checkpoint(candidate)
            read_contents(obj, candidate)
            return candidate, obj
        except CheckpointError as error:
            reasons.append(str(error))
            warn(f"skipping checkpoint {candidate}: {error}; trying the previous one")
    raise CheckpointError(f"no usable checkpoint in {folder}: {len(reasons)} found, none readable (newest: {reasons[0]})")


def export_model(source: str | os.PathLike, destination: str | os.PathLike,
                 warn: Callable[[str], None] = logger.warning) -> tuple[Path, int]:
    """Write the model weights of the checkpoint at ``source`` to ``destination`` as the plain state_dict that
    ``model.pt`` is (no ``module.`` prefix; ``torch.load(..., weights_only=True)`` into the bare model).

    ``source``: a checkpoint (a file of any layout ``read_contents`` knows, or a sharded checkpoint's folder), a
    checkpoint folder (its newest complete checkpoint), or a run's output folder (that of its ``checkpoints/``).
    A sharded checkpoint is read whole in this process. Returns (the checkpoint read, tensors written).
    """
    source = Path(source)
    if source.is_dir() and (source / FOLDER).is_dir():
        source = source / FOLDER
    if source.is_dir() and not is_sharded_checkpoint(source):
        found = find_resumable(source, warn)
        if found is None:
            raise CheckpointError(f"{source} holds no checkpoint (step-* files or folders)")
        chosen, obj = found
    else:
        chosen, obj = source, load_checkpoint(source)
    contents = read_contents(obj, chosen)
    if contents.sharded is not None:
        from ddpkit import sharded

        state = sharded.load_model(contents.sharded)
    else:
        state = contents.model
    atomic_save(state, destination)
    return chosen, len(state)


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is one sharded checkpoint's folder (rather than a folder of checkpoints)."""
    from ddpkit.sharded import METADATA, SIDECAR

    path = Path(path)
    return path.is_dir() and ((path / SIDECAR).exists() or (path / METADATA).exists())


# ------------------------------------------------------------------------------------------------ RNG


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's random number generator states, in types ``weights_only`` loading accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _python_rng()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def _python_rng() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    if "numpy" in state:
        import numpy as np

        numpy_state = state["numpy"]
        np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype("uint32"), numpy_state["pos"],
                             numpy_state["has_gauss"], numpy_state["cached_gaussian"]))


def versions() -> dict[str, str]:
    from ddpkit import __version__

    # str(): torch.__version__ is a TorchVersion, which weights_only loading would refuse.
    found = {"ddpkit": str(__version__), "torch": str(torch.__version__), "python": platform.python_version()}
    if torch.version.cuda:
        found["cuda"] = str(torch.version.cuda)
    return found


# ------------------------------------------------------------------------------------- the checkpointer


@dataclasses.dataclass
class Resumed:
    """A checkpoint ``Checkpointer.load`` read; its weights are in the model already."""

    path: Path
    contents: Contents
    runtime: Any
    epoch: int  # the epoch to run next (part-way when samples > 0)
    samples: int  # samples of that epoch every rank together had consumed
    global_step: int
    world_size: int | None  # the world size that wrote it (None: not recorded)
    global_batch: int | None
    rank_state: dict  # this rank's own entry (``rank_state`` given to save), {} when none
    parameter_names: list[str] = dataclasses.field(default_factory=list)  # the bare model's, in order
    strategy: Strategy | None = None  # the one the model is trained with (None: told by the model's type)

    @property
    def same_world_size(self) -> bool:
        """Whether the checkpoint was written by as many processes as resume it."""
        return self.world_size == self.runtime.world_size

    def restore(self, *, optimizer=None, scheduler=None, scaler=None, loader=None, model=None) -> None:
        """Load the rest once the model is wrapped and the optimizer exists, then this rank's RNG states.

        Call it right before the training loop: anything that draws random numbers after it (and
        before the first step) would shift the run off its uninterrupted course. The RNG states are
        restored only for the world size that saved them. ``model``: the wrapped model the optimizer
        drives; needed for FSDP and pipeline, whose optimizer states name their parameters, and for a
        sharded checkpoint, whose model and optimizer states are loaded here (every rank calls it then).
        """
        contents = self.contents
        if contents.sharded is not None:
            self._restore_sharded(model, optimizer)
        elif optimizer is not None and contents.optimizer is not None:
            if model is None and any(is_shard(p) for group in optimizer.param_groups for p in group["params"]):
                raise UsageError("this optimizer drives sharded (FSDP) parameters: pass model= to Resumed.restore")
            strategy = self.strategy or strategy_of(model if model is not None else nn.Identity(), optimizer)
            strategy.load_optimizer_state(model, optimizer, contents.optimizer, self.parameter_names,
                                          lambda opt, saved: check_optimizer_state(opt, saved, self.path))
        if scheduler is not None and contents.scheduler is not None:
            scheduler.load_state_dict(contents.scheduler)
        if scaler is not None and contents.scaler:
            scaler.load_state_dict(contents.scaler)
        if loader is not None:
            loader.load_state_dict({"epoch": self.epoch, "samples": self.samples})
        if self.rank_state.get("rng") is not None and self.same_world_size:
            set_rng_state(self.rank_state["rng"], self.runtime.device)

    def _restore_sharded(self, model: nn.Module | None, optimizer) -> None:
        """Every rank reads its own part of the model and optimizer state (a collective)."""
        from ddpkit import sharded

        if model is None:
            raise UsageError(f"{self.path} is a sharded checkpoint, loaded into the wrapped model: pass model= to "
                             "Resumed.restore")
        strategy = self.strategy or strategy_of(model, optimizer)
        group = control_group(self.runtime)
        saved_optimizer = optimizer if self.contents.optimizer is not None else None
        with said_once(self.runtime.is_main):  # every rank meets the same mismatch
            strategy.load_sharded_state(model, saved_optimizer,
                                        lambda state: sharded.load(state, self.contents.sharded, group))


class Checkpointer:
    """Save and resume on every rank with one call each; see the module docstring.

    ``keep``: how many checkpoints stay on disk (the newest). ``writer(obj, path)`` writes one file
    (default ``atomic_save``). ``log`` prints rank 0's messages (default: stderr). ``strategy``: the one
    the model is trained with (``ddpkit.strategies``); by default it is told from the model's type.
    ``sharded``: every rank writes its own part (see the module docstring; None: the strategy's default,
    sharded for fsdp and zero). ``async_save``: a sharded save returns once the state is copied to host
    memory, and the files are written in the background (implies ``sharded``).

    Handed what it saves once (``model`` wrapped, ``optimizer``, ``scheduler``, ``scaler``, ``loader``, and
    ``progress``, an object whose ``global_step`` counts optimizer steps, such as a ``ddpkit.Job``), it
    needs no arguments: ``save()`` at a step boundary and ``resume(source)`` after setup::

        ckpt = job.checkpointer("runs/x/checkpoints", model=model, optimizer=optimizer, loader=loader)
        ckpt.resume("auto")        # everything back in place (the loader continues mid-epoch); None: fresh
        ...
        ckpt.save()                # every rank calls it
    """

    def __init__(self, folder: str | os.PathLike, runtime, *, keep: int = 3,
                 writer: Callable[[Any, Path], None] = atomic_save, log: Callable[[str], None] | None = None,
                 strategy: Strategy | None = None, model: nn.Module | None = None, optimizer=None, scheduler=None,
                 scaler=None, loader=None, progress=None, sharded: bool | None = None, async_save: bool = False):
        if keep < 1:
            raise UsageError(f"`keep_checkpoints` must be at least 1, got {keep}")
        if async_save and sharded is False:
            raise UsageError("asynchronous saving writes sharded checkpoints (torch.distributed.checkpoint); full ones "
                             "are written in the background by rank 0 already: drop one of the two settings")
        self.folder = Path(folder)
        self.runtime = runtime
        self.keep = keep
        self.writer = writer
        self.strategy = strategy
        self.sharded = True if async_save else sharded
        self.async_save = async_save
        self.bound = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler,
                      "loader": loader}
        self.progress = progress
        # Messages go to the ddpkit logger (rank 0's, below warning); ``log`` takes them all instead.
        self.log = log or logger.info
        self.warn = log or (logger.warning if runtime.is_main else logger.debug)  # every rank sees the same
        self.group = control_group(runtime)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_path: Path | None = None
        if runtime.is_main:
            for partial in remove_partial_writes(self.folder):
                self.log(f"removed {partial}, a checkpoint whose writing was interrupted")

    # -- saving

    def save(
        self, *, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, scheduler=None,
        scaler=None, loader=None, epoch: int | None = None, samples: int | None = None, global_step: int | None = None,
        config: dict | None = None, extra: dict | None = None, rank_state: dict | None = None,
        if_idle: bool = False, global_batch: int | None = None,
    ) -> Path | None:
        """Checkpoint at this step boundary; every rank calls it. Returns the file rank 0 is writing.

        ``model`` ... ``loader`` default to the ones the Checkpointer was handed, ``global_step`` to its
        ``progress``. The position is ``loader.state_dict()`` unless ``epoch``/``samples`` say otherwise.
        ``if_idle``: skip (rank 0 logs it) when the previous checkpoint is still being written, instead
        of making every rank wait for it; use it for frequent mid-epoch checkpoints.
        ``rank_state``: small per-rank values (gathered to rank 0 with the RNG states).
        """
        pace.mark("checkpoint")
        model, optimizer, scheduler, scaler, loader = self._bound(model, optimizer, scheduler, scaler, loader)
        if global_step is None and self.progress is not None:
            global_step = self.progress.global_step
        position = loader.state_dict() if loader is not None else {"epoch": 0, "samples": 0}
        epoch = position["epoch"] if epoch is None else epoch
        samples = position["samples"] if samples is None else samples
        if global_batch is None:  # samples per optimizer step (pass it when accumulating micro-batches)
            global_batch = loader.global_batch if loader is not None else None
        if global_step is None:
            steps_per_epoch = loader.steps_per_epoch if loader is not None else 0
            global_step = epoch * steps_per_epoch + (samples // global_batch if global_batch else 0)
        ranks = self._gather({"rng": rng_state(self.runtime.device), **(rank_state or {})})
        busy = self._writing()
        if busy and if_idle:
            if self.runtime.is_main:
                self.warn(f"skipped the checkpoint at step {global_step}: the previous one is still being written")
            return None
        self.wait()
        strategy = self.strategy or strategy_of(model, optimizer)
        sharded = strategy.sharded_checkpoints if self.sharded is None else self.sharded
        path = self.folder / checkpoint_name(global_step, sharded)
        if sharded:
            state = strategy.sharded_state(model, optimizer)  # this rank's part: nothing is gathered
        else:
            # Collectives for the strategies that spread the model or the optimizer over the ranks.
            model_state = strategy.full_model_state(model, self.runtime)
            optimizer_state = (strategy.full_optimizer_state(model, optimizer, self.runtime)
                               if optimizer is not None else None)
        rest = snapshot({
            KEY_FORMAT: FORMAT,
            KEY_OPTIMIZER: "sharded" if sharded and optimizer is not None else None,
            KEY_SCHEDULER: scheduler.state_dict() if scheduler is not None else None,
            KEY_SCALER: scaler.state_dict() if scaler is not None else None,
            KEY_PROGRESS: {"epoch": epoch, "samples": samples, "global_step": global_step,
                           "world_size": self.runtime.world_size, "global_batch": global_batch},
            KEY_RANKS: ranks,
            KEY_CONFIG: config,
            KEY_VERSIONS: versions(),
            KEY_EXTRA: extra,
        }) if self.runtime.is_main else None
        if sharded:
            self._save_sharded(state, rest, path)
        elif self.runtime.is_main:
            obj = {**rest, KEY_MODEL: snapshot(model_state), KEY_OPTIMIZER: snapshot(optimizer_state)}
            self._start(self._write, obj, path)
        if not self.runtime.is_main:
            return None
        self.last_path = path
        return path

    def _start(self, target: Callable, *args: Any) -> None:
        self._thread = threading.Thread(target=target, args=args, name="ddpkit-checkpoint")
        self._thread.start()

    def _write(self, obj: Any, path: Path) -> None:
        try:
            self.writer(obj, path)
            self._publish(path)
        except BaseException as error:  # reported by the main thread at its next save() or wait()
            self._error = error

    def _publish(self, path: Path) -> None:
        write_pointer(self.folder, path)
        prune(self.folder, self.keep)

    def _save_sharded(self, state: dict, rest: dict | None, path: Path) -> None:
        """Every rank writes its part into a temporary folder; rank 0 completes it and renames it into place."""
        from ddpkit import sharded

        temporary = self.folder / (TEMP_PREFIX + path.name)
        if not self.async_save:
            try:
                sharded.save(state, temporary, self.group, asynchronous=False)
            except (Exception, sharded.CheckpointException) as error:  # DCP raises it on every rank alike
                self._error = sharded.as_error(error)
                self.last_path = path
                self.wait()
            future = None
        else:
            # DCP's collectives then run in a background thread: on a group of their own.
            future = sharded.save(state, temporary, background_group(self.runtime), asynchronous=True)
        if future is not None or self.runtime.is_main:
            self._start(self._finish_sharded, future, rest, temporary, path)

    def _finish_sharded(self, future, rest: dict | None, temporary: Path, path: Path) -> None:
        from ddpkit import sharded

        try:
            if future is not None:
                try:
                    future.result()
                except (Exception, sharded.CheckpointException) as error:
                    raise sharded.as_error(error) from None
            if rest is None:  # not rank 0: its part is written
                return
            rest[KEY_CHECKSUMS] = sharded.checksums(temporary)
            atomic_save(rest, temporary / sharded.SIDECAR)
            if path.exists():  # the same step written by an earlier course of this run
                _remove(path)
            os.replace(temporary, path)
            _fsync_folder(self.folder)
            self._publish(path)
        except BaseException as error:  # reported by the main thread at its next save() or wait()
            self._error = error

    def _writing(self) -> bool:
        """Whether rank 0 is still writing; the same answer on every rank."""
        busy = self._thread is not None and self._thread.is_alive()
        if self.group is None:
            return busy
        flag = torch.tensor([1 if busy else 0])
        dist.broadcast(flag, src=0, group=self.group)
        return bool(flag.item())

    def _gather(self, mine: dict) -> list[dict]:
        if self.group is None:
            return [mine]
        gathered: list | None = [None] * self.runtime.world_size if self.runtime.is_main else None
        dist.gather_object(mine, gathered, dst=0, group=self.group)
        return gathered or []

    def wait(self) -> None:
        """Every rank returns once rank 0's write is on disk (a wait without the collective timeout)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        failed = error is not None
        if self.group is not None:
            # Also the hand-off every rank waits on: rank 0 sends it once the write is done (or failed).
            flag = torch.tensor([1 if failed else 0])
            dist.broadcast(flag, src=0, group=self.group)
            failed = bool(flag.item())
        if failed:
            kept = f"the last complete checkpoint, {read_pointer(self.folder) or 'none yet'}, is kept"
            if isinstance(error, DiskFull):
                raise error.and_(kept)
            what = first_line(error) if error is not None else "see rank 0's message"
            raise CheckpointError(f"writing checkpoint {self.last_path or ''} failed: {what}; {kept}",
                                  said_elsewhere=not self.runtime.is_main)

    # -- resuming

    def _bound(self, model, optimizer, scheduler, scaler, loader) -> tuple:
        given = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "loader": loader}
        chosen = tuple(self.bound[name] if value is None else value for name, value in given.items())
        if chosen[0] is None:
            raise UsageError("Checkpointer.save needs the model: pass model=, or hand it to the Checkpointer")
        return chosen

    def resume(self, source: str | os.PathLike | None = "auto") -> Resumed | None:
        """Put the handed model (wrapped), optimizer, scheduler, scaler, loader position, every rank's RNG and
        the ``progress``'s step back as ``source`` saved them; None (nothing changed) when there is none.

        Call it after setup and right before the loop. ``source`` as in ``load``; None resumes nothing.
        """
        model = self.bound["model"]
        if model is None:
            raise UsageError("Checkpointer.resume needs the model: hand it over as Checkpointer(..., model=...)")
        strategy = self.strategy or strategy_of(model, self.bound["optimizer"])
        resumed = self._read(source, model)
        if resumed is None:
            return None
        if resumed.contents.sharded is None:  # a sharded one loads in restore, into the wrapped model
            strategy.load_model_state(model, resumed.contents.model)
        resumed.strategy = strategy
        resumed.restore(optimizer=self.bound["optimizer"], scheduler=self.bound["scheduler"],
                        scaler=self.bound["scaler"], loader=self.bound["loader"], model=model)
        if self.progress is not None:
            self.progress.global_step = resumed.global_step
        return resumed

    def load(self, source: str | os.PathLike | None = "auto", *, model: nn.Module) -> Resumed | None:
        """Read a checkpoint on every rank and load its weights into ``model``; None when there is none.

        ``source``: ``auto`` (the newest complete checkpoint in this folder, falling back past unreadable
        ones, None when the folder has none), a checkpoint folder, or a file (any layout ``read_contents``
        knows). Call it on the bare model, before wrapping; then ``Resumed.restore`` for the rest.
        """
        resumed = self._read(source, model)
        if resumed is not None and resumed.contents.sharded is None:  # a sharded one loads in Resumed.restore
            load_model_state(model, resumed.contents.model, resumed.path)
        return resumed

    def _read(self, source: str | os.PathLike | None, model: nn.Module) -> Resumed | None:
        """The checkpoint ``source`` names, read on every rank and checked against ``model``; weights not loaded."""
        if source is None:
            return None
        path, obj = self._choose(source, model)
        if path is None:
            return None
        if obj is None:  # rank 0 read it already (and checked it); the others read it now
            try:
                obj = load_checkpoint(path, verify=False)
            except CheckpointError as error:
                raise CheckpointError(f"rank {self.runtime.rank} cannot read the checkpoint rank 0 chose ({error}); "
                                      "checkpoints must be on storage every node can read") from None
        contents = read_contents(obj, path)
        progress = contents.progress or {"epoch": 0, "samples": 0}
        ranks = contents.ranks
        return Resumed(
            path=path, contents=contents, runtime=self.runtime, epoch=int(progress["epoch"]),
            samples=int(progress.get("samples", 0)), global_step=int(progress.get("global_step", 0)),
            world_size=progress.get("world_size"), global_batch=progress.get("global_batch"),
            rank_state=ranks[self.runtime.rank] if self.runtime.rank < len(ranks) else {},
            parameter_names=[name for name, _ in unwrap(model).named_parameters()], strategy=self.strategy,
        )

    def _choose(self, source: str | os.PathLike, model: nn.Module) -> tuple[Path | None, Any]:
        """Rank 0 picks the file (warning about any it skips) and tells the others, or everyone raises."""
        decision: list[Any] = [None]
        obj = None
        if self.runtime.is_main:
            try:
                found = self._find(source)
                if found is not None:
                    path, obj = found
                    contents = read_contents(obj, path)
                    check_model_state(model, contents.model, path)
                    self._retire_newer(path, int((contents.progress or {}).get("global_step", 0)))
                    decision = [("ok", str(path))]
                else:
                    decision = [("none", "")]
            except CheckpointError as error:
                decision = [("error", str(error))]
        if self.group is not None:
            dist.broadcast_object_list(decision, src=0, group=self.group)
        kind, value = decision[0]
        if kind == "error":
            raise CheckpointError(value, said_elsewhere=not self.runtime.is_main)
        if kind == "none":
            return None, None
        return Path(value), obj

    def _retire_newer(self, chosen: Path, step: int) -> None:
        """Rename this folder's checkpoints past the resumed step to ``*.stale``.

        They belong to another course of the run (a corrupt file skipped, or the later checkpoints of a run
        resumed from an earlier one): left in place they would outrank the new ones in ``list_checkpoints``
        and in pruning, and a later ``--resume auto`` could pick them.
        """
        for entry in list_checkpoints(self.folder):
            if entry.resolve() != chosen.resolve() and step_of(entry) > step:
                stale = entry.with_name(entry.name + ".stale")
                entry.rename(stale)
                self.log(f"renamed {entry} to {stale.name}: it is past the step this run resumes from")

    def _find(self, source: str | os.PathLike) -> tuple[Path, Any] | None:
        if str(source) == "auto":
            return find_resumable(self.folder, self.warn)
        path = Path(source)
        if path.is_dir() and not is_sharded_checkpoint(path):
            found = find_resumable(path, self.warn)
            if found is None:
                raise CheckpointError(f"`resume` {path}: the folder holds no checkpoint (step-* files or folders)")
            return found
        if not path.exists():
            raise CheckpointError(f"`resume` {path}: no such file or folder")
        return path, load_checkpoint(path)
