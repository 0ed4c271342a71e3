"""``ddpkit checkpoint export``: a checkpoint's model weights as the plain state_dict that ``model.pt`` is."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ddpkit.checkpoint.files import atomic_save, is_sharded_checkpoint, load_checkpoint
from ddpkit.checkpoint.folder import FOLDER, find_resumable
from ddpkit.checkpoint.format import read_contents
from ddpkit.core.errors import CheckpointError
from ddpkit.core.logs import logger


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
        from ddpkit.checkpoint import sharded

        state = sharded.load_model(contents.sharded)
    else:
        state = contents.model
    atomic_save(state, destination)
    return chosen, len(state)
