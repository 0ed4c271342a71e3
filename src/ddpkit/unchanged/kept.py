"""What the script's code keeps of a model's outputs, and whether it reads them again: read from the code that called
the model (its bytecode, through ``dis``), once, at a with-loss model's first call on a batch cut by hand.

On batches cut by hand, a model that returns its loss is split at its calls from its second on, and its other outputs
(logits) are then its share's rows. A loop that compares them with the batch's labels, at every step or only every
hundredth, would read a share's logits against the whole batch's labels. So the code that called the model tells what
it does with them: the names that the call's result is stored under (the result itself, ``out = model(**batch)``, or
its parts, ``logits, loss = model(x, y)``), and every place where that code (and, for a module's or a closure's name,
the code nested in it) loads such a name again, whether it runs at every step or never. A name that holds an output
beside the loss and is loaded anywhere, or a result whose name is loaded other than for its loss (``out.loss``,
``out["loss"]``, ``out[1]``), is read: the outputs are then gathered at every call, as DataParallel gathers them.
nanoGPT's loop stores its logits and never loads them again: its shares stay apart. A result used where it is made
other than for its loss, or a part stored elsewhere than under a name (an attribute, an item of a list), counts as
read. Nothing is changed: code objects are read, never run.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator

import torch
from torch.utils import _pytree as pytree

from ddpkit.unchanged.bytecode import LOADS, STORES, index_at
from ddpkit.unchanged.bytecode import instructions as listed
from ddpkit.unchanged.bytecode import names as named
from ddpkit.unchanged.callers import innermost

_UNKNOWN = "where ddpkit cannot follow them"  # (inline, or in an item or an attribute: counted as read)


def read_again(frame: types.FrameType | None, output, is_the_loss: Callable[[object], bool]) -> str | None:
    """Where the script's code keeps one of a model's outputs beside its loss and reads it again: the name it keeps
    it under, or a few words where it uses one otherwise (inline, or stored in an item or an attribute); None where
    it never does. ``frame``: the script's frame stopped at the call of the model, which returned ``output``
    (``script_frame``); a function of the script's that returns the result at once (``return model(**batch)``) is
    followed to where it was called. ``is_the_loss(leaf)``: whether a leaf of ``output`` is its loss."""
    for _ in range(8):
        if frame is None:
            return _UNKNOWN
        instructions = listed(frame.f_code)
        at = index_at(frame.f_code, frame.f_lasti)
        if at is None or not instructions[at].opname.startswith("CALL"):
            return _UNKNOWN  # (not called from Python code: what it does with the result cannot be read)
        at = _onwards(instructions, at + 1)
        if at >= len(instructions) or instructions[at].opname not in ("RETURN_VALUE", "RETURN_CONST"):
            break
        frame = script_frame(frame.f_back)
    else:
        return _UNKNOWN
    stored = list(_stored(instructions, at))
    if not stored:  # (used where it is made: ``model(x, y)[1].backward()`` takes the loss alone)
        key = _key(instructions[at], instructions[at + 1:at + 2]) if at < len(instructions) else None
        return _UNKNOWN if key is None or _holds_others(_part(output, (key,)), is_the_loss) else None
    for name, scope, part in stored:
        kept = _part(output, part)
        if not _holds_others(kept, is_the_loss):
            continue
        if name is None:
            return _UNKNOWN
        if part is not None or not _has_items(kept):
            if any(True for _ in _loads(frame.f_code, name, scope)):
                return name
            continue
        for after in _loads(frame.f_code, name, scope):  # (the result kept whole: read other than for its loss?)
            key = _key(*after)
            if key is None or not is_the_loss(_part(kept, (key,))):
                return name
    return None


def script_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The innermost frame from ``frame`` outwards whose code is neither torch's, nor ddpkit's, nor Python's standard
    library's (by its package): the script's, or a library's that it called, which made the call going on."""
    return innermost(frame, ("torch", "ddpkit"))


