"""``Checkpointer``: save and resume on every rank with one call each (see ``ddpkit.checkpoint``).

Full checkpoints are gathered to rank 0, which writes them in a background thread from a CPU copy taken at
the step boundary; sharded ones are written by every rank through ``ddpkit.checkpoint.sharded``, and with
``async_save`` in the background. Either way ``latest`` moves only once a checkpoint is whole on disk.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.checkpoint import resume
from ddpkit.checkpoint.files import TEMP_PREFIX, atomic_save, fsync_folder
from ddpkit.checkpoint.folder import checkpoint_name, prune, read_pointer, remove_entry, remove_partial_writes, write_pointer
from ddpkit.checkpoint.format import (FORMAT, KEY_CHECKSUMS, KEY_CONFIG, KEY_EXTRA, KEY_FORMAT, KEY_MODEL, KEY_OPTIMIZER,
                                      KEY_PROGRESS, KEY_RANKS, KEY_SCALER, KEY_SCHEDULER, KEY_VERSIONS, load_model_state,
                                      rng_state, versions)
from ddpkit.checkpoint.resume import Resumed
from ddpkit.core.progress import mark
from ddpkit.core.errors import CheckpointError, DiskFull, UsageError, first_line
from ddpkit.core.logs import logger
from ddpkit.core.process_group import background_group, control_group
from ddpkit.core.snapshot import snapshot
from ddpkit.strategies import Strategy, strategy_of


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
        self._staging = None  # sharded.Staging: the pinned host copy that asynchronous saves reuse
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
        mark("checkpoint")
        model, optimizer, scheduler, scaler, loader = self._bound(model, optimizer, scheduler, scaler, loader)
        epoch, samples, global_step, global_batch = self._position(loader, epoch, samples, global_step, global_batch)
        ranks = self._gather({"rng": rng_state(self.runtime.device), **(rank_state or {})})
        busy = self._writing()
        if busy and if_idle:
            if self.runtime.is_main:
                self.warn(f"skipped the checkpoint at step {global_step}: the previous one is still being written")
            return None
        self.wait()
        strategy = self.strategy or strategy_of(model, optimizer)
        sharded = strategy.sharded_checkpoints if self.sharded is None else self.sharded
        if sharded and not strategy.can_shard_checkpoints:
            raise UsageError(f"strategy {strategy.name} cannot write sharded checkpoints yet; save full ones "
                             "(`sharded` False)", said_elsewhere=not self.runtime.is_main)
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

    def _position(self, loader, epoch: int | None, samples: int | None, global_step: int | None,
                  global_batch: int | None) -> tuple[int, int, int, int | None]:
        """(epoch, samples, global_step, global_batch) of a save: as given, else from the loader and ``progress``."""
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
        return epoch, samples, global_step, global_batch

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
        from ddpkit.checkpoint import sharded

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
            self._staging = self._staging or sharded.Staging()
            future = sharded.save(state, temporary, background_group(self.runtime), asynchronous=True,
                                  staging=self._staging)
        if future is not None or self.runtime.is_main:
            self._start(self._finish_sharded, future, rest, temporary, path)

    def _finish_sharded(self, future, rest: dict | None, temporary: Path, path: Path) -> None:
        from ddpkit.checkpoint import sharded

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
                remove_entry(path)
            os.replace(temporary, path)
            fsync_folder(self.folder)
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
        resumed = resume.read(self, source, model)
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
        resumed = resume.read(self, source, model)
        if resumed is not None and resumed.contents.sharded is None:  # a sharded one loads in Resumed.restore
            load_model_state(model, resumed.contents.model, resumed.path)
        return resumed
