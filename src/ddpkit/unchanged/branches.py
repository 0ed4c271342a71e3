"""Whether a model's forward reads the values of its tensors in Python: the evidence that a later step may use other
parameters than its first (``ddpkit run --unchanged``).

DDP's reducer is decided from a model's first training step (``strategies.in_place.Replica``): where that step
reached every parameter, DDP is built plain, and a later step that leaves one without a gradient (a loss term that a
detector computes only where its batch holds a positive, ``if positives.any():``) would stop the run: the gradients
of that step were not averaged. Such a step is one whose forward decides something from its data: a
Python branch needs a tensor's value (``bool``, ``.item()``, ``.tolist()``, ``int``, ``torch.equal``), or a size
that its data decides (``nonzero``, a boolean mask's selection, ``unique``, and the size of what they return). So the
forward of each call of a model's first step runs under ``ReadsItsData``, a torch function mode that notes whether
code other than ddpkit's (the model's, a library's it calls; a read inside torch's own modules counts for the code
that called them) calls one of those functions. Where it does on any process, DDP looks for unused parameters from
then on (``find_unused_parameters``): a parameter that one process's share left without a gradient gets the batch's,
and one that the whole batch left without one keeps none, as on one device.

The same mode finds the code that its data decides whether to run: the block of each ``if`` (its ``else`` too),
``while``, ``and``, ``or`` or ``for`` whose test or iterable holds what such a read gave, there or through the names
that the code stores it under, line after line (``nt = b.shape[0]``, then ``if nt:``), as the code's instructions
list them (``dis``). A loss of torch's whose mean ddpkit makes the batch's with an all-reduce at each call
(``counted``) that runs in such a block (``guarded``), or that the block's code may call though it did not run at
this step (its names read where the test ran: a function of ``torch.nn.functional`` by its name, a loss module, a
module's forward, a function's or a method's code, followed ``DEPTH`` calls deep), is a loss that its data decides
whether to compute, which some processes' shares would compute and others' not, leaving the others' all-reduces
unpaired. The model is then computed whole (``unchanged.models``). A sharded model's first call runs under it too:
one of its sharded blocks that such a block of code calls, or may call, would be skipped on some processes' shares
and not on others', where FSDP's all-gather of its parameters would wait forever, and the run is refused in one line.
No function's result changes, and no code runs but the forward's own. Not seen: a branch on something else than a
tensor (Python's ``random``, a counter of the model's own), and a call that the block's names do not show (a function
taken from a dict, a ``getattr`` by a string).
"""

from __future__ import annotations

import builtins
import functools
import inspect
import sys
import types
from collections.abc import Callable

import torch
from torch import nn

from ddpkit.core.logs import logger
from ddpkit.unchanged.adoption import class_name
from ddpkit.unchanged.bytecode import LOADED, STORES, index_at, instructions, lines, names
from ddpkit.unchanged.callers import innermost, package
from ddpkit.unchanged.counted import ELEMENTWISE, OBSERVED
from ddpkit.unchanged.step_rule import Watch

Tensor = torch.Tensor
# Functions whose result's size its values decide (a read of that size is a read of its data).
SIZED = frozenset({torch.nonzero, Tensor.nonzero, torch.argwhere, Tensor.argwhere, torch.masked_select,
                   Tensor.masked_select, torch.unique, Tensor.unique, torch.unique_consecutive,
                   Tensor.unique_consecutive})
# Functions whose Python result is a tensor's value, or whose result's size its values decide.
READS = SIZED | {Tensor.__bool__, Tensor.item, Tensor.tolist, Tensor.__int__, Tensor.__float__, Tensor.__index__,
                 Tensor.__contains__, Tensor.numpy, torch.equal, torch.allclose, torch.is_nonzero}
SIZES = frozenset({Tensor.size, Tensor.__len__, Tensor.numel})  # (and ``Tensor.shape``: ``_a_size``)

# torch.nn.functional's losses whose mean ddpkit makes the batch's with one all-reduce at each call on a split batch
# (``counted``): a call that only some processes make leaves the others' collectives unpaired.
COUNTED = OBSERVED + ELEMENTWISE
DEPTH = 4  # calls followed from a block that its data decides into the code that it calls
_UNSEEN = object()  # what a name holds where the code's names do not show it


