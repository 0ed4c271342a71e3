"""The script's code as Python compiled it, read through ``dis`` (``unchanged.kept``, ``unchanged.branches``): each
code object's instructions listed once, with their source lines, and the instruction that a frame is running. Code
objects are read, never run or changed.
"""

from __future__ import annotations

import bisect
import dis
import functools
import types

# Instructions that bind or read a name (those of Python 3.10 to 3.14; 3.13 joins two in one, the names a tuple).
STORES = {"STORE_FAST": "fast", "STORE_FAST_STORE_FAST": "fast", "STORE_DEREF": "cell", "STORE_NAME": "global",
          "STORE_GLOBAL": "global"}
LOADS = {
    "fast": {"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_FAST_LOAD_FAST",
             "LOAD_FAST_BORROW_LOAD_FAST_BORROW", "STORE_FAST_LOAD_FAST"},
    "cell": {"LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FROM_DICT_OR_DEREF"},
    "global": {"LOAD_NAME", "LOAD_GLOBAL", "LOAD_FROM_DICT_OR_GLOBALS"},
}
LOADED = {opname: scope for scope, opnames in LOADS.items() for opname in opnames}


@functools.lru_cache(maxsize=512)
def instructions(code: types.CodeType) -> tuple[dis.Instruction, ...]:
    """``code``'s instructions, as ``dis`` lists them (without their caches)."""
    return tuple(dis.get_instructions(code))


@functools.lru_cache(maxsize=512)
def lines(code: types.CodeType) -> tuple[int | None, ...]:
    """The source line of each of ``instructions(code)`` (carried on from the last one that starts a line)."""
    line, listed = None, []
    for instruction in instructions(code):
        positions = getattr(instruction, "positions", None)
        started = positions.lineno if positions is not None and positions.lineno is not None else (
            instruction.starts_line if isinstance(instruction.starts_line, int)
            and not isinstance(instruction.starts_line, bool) else getattr(instruction, "line_number", None))
        line = started if started is not None else line
        listed.append(line)
    return tuple(listed)


@functools.lru_cache(maxsize=512)
def _offsets(code: types.CodeType) -> tuple[int, ...]:
    return tuple(instruction.offset for instruction in instructions(code))


def index_at(code: types.CodeType, lasti: int) -> int | None:
    """The index in ``instructions(code)`` of the instruction that a frame of ``code`` at ``lasti`` runs (its
    ``f_lasti``, which some releases point past the instruction, into its caches); None before the first."""
    at = bisect.bisect_right(_offsets(code), lasti) - 1
    return at if at >= 0 else None


def line_at(code: types.CodeType, lasti: int) -> int | None:
    """The source line of the instruction that a frame of ``code`` at ``lasti`` runs."""
    at = index_at(code, lasti)
    return None if at is None else lines(code)[at]


def names(instruction: dis.Instruction, *, loaded: bool = False) -> tuple:
    """The names that an instruction of ``STORES`` binds, or (``loaded``) that one of ``LOADS`` reads."""
    value = instruction.argval
    found = value if isinstance(value, tuple) else (value,)
    if instruction.opname == "STORE_FAST_LOAD_FAST":
        return found[1:] if loaded else found[:1]
    return found
