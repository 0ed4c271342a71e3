"""CPU copies of state: what is written to disk must not change while training goes on."""

from __future__ import annotations

from typing import Any

import torch


def snapshot(obj: Any) -> Any:
    """A copy with every tensor cloned to the CPU, safe to write while training changes the originals."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: snapshot(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(value) for value in obj)
    return obj
