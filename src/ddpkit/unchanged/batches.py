"""The script's DataLoaders, each batch split across the ranks (``ddpkit run --unchanged``).

A loader is taken over when it is first iterated (``DataLoader.__iter__``: no hook exists where a loader hands out
its batches): its batch sampler is wrapped in a ``SplitBatchSampler``, so each rank fetches only its share of every
batch, and ``len(loader)``, the batch size, the collate_fn and the workers stay as the script set them.

Each pass over a loader is one of two kinds, decided when it starts:

- **training** (gradients on, and not every model seen so far in eval mode): each batch split; the weight of this
  rank's gradient (``Batch``) follows the batches as the loader hands them out;
- **evaluation** (under ``torch.no_grad()``/``inference_mode()``, or every model in eval mode): every rank reads
  the whole batches, as one process does, so that the script's own sums and counts are those of one process.

A loader of an ``IterableDataset``, or one without a batch sampler (``batch_size=None``), is left as it is: its
batches are split where they enter the model, as when a script cuts its batches by hand (``unchanged.models``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from ddpkit.data.split_batches import SharedStream, SplitBatchSampler
from ddpkit.unchanged.randomness import Streams, derived_seed


@dataclasses.dataclass
class Batch:
    """The batch this rank trains on now: the weight of its gradient and, for a loss summed over the batch, the factor
    that makes its share's sum count as the batch's (``unchanged.models``)."""

    world_size: int
    summed: bool = False  # the script's loss is a sum over its batch (``--loss-reduction sum``)
    weight: float = 1.0
    whole: bool = True  # every rank has the whole batch (nothing split it)
    loader_passes: int = 0  # split loaders' training passes going on: their batches are split, not at the models

    def __post_init__(self) -> None:
        self.weight = 1.0 / self.world_size

    def set(self, weight: float, *, whole: bool = False) -> None:
        self.weight = weight
        self.whole = whole

    def set_whole(self) -> None:
        """Every rank has the whole batch: the same gradient on each, averaged."""
        self.set(1.0 / self.world_size, whole=True)

    def current_weight(self) -> float:
        return self.weight

    def output_scale(self) -> float:
        """What a model's outputs' gradient is multiplied by: for a loss summed over a share, the batch's size over
        the share's, so that the share's sum counts as the whole batch's would (a stand-in counts 0 anyway)."""
        return 1.0 / self.weight if self.summed and not self.whole and self.weight > 0 else 1.0


class Loaders:
    """Takes over the script's DataLoaders as they are iterated (``install``)."""

    def __init__(self, *, rank: int, world_size: int, batch: Batch, streams: Streams,
                 all_models_evaluating: Callable[[], bool]):
        self.rank = rank
        self.world_size = world_size
        self.batch = batch
        self.streams = streams
        self.all_models_evaluating = all_models_evaluating
        self._numbers = itertools.count()
        self._original_iter: Callable | None = None

    def install(self) -> None:
        self._original_iter = DataLoader.__iter__
        loaders = self

        def __iter__(loader: DataLoader):
            return loaders.iterate(loader)

        DataLoader.__iter__ = __iter__

    def iterate(self, loader: DataLoader):
        sampler = self.split_sampler(loader)
        if sampler is None:
            return self._original_iter(loader)
        training = torch.is_grad_enabled() and not self.all_models_evaluating()
        sampler.whole = not training
        sampler.shares.clear()
        return self.follow(loader, sampler) if training else self._original_iter(loader)

    def follow(self, loader: DataLoader, sampler: SplitBatchSampler) -> Iterator:
        """A training pass over ``loader``: its batches, this rank's weight set to each one's as it is handed out, and
        this rank's own random streams from its start (before the loader draws its workers' seeds) to its end."""
        self.batch.loader_passes += 1
        self.streams.enter_pass()
        try:
            for batch in self._original_iter(loader):
                self.batch.set(sampler.shares.popleft().weight)
                yield batch
        finally:
            self.batch.loader_passes -= 1
            self.streams.leave_pass()

    def split_sampler(self, loader: DataLoader) -> SplitBatchSampler | None:
        """The loader's SplitBatchSampler, put in place at its first pass; None for a loader whose batches it
        cannot split by index."""
        current = loader.batch_sampler
        if isinstance(current, SplitBatchSampler):
            return current
        if current is None or isinstance(loader.dataset, IterableDataset):
            return None
        stream = SharedStream(derived_seed(self.streams.seed, "loader", next(self._numbers)))
        split = SplitBatchSampler(current, rank=self.rank, world_size=self.world_size, stream=stream)
        # DataLoader refuses a new batch_sampler once built (its __setattr__); its _index_sampler reads this one.
        loader.__dict__["batch_sampler"] = split
        return split