class ReadsItsData(Watch):
    """From ``start`` to ``end``: whether code other than ddpkit's called a function of ``READS``, or
    ``torch.where`` with a condition alone, or indexed a tensor with a boolean mask, or read the size of what one of
    those gave (``read``); and whether a block of code that such a read decides whether to run calls, or may call,
    one of the ``COUNTED`` losses (``guarded``, its name: ``if positive.any(): losses["boxes"] =
    F.smooth_l1_loss(...)``), or a module for which ``block`` holds (``block``, its class's name)."""

    def __init__(self, *, block: Callable[[nn.Module], bool] | None = None):
        super().__init__()
        self.read = False
        self.guarded = ""  # the loss called in such a block, by its name
        self.block = ""  # a sharded block of the model called in such a block, by its class (``unchanged.models``)
        self._is_block = block
        self._decided: set[tuple[types.CodeType, int]] = set()  # (code, offset) of each jump that its data decides
        self._codes: set[types.CodeType] = set()
        self._reads: set[tuple[types.CodeType, int]] = set()  # (code, index) of each instruction seen reading
        self._sized: dict[int, Tensor] = {}  # tensors whose size their data decided, by id (held to the ``end``)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        sized = func in SIZED or func is torch.where and len(args) + len(kwargs) == 1 or (
            func is Tensor.__getitem__ and len(args) == 2 and self._selects(args[1]))
        if sized or func in READS or (func in SIZES or _a_size(func)) and args and id(args[0]) in self._sized:
            caller = _caller(sys._getframe(1))
            if caller is not None:
                self.read = True
                self._decide(caller)
        elif (not self.guarded and getattr(func, "__module__", "") == "torch.nn.functional"
              and getattr(func, "__name__", "") in COUNTED and self.guards(sys._getframe(1))):
            self.guarded = func.__name__
        if sized or func is Tensor.__getitem__ and args and id(args[0]) in self._sized:
            for each in result if isinstance(result, tuple) else (result,):
                self._sized[id(each)] = each
        return result

    def guards(self, frame) -> bool:
        """Whether what runs at ``frame`` (a loss called, a block of the model called) stands inside a block that
        its data decides whether to run, in its code or in the code that called it, out to the script's."""
        while frame is not None and self._codes:
            code, at = frame.f_code, frame.f_lasti
            if code in self._codes and any(offset < at < end and (code, offset) in self._decided
                                           for offset, end in _regions(code).items()):
                return True
            frame = frame.f_back
        return False

    def start(self) -> ReadsItsData:
        self.resume()
        return self

    def end(self) -> bool:
        """Out of torch's function modes: whether the forward read its data. Where a mode entered above this one is
        still there (the forward entered it and did not leave it), this one stays, reading nothing more, and counts
        as read."""
        if not self.pause():
            self.read = True
            self.on = False
        self._sized.clear()
        return self.read

    def _selects(self, index) -> bool:
        """Whether ``index`` picks a tensor's rows by its data: a boolean mask, or indices whose size it decided."""
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(part, torch.Tensor) and (part.dtype == torch.bool or id(part) in self._sized)
                   for part in parts)

    def _decide(self, frame) -> None:
        """A read of its data by the code running at ``frame``: each jump that it decides (``_decided_by``) is
        noted, and the code that the jump's test decides whether to run read for what it may call (``_Reach``)."""
        code = frame.f_code
        index = index_at(code, frame.f_lasti)
        if index is None or (code, index) in self._reads:
            return
        self._reads.add((code, index))
        for offset in _decided_by(code, index):
            if (code, offset) in self._decided:
                continue
            self._decided.add((code, offset))
            self._codes.add(code)
            if not self.guarded or self._is_block is not None and not self.block:
                reach = _Reach(self._is_block)
                try:
                    reach.code(code, offset, _regions(code)[offset], _Scope.of_frame(frame), DEPTH)
                except Exception as error:  # (an object of the script's that cannot be read without running it)
                    logger.debug(f"--unchanged: the code at {code.co_filename}:{code.co_firstlineno} that its data "
                                 f"decides whether to run was read in part ({error!r})")
                self.guarded, self.block = self.guarded or reach.loss, self.block or reach.block


def _a_size(func) -> bool:
    return getattr(func, "__self__", None) is Tensor.shape  # (``tensor.shape``: its getter's method-wrapper)


