"""``torch.save`` to a path, once for the job (``ddpkit run --unchanged``): every rank holds the same weights, so rank
0 writes the file, atomically (a temporary file beside it, renamed over it: a crash leaves the old file or the new,
never a torn one), and the others wait until it is there, so that a script that reads it back or copies it next
(pytorch/examples' ``shutil.copyfile(filename, 'model_best.pth.tar')``) finds it on every rank. ``torch.save`` into an
open file or buffer is left as it is, on every rank. (``torch.save`` is replaced: PyTorch has no hook for it.) Where
models are sharded (``--shard``), every rank first takes part in gathering the modules that the object holds whole
(``sharded_in_place.plain_for_saving``), then rank 0 writes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch

from ddpkit.checkpoint.files import atomic_write


class SaveOnce:
    """The replacement of ``torch.save``; ``wait_for_rank_0`` is a barrier the other ranks pass once it has written."""

    def __init__(self, *, rank: int, wait_for_rank_0: Callable[[], None], sharding: bool = False):
        self.rank = rank
        self.sharding = sharding  # models may be sharded: every rank gathers what the file holds whole, first
        self.wait_for_rank_0 = wait_for_rank_0
        self.original = torch.save

    def install(self) -> None:
        torch.save = self

    def uninstall(self) -> None:
        if torch.save is self:
            torch.save = self.original

    def __call__(self, obj, f, *args, **kwargs) -> None:
        if not isinstance(f, (str, os.PathLike)):
            self.original(obj, f, *args, **kwargs)
            return
        alone = contextlib.nullcontext()
        if self.sharding:
            from ddpkit.strategies.sharded_in_place import plain_for_saving, saved_alone

            obj, alone = plain_for_saving(obj), saved_alone()
        if self.rank == 0:
            with alone:
                atomic_write(f, lambda handle: self.original(obj, handle, *args, **kwargs))
        self.wait_for_rank_0()
