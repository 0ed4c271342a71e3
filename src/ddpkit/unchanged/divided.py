"""Evaluation divided across the ranks, and still one device's numbers (``ddpkit run --unchanged``).

In an evaluation, every rank reads the whole batches (``unchanged.batches``). Computing each of them in full on every
rank would make an evaluation no faster on N devices than on one. Instead, a model called to evaluate a whole batch
computes its share of the rows, and its outputs are gathered into the whole batch's on every rank
(``gathered``): the script's own sums, counts and accuracies are one device's, at about 1/N of the model's work.

A model is divided once a whole call showed that it can be (``Evaluations.learn``): its tensor arguments are
positional and share their first dimension (the batch's), and its outputs are batch-shaped (a tensor, or a tuple,
list, dict or dataclass of them, each with a row per sample). A model called with tensor keywords (which the hooks
cannot cut), one whose outputs are not batch-shaped (a loss it returns), and one with a BatchNorm layer in training
mode (whose statistics are the batch's) are computed whole, as before. A call whose outputs turn out not
batch-shaped is computed again, whole, and that model is not divided again. The rows each rank computes are a
contiguous run of the batch, as a split training batch's; a batch smaller than the world is computed whole.
PyTorch's global forward hooks show a call's keywords only in releases after late 2024 (pytorch#137403;
``KEYWORDS_SEEN``, read from the hook's signature; torch 2.4 has none): on an older torch, evaluation stays whole.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref

import torch
import torch.nn as nn
from torch.nn.modules import module as module_hooks

from ddpkit.data.split_batches import Share, rows_of_share, share_of, share_sizes
from ddpkit.unchanged.gathered import batch_shaped, gathered, map_tensors

KEYWORDS_SEEN = "with_kwargs" in inspect.signature(module_hooks.register_module_forward_hook).parameters


@dataclasses.dataclass
class Call:
    """A root call of a model, between its hooks: ``share`` where it computes only this rank's rows."""

    module: nn.Module
    whole_args: tuple
    evaluating: bool = False
    share: Share | None = None
    learning: bool = False  # a model's first training call outside a split loader: whether it returns its loss
    items_counted: bool = False  # given the batch's count of items (``num_items_in_batch``): its loss a part of a sum
    gathered: bool = False  # a loader's whole batch cut at the model, its outputs gathered (``AtTheModel.split_whole``)
    tried: bool = False  # a model's first call, cut before its outputs showed they can be gathered (``split_first``)
    buffers: list | None = None  # a model's first training call: its buffers (but BatchNorm's) as they were before it
    versions: list | None = None  # and its parameters, each with its version counter (written in place: it grows)
    attributes: dict | None = None  # and the tensors its layers held as attributes before it (``held_tensors``)
    keywords: dict = dataclasses.field(default_factory=dict)  # a tried call's own (to compute it again, whole)
    of_a_split_batch: bool = False  # a training call on this rank's share of a batch that its loader split
    by_hand: bool = False  # a training call on this rank's share of a batch that no loader split (``AtTheModel.split``)


class Evaluations:
    """Which models are divided in evaluation, and the division of their calls (see the module)."""

    def __init__(self, *, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.divisible: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
        self.never: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def divide(self, module: nn.Module, args: tuple) -> tuple[tuple, Share] | None:
        """This rank's rows of ``args`` for an evaluating call of ``module`` on a whole batch, or None (whole)."""
        if not KEYWORDS_SEEN or self.world_size == 1 or not self.divisible.get(module) or module in self.never:
            return None
        samples = rows_of(args)
        if samples is None or samples < self.world_size or _batch_norm_training(module):
            return None
        share = share_of(range(samples), self.rank, self.world_size)
        return rows_of_share(args, share), share

    def finish(self, call: Call, kwargs: dict, output):
        """The output of an evaluating call: learned from (a whole call), gathered (a divided one), or computed
        again whole (a divided call whose outputs are not batch-shaped: the model is not divided again)."""
        keywords = any(isinstance(value, torch.Tensor) for value in kwargs.values())
        if call.share is None:
            if call.module not in self.divisible:
                samples = rows_of(call.whole_args)
                self.divisible[call.module] = samples is not None and not keywords and batch_shaped(output, samples)
            return None
        rows = len(call.share.indices)
        if keywords or not batch_shaped(output, rows):
            self.never.add(call.module)
            return call.module(*call.whole_args, **kwargs)
        return gathered(output, sizes=share_sizes(call.share.samples, world_size=self.world_size), rank=self.rank,
                        rows=rows, with_gradients=False)


def rows_of(args: tuple) -> int | None:
    """The first dimension that every tensor argument shares (the batch's), or None (none, or different ones)."""
    sizes = {arg.shape[0] for arg in args if isinstance(arg, torch.Tensor) and arg.dim() > 0}
    return sizes.pop() if len(sizes) == 1 and not any(_holds_tensors(arg) for arg in args) else None


def _holds_tensors(arg) -> bool:
    """Whether ``arg`` is a container with tensors inside (which the division would not cut)."""
    if isinstance(arg, torch.Tensor):
        return False
    found = []
    map_tensors(arg, found.append)
    return bool(found)


def _batch_norm_training(module: nn.Module) -> bool:
    return any(isinstance(part, nn.modules.batchnorm._BatchNorm) and part.training for part in module.modules())