def _caller(frame):
    """The innermost calling frame outside torch and Python's standard library (torch's own modules read for the code
    that called them), where it is not ddpkit's; else None."""
    frame = innermost(frame, ("torch",))
    return frame if frame is not None and package(frame) != "ddpkit" else None


@functools.lru_cache(maxsize=256)
def _regions(code: types.CodeType) -> dict[int, int]:
    """For each conditional forward jump of ``code`` (an ``if``'s, a ``while``'s, ``and``'s, ``or``'s, a ``for``'s),
    by its offset: where the code that its test decides whether to run ends (its target; an ``if``'s ``else``
    included, where the code before its target jumps forward past it; the rest of the loop's body, where it jumps
    back to its loop's head: a ``continue``; the rest of the code, where the code before its target returns)."""
    listed = instructions(code)
    at = {instruction.offset: index for index, instruction in enumerate(listed)}
    regions = {}
    for instruction in listed:
        name, target = instruction.opname, instruction.argval
        if not (("JUMP" in name and "IF" in name and "BACKWARD" not in name or name == "FOR_ITER")
                and isinstance(target, int) and target > instruction.offset):
            continue
        before = listed[at[target] - 1] if at.get(target) else None
        jumps = before is not None and "JUMP" in before.opname and isinstance(before.argval, int)
        if name == "FOR_ITER" or before is None:
            pass
        elif jumps and before.opname in ("JUMP_FORWARD", "JUMP") and before.argval > target:
            target = before.argval
        elif jumps and before.argval < instruction.offset:  # (a ``continue``, or the end of a
            # loop's body past an ``else``: the rest of the loop's body, to its last jump back to its head)
            target = 1 + max(each.offset for each in listed if "JUMP" in each.opname and each.argval == before.argval)
        elif before.opname in ("RETURN_VALUE", "RETURN_CONST"):  # (an early return: the rest runs where it did not)
            target = listed[-1].offset + 1
        regions[instruction.offset] = target
    return regions


@functools.lru_cache(maxsize=1024)
def _decided_by(code: types.CodeType, index: int) -> tuple[int, ...]:
    """The offsets of the jumps of ``_regions(code)`` that a read of data by its instruction at ``index`` decides: a
    jump on the read's line, at or after it, and each later jump whose test holds a name that the read's line stores,
    or that a later line stores from such a name (in the order of the code's instructions)."""
    listed, line = instructions(code), lines(code)
    regions = _regions(code)
    decided, held, flowing, stored = [], set(), True, False  # flowing: what is being computed holds the read's
    for position in range(index, len(listed)):
        instruction, here = listed[position], line[position] == line[index]
        name = instruction.opname
        if stored and name not in STORES:
            flowing = stored = False
        if name in LOADED and held.intersection(names(instruction, loaded=True)):
            flowing = True
        if instruction.offset in regions:
            if flowing or here:
                decided.append(instruction.offset)
            flowing = flowing and name == "FOR_ITER"  # (a ``for``'s name takes what it iterates)
        elif name in STORES:
            if flowing or here:
                held.update(names(instruction))
            stored = True
        elif name in ("POP_TOP", "RETURN_VALUE", "RETURN_CONST") or name.startswith("JUMP"):
            flowing = False
    return tuple(decided)


class _Scope:
    """What the names of some code hold: a running frame's, or a function's (its globals, its closure's cells, its
    first argument where it is bound)."""

    def __init__(self, globals_: dict, locals_: dict):
        self.globals, self.locals = globals_, locals_

    @classmethod
    def of_frame(cls, frame) -> _Scope:
        return cls(frame.f_globals, dict(frame.f_locals))

    @classmethod
    def of_function(cls, function: types.FunctionType, bound) -> _Scope:
        code, held = function.__code__, {}
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            try:
                held[name] = cell.cell_contents
            except ValueError:  # (a cell not yet filled)
                continue
        if bound is not None and code.co_argcount:
            held[code.co_varnames[0]] = bound
        return cls(function.__globals__, held)

    def load(self, kind: str, name) -> object:
        if kind != "global":
            return self.locals.get(name, _UNSEEN)
        return self.globals.get(name, getattr(builtins, name, _UNSEEN) if isinstance(name, str) else _UNSEEN)


