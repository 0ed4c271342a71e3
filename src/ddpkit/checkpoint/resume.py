"""Reading a checkpoint back on every rank: rank 0 chooses it (skipping unreadable ones) and checks it against
the model, every rank reads it, and ``Resumed.restore`` puts the optimizer, schedule, scaler, loader position
and this rank's RNG states back once the model is wrapped.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from ddpkit.checkpoint.files import is_sharded_checkpoint, load_checkpoint
from ddpkit.checkpoint.folder import find_resumable, retire_newer
from ddpkit.checkpoint.format import Contents, check_model_state, check_optimizer_state, read_contents, set_rng_state
from ddpkit.core.errors import CheckpointError, UsageError, said_once
from ddpkit.core.process_group import control_group
from ddpkit.strategies import Strategy, strategy_of, unwrap
from ddpkit.strategies.base import is_shard


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
        from ddpkit.checkpoint import sharded

        if model is None:
            raise UsageError(f"{self.path} is a sharded checkpoint, loaded into the wrapped model: pass model= to "
                             "Resumed.restore")
        strategy = self.strategy or strategy_of(model, optimizer)
        group = control_group(self.runtime)
        saved_optimizer = optimizer if self.contents.optimizer is not None else None
        with said_once(self.runtime.is_main):  # every rank meets the same mismatch
            strategy.load_sharded_state(model, saved_optimizer,
                                        lambda state: sharded.load(state, self.contents.sharded, group))


def read(checkpointer, source: str | os.PathLike | None, model: nn.Module) -> Resumed | None:
    """The checkpoint ``source`` names for ``checkpointer`` (a ``Checkpointer``: its folder, runtime, group, strategy
    and messages), read on every rank and checked against ``model``; the weights are not loaded."""
    if source is None:
        return None
    runtime = checkpointer.runtime
    path, obj = choose(checkpointer, source, model)
    if path is None:
        return None
    if obj is None:  # rank 0 read it already (and checked it); the others read it now
        try:
            obj = load_checkpoint(path, verify=False)
        except CheckpointError as error:
            raise CheckpointError(f"rank {runtime.rank} cannot read the checkpoint rank 0 chose ({error}); "
                                  "checkpoints must be on storage every node can read") from None
    contents = read_contents(obj, path)
    progress = contents.progress or {"epoch": 0, "samples": 0}
    ranks = contents.ranks
    return Resumed(
        path=path, contents=contents, runtime=runtime, epoch=int(progress["epoch"]),
        samples=int(progress.get("samples", 0)), global_step=int(progress.get("global_step", 0)),
        world_size=progress.get("world_size"), global_batch=progress.get("global_batch"),
        rank_state=ranks[runtime.rank] if runtime.rank < len(ranks) else {},
        parameter_names=[name for name, _ in unwrap(model).named_parameters()], strategy=checkpointer.strategy,
    )


def choose(checkpointer, source: str | os.PathLike, model: nn.Module) -> tuple[Path | None, Any]:
    """Rank 0 picks the file (warning about any it skips) and tells the others, or everyone raises."""
    runtime = checkpointer.runtime
    decision: list[Any] = [None]
    obj = None
    if runtime.is_main:
        try:
            found = find(checkpointer.folder, source, checkpointer.warn)
            if found is not None:
                path, obj = found
                contents = read_contents(obj, path)
                check_model_state(model, contents.model, path)
                retire_newer(checkpointer.folder, path, int((contents.progress or {}).get("global_step", 0)),
                             checkpointer.log)
                decision = [("ok", str(path))]
            else:
                decision = [("none", "")]
        except CheckpointError as error:
            decision = [("error", str(error))]
    if checkpointer.group is not None:
        dist.broadcast_object_list(decision, src=0, group=checkpointer.group)
    kind, value = decision[0]
    if kind == "error":
        raise CheckpointError(value, said_elsewhere=not runtime.is_main)
    if kind == "none":
        return None, None
    return Path(value), obj


def find(folder: Path, source: str | os.PathLike, warn) -> tuple[Path, Any] | None:
    """What ``source`` names: ``auto`` (the newest complete checkpoint in ``folder``), a checkpoint folder's newest,
    or one checkpoint (file or sharded folder); None when an ``auto`` folder holds none."""
    if str(source) == "auto":
        return find_resumable(folder, warn)
    path = Path(source)
    if path.is_dir() and not is_sharded_checkpoint(path):
        found = find_resumable(path, warn)
        if found is None:
            raise CheckpointError(f"`resume` {path}: the folder holds no checkpoint (step-* files or folders)")
        return found
    if not path.exists():
        raise CheckpointError(f"`resume` {path}: no such file or folder")
    return path, load_checkpoint(path)
