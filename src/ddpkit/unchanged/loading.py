"""How a loader on the gathered way reads its batches (``ddpkit run --unchanged``): every rank holds each whole batch,
and reads it whole, or reads only its share and gathers the collated shares from the others.

Gathering is one device's batch only where the loader collates by rows: where the collated batch is its samples'
collated rows put one after the other (``default_collate`` of tensors and numbers). A collate function that pads to
the batch's longest sample, builds a graph's batch (offsets into the whole), counts its samples or keeps strings does
not, and is read whole. It is shown, not guessed: ``collates_by_rows`` reads one batch's samples in a child process
forked from this one (``apart``) and collates them whole and one by one (once per loader, where its training step
showed the gathered way). A later batch whose shares cannot be put together (a shape that differs across the ranks) is
read whole apart as well, from a state of the random streams that is the same on every rank, and that loader is read
whole from its next pass.

Each rank reads its share only where its loader reads in worker processes (the script's author took reading off the
step: decoding, augmenting), whose seeds each rank draws from its own streams (persistent workers started again,
``batches.Loaders``; not a generator of the loader's own, whose seeds would be the same on every rank, nor a
``worker_init_fn``, which may seed them alike: two shares' samples would draw alike). A share's random augmentations
are then this rank's, as on the split way; read whole, they are one device's draws.
Gathering costs the step collectives over the control group (gloo, on the CPU, where the batch is), moving (N-1)/N of
the batch's bytes into each rank; reading whole costs each rank N times the reading (``benchmarks/gathered_batch.py``).
"""

from __future__ import annotations

import multiprocessing
import pickle
import zlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, default_collate

from ddpkit.data.split_batches import global_random_states, seed_global_random_states, set_global_random_states


def samples(loader: DataLoader, indices: list) -> list:
    """The samples of ``indices`` in ``loader``'s dataset, read in this process as its fetcher reads them (a
    dataset's ``__getitems__`` where it has one)."""
    many = getattr(loader.dataset, "__getitems__", None)
    return many(indices) if many is not None else [loader.dataset[index] for index in indices]


def apart(function, *args):
    """``function(*args)`` computed in a child process forked from this one, where this platform forks (else here):
    the dataset's reads leave this process as it was, so that no file that a dataset opens as it reads (an HDF5 file,
    an LMDB environment) is then shared with the loader's workers, forked after it, nor any state it keeps. What the
    function raises is raised here."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return function(*args)
    context = multiprocessing.get_context("fork")
    reading, writing = context.Pipe(duplex=False)
    child = context.Process(target=_answer, args=(writing, function, args))
    child.start()
    writing.close()
    try:
        raised, value = pickle.loads(reading.recv_bytes())  # (by value: torch's own pickling shares file descriptors)
    except EOFError:  # (it ended without an answer: killed, or what it had to send could not be pickled)
        raised, value = True, None
    finally:
        reading.close()
        child.join()
    if raised:
        raise value or NotReadApart(f"the process that read a loader's samples apart ended without an answer (exit "
                                    f"code {child.exitcode})")
    return value


class NotReadApart(RuntimeError):
    """``apart``'s child process ended without an answer."""


def _answer(writing, function, args) -> None:
    try:
        answer = (False, function(*args))
    except Exception as error:  # (given to the parent, which raises it)
        answer = (True, error)
    try:
        sent = pickle.dumps(answer)
    except Exception as error:  # (what cannot be pickled: the parent is told so)
        sent = pickle.dumps((True, NotReadApart(f"what the process that read a loader's samples apart found cannot be "
                                                f"sent back ({type(error).__name__}: {error})")))
    writing.send_bytes(sent)
    writing.close()


def whole_here(loader: DataLoader, indices: list, seed: int):
    """The batch of ``indices``, read and collated apart from this process (``apart``), its random draws from a state
    seeded with ``seed`` (the same batch on every rank that gives the same seed); pinned where the loader pins."""
    batch = apart(_whole, loader, indices, seed)
    if loader.pin_memory and torch.cuda.is_available():
        batch = pytree.tree_map(lambda leaf: leaf.pin_memory() if isinstance(leaf, torch.Tensor) else leaf, batch)
    return batch


def _whole(loader: DataLoader, indices: list, seed: int):
    saved = global_random_states()
    seed_global_random_states(seed)
    try:
        return loader.collate_fn(samples(loader, indices))
    finally:
        set_global_random_states(saved)


def tensors_of_rows(batch, rows: int) -> tuple[list[torch.Tensor], pytree.TreeSpec] | None:
    """``batch``'s tensors and its structure, where each is a CPU tensor of ``rows`` rows (its first dimension) and
    nothing else is in it; else None."""
    leaves, spec = pytree.tree_flatten(batch)
    if not leaves or not all(isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.size(0) == rows
                             and leaf.device.type == "cpu" for leaf in leaves):
        return None
    return leaves, spec


IN_THE_MAIN_PROCESS = "it reads its samples in the main process"


def whole_reading(loader: DataLoader) -> str | None:
    """Why ``loader``'s batches are read whole by every rank on the gathered way, whatever it collates; None where each
    rank may read its share (see the module)."""
    if loader.num_workers == 0:
        return IN_THE_MAIN_PROCESS
    if loader.generator is not None:
        return "it draws its workers' seeds from a generator of its own, the same on every process"
    if getattr(loader, "in_order", True) is False:  # (torch 2.6 and later)
        return "it hands out its batches as its workers finish them (in_order=False), not in its sampler's order"
    if loader.worker_init_fn is not None:
        return "its workers run a function of the script's as they start (worker_init_fn), which may seed them alike"
    return None


