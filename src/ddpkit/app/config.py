"""One table of options: a dataclass's fields carry their flag's help, choices and group, so the command
line, the config object, their defaults and choices come from one definition and cannot drift.

    >>> import argparse, dataclasses
    >>> from ddpkit.app.config import option, add_flags, from_namespace
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

from ddpkit.core.errors import UsageError


def option(default: Any, help: str, *, choices: tuple | None = None, metavar: str | None = None,  # noqa: A002
           group: str = "training", kind: Callable | None = None, flag: str | None = None,
           repeat: bool = False) -> Any:
    """A dataclass field that is also a command-line flag.

    ``kind``: the type a value is read as (default: the default's type; give it when the default is None).
    ``flag``: the flag's name when it is not ``--`` + the field's name with dashes; a bool whose flag starts
    with ``--no-`` stores False. ``group``: the section of ``--help`` it is listed in. ``repeat``: the flag may
    be given several times; the field is the tuple of its values (default ``()``).
    """
    metadata = {"help": help, "choices": choices, "metavar": metavar, "group": group, "kind": kind, "flag": flag,
                "repeat": repeat}
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
        if meta.get("repeat"):
            group.add_argument(name, dest=field.name, action="append", default=None, metavar=meta["metavar"],
                               choices=meta["choices"], help=meta["help"] + " (repeatable)")
            continue
        kind = meta["kind"] or type(field.default)
        shown = f" (default: {field.default})" if field.default is not None and "default:" not in meta["help"] else ""
        group.add_argument(name, dest=field.name, type=kind, default=field.default, choices=meta["choices"],
                           metavar=meta["metavar"], help=meta["help"] + shown)


def from_namespace(cls: type, ns: argparse.Namespace):
    """The ``cls`` the parsed flags describe."""
    values = {}
    for field in dataclasses.fields(cls):
        if "help" in field.metadata:
            value = getattr(ns, field.name)
            values[field.name] = tuple(value or ()) if field.metadata.get("repeat") else value
    return cls(**values)


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


# ------------------------------------------------------------------------------------------ config files
#
# A config file is TOML whose keys are a command's long flag names without the dashes (``batch-size = 64``;
# ``batch_size`` is read the same). It stands for those flags written before the command line's own, so a
# flag given on the command line overrides the file's key, and every value is checked as the flag's.

CONFIG_FILE = "config.toml"  # the resolved settings of a run, in its output folder
NOT_IN_FILES = ("help", "config", "list-models")  # flags that are not settings of a run


def _long_flag(action: argparse.Action) -> str | None:
    names = [name for name in action.option_strings if name.startswith("--")]
    return names[0] if names else None


def file_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Key -> flag of ``parser``, for every flag a config file may set."""
    keys = {}
    for action in parser._actions:  # noqa: SLF001 (argparse has no public list of a parser's flags)
        flag = _long_flag(action)
        if flag is not None and flag[2:] not in NOT_IN_FILES:
            keys[flag[2:]] = action
    return keys


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0  # store_true / store_false: the flag alone, no value


def _flag_value(source: str, key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UsageError(f"{source}: {key} must be a number or a string, got {value!r}")
    return str(value)


def flags_from_table(table: Mapping[str, Any], parser: argparse.ArgumentParser, source: str) -> list[str]:
    """The command-line flags a config file's table stands for (``source`` names the file in errors)."""
    import difflib

    keys = file_keys(parser)
    argv: list[str] = []
    for key, value in table.items():
        action = keys.get(key.replace("_", "-"))
        if action is None:
            close = difflib.get_close_matches(key.replace("_", "-"), keys, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UsageError(f"{source}: unknown key {key!r}{hint}; the keys are the long flags of "
                             f"`{parser.prog} --help` without their dashes, e.g. batch-size = 64")
        flag = _long_flag(action)
        if _is_switch(action):
            if not isinstance(value, bool):
                raise UsageError(f"{source}: {key} must be true or false, got {value!r}")
            if value:
                argv.append(flag)
        elif isinstance(action, argparse._AppendAction):  # noqa: SLF001 (a repeatable flag: a list of values)
            for item in value if isinstance(value, list) else [value]:
                argv += [flag, _flag_value(source, key, item)]
        else:
            argv += [flag, _flag_value(source, key, value)]
    return argv


def read_config_file(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags that the config file ``path`` stands for, checked by ``parser`` as if they were typed."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    source = f"--config {path}"
    try:
        with open(path, "rb") as handle:
            table = tomllib.load(handle)
    except OSError as error:
        raise UsageError(f"{source}: cannot read it ({error.strerror})") from None
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{source}: not valid TOML ({error})") from None
    argv = flags_from_table(table, parser, source)
    try:
        parser.parse_args(argv)  # each value checked as its flag's, the error naming the file
    except UsageError as error:
        raise UsageError(f"{source}: {error}") from None
    return argv


def toml_value(value: Any) -> str:
    """``value`` (a string, number, bool or list of them) written as TOML."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # Python's shortest repr reads back to the same float; inf and nan are TOML's too
    if isinstance(value, str):
        return json.dumps(value).replace("\x7f", "\\u007f")  # JSON's escapes are a subset of TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def resolved_settings(ns: argparse.Namespace, parser: argparse.ArgumentParser,
                      resolved: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """(key -> value for every setting of ``parser``'s flags in ``ns``, the keys left unset (None));
    ``resolved`` replaces values that were chosen when the run started (``auto``, defaults)."""
    settings, unset = {}, []
    for key, action in file_keys(parser).items():
        value = (resolved or {}).get(key, getattr(ns, action.dest))
        if _is_switch(action):
            value = bool(value) == action.const  # --no-progress stores False: the key says whether it was given
        if value is None or value == []:
            unset.append(key)
        else:
            settings[key] = value
    return settings, unset


def config_text(settings: Mapping[str, Any], unset: list[str], command: str) -> str:
    """A config file holding ``settings``, with a header that says how to repeat the run."""
    lines = [f"# The settings of this run of `{command}`, as it started: `{command} --config FILE` repeats it",
             "# (a flag given on the command line overrides the key of the same name)."]
    if unset:
        lines.append(f"# Left to their defaults: {', '.join(unset)}.")
    lines += [f"{key} = {toml_value(value)}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"
