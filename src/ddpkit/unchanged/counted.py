"""Means over counted items, as one device takes them (``ddpkit run --unchanged``).

A loss that is a mean over its batch's rows is the same whichever way the batch is cut: each rank's gradient weighs
its share of the rows (``unchanged.batches.Batch``), and the weighted shares add up to the whole batch's. A mean whose
denominator is counted from the batch is not: ``F.cross_entropy(logits, labels, ignore_index=-100)`` divides by the
tokens that are not ignored, ``CrossEntropyLoss(weight=w)`` by the summed weights of the targets, and each share has
its own count. Averaging the shares' means then weighs every token by the inverse of its share's count (the error that
transformers fixed in its Trainer with ``num_items_in_batch``).

Here the count is read from the call itself. PyTorch's class-index losses, ``F.cross_entropy`` and ``F.nll_loss``
(and so ``nn.CrossEntropyLoss``, ``nn.NLLLoss``, transformers' model-computed losses and any library that calls
them), are observed where they are called (``torch.nn.functional``'s two functions replaced: no hook exists for a
function): in a training step on a split batch, with ``reduction="mean"``, each rank computes its share's sum and
counts its share's items (targets not ignored, each weighing its class's weight), and one all-reduce of (count, sum)
gives the batch's. The loss a rank returns is its sum over the batch's count, valued as the whole batch's mean (what
the script prints); its gradient is then this rank's part of one device's (``ScaleGradient`` divides the share's
weight out again: DDP multiplies it back in). A stand-in sample (a rank without one of the batch's) counts nothing.

Where it does not apply, the call is PyTorch's own, untouched: one process, a batch every rank holds whole (an
evaluation, a batch cut at the model before it splits), ``--loss-reduction sum`` or ``coupled`` (the loss is then over
the whole batch), gradients off, ``reduction`` other than ``"mean"`` (or the legacy ``size_average``/``reduce``),
probabilities as targets (a mean over rows), and a loss inside TorchScript (``torch.jit.script`` compiles PyTorch's
own function). What cannot be seen is a mean written by hand: ``(l * m).sum() / m.sum()`` (docs/unchanged.md says
what to write instead).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpkit.unchanged.batches import Batch
from ddpkit.unchanged.gathered import ScaleGradient

OBSERVED = ("cross_entropy", "nll_loss")  # torch.nn.functional's losses whose mean is over counted items
# torch.nn.functional's losses whose mean is over their elements: the count is the share's number of elements, and the
# value the script reads is the whole batch's (a split batch's share of a mean is its own mean, not the batch's).
ELEMENTWISE = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
               "binary_cross_entropy_with_logits")


class CountedMeans:
    """The replacements of ``OBSERVED``, weighing each rank's share of a mean by its count (see the module)."""

    def __init__(self, *, batch: Batch):
        self.batch = batch
        self.originals: dict[str, object] = {}

    def install(self) -> None:
        for name in OBSERVED + ELEMENTWISE:
            original = getattr(F, name)
            self.originals[name] = original
            setattr(F, name, self._observed(original) if name in OBSERVED else self._elementwise(original))

    def uninstall(self) -> None:
        for name, original in self.originals.items():
            setattr(F, name, original)
        self.originals.clear()

    def _observed(self, original):
        @functools.wraps(original)
        def loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                 *more, **kwargs):  # (more: cross_entropy's label_smoothing, given by position)
            if (reduction != "mean" or size_average is not None or reduce is not None or not self.applies(input)
                    or target.is_floating_point()):  # (probabilities: a mean over rows, which the share's weight keeps)
                return original(input, target, weight, size_average, ignore_index, reduce, reduction, *more, **kwargs)
            summed = original(input, target, weight, None, ignore_index, None, "sum", *more, **kwargs)
            return self.mean_of_the_batch(summed, counted(target, weight, ignore_index))

        return _scripted_as(original, loss)

    def _elementwise(self, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def loss(*args, **kwargs):
            input = args[0] if args else kwargs.get("input")
            if not self.applies(input):
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            given = bound.arguments
            if (given.get("reduction", "mean") != "mean" or given.get("size_average") is not None
                    or given.get("reduce") is not None):
                return original(*args, **kwargs)
            given["reduction"] = "sum"
            target = given.get("target")
            shape = input.shape if not isinstance(target, torch.Tensor) else torch.broadcast_shapes(input.shape,
                                                                                                    target.shape)
            count = torch.tensor(shape.numel(), device=input.device)
            return self.mean_of_the_batch(original(*bound.args, **bound.kwargs), count)

        return _scripted_as(original, loss)

    def applies(self, input: torch.Tensor) -> bool:
        """A training step on a batch split across several ranks (or a share's loss computed, gradients off, to
        compare with the whole batch's: ``at_the_model.check_both_ways``)."""
        batch = self.batch
        return (batch.world_size > 1 and not batch.whole and not batch.summed and not batch.coupled
                and not batch.gathered and isinstance(input, torch.Tensor)
                and (input.requires_grad and torch.is_grad_enabled() or batch.checking))

    def mean_of_the_batch(self, summed: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The whole batch's mean, from this rank's ``summed`` loss over its ``count`` items: its value the batch's,
        its gradient this rank's sum over the batch's count (its share's weight divided out: DDP multiplies it back
        in). One all-reduce. Nothing counted anywhere gives 0/0, as one device's mean does."""
        share = self.batch.current_weight()
        if share == 0:  # a stand-in: it counts nothing
            summed, count = summed * 0, torch.zeros_like(count)
        sums = torch.stack([count.to(torch.float64), summed.detach().to(torch.float64)])
        dist.all_reduce(sums)
        whole_count, whole_sum = sums[0].to(summed.dtype), sums[1].to(summed.dtype)
        mean = ScaleGradient.apply(summed / whole_count, 1.0 / share if share > 0 else 0.0)
        valued = mean + (whole_sum / whole_count - mean).detach()
        self.batch.valued_whole(valued)  # (a model that returns it: its value is the batch's already)
        return valued


def _scripted_as(original, loss):
    """``loss``, which TorchScript compiles as PyTorch's own ``original`` where a script calls it (its mark for a
    wrapper)."""
    setattr(loss, "__original_fn", original)
    setattr(loss, "__script_if_tracing_wrapper", True)
    return loss


def counted(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """What a class-index loss with ``reduction="mean"`` divides by: the targets not ignored, each weighing its class's
    ``weight`` where one is given (0-dimensional, on the target's device)."""
    kept = target != ignore_index
    if weight is None:
        return kept.sum()
    return weight.to(target.device)[target[kept]].sum()
