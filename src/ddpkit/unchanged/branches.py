"""Whether a model's forward reads the values of its tensors in Python: the evidence that a later step may use other
parameters than its first (``ddpkit run --unchanged``).

DDP's reducer is decided from a model's first training step (``strategies.in_place.Replica``): where that step
reached every parameter, DDP is built plain, and a later step that leaves one without a gradient (a loss term that a
detector computes only where its batch holds a positive, ``if positives.any():``) would stop the run: the gradients
of that step were not averaged. Such a step is one whose forward decides something from its data: a
Python branch needs a tensor's value (``bool``, ``.item()``, ``.tolist()``, ``int``, ``torch.equal``), or a size
that its data decides (``nonzero``, a boolean mask's selection, ``unique``). So the forward of each call of a model's
first step runs under ``ReadsItsData``, a torch function mode that notes whether code other than ddpkit's (the
model's, a library's it calls; a read inside torch's own modules counts for the code that called them) calls one of
those functions. Where it does on any process, DDP looks for unused parameters from then on
(``find_unused_parameters``): a parameter that one process's share left without a gradient gets the batch's, and one
that the whole batch left without one keeps none, as on one device. No function's result changes. A branch on
something else than a tensor (Python's ``random``, a counter of the model's own) is not seen.
"""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode

Tensor = torch.Tensor
# Functions whose Python result is a tensor's value, or whose result's size its values decide.
READS = frozenset({
    Tensor.__bool__, Tensor.item, Tensor.tolist, Tensor.__int__, Tensor.__float__, Tensor.__index__,
    Tensor.__contains__, Tensor.numpy, torch.equal, torch.allclose, torch.is_nonzero,
    torch.nonzero, Tensor.nonzero, torch.argwhere, Tensor.argwhere, torch.masked_select, Tensor.masked_select,
    torch.unique, Tensor.unique, torch.unique_consecutive, Tensor.unique_consecutive,
})


class ReadsItsData(TorchFunctionMode):
    """From ``start`` to ``end``: whether code other than ddpkit's called a function of ``READS``, or
    ``torch.where`` with a condition alone, or indexed a tensor with a boolean mask."""

    def __init__(self):
        super().__init__()
        self.read = False
        self.on = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.read and (func in READS or func is torch.where and len(args) + len(kwargs) == 1 or (
                func is Tensor.__getitem__ and len(args) == 2 and _a_mask(args[1]))):
            self.read = _outside(sys._getframe(1))
        return func(*args, **kwargs)

    def start(self) -> ReadsItsData:
        self.__enter__()
        self.on = True
        return self

    def end(self) -> bool:
        """Out of torch's function modes: whether the forward read its data. Where a mode entered above this one is
        still there (the forward entered it and did not leave it), this one stays, reading nothing more, and counts
        as read."""
        if self.on and _get_current_function_mode() is self:
            self.__exit__(None, None, None)
        elif self.on:
            self.read = True
        self.on = False
        return self.read


def _a_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


def _outside(frame) -> bool:
    """Whether the innermost caller outside torch and Python's standard library (torch's own modules read for the code
    that called them) is not ddpkit's."""
    while frame is not None:
        package = frame.f_globals.get("__name__", "").partition(".")[0]
        if package != "torch" and package not in sys.stdlib_module_names:
            return package != "ddpkit"
        frame = frame.f_back
    return False
