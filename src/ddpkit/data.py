"""Distributed data loading: a sampler whose order is the same for every world size, and exact evaluation.

    >>> loader = train_loader(dataset, batch_size=32, runtime=rt, seed=0)   # doctest: +SKIP
    >>> for epoch in range(3):
    ...     for images, labels in loader:        # set_epoch is called for you
    ...         ...

Training order. ``DistributedSampler`` shuffles one permutation of the whole data set, seeded by
``seed + epoch`` only, and gives rank r every world_size-th index of it. So rank r's k-th batch of B
and the other ranks' k-th batches together are exactly the k-th chunk of N*B of that permutation:
N processes x batch B see the same global batches as 1 process x batch N*B. Training drops the last
incomplete *global* batch (``drop_last`` in both sampler and loader), so every step is full and the
step count is floor(len / (N*B)) whatever N is.

Evaluation. ``DistributedSampler`` pads the data with duplicates to a multiple of the world size;
those must not reach the metrics. ``eval_loader`` gives rank r the indices r, r+N, r+2N, ... with no
padding, and ``reduce_sums`` adds the per-rank sums, so every validation sample counts exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from ddpkit.errors import UsageError
from ddpkit.process_group import Runtime, usable_cores


def default_workers(runtime: Runtime, in_memory: bool | None, dataset: Dataset) -> int:
    """Loader worker processes per rank: none for tensors already in memory, else a share of the cores.

    ``in_memory=None`` decides by the data set's type: a TensorDataset needs no decoding workers.
    """
    if in_memory is None:
        in_memory = isinstance(dataset, TensorDataset)
    if in_memory:
        return 0
    return max(1, min(8, usable_cores() // max(1, runtime.env.local_world_size) - 1))


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(item, device, non_blocking) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device, non_blocking) for key, value in batch.items()}
    return batch


class DeviceLoader:
    """A DataLoader whose batches arrive on ``device`` (pinned memory and non-blocking copies on GPU).

    With a ``DistributedSampler`` it also calls ``set_epoch`` itself. Forgetting
    ``sampler.set_epoch(epoch)`` is the classic DDP bug: every epoch repeats the same order. Here each
    ``iter()`` starts the next epoch; ``set_epoch`` still sets it explicitly (for resuming).
    """

    def __init__(self, loader: DataLoader, device: torch.device, sampler: DistributedSampler | None = None):
        self.loader = loader
        self.sampler = sampler
        self.device = device
        self.epoch = 0
        self._non_blocking = device.type == "cuda" and loader.pin_memory

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        for batch in self.loader:
            yield to_device(batch, self.device, self._non_blocking)


def train_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    runtime: Runtime,
    seed: int = 0,
    shuffle: bool = True,
    workers: int | None = None,
    in_memory: bool | None = None,
    drop_last: bool = True,
) -> DeviceLoader:
    """Per-process batches of ``batch_size``; the global batch is ``batch_size * world_size``.

    ``drop_last=False`` keeps every sample, at a price: DistributedSampler pads the epoch with up to
    world_size - 1 repeated samples, and the last batch is smaller, so the run no longer matches one
    process with the global batch exactly.
    """
    if batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {batch_size}")
    global_batch = batch_size * runtime.world_size
    if drop_last and len(dataset) < global_batch:
        raise UsageError(
            f"the training set has {len(dataset)} samples, fewer than one global batch of {global_batch} "
            f"({batch_size} per process x {runtime.world_size} processes); lower --batch-size"
        )
    sampler = DistributedSampler(
        dataset,
        num_replicas=runtime.world_size,
        rank=runtime.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    workers = default_workers(runtime, in_memory, dataset) if workers is None else workers
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=workers,
        pin_memory=runtime.device.type == "cuda",
        persistent_workers=workers > 0,
    )
    return DeviceLoader(loader, runtime.device, sampler)


def eval_indices(length: int, rank: int, world_size: int) -> range:
    """This rank's share of a validation set: every world_size-th sample, no padding."""
    return range(rank, length, world_size)


def eval_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    runtime: Runtime,
    workers: int | None = None,
    in_memory: bool | None = None,
) -> DeviceLoader:
    """Each validation sample goes to exactly one rank (some ranks may get one sample fewer)."""
    shard = Subset(dataset, eval_indices(len(dataset), runtime.rank, runtime.world_size))
    workers = default_workers(runtime, in_memory, dataset) if workers is None else workers
    loader = DataLoader(
        shard, batch_size=batch_size, shuffle=False, num_workers=workers, pin_memory=runtime.device.type == "cuda"
    )
    return DeviceLoader(loader, runtime.device)


def reduce_sums(values: list[float], runtime: Runtime) -> list[float]:
    """Add each value over all ranks (one all-reduce, float64 so counts stay exact)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if runtime.backend is not None:
        if runtime.backend == "nccl":
            tensor = tensor.to(runtime.device)
        dist.all_reduce(tensor)
    return tensor.cpu().tolist()
