"""Loaders for every rank: its share of the data, in the order ``ddpkit.data.sampler`` deals, on its device.

    loader = train_loader(dataset, batch_size=32, runtime=rt, seed=0)
    for epoch in range(3):
        for images, labels in loader:        # set_epoch is called for you
            ...

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

import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from ddpkit.core import progress, signals
from ddpkit.core.errors import UsageError
from ddpkit.core.process_group import Runtime, usable_cores
from ddpkit.data.evaluation import wait_until_only_python_holds
from ddpkit.data.sampler import ResumableSampler, eval_indices


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

    ``state_dict()`` is the position in the global sample order (epoch, samples consumed by all ranks),
    and ``load_state_dict()`` makes the next ``iter()`` continue from there: the resumed run sees
    exactly the batches the interrupted one had not reached, for any world size.

    ``accumulate``: batches per optimizer step; an epoch then ends at the last whole group of that many.
    """

    def __init__(self, loader: DataLoader, device: torch.device, sampler: DistributedSampler | None = None,
                 seed: int = 0, rank: int = 0, accumulate: int = 1, phase: str | None = None):
        if accumulate < 1:
            raise UsageError(f"accumulate must be at least 1, got {accumulate}")
        self.loader = loader
        self.accumulate = accumulate
        self.sampler = sampler
        self.device = device
        self.epoch = 0  # the epoch the next iter() runs
        self.seed = seed
        self.rank = rank
        self._start = 0  # global samples of that epoch to skip (a resumed position)
        self._running: tuple[int, int] | None = None  # (epoch, start) of the iteration in progress
        self._yielded = 0
        self._non_blocking = device.type == "cuda" and loader.pin_memory
        self.phase = phase  # the heartbeat's phase once a batch is handed over ("forward" for training)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._start = 0
        self.epoch = epoch

    @property
    def batch_samples(self) -> int:
        """Samples in one batch of every rank together."""
        replicas = self.sampler.num_replicas if self.sampler is not None else 1
        return (self.loader.batch_size or 1) * replicas

    @property
    def global_batch(self) -> int:
        """Samples of one optimizer step: every rank's batches of its ``accumulate`` micro-steps."""
        return self.batch_samples * self.accumulate

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in a whole epoch (whatever position the loader was told to resume from)."""
        start, self._start = self._start, 0
        try:
            return len(self) // self.accumulate
        finally:
            self._start = start

    def state_dict(self) -> dict[str, int]:
        """Where a resumed run should continue: mid-epoch while iterating, else the next epoch's start."""
        if self._running is not None:
            epoch, start = self._running
            return {"epoch": epoch, "samples": start + self._yielded * self.batch_samples, "seed": self.seed}
        return {"epoch": self.epoch, "samples": self._start, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self._start = int(state["samples"])
        self._running = None

    def __len__(self) -> int:
        self._position_sampler(self.epoch, self._start)
        batches = len(self.loader)
        return batches - batches % self.accumulate

    def _position_sampler(self, epoch: int, start: int) -> None:
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.start = start
        elif start and self.sampler is not None:
            raise ValueError("this loader's sampler cannot start part-way through an epoch")
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self.epoch, self._start
        self._position_sampler(epoch, start)
        # The loader draws its workers' seeds from this generator, not from the global RNG: a resumed
        # run's global RNG (dropout, augmentation) then continues exactly where it was saved.
        if self.loader.generator is not None:
            self.loader.generator.manual_seed(_epoch_seed(self.seed, self.rank, epoch))
        self.epoch, self._start = epoch + 1, 0
        self._running, self._yielded = (epoch, start), 0
        whole = len(self.loader) - len(self.loader) % self.accumulate
        for batch in itertools.islice(self.loader, whole):
            self._yielded += 1  # counted as handed over: a checkpoint taken now is past this batch
            if self.phase:
                progress.mark(self.phase)
            yield to_device(batch, self.device, self._non_blocking)
        self._running = None


def _epoch_seed(seed: int, rank: int, epoch: int) -> int:
    return (seed * 1_000_003 + rank * 7_919 + epoch) % (2**63)


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
    replica: tuple[int, int] | None = None,
    accumulate: int = 1,
) -> DeviceLoader:
    """Per-process batches of ``batch_size``; the global batch is ``batch_size`` x the ways the data is split
    (``world_size``, or the count in ``replica``).

    ``drop_last=False`` keeps every sample, at a price: DistributedSampler pads the epoch with up to
    world_size - 1 repeated samples, and the last batch is smaller, so the run no longer matches one
    process with the global batch exactly.
    ``replica=(index, count)``: split the data ``count`` ways and take part ``index`` instead of this
    rank's part of world_size (the stages of one pipeline all take the same part).
    ``accumulate``: micro-steps per optimizer step; each epoch ends at its last whole step.
    """
    if batch_size < 1:
        raise UsageError(f"`batch_size` must be at least 1, got {batch_size}")
    index, count = replica or (runtime.rank, runtime.world_size)
    global_batch = batch_size * count
    if drop_last and len(dataset) < global_batch:
        raise UsageError(
            f"the training set has {len(dataset)} samples, fewer than one global batch of {global_batch} "
            f"({batch_size} per process x {count} data-parallel processes); lower `batch_size`",
            said_elsewhere=not runtime.is_main,  # every rank finds it: rank 0 says it
        )
    sampler = ResumableSampler(
        dataset,
        num_replicas=count,
        rank=index,
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
        worker_init_fn=signals.ignore_stop_signals if workers > 0 else None,
        generator=torch.Generator(),
    )
    return DeviceLoader(loader, runtime.device, sampler, seed=seed, rank=index, accumulate=accumulate, phase="forward")


