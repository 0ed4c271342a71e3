"""Each process's part of every batch that a script's own DataLoader makes (``ddpkit run --unchanged``).

    >>> share_of([10, 11, 12, 13, 14], rank=1, world_size=2)
    Share(indices=[13, 14], weight=0.4, samples=5)
    >>> share_of([7], rank=1, world_size=2)         # fewer samples than processes: a stand-in, weighed 0
    Share(indices=[7], weight=0.0, samples=1)

A batch of n indices is cut into world_size contiguous runs, the first ``n % world_size`` one longer (as
``torch.tensor_split`` and DataParallel's scatter cut it). A rank's gradient counts ``weight`` = its samples / n of
the batch's: for a loss averaged over the batch, the sum over ranks of weight × the rank's gradient is the gradient
of the whole batch, an uneven last batch included. A rank left with no sample (a batch smaller than the world) reads
the batch's last sample as a stand-in, so that its forward and backward run like the others', and weighs 0.

``SplitBatchSampler`` wraps the loader's own batch sampler: the loader, its ``len``, its collate_fn and workers stay
as they were; each rank fetches only its indices. The order comes from the wrapped sampler, drawn inside a
``SharedStream``: ddpkit's random state, the same on every rank, never the script's global one (whose draws differ
across ranks once training begins: ``ddpkit.unchanged``).
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Iterable, Iterator, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Share:
    """One rank's part of one batch: the indices it reads and the weight of its gradient."""

    indices: list
    weight: float  # this rank's samples / the batch's (0 for a stand-in)
    samples: int  # the whole batch's size, as one process reads it
    whole: bool = dataclasses.field(default=False, repr=False)  # not split: every rank reads the whole batch
    batch: tuple = dataclasses.field(default=(), repr=False)  # the whole batch's indices
    # The whole batch read and collated, and this share's rows cut from it (``SplitBatchSampler.cut``).
    cut: bool = dataclasses.field(default=False, repr=False)


