"""The order of samples: the same for every world size, and resumable part-way through an epoch.

``DistributedSampler`` shuffles one permutation of the whole data set, seeded by ``seed + epoch`` only, and
gives rank r every world_size-th index of it. So rank r's k-th batch of B and the other ranks' k-th batches
together are exactly the k-th chunk of N*B of that permutation: N processes x batch B see the same global
batches as 1 process x batch N*B. ``ResumableSampler`` can also start after the first ``start`` samples of
that order, for any world size. Validation (``eval_indices``) gives each sample to exactly one rank, with no
padding.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start an epoch part-way, after ``start`` samples of the global order.

    Resuming after k optimizer steps of a global batch G means skipping the first k*G samples of the
    epoch's permutation (the one DistributedSampler draws from ``seed + epoch``), then dealing the rest
    to the ranks as usual. Because the skip is counted in global samples, the world size may change on
    resume: the remaining samples are simply dealt to the new number of ranks.
    """

    def __init__(self, *args, keyed: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0
        self.keyed = keyed  # yield (epoch, index): for data sets whose augmentation is the sample's own per epoch

    def _remaining(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        else:
            order = list(range(len(self.dataset)))  # type: ignore[arg-type]
        # The whole epoch as DistributedSampler deals it (cut, or padded from its start), then the rest.
        if self.drop_last:
            order = order[: self.total_size]
        else:
            order = (order * math.ceil(self.total_size / max(len(order), 1)))[: self.total_size]
        rest = order[self.start:]
        # After a change of world size the rest may not split evenly: every rank must get as many.
        usable = len(rest) // self.num_replicas * self.num_replicas
        if self.drop_last or usable == len(rest):
            return rest[:usable]
        padding = self.num_replicas - (len(rest) - usable)
        return rest + (rest * math.ceil(padding / len(rest)))[:padding]

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int]]:
        indices = super().__iter__() if self.start == 0 else iter(self._remaining()[self.rank::self.num_replicas])
        if self.keyed:
            epoch = self.epoch
            return ((epoch, index) for index in indices)
        return indices

    def __len__(self) -> int:
        if self.start == 0:
            return super().__len__()
        return len(self._remaining()) // self.num_replicas


def eval_indices(length: int, rank: int, world_size: int) -> range:
    """This rank's share of a validation set: every world_size-th sample, no padding."""
    return range(rank, length, world_size)
