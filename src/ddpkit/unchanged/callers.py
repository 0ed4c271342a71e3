"""Whose code makes a call that ddpkit sees (``ddpkit run --unchanged``): the calling frames, walked outwards past
the code that only passes the call on (Python's standard library, and where asked, torch's or ddpkit's own)."""

from __future__ import annotations

import sys
import types


def package(frame: types.FrameType) -> str:
    """The top-level package of the module whose code ``frame`` runs (``""`` for code that names no module)."""
    return frame.f_globals.get("__name__", "").partition(".")[0]


def innermost(frame: types.FrameType | None, passing: tuple[str, ...] = ()) -> types.FrameType | None:
    """The innermost frame from ``frame`` outwards whose code is neither Python's standard library's nor of one of
    the packages ``passing`` (code that names no module, run by ``exec``, is the script's: it stops there); None where
    there is none."""
    while frame is not None:
        found = package(frame)
        if found not in sys.stdlib_module_names and found not in passing:
            return frame
        frame = frame.f_back
    return None