def share_of(batch: Sequence, rank: int, world_size: int) -> Share:
    """Rank ``rank``'s contiguous run of ``batch``, of ``world_size`` runs; a stand-in of weight 0 when none is left."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    samples = len(batch)
    if samples == 0:
        raise ValueError("a batch sampler yielded an empty batch: there is nothing to split")
    counts = share_sizes(samples, world_size=world_size)
    if counts[rank] == 0:
        return Share(indices=[batch[-1]], weight=0.0, samples=samples, batch=tuple(batch))
    start = sum(counts[:rank])
    return Share(indices=list(batch[start:start + counts[rank]]), weight=counts[rank] / samples, samples=samples,
                 batch=tuple(batch))


def share_sizes(samples: int, *, world_size: int) -> list[int]:
    """How many of ``samples`` each rank's share holds (0: that rank reads a stand-in).

        >>> share_sizes(5, world_size=2), share_sizes(1, world_size=2)
        ([3, 2], [1, 0])
    """
    base, longer = divmod(samples, world_size)
    return [base + (rank < longer) for rank in range(world_size)]


def fewest_share_rows(batches, world_size: int) -> int | None:
    """The rows of the smallest share that a batch of ``batches`` (a loader's batch sampler) can give: of torch's
    ``BatchSampler``, its batch size and, without ``drop_last``, the last batch's (what is left); None for another
    kind of batch sampler, whose batches' sizes are not known ahead.

        >>> from torch.utils.data import BatchSampler, SequentialSampler
        >>> fewest_share_rows(BatchSampler(SequentialSampler(range(50)), 8, drop_last=False), 2)  # the last: 2
        1
        >>> fewest_share_rows(BatchSampler(SequentialSampler(range(50)), 8, drop_last=True), 2)
        4
    """
    from torch.utils.data import BatchSampler

    if type(batches) is not BatchSampler or batches.batch_size is None:
        return None
    try:
        total = len(batches.sampler)
    except TypeError:  # a sampler of no length
        return None
    sizes = [batches.batch_size] if total >= batches.batch_size else []
    if total % batches.batch_size and not batches.drop_last:
        sizes.append(total % batches.batch_size)
    return min(sizes) // world_size if sizes else None


def rows_of_share(args: tuple, share: Share) -> tuple:
    """``args`` (a model's positional arguments) cut to ``share``'s rows: each tensor along its first dimension (a
    share is a contiguous run); anything else as it is."""
    rows = slice(share.indices[0], share.indices[-1] + 1)
    return tuple(arg[rows] if isinstance(arg, torch.Tensor) and arg.dim() > 0 else arg for arg in args)


class SharedStream:
    """A random state of ddpkit's, the same on every rank, put in place of the global one (torch's CPU generator,
    Python's ``random``, NumPy's) for the time of a ``with`` block, and kept for the next block.

    A sampler that draws from the global stream (``RandomSampler`` without a generator, a custom one) then draws the
    same order on every rank, whatever the script's own draws did to the global streams meanwhile.
    """

    def __init__(self, seed: int):
        previous = global_random_states(gpus=False)
        seed_global_random_states(seed, gpus=False)  # the CPU's alone: the GPUs' streams are not the sampler's
        self._states = global_random_states(gpus=False)
        self._saved: list = []
        set_global_random_states(previous)

    def __enter__(self) -> SharedStream:
        self._saved.append(global_random_states(gpus=False))
        set_global_random_states(self._states)
        return self

    def __exit__(self, *exc) -> None:
        self._states = global_random_states(gpus=False)
        set_global_random_states(self._saved.pop())


def global_random_states(*, torch_only: bool = False, gpus: bool = True) -> tuple:
    """The global random states: torch's CPU generator, the GPUs' (where CUDA has started, and ``gpus``), and, unless
    ``torch_only``, Python's ``random`` and NumPy's (where NumPy is installed); None for those left out."""
    cuda = torch.cuda.get_rng_state_all() if gpus and torch.cuda.is_initialized() else None
    if torch_only:
        return torch.get_rng_state(), cuda, None, None
    numpy = _numpy()
    return torch.get_rng_state(), cuda, random.getstate(), None if numpy is None else numpy.random.get_state()


def seed_global_random_states(seed: int, *, gpus: bool = True) -> None:
    """Seed the global random states with ``seed``, as a script's own seeding would: torch's CPU generator (and every
    GPU's, with ``gpus``), Python's ``random`` and NumPy's (where NumPy is installed)."""
    if gpus:
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def set_global_random_states(states: tuple) -> None:
    """Put back what ``global_random_states`` returned."""
    cpu, cuda, python, numpy_state = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    if python is not None:
        random.setstate(python)
    if numpy_state is not None:
        _numpy().random.set_state(numpy_state)


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class SplitBatchSampler:
    """The batches of ``batches`` (a loader's batch sampler), each cut to this rank's share; while ``whole`` is set
    (it is read at each batch), the whole batches instead (an evaluation, which every rank computes in full). Each
    share yielded is also queued in ``shares``, for whoever follows the batches the loader hands out (with workers,
    the sampler runs ahead). While ``cut`` is set (a loader whose collate function does not put its samples' rows
    one after the other: padding to the batch's longest), the whole batch's indices are yielded for each share, which
    whoever follows the batches cuts from the collated batch (``unchanged.loading.rows_cut``)."""

    def __init__(self, batches: Iterable, *, rank: int, world_size: int, stream: SharedStream):
        self.batches = batches
        self.rank = rank
        self.world_size = world_size
        self.stream = stream
        self.whole = False
        self.cut = False
        self.shares: collections.deque[Share] = collections.deque()

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list]:
        iterator = None
        while True:
            with self.stream:
                if iterator is None:
                    iterator = iter(self.batches)
                batch = next(iterator, None)
            if batch is None:
                return
            batch = batch.tolist() if isinstance(batch, torch.Tensor) else list(batch)
            share = Share(batch, 1.0, len(batch), whole=True, batch=tuple(batch)) if self.whole else \
                share_of(batch, self.rank, self.world_size)
            if self.cut and not share.whole:
                share = dataclasses.replace(share, cut=True)
            self.shares.append(share)
            yield list(share.batch) if share.cut else share.indices