def eval_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    runtime: Runtime,
    workers: int | None = None,
    in_memory: bool | None = None,
    replica: tuple[int, int] | None = None,
) -> DeviceLoader:
    """Each validation sample goes to exactly one rank (some ranks may get one sample fewer).

    ``replica=(index, count)``: as in ``train_loader``, a part of ``count`` rather than of world_size.
    """
    shard = Subset(dataset, eval_indices(len(dataset), *(replica or (runtime.rank, runtime.world_size))))
    workers = default_workers(runtime, in_memory, dataset) if workers is None else workers
    loader = DataLoader(
        shard, batch_size=batch_size, shuffle=False, num_workers=workers, pin_memory=runtime.device.type == "cuda",
        worker_init_fn=signals.ignore_stop_signals if workers > 0 else None, generator=torch.Generator(),
    )
    return DeviceLoader(loader, runtime.device, rank=runtime.rank)


def check_equal_batches(loader, runtime: Runtime) -> int:
    """Every rank's number of batches, compared before the first step; UsageError when they differ.

        loader = DataLoader(my_shard, batch_size=32)        # a sharding of your own
        steps = ddpkit.check_equal_batches(loader, rt)      # every rank calls it

    With unequal counts the ranks with more batches reach an all-reduce the others never join, and wait
    for it until the collective timeout: a hang, not an error. ``train_loader`` always gives equal
    counts; loaders of your own should be checked, or the loop wrapped in PyTorch's
    ``torch.distributed.algorithms.Join([model])``, which lets finished ranks shadow the others.
    """
    count = len(loader)
    if runtime.backend is None or runtime.world_size == 1:
        return count
    # The training group: a rank stuck before it fails within --timeout.
    mine = torch.tensor([count], dtype=torch.int64, device=runtime.device)
    gathered = [torch.zeros_like(mine) for _ in range(runtime.world_size)]
    dist.all_gather(gathered, mine)
    wait_until_only_python_holds([mine, *gathered])
    counts = [int(tensor.item()) for tensor in gathered]
    if len(set(counts)) > 1:
        shown = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(counts[:8]))
        more = f" (and {len(counts) - 8} more ranks)" if len(counts) > 8 else ""
        raise UsageError(
            f"the ranks have unequal numbers of batches per epoch ({shown}{more}); the ranks with more would wait "
            "forever in their extra steps' all-reduce. Shard with ddpkit.train_loader or DistributedSampler "
            "(equal shares), or wrap the loop in torch.distributed.algorithms.Join([model])",
            said_elsewhere=not runtime.is_main,
        )
    return count
