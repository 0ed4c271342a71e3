"""The one place where ddpkit installs signal handlers; none is installed at import.

    >>> import signal
    >>> from ddpkit import signals
    >>> before = signal.getsignal(signal.SIGTERM)
    >>> previous = signals.catch((signal.SIGTERM,), signals.raise_terminated)
    >>> signal.getsignal(signal.SIGTERM) is signals.raise_terminated
    True
    >>> signals.restore(previous)
    >>> signal.getsignal(signal.SIGTERM) is before
    True

Who installs what, and for how long:
- ``ddpkit.setup`` (so ``distributed()`` and ``Job``): SIGTERM raises ``Terminated`` in the main thread,
  so ``finally`` blocks (teardown, a checkpoint's wait) still run; ``distributed()`` restores the
  previous handler when its block ends.
- ``ddpkit.stop_on_signal`` (``ddpkit train``'s loop): SIGTERM and SIGINT only raise a flag while the
  loop runs, so that every rank stops at the same step; restored when the loop ends.
- DataLoader worker processes ignore SIGTERM and SIGINT (``ignore_stop_signals``): their rank stops them.
- A rank a launcher started (torchrun's agent, ``ddpkit train --launcher spawn``) asks Linux for SIGTERM
  when that launcher ends (``end_with_parent``): a launcher killed with SIGKILL leaves no rank training on.
Only the main thread may install handlers (Python's rule); elsewhere these functions do nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from types import FrameType

Handler = Callable[[int, FrameType | None], object]


class Terminated(SystemExit):
    """Raised in the main thread on SIGTERM, so ``finally`` blocks (teardown, checkpoint) still run."""


def raise_terminated(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001 - signal's signature
    raise Terminated(128 + signum)


def catch(signals: Iterable[int], handler: Handler | int) -> dict[int, object]:
    """Install ``handler`` for each of ``signals``; return the handlers it replaced, for ``restore``.

    An empty dict off the main thread, where Python allows no handler to be installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in signals:
        previous[sig] = signal.getsignal(sig)
        signal.signal(sig, handler)
    return previous


def current(signals: Iterable[int]) -> dict[int, object]:
    """The handlers installed now for ``signals`` (empty off the main thread), for ``restore`` later."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in signals}


def restore(previous: dict[int, object]) -> None:
    """Put back the handlers ``catch`` replaced."""
    for sig, handler in previous.items():
        if handler is not None:  # None: a handler installed outside Python, which cannot be put back
            signal.signal(sig, handler)


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when the thread that started it ends


def end_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Have Linux send ``sig`` to this process when its parent ends, whatever ends it (SIGKILL included);
    return whether that is set (not on other systems).

    For a rank whose launcher started it: otherwise a launcher killed with SIGKILL leaves its ranks training
    on, holding their GPUs and ports. SIGTERM then stops the rank as a signal from the launcher would.
    Not for a script run by hand, whose parent is a shell: ``nohup`` must keep it running.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() == 1:  # the parent ended before the request was made: nobody will send it now
        os.kill(os.getpid(), sig)
    return True


def ignore_stop_signals(worker_id: int = 0) -> None:  # noqa: ARG001 - DataLoader's worker_init_fn signature
    """For loader worker processes: leave SIGTERM/SIGINT to their rank, which stops at a step boundary and
    ends them. torchrun signals a worker's whole process group; a loader process dying of it would abort
    the rank in the middle of the step it is meant to finish cleanly.
    """
    catch((signal.SIGTERM, signal.SIGINT), signal.SIG_IGN)
