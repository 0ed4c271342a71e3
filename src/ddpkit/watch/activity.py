"""Whether a rank is at work when its training thread marks no progress: an evaluation loop of the script's own,
a sampling loop, a metric computed over all predictions, a checkpoint uploaded.

The heartbeat thread asks every few seconds. On the CPU, a process at work burns CPU time, and one that waits
(asleep, stuck in a collective or a lock, stopped) does not: gloo's collectives wait in a condition variable and
in ``epoll``. A process that reads or writes (a download on rank 0 while the others wait at a barrier, a file
copied) moves bytes through its system calls, which ``/proc/self/io`` counts; the heartbeat's own few hundred
bytes a beat stay far below ``IO_BYTES``. On a GPU, a host thread waiting for the device spins (CUDA's default), so CPU time says nothing; there
a rank is at work when its CUDA caching allocator hands out memory (every new tensor, even from its cache) or when
its CPU time goes with Python code that moves (the training thread's innermost frame changes). A rank stuck in a
NCCL collective allocates nothing and sits in one call.

Cost: one ``time.process_time()``, one ``sys._current_frames()`` and, on a GPU, one read of the allocator's
counters per heartbeat; nothing in the training thread.
"""

from __future__ import annotations

import sys
import time

import torch

CPU_SHARE = 0.1  # of one core over the interval: a process using this much is at work (a waiting one ~0)
IO_BYTES = 256 * 1024  # read or written through system calls over the interval: a process moving this much works


class Activity:
    """Signs of work in this process since the last ``working()``: its CPU time, its training thread's frame and,
    on ``device`` (a CUDA device), its allocator's count of allocations."""

    def __init__(self, thread_id: int, device: torch.device | None = None):
        self.thread_id = thread_id
        self.device = device if device is not None and device.type == "cuda" else None
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, int | None, tuple[int, int] | None, int]:
        return time.monotonic(), time.process_time(), self._allocations(), self._frame(), io_bytes()

    def _allocations(self) -> int | None:
        if self.device is None or not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.memory_stats(self.device).get("allocation.all.allocated", 0))

    def _frame(self) -> tuple[int, int] | None:
        frame = sys._current_frames().get(self.thread_id)  # noqa: SLF001 - the one way to see another thread's frame
        return None if frame is None else (id(frame), frame.f_lasti)

    def working(self) -> bool:
        """Whether the process has been at work since the last call."""
        now = self._sample()
        before, self._last = self._last, now
        busy = now[1] - before[1] >= CPU_SHARE * max(now[0] - before[0], 1e-9)
        moving_bytes = now[4] - before[4] >= IO_BYTES
        if self.device is None:
            return busy or moving_bytes
        return moving_bytes or now[2] != before[2] or (busy and now[3] != before[3])


def io_bytes() -> int:
    """Bytes this process has read and written through system calls (files, sockets, pipes); 0 where the system
    does not say (not Linux)."""
    try:
        with open("/proc/self/io") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        return int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return 0
