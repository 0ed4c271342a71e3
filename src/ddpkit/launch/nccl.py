"""``--nccl KEY=VALUE`` and named presets: NCCL settings applied to every rank, echoed and recorded.

    >>> settings(["NCCL_ALGO=Ring", "no-p2p"])
    {'NCCL_ALGO': 'Ring', 'NCCL_P2P_DISABLE': '1'}

NCCL reads its settings from environment variables when a process creates its first communicator. The
launcher sets them in its own environment before starting the workers, which inherit it; on several
nodes every node's launcher gets the same flags. What each variable does: docs/nccl.md, and
``ddpkit doctor`` for the ones in effect.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger

PRESETS = {
    # What NCCL chose (rings, transports, interfaces) and why it failed to connect.
    "debug": {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"},
    # Broken or slow GPU peer-to-peer (some PCIe switches, virtual machines): copy through host memory.
    "no-p2p": {"NCCL_P2P_DISABLE": "1"},
    # A node with an InfiniBand card NCCL cannot use: TCP sockets only.
    "no-ib": {"NCCL_IB_DISABLE": "1"},
}


def settings(values: Iterable[str]) -> dict[str, str]:
    """The variables ``--nccl`` values ask for, in order (a later value wins); UsageError for a malformed one."""
    chosen: dict[str, str] = {}
    for value in values:
        if value in PRESETS:
            chosen.update(PRESETS[value])
            continue
        key, equals, setting = value.partition("=")
        if not equals or not key.startswith("NCCL_") or not setting:
            raise UsageError(f"--nccl takes NCCL_NAME=VALUE or a preset ({', '.join(PRESETS)}), got {value!r}")
        chosen[key] = setting
    return chosen


def apply(chosen: dict[str, str], *, echo: bool = True) -> None:
    """Put the settings into this process's environment (the workers inherit it) and say so once."""
    os.environ.update(chosen)
    if chosen and echo:
        logger.info("NCCL settings: " + " ".join(f"{key}={shown(key, value)}" for key, value in chosen.items()))


# A variable whose name has one of these words (between underscores) holds a secret: its value is never
# printed or recorded (NCCL_IB_PKEY, a partition number, has none of them).
SECRET_WORDS = frozenset({"PASSWORD", "PASSWD", "PASS", "SECRET", "TOKEN", "KEY", "CREDENTIAL", "CREDENTIALS", "AUTH"})
HIDDEN = "<hidden>"


def shown(name: str, value: str) -> str:
    """``value`` as ddpkit prints and records it: HIDDEN for a variable whose name says it is a secret.

        >>> shown("NCCL_IB_PASSWORD", "hunter2"), shown("NCCL_ALGO", "Ring")
        ('<hidden>', 'Ring')
    """
    return HIDDEN if SECRET_WORDS & set(name.upper().split("_")) else value


def in_effect(environ: dict[str, str] | None = None, prefixes: tuple[str, ...] = ("NCCL_",)) -> dict[str, str]:
    """Every variable set whose name starts with one of ``prefixes``, for the record (metrics.jsonl, bench
    JSON), secrets hidden."""
    environ = os.environ if environ is None else environ
    return {key: shown(key, value) for key, value in sorted(environ.items()) if key.startswith(prefixes)}
