"""Exact evaluation across ranks: every sample counted once, whatever the world size.

``DistributedSampler`` pads the data with duplicates to a multiple of the world size; those must not reach the
metrics. ``eval_loader`` gives each rank its share with no padding. Then any metric is one line:

    correct1, correct5, count = job.sum(correct1, correct5, count)    # sums, one all-reduce (float64: exact)
    predictions, targets = job.gather(predictions, targets)           # every rank's rows, for AUC, F1, ...

and ``evaluate`` is the shortcut for classifiers (top-k accuracy), language models (per-token loss) and
regressions (the mean of ``loss_fn``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.core import progress
from ddpkit.core.precision import autocast
from ddpkit.core.process_group import Runtime


def reduce_sums(values: list[float], runtime: Runtime) -> list[float]:
    """Add each value over all ranks (one all-reduce, float64 so counts stay exact): ``sums`` as floats."""
    return [float(value) for value in sums([float(value) for value in values], runtime)]


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


Number = int | float


def sums(values: Sequence[Number | torch.Tensor], runtime: Runtime) -> list[Number | torch.Tensor]:
    """Each value (a number, or a tensor of any shape) added over all ranks in one all-reduce. Numbers come back
    as numbers (ints as ints: counts stay exact, in float64 on the way), tensors as tensors of their own dtype
    and device."""
    progress.touch()  # this rank is at work; its phase (and so its step time) stays as it was
    flat = [(value.detach().reshape(-1).to("cpu", torch.float64) if isinstance(value, torch.Tensor)
             else torch.tensor([float(value)], dtype=torch.float64)) for value in values]
    total = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
    if runtime.backend is not None and runtime.world_size > 1:
        total = total.to(runtime.device) if runtime.backend == "nccl" else total
        dist.all_reduce(total)
        total = total.cpu()
    out, at = [], 0
    for value, part in zip(values, flat):
        summed, at = total[at:at + part.numel()], at + part.numel()
        if isinstance(value, torch.Tensor):
            out.append(summed.reshape(value.shape).to(value.device, value.dtype))
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            out.append(summed.item())
        else:
            out.append(int(round(summed.item())) if isinstance(value, int) else summed.item())
    return out


def gather(tensors: Sequence[torch.Tensor], runtime: Runtime) -> list[torch.Tensor]:
    """Every rank's rows of each tensor (all ranks' first dimensions may differ), concatenated in rank order, on
    every rank. For metrics that need all the predictions (AUC, F1): gather once, after the loop, what each
    rank's share of an ``eval_loader`` produced; nothing is padded, so nothing needs dropping."""
    progress.touch()  # this rank is at work; its phase (and so its step time) stays as it was
    if runtime.backend is None or runtime.world_size == 1:
        return list(tensors)
    device = runtime.device if runtime.backend == "nccl" else torch.device("cpu")
    rows = torch.tensor([tensor.shape[0] for tensor in tensors], device=device)
    every_rows = [torch.empty_like(rows) for _ in range(runtime.world_size)]
    dist.all_gather(every_rows, rows)
    counts = torch.stack(every_rows).cpu()  # rank x tensor
    out = []
    for index, tensor in enumerate(tensors):
        longest = int(counts[:, index].max())
        padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=device)
        padded[:tensor.shape[0]] = tensor.detach().to(device)
        parts = [torch.empty_like(padded) for _ in range(runtime.world_size)]
        dist.all_gather(parts, padded)
        out.append(torch.cat([part[:int(counts[rank, index])] for rank, part in enumerate(parts)]).to(tensor.device))
    return out


@torch.no_grad()
def evaluate(model: nn.Module, loader, runtime: Runtime, amp: str = "off", *, lockstep: bool = False,
             loss_fn: Callable = F.cross_entropy, topk: Sequence[int] = (1,)) -> tuple:
    """``(loss, accuracy, count)`` over the whole validation set, each sample counted once: the mean of
    ``loss_fn(output, target, reduction="sum")`` per target, the share of targets among the ``k`` highest outputs
    for each ``k`` of ``topk`` (``topk=(1, 5)``: ``(loss, top1, top5, count)``; ``topk=()``: ``(loss, count)``, for a
    regression), and the number of targets.

    A model that returns a tuple (``(logits, loss)``, HF-style) is scored on its first item. Outputs of more than
    two dimensions (a language model's ``(batch, tokens, vocabulary)``) are scored per token: ``count`` is then
    the tokens. ``lockstep``: every rank runs as many forwards as the rank with the most batches (a rank out of
    batches runs empty ones), for models whose forward is a collective (FSDP's all-gathers).
    """
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, [0.0] * len(topk), 0.0
    try:
        for inputs, targets in lockstep_batches(loader, runtime) if lockstep else loader:
            progress.mark("evaluate")
            with autocast(runtime.device, amp):
                output = model(inputs)
            if isinstance(output, (tuple, list)):
                output = output[0]
            if output is None:  # a pipeline stage other than the last
                continue
            targets = targets.to(output.device)
            if output.dim() > 2 and targets.dim() == output.dim() - 1:  # per token: (batch, tokens, classes)
                output, targets = output.flatten(0, -2), targets.flatten()
            loss_sum += loss_fn(output.float(), targets, reduction="sum").item()
            for index, k in enumerate(topk):
                if k == 1:  # argmax: ties go to the first class, as they always have
                    hits = output.argmax(dim=-1) == targets
                else:
                    hits = (output.topk(min(k, output.shape[-1]), dim=-1).indices == targets.unsqueeze(-1)).any(dim=-1)
                correct[index] += hits.sum().item()
            count += targets.numel()
    finally:
        model.train(was_training)
    loss_sum, *correct, count = sums([loss_sum, *correct, count], runtime)
    return (loss_sum / max(count, 1.0), *(value / max(count, 1.0) for value in correct), int(count))


def lockstep_batches(loader, runtime: Runtime):
    """The loader's batches, then empty batches shaped like them until every rank has run as many."""
    batches = torch.tensor([len(loader)], device=runtime.device if runtime.backend == "nccl" else "cpu")
    dist.all_reduce(batches, op=dist.ReduceOp.MAX)
    last = None
    # A ddpkit loader would first refuse unequal counts (DeviceLoader's ``lockstep``): here they are evened out.
    for last in (loader.without_count_check() if hasattr(loader, "without_count_check") else loader):
        yield last
    for _ in range(int(batches.item()) - len(loader)):
        if last is None:  # this rank holds no validation sample (fewer than ranks): shape one like the set's first
            image, label = loader.dataset[0]
            last = [torch.as_tensor(image)[None].to(runtime.device), torch.as_tensor(label)[None].to(runtime.device)]
        yield [item[:0] for item in last]