class _Reach:
    """What some code may call, from what its names hold (read, never run): a loss of ``COUNTED`` (``loss``, by its
    name: named in the code, or a function of torch's by that name), and a module for which ``is_block`` holds
    (``block``, by its class); a module's forward (a container's modules), a function's or a method's code followed
    into, to ``depth`` calls deep. Not followed: ddpkit's code, Python's standard library's, and torch's other than its
    modules (``torch.nn.modules``)."""

    def __init__(self, is_block: Callable[[nn.Module], bool] | None):
        self.is_block = is_block
        self.loss = self.block = ""
        self._followed: dict[tuple[types.CodeType, int], int] = {}  # the code followed, and how many calls deeper

    def code(self, code: types.CodeType, start: int, end: int, scope: _Scope, depth: int) -> None:
        """What the instructions of ``code`` after ``start`` and before ``end`` may call."""
        held = _UNSEEN  # what the names loaded last hold (``self.head``), followed where they end
        for instruction in instructions(code):
            if not start < instruction.offset < end:
                continue
            name, value = instruction.opname, instruction.argval
            if isinstance(value, str) and value in COUNTED and (name in ("LOAD_ATTR", "LOAD_METHOD")
                                                                 or LOADED.get(name) == "global"):
                self.loss = self.loss or value  # (``F.mse_loss``, an imported ``mse_loss``; not a local's name)
            if name in ("LOAD_ATTR", "LOAD_METHOD"):
                held = _attribute(held, value)
                continue
            self.follow(held, depth)
            held = _UNSEEN
            if name in LOADED:
                held = scope.load(LOADED[name], names(instruction, loaded=True)[-1])
            elif name == "LOAD_CONST" and isinstance(value, types.CodeType):  # (a comprehension, a lambda)
                self.code(value, -1, sys.maxsize, scope, depth)
        self.follow(held, depth)

    def follow(self, held, depth: int) -> None:
        if held is _UNSEEN or held is None or depth < 0:
            return
        if isinstance(held, types.FunctionType) and held.__module__ == "torch.nn.functional" and (
                held.__name__ in COUNTED):
            self.loss = self.loss or held.__name__
        if isinstance(held, nn.Module):
            if self.is_block is not None and not self.block and self.is_block(held):
                self.block = class_name(held)
            forward = inspect.getattr_static(type(held), "forward", None)
            if type(held).__module__.startswith("torch.nn.modules.container"):
                for module in held.__dict__.get("_modules", {}).values():
                    self.follow(module, depth - 1)
            elif isinstance(forward, types.FunctionType):
                self.function(forward, held, depth - 1)
        elif isinstance(held, types.MethodType):
            self.function(held.__func__, held.__self__, depth - 1)
        elif isinstance(held, types.FunctionType):
            self.function(held, None, depth - 1)
        elif isinstance(held, (staticmethod, classmethod)):
            self.follow(held.__func__, depth)
        elif isinstance(held, property) and held.fget is not None:
            self.function(held.fget, None, depth - 1)

    def function(self, function, bound, depth: int) -> None:
        if not isinstance(function, types.FunctionType):  # (a callable object's, a builtin's: not read)
            return
        module = function.__module__ or ""
        top = module.partition(".")[0]
        if (depth < 0 or top == "ddpkit" or top in sys.stdlib_module_names
                or top == "torch" and not module.startswith("torch.nn.modules")):
            return
        key = (function.__code__, id(bound))
        if self._followed.get(key, -1) < depth:  # (not yet followed, or followed less deep)
            self._followed[key] = depth
            self.code(function.__code__, -1, sys.maxsize, _Scope.of_function(function, bound), depth)


def _attribute(held, name: str) -> object:
    """What ``held.name`` gives, read without running it (a property stays a property); a function of a class, bound
    to the object that it is taken from."""
    if held is _UNSEEN:
        return _UNSEEN
    try:
        own = object.__getattribute__(held, "__dict__")  # (the object's own, as it is: no ``__getattr__`` runs)
    except AttributeError:  # (an object of ``__slots__``)
        own = {}
    if isinstance(held, nn.Module):
        for table in ("_modules", "_parameters", "_buffers"):
            found = own.get(table, {})
            if name in found:
                return found[name]
    try:
        found = inspect.getattr_static(held, name)
    except (AttributeError, TypeError):
        return _UNSEEN
    if isinstance(found, types.FunctionType) and not isinstance(held, (type, types.ModuleType)) and (
            name not in own):
        return types.MethodType(found, held)
    return found
