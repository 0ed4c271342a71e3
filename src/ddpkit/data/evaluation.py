"""Exact evaluation across ranks: every sample counted once, whatever the world size.

``DistributedSampler`` pads the data with duplicates to a multiple of the world size; those must not reach the
metrics. ``eval_loader`` gives each rank its share with no padding, and ``reduce_sums`` adds the per-rank
sums (float64, so counts stay exact).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddpkit.core.process_group import Runtime


def reduce_sums(values: list[float], runtime: Runtime) -> list[float]:
    """Add each value over all ranks (one all-reduce, float64 so counts stay exact)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if runtime.backend is not None:
        if runtime.backend == "nccl":
            tensor = tensor.to(runtime.device)
        dist.all_reduce(tensor)
    return tensor.cpu().tolist()


RELEASE_WAIT_S = 2.0


def wait_until_only_python_holds(tensors: list[torch.Tensor], timeout_s: float = RELEASE_WAIT_S) -> None:
    """After a collective that returned: wait (at most ``timeout_s``) until the backend's thread has let go of
    ``tensors``, so that their last reference is Python's and they are freed in this thread.

    gloo's worker thread drops a finished collective's tensors a moment after ``wait()`` returns. Were that
    the last reference while the interpreter finalizes (a rank that raises right after the collective and
    exits), freeing their Python objects would need the GIL, and Python ends a thread that asks for it then
    with ``pthread_exit``, which through gloo's C++ frames is ``std::terminate``: signal 6 at exit.
    """
    if not all(hasattr(tensor, "_use_count") for tensor in tensors):  # a torch without the count: no way to tell
        return
    deadline = time.monotonic() + timeout_s
    while any(tensor._use_count() > 1 for tensor in tensors) and time.monotonic() < deadline:
        time.sleep(0.001)
