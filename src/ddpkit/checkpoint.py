"""Saving that never leaves a half-written file, and the model as a plain state_dict.

    >>> from ddpkit.checkpoint import atomic_save, model_state_dict
    >>> atomic_save(model_state_dict(ddp_model), "runs/x/model.pt")      # doctest: +SKIP

``atomic_save`` writes a temporary file in the target's folder, flushes and fsyncs it, then renames it
over the target: a crash at any moment leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.nn as nn

from ddpkit.strategies import unwrap

MODEL_FILE = "model.pt"


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates the file readable by its owner only; give it the mode torch.save's open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    # The rename itself is durable only once the folder's entry is on disk.
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The bare model's weights on the CPU: no ``module.`` prefix, loadable with ``weights_only=True``."""
    return {key: value.detach().cpu() for key, value in unwrap(model).state_dict().items()}
