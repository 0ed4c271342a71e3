"""Mixed precision by name: ``off``, ``fp16`` (with a GradScaler) or ``bf16``.

    >>> from ddpkit.core.precision import autocast
    >>> with autocast(torch.device("cpu"), "bf16"):        # doctest: +SKIP
    ...     loss = model(x)
"""

from __future__ import annotations

import contextlib

import torch

AMP_DTYPES = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def autocast(device: torch.device, amp: str):
    """``torch.autocast`` to ``amp``'s dtype on ``device`` (a no-op context for ``"off"``)."""
    dtype = AMP_DTYPES[amp]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)
