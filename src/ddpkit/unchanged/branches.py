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
that the whole batch left without one keeps none, as on one device.

The same mode notes a loss of torch's whose mean ddpkit makes the batch's with an all-reduce at each call
(``counted``) called inside the block of an ``if`` whose condition was a tensor's truth, or a tensor's number or a
size its data decides, read on the ``if``'s own line (``guarded``): a loss that its data decides whether to compute,
which some processes' shares would compute and others' not, leaving the others' all-reduces unpaired. The model is
then computed whole (``unchanged.models``). A sharded model's first call runs under it too: one of its sharded blocks
called in such a block of code would be skipped on some processes' shares and not on others', where FSDP's
all-gather of its parameters would wait forever, and the run is refused in one line. No function's result changes.
A branch on something else than a tensor (Python's ``random``, a counter of the model's own) is not seen.
"""

from __future__ import annotations

import dis
import functools
import sys
import types

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


# torch.nn.functional's losses whose mean ddpkit makes the batch's with one all-reduce at each call on a split batch
# (``counted``): a call that only some processes make leaves the others' collectives unpaired.
COUNTED = ("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
           "binary_cross_entropy", "binary_cross_entropy_with_logits")


class ReadsItsData(TorchFunctionMode):
    """From ``start`` to ``end``: whether code other than ddpkit's called a function of ``READS``, or
    ``torch.where`` with a condition alone, or indexed a tensor with a boolean mask (``read``); and whether it called
    one of the ``COUNTED`` losses inside the block of an ``if`` (or ``while``, ``and``, ``or``) whose condition was a
    tensor's truth (``guarded``: ``if positive.any(): losses["boxes"] = F.smooth_l1_loss(...)``), which its data
    decides whether to compute."""

    def __init__(self):
        super().__init__()
        self.read = False
        self.guarded = ""  # the loss called in such a block, by its name
        self.block = ""  # a sharded block of the model called in such a block, by its class (``unchanged.models``)
        self.on = False
        self._jumps: list[tuple[types.CodeType, int]] = []  # (code, offset) of each jump on a tensor's truth
        self._values: list[tuple[types.CodeType, int]] = []  # (code, offset) of each read of a tensor's number

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS or func is torch.where and len(args) + len(kwargs) == 1 or (
                func is Tensor.__getitem__ and len(args) == 2 and _a_mask(args[1])):
            caller = _caller(sys._getframe(1))
            self.read = self.read or caller is not None
            if func is Tensor.__bool__ and caller is not None:
                self._jumps.append((caller.f_code, caller.f_lasti))
            elif caller is not None:  # (a number, or a size, that a later ``if`` of the same code may test)
                self._values.append((caller.f_code, caller.f_lasti))
        elif (not self.guarded and getattr(func, "__module__", "") == "torch.nn.functional"
              and getattr(func, "__name__", "") in COUNTED and self.guards(sys._getframe(1))):
            self.guarded = func.__name__
        return func(*args, **kwargs)

    def guards(self, frame) -> bool:
        """Whether what runs at ``frame`` (a loss called, a block of the model called) stands inside a block that
        its data decides whether to run (``_guarded``)."""
        return bool(self._jumps or self._values) and _guarded(frame, self._jumps, self._values)

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


def _caller(frame):
    """The innermost calling frame outside torch and Python's standard library (torch's own modules read for the code
    that called them), where it is not ddpkit's; else None."""
    while frame is not None:
        package = frame.f_globals.get("__name__", "").partition(".")[0]
        if package != "torch" and package not in sys.stdlib_module_names:
            return frame if package != "ddpkit" else None
        frame = frame.f_back
    return None


def _guarded(frame, jumps: list, values: list) -> bool:
    """Whether a frame from ``frame`` outwards (the code that called a loss, and the code that called it, to the
    script's) stands inside the block that a conditional forward jump of its code skips, where that jump tested a
    tensor's truth (one of ``jumps``), or tested a tensor's number or a size its data decides, read on the jump's own
    line (one of ``values``: ``if positive.sum().item() > 0:``, ``if len(rows.nonzero()):``; a number read into a
    name on one line and tested on another is not followed)."""
    while frame is not None:
        code, at = frame.f_code, frame.f_lasti
        tested = {offset for seen, offset in jumps if seen is code}
        read = {_line_at(code, offset) for seen, offset in values if seen is code}
        for offset, target in _conditional_jumps(code) if tested or read else ():
            if offset < at < target and (any(offset <= seen <= _end_of(code, offset) for seen in tested)
                                         or _line_at(code, offset) in read):
                return True
        frame = frame.f_back
    return False


@functools.lru_cache(maxsize=256)
def _conditional_jumps(code: types.CodeType) -> tuple[tuple[int, int], ...]:
    """(offset, target) of each conditional forward jump of ``code`` (an ``if``'s, a ``while``'s, ``and``'s and
    ``or``'s), as ``dis`` lists them."""
    return tuple((instruction.offset, instruction.argval) for instruction in dis.get_instructions(code)
                 if "JUMP" in instruction.opname and "IF" in instruction.opname
                 and "BACKWARD" not in instruction.opname and isinstance(instruction.argval, int)
                 and instruction.argval > instruction.offset)


@functools.lru_cache(maxsize=1024)
def _line_at(code: types.CodeType, offset: int) -> int | None:
    """The source line of the instruction that ``code`` was at when at ``offset`` (past its caches, where a frame may
    point)."""
    line = None
    for instruction in dis.get_instructions(code):
        if instruction.offset > offset:
            break
        positions = getattr(instruction, "positions", None)
        started = positions.lineno if positions is not None and positions.lineno is not None else (
            instruction.starts_line if isinstance(instruction.starts_line, int) else None)
        line = started if started is not None else line
    return line


@functools.lru_cache(maxsize=256)
def _end_of(code: types.CodeType, offset: int) -> int:
    """The last offset that the instruction at ``offset`` covers with its caches (where a frame that runs it may
    point: the next listed instruction's offset, less one)."""
    offsets = [instruction.offset for instruction in dis.get_instructions(code)]
    later = [each for each in offsets if each > offset]
    return later[0] - 1 if later else offset