def collates_by_rows(loader: DataLoader, indices: list) -> str | None:
    """Why ``loader`` does not collate by rows, or None where it does: torch's ``default_collate`` does; another
    collate function where its samples of ``indices``, read apart from this process (``apart``), collated whole hold at
    each row what each collated alone holds (``rows_cut``: tensors of a row per sample, and lists of a plain value per
    sample, a path or an id)."""
    if loader.collate_fn is default_collate:  # (torch's own stacks each field's rows, and raises where they differ:
        return None  # nothing to read)
    try:
        return apart(_collates_by_rows, loader, indices)
    except NotReadApart as error:  # (the decision: read whole by its workers)
        return str(error)


def _collates_by_rows(loader: DataLoader, indices: list) -> str | None:
    saved = global_random_states()
    try:
        read = samples(loader, indices)
        whole = loader.collate_fn(read)
        ones = [loader.collate_fn([sample]) for sample in read]
    except Exception as error:  # (the decision: a dataset that cannot be read here is read whole by its workers)
        return f"its samples cannot be read and collated in the main process ({type(error).__name__}: {error})"
    finally:
        set_global_random_states(saved)
    if rows_cut(whole, len(read), 0, len(read)) is None:
        return "its batches are not rows of one per sample (tensors, and lists of a plain value each)"
    for row, one in enumerate(ones):
        if not _equal(rows_cut(whole, len(read), row, row + 1), one):
            return "its collate function does not put its samples' rows one after the other (padding?)"
    return None


def _equal(one, other) -> bool:
    """Whether two collated batches hold the same: tensors of one dtype and shape with the same values, and the rest
    equal, in the same structure."""
    if isinstance(one, torch.Tensor) or isinstance(other, torch.Tensor):
        return isinstance(one, torch.Tensor) and isinstance(other, torch.Tensor) and one.dtype == other.dtype \
            and one.shape == other.shape and torch.equal(one, other)
    if isinstance(one, Mapping) and isinstance(other, Mapping):
        return list(one) == list(other) and all(_equal(one[key], other[key]) for key in one)
    if isinstance(one, (list, tuple)) and isinstance(other, (list, tuple)):
        return type(one) is type(other) and len(one) == len(other) and all(map(_equal, one, other))
    return type(one) is type(other) and one == other


def rows_cut(batch, rows: int, start: int, stop: int):
    """``batch`` (collated whole, of ``rows`` rows) cut to its rows ``start:stop``: each tensor of ``rows`` rows, and
    each list or tuple of ``rows`` plain values (a sample's id, its text), inside dicts, lists and tuples; a share with
    the whole batch's padding, as one device collates it. None where the batch holds anything else (a tensor of
    another first dimension, an object of a kind not read here), or no tensor of rows."""
    found = []
    try:
        cut = _rows_cut(batch, rows, slice(start, stop), found)
    except _NotRows:
        return None
    return cut if found else None


class _NotRows(Exception):
    """A part of a batch that is not a row per sample."""


PLAIN = (str, bytes, int, float, bool, type(None))


def _rows_cut(value, rows: int, rows_kept: slice, found: list):
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.size(0) != rows:
            raise _NotRows
        found.append(value)
        return value[rows_kept]
    if isinstance(value, Mapping):
        return _rebuilt(type(value), {key: _rows_cut(item, rows, rows_kept, found) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(item, PLAIN) for item in value):
            if len(value) != rows:
                raise _NotRows
            return value[rows_kept]
        items = [_rows_cut(item, rows, rows_kept, found) for item in value]
        return _rebuilt(type(value), *items) if hasattr(value, "_fields") else _rebuilt(type(value), items)
    raise _NotRows


def _rebuilt(kind: type, *items):
    """A container of ``kind`` made of ``items`` as its own constructor takes them (a dict's class from a dict, a
    named tuple's from its fields); one whose constructor does not is not read here."""
    try:
        return kind(*items)
    except TypeError as error:  # (a container of a library's own, made otherwise: its batch is collated by shares)
        raise _NotRows from error


def _mark(described) -> int:
    """A number for a batch's structure, its tensors' types and their shapes but the rows: equal on the ranks whose
    shares can be put together; -1 for a batch that cannot."""
    if described is None:
        return -1
    leaves, spec = described
    text = repr((str(spec), [(str(leaf.dtype), tuple(leaf.shape[1:])) for leaf in leaves]))
    return zlib.crc32(text.encode())


def gathered_rows(batch, *, sizes: list[int], rank: int, group=None):
    """The whole batch from each rank's collated share (``sizes``: the shares' rows, 0 for a stand-in, which reads one
    row and gives none), on every rank; None where the shares cannot be put together (told the same on every rank).
    Over ``group``: one all-reduce compares the shares' structure, then each rank broadcasts its rows of each tensor
    into the whole one's (gloo's broadcasts move a batch about three times as fast as its all-gather), as bytes."""
    described = tensors_of_rows(batch, max(sizes[rank], 1))
    mark = _mark(described)
    marks = torch.tensor([mark, -mark], dtype=torch.int64)
    dist.all_reduce(marks, op=dist.ReduceOp.MAX, group=group)
    if mark < 0 or int(marks[0]) != -int(marks[1]):
        return None
    leaves, spec = described
    starts = [sum(sizes[:each]) for each in range(len(sizes))]
    out = []
    for leaf in leaves:
        whole = torch.empty((sum(sizes), *leaf.shape[1:]), dtype=leaf.dtype, pin_memory=leaf.is_pinned())
        whole[starts[rank]:starts[rank] + sizes[rank]] = leaf[:sizes[rank]]
        for source, (start, size) in enumerate(zip(starts, sizes)):
            if size:
                dist.broadcast(whole[start:start + size].view(-1).view(torch.uint8), src=source, group=group)
        out.append(whole)
    return pytree.tree_unflatten(out, spec)
