"""One table of options: a dataclass's fields carry their flag's help, choices and group, so the command
line, the config object, their defaults and choices come from one definition and cannot drift.

    >>> import argparse, dataclasses
    >>> from ddpkit.config import option, add_flags, from_namespace
    >>> @dataclasses.dataclass
    ... class Settings:
    ...     epochs: int = option(8, "passes over the data")
    ...     amp: str = option("off", "mixed precision", choices=("off", "bf16"))
    >>> parser = argparse.ArgumentParser()
    >>> add_flags(parser, Settings)
    >>> from_namespace(Settings, parser.parse_args(["--epochs", "3"]))
    Settings(epochs=3, amp='off')

The library names its parameters in its errors (`` `amp` must be one of off, bf16``); a command line
says them as its flags:

    >>> in_flag_terms("`amp` must be one of off, bf16, got 'fp8'", Settings)
    "--amp must be one of off, bf16, got 'fp8'"
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ddpkit.errors import UsageError


def option(default: Any, help: str, *, choices: tuple | None = None, metavar: str | None = None,  # noqa: A002
           group: str = "training", kind: Callable | None = None, flag: str | None = None) -> Any:
    """A dataclass field that is also a command-line flag.

    ``kind``: the type a value is read as (default: the default's type; give it when the default is None).
    ``flag``: the flag's name when it is not ``--`` + the field's name with dashes; a bool whose flag starts
    with ``--no-`` stores False. ``group``: the section of ``--help`` it is listed in.
    """
    metadata = {"help": help, "choices": choices, "metavar": metavar, "group": group, "kind": kind, "flag": flag}
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of ``cls`` that was declared with ``option``, grouped as the fields say."""
    groups: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if "help" not in field.metadata:
            continue
        meta = field.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        name = flag_name(field)
        if isinstance(field.default, bool):
            action = "store_false" if name.startswith("--no-") else "store_true"
            group.add_argument(name, dest=field.name, action=action, help=meta["help"])
            continue
        kind = meta["kind"] or type(field.default)
        shown = f" (default: {field.default})" if field.default is not None and "default:" not in meta["help"] else ""
        group.add_argument(name, dest=field.name, type=kind, default=field.default, choices=meta["choices"],
                           metavar=meta["metavar"], help=meta["help"] + shown)


def from_namespace(cls: type, ns: argparse.Namespace):
    """The ``cls`` the parsed flags describe."""
    return cls(**{field.name: getattr(ns, field.name) for field in dataclasses.fields(cls) if "help" in field.metadata})


def flag_names(cls: type, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Parameter name -> flag, for ``cls``'s fields declared with ``option`` (and ``extra``'s)."""
    names = {field.name: flag_name(field) for field in dataclasses.fields(cls) if "help" in field.metadata}
    return {**names, **(extra or {})}


def in_flag_terms(message: str, cls: type, extra: Mapping[str, str] | None = None) -> str:
    """``message`` with each backquoted parameter name that is a flag of ``cls`` (or in ``extra``) said as
    the flag; other names stay as they are."""
    flags = flag_names(cls, extra)
    return re.sub(r"`(\w+)`", lambda found: flags.get(found.group(1), found.group(0)), message)


@contextlib.contextmanager
def flag_terms(cls: type, extra: Mapping[str, str] | None = None) -> Iterator[None]:
    """Re-raise a UsageError from inside the block in flag terms (``in_flag_terms``), as the same class."""
    try:
        yield
    except UsageError as error:
        raise said_in_flags(error, cls, extra) from None


def said_in_flags(error: UsageError, cls: type, extra: Mapping[str, str] | None = None) -> UsageError:
    """The same error (its class, whether another rank says it) with its message ``in_flag_terms``."""
    return type(error)(in_flag_terms(str(error), cls, extra), said_elsewhere=error.said_elsewhere)
