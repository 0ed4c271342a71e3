"""A one-device process for the script, and a process group of the script's own found at run time.

The launcher's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...: ``LAUNCHER_VARIABLES``) tell a rank how to
find its group. ddpkit has found it before the script's first line, and takes them out of the script's environment
(``Hidden``), as a one-device run has none: a script that distributes itself where it finds them (nanoGPT's
``train.py``: ``ddp = int(os.environ.get('RANK', -1)) != -1``) takes its one-device way, which --unchanged spreads
over the processes, and a script or library that reads them (a learning rate scaled by ``WORLD_SIZE``, a device
``cuda:{LOCAL_RANK}``) gets one device's values. torchrun's other variables (``TORCHELASTIC_*``: its error file,
restarts) stay.

A script whose own ``init_process_group`` is guarded by a condition (``ddpkit.unchanged.stands_aside``: the ImageNet
trainer of pytorch/examples, told by its flags) runs under --unchanged too. If it makes the call, it distributes
itself after all (``OwnGroup``): ddpkit takes every hook of its own out and gives the variables back, and the call
returns with the group that ddpkit started, which is the one the script asks for (the launcher's ranks, over the
backend that ddpkit chose for the device), as under ``ddpkit run``. (A second group over the same store cannot be
started: its peers would read the first one's addresses.) A call for another world or another backend is refused in
one line. On a GPU machine each process still sees its one GPU (``CUDA_VISIBLE_DEVICES`` is read once, before the
script's first line).

Until the script starts a group of its own, it and the libraries it calls find none: where code
outside torch and ddpkit asks ``torch.distributed.is_initialized()``, the answer is False, as on one device
(``OwnGroup``). torchmetrics, for one, syncs its metrics' states over any group it finds: over ddpkit's, where each
process holds the whole evaluation (or, on the gathered way, the whole batch), its sums and concatenations would
count every sample once per process. torch's own code, and ddpkit's, read the group as it is; so does the code inside
a model's call that computes only this process's rows of the batch, the other processes the rest (``holds_a_share``):
a model that gathers its rows across the group when it finds one (FLAVA's contrastive loss in transformers) then
does so, as under DDP.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d

from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger
from ddpkit.unchanged.callers import innermost, package

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


class Hidden:
    """The launcher's variables, out of ``os.environ`` from ``hide`` until ``give_back``."""

    def __init__(self) -> None:
        self.kept: dict[str, str] = {}

    def hide(self) -> None:
        self.kept = {name: os.environ.pop(name) for name in LAUNCHER_VARIABLES if name in os.environ}

    def give_back(self) -> None:
        for name, value in self.kept.items():
            os.environ.setdefault(name, value)

    def environment(self) -> dict[str, str]:
        """This process's environment as the launcher set it: for what ddpkit itself reads of it later."""
        return {**os.environ, **self.kept}


# The packages whose code reads the process group as it is (``OwnGroup``): the group is theirs to run.
READ_AS_IT_IS = ("torch", "ddpkit")


class OwnGroup:
    """``torch.distributed.init_process_group`` and ``torch.distributed.is_initialized``, replaced while --unchanged
    runs the script (no hook exists for either). The script's call of the first stands --unchanged aside
    (``stand_aside``: every hook out, the variables back) and leaves it ddpkit's group, where that is the group the
    call asks for; any other is refused in one line. Until then the second answers False to any code but torch's and
    ddpkit's (``group_seen``), outside a model's call on a share of its batch (``holds_a_share``): the script, and the
    libraries it calls, find no group, as on one device."""

    def __init__(self, *, rank: int, stand_aside: Callable[[], None],
                 holds_a_share: Callable[[], bool] = lambda: False) -> None:
        self.rank = rank
        self.stand_aside = stand_aside
        self.holds_a_share = holds_a_share
        self.original = distributed_c10d.init_process_group
        self.original_is_initialized = dist.is_initialized

    def install(self) -> None:
        @functools.wraps(self.original)
        def init_process_group(*args, **kwargs):
            return self.called(*args, **kwargs)

        original_is_initialized, holds_a_share = self.original_is_initialized, self.holds_a_share

        @functools.wraps(original_is_initialized)
        def is_initialized() -> bool:
            return original_is_initialized() and (group_seen(sys._getframe(1)) or holds_a_share())

        dist.init_process_group = distributed_c10d.init_process_group = init_process_group
        dist.is_initialized = is_initialized

    def uninstall(self) -> None:
        dist.init_process_group = distributed_c10d.init_process_group = self.original
        dist.is_initialized = self.original_is_initialized

    def called(self, *args, **kwargs) -> None:
        asked = inspect.signature(self.original).bind(*args, **kwargs).arguments
        if self.rank == 0:
            logger.warning("--unchanged stood aside: the script starts a process group of its own "
                           "(init_process_group), and runs as under ddpkit run (its loaders, files, saves and losses "
                           "its own from here on)")
        self.stand_aside()  # (this object's uninstall among it)
        refused = other_group(asked, backend=dist.get_backend(), world_size=dist.get_world_size(), rank=dist.get_rank())
        if refused is not None:
            raise UsageError(f"--unchanged: the script starts a process group of its own {refused}: run it under "
                             "`ddpkit run` without --unchanged")


def group_seen(frame) -> bool:
    """Whether the code that asks, in ``frame`` (the innermost caller outside Python's standard library, which only
    passes a call on), reads the process group as it is: torch's and ddpkit's (``READ_AS_IT_IS``)."""
    frame = innermost(frame)
    return frame is not None and package(frame) in READ_AS_IT_IS


def other_group(asked: dict, *, backend: str, world_size: int, rank: int) -> str | None:
    """How the group that ``init_process_group``'s arguments ``asked`` for differs from ddpkit's (over ``backend``, of
    ``world_size`` ranks, this one ``rank``), or None where it is that group."""
    wanted = str(asked.get("backend") or "").lower()
    if wanted and wanted not in backend.lower():
        return f"over {wanted}, where ddpkit's runs over {backend} on this machine"
    if asked.get("world_size", -1) not in (-1, world_size):
        return f"of {asked['world_size']} processes, where {world_size} run"
    if asked.get("rank", -1) not in (-1, rank):
        return f"in which this process is rank {asked['rank']}, where it is rank {rank}"
    return None