def _onwards(instructions: list, at: int) -> int:
    """The index of the instruction that runs next from ``at``, past no-ops and jumps forward (the end of one branch
    of ``a if keyword else b``)."""
    for _ in range(len(instructions)):
        if at >= len(instructions):
            return at
        instruction = instructions[at]
        if instruction.opname == "NOP":
            at += 1
        elif instruction.opname in ("JUMP_FORWARD", "JUMP", "JUMP_NO_INTERRUPT") and instruction.argval > (
                instruction.offset):
            at = next((index for index, target in enumerate(instructions) if target.offset == instruction.argval),
                      len(instructions))
        else:
            return at
    return at


def _stored(instructions: list, at: int) -> Iterator[tuple[str | None, str, tuple | None]]:
    """(name, scope, part) for what the instructions from ``at`` store of a call's result: the result itself (part
    None), or its items as an unpacking or one index or attribute takes them (part: a tuple of keys); name None where a
    part is stored other than under a name."""
    first = instructions[at] if at < len(instructions) else None
    if first is None:
        return
    if first.opname == "UNPACK_SEQUENCE":
        position, index = 0, at + 1
        while position < first.argval and index < len(instructions):
            instruction = instructions[index]
            names = named(instruction) if instruction.opname in STORES else (None,)
            for name in names:
                yield name, STORES.get(instruction.opname, ""), (position,)
                position += 1
            if names == (None,):  # (stored otherwise: the rest of the unpacking cannot be followed)
                for rest in range(position, first.argval):
                    yield None, "", (rest,)
                return
            index += 1
        return
    if first.opname in STORES:
        yield named(first)[0], STORES[first.opname], None
    elif first.opname == "UNPACK_EX":  # (``logits, *rest = ...``)
        yield None, "", None
    else:
        key = _key(first, instructions[at + 1:at + 2])
        taken = at + (1 if first.opname in ("LOAD_ATTR", "LOAD_METHOD") else 2)
        if key is not None and taken < len(instructions) and instructions[taken].opname in STORES:
            yield named(instructions[taken])[0], STORES[instructions[taken].opname], (key,)


def _key(instruction, following: list):
    """The attribute or constant index that an access right after a name's load (``instruction``, then
    ``following``) takes: ``out.loss``, ``out["loss"]``, ``out[1]``; None for anything else."""
    if instruction.opname in ("LOAD_ATTR", "LOAD_METHOD"):
        return instruction.argval
    if instruction.opname == "LOAD_CONST" and following and (
            following[0].opname == "BINARY_SUBSCR" or following[0].opname == "BINARY_OP" and
            following[0].argrepr == "[]"):
        return instruction.argval
    return None


def _loads(code: types.CodeType, name: str, scope: str) -> Iterator[tuple]:
    """The instructions right after each load of ``name`` (the next one and the one after it), in ``code`` and,
    for a module's name or a closure's cell, in the code nested in it."""
    instructions = listed(code)
    for index, instruction in enumerate(instructions):
        if instruction.opname in LOADS[scope] and name in named(instruction, loaded=True):
            last = named(instruction, loaded=True)[-1] == name
            following = instructions[index + 1:index + 3]
            yield (following[0], following[1:]) if last and following else (instruction, [])
    if scope == "fast":
        return
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType) and (scope == "global" or name in constant.co_freevars):
            yield from _loads(constant, name, scope)


def _part(output, part: tuple | None):
    for key in part or ():
        try:
            output = getattr(output, key) if isinstance(key, str) and not isinstance(output, dict) else output[key]
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
    return output


def _has_items(value) -> bool:
    return len(pytree.tree_leaves(value)) > 1


def _holds_others(value, is_the_loss: Callable[[object], bool]) -> bool:
    """Whether ``value`` (a model's output, or a part of it) holds a tensor beside the loss, with rows."""
    if value is None:
        return True  # (a part that cannot be told: counted as one)
    return any(isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and not is_the_loss(leaf)
               for leaf in pytree.tree_leaves(value))
