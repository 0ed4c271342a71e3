"""The script's DataLoaders, each batch split across the ranks (``ddpkit run --unchanged``).

A loader is taken over when it is first iterated (``DataLoader.__iter__``: no hook exists where a loader hands out
its batches): its batch sampler is wrapped in a ``SplitBatchSampler``, so each rank fetches only its share of every
batch, and ``len(loader)``, the batch size, the collate_fn and the workers stay as the script set them.

Each pass over a loader is one of two kinds, decided from what the script does with its batches, never guessed at its
start (``Pass``; docs/unchanged.md, "Training or evaluation: the rule"):

- until the pass shows what it is, every rank reads the whole batches, and a training step on such a batch computes
  the whole batch's gradient on every rank (the same on each, averaged): exact, at N times the work;
- **training**, once one of the script's models is called in training mode with gradients on during the pass: the
  batches drawn from then on are split; the weight of this rank's gradient (``Batch``) follows the batches as the
  loader hands them out;
- **evaluation**, once a batch was handed out, a model called on it, and none of those calls trained (gradients off,
  whatever the switch: ``no_grad``, ``inference_mode``, ``set_grad_enabled(False)`` inside a step function; or the
  model in eval mode): every rank reads the whole batches to the end, as one process does, so that the script's own
  sums and counts are those of one process.

A wrapper that fetches a loader's batches ahead of the step (timm's ``PrefetchLoader``, a prefetching thread) hands
the model a batch other than the one handed out last, and the pass's last batch after the pass has ended: there is
no following each batch to its model. Where a training pass's first training call finds more than one batch handed
out on any rank (one all-reduce a pass), the loader is read whole by every rank from then on, every pass, and each
batch is cut where it enters the model (exact; the reading is every rank's); such a pass, its loader done, stays the
current one until another pass begins, for the last batch that the wrapper still holds: ``Pass.ahead``.

A training pass's batches are split only where the script's step is proven exact on shares (``step_rule``): a
loader's first training step is taken whole, cut at the model, and watched; where the step is not proven (a loss that
couples the rows, a sum, the batch's size read, a draw of the loop's), the loader's batches are read whole and cut at
the models from then on, as a fetched-ahead loader's (``Pass.ahead``, the gathered way), and the loop's draws are
then the shared streams' (each rank holds the whole batch, and draws for it as one device does). Decided again at
each training pass's first step while the loader is split (a gathered loader stays so), the same on every rank (one
all-reduce); said once.

On the gathered way, from such a loader's next pass, each rank reads only its share of each batch and the collated
shares are put together into the whole batch on every rank, where its workers' seeds can be each rank's own and it
collates by rows (``loading``; ``Pass.shares_gathered``): the batch handed out is the whole one, read once.

A loader whose batches cannot be split by index, a stream's (an ``IterableDataset``) or one without a batch sampler
(``batch_size=None``), is followed the same way, its batches whole on every rank: every rank reads the stream in the
same order, and a model called to train on one of its batches computes this rank's share of it, its outputs gathered
(``unchanged.models``): the stream's order, its epochs and its last short batch stay one device's. A stream that splits
itself by process (its first batch differs across the ranks: it reads the rank) is left as it is, said once: each
rank trains on its own batches, averaged as under DDP (``Pass.own_batches``).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from ddpkit.core.logs import logger
from ddpkit.data.split_batches import Share, SharedStream, SplitBatchSampler, fewest_share_rows, share_sizes
from ddpkit.unchanged import loading
from ddpkit.unchanged.randomness import Streams, derived_seed
from ddpkit.unchanged.step_rule import StepWatch


@dataclasses.dataclass
class Batch:
    """The batch this rank trains on now: the weight of its gradient and, for a loss summed over the batch, the factor
    that makes its share's sum count as the batch's (``unchanged.models``)."""

    world_size: int
    summed: bool = False  # the script's loss is a sum over its batch (``--loss-reduction sum``)
    coupled: bool = False  # the loss couples the batch (``--loss-reduction coupled``): split at the models alone
    weight: float = 1.0
    whole: bool = True  # every rank has the whole batch (nothing split it)
    loader_passes: int = 0  # split loaders' passes going on: they set the batch, which the models do not split
    gathered: bool = False  # a model's outputs on this batch were gathered from its shares (``unchanged.models``)
    own_batches: bool = False  # each rank's batch is its own (a stream that splits itself): DDP's average, no split
    stream: bool = False  # the batch comes from a loader whose batches cannot be split by index (a stream's)
    gathered_way: bool = False  # its loader takes the gathered way: whole batches, cut at the models (``step_rule``)
    loader_share: bool = False  # this rank holds its loader's share of the batch (a cut at a model leaves it as it is)
    checking: bool = False  # a loss computed both ways, on a share, gradients off (``at_the_model.check_both_ways``)
    # The rows of the smallest share of the batch split now (None: not split): under 2, a share's one-element output
    # may be its row of a per-row output, not a loss (``at_the_model.is_a_loss``).
    fewest_rows: int | None = None
    # Losses whose value is the whole batch's already (``counted``): a model that returns one needs no more. (By
    # identity: a tensor's ``==`` is elementwise.)
    _valued_whole: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.weight = 1.0 / self.world_size

    def set(self, weight: float, *, whole: bool = False, gathered: bool = False, samples: int | None = None) -> None:
        """This rank's ``weight`` in a batch of ``samples`` rows in all (None: unknown, or not split)."""
        self.weight = weight
        self.whole = whole
        self.gathered = gathered
        self.own_batches = False
        self.fewest_rows = None if whole or samples is None else samples // self.world_size

    def set_whole(self) -> None:
        """Every rank has the whole batch: the same gradient on each, averaged."""
        self.set(1.0 / self.world_size, whole=True)

    def valued_whole(self, loss) -> None:
        """``loss``'s value is the whole batch's already."""
        key = id(loss)
        self._valued_whole[key] = weakref.ref(loss, lambda _: self._valued_whole.pop(key, None))

    def is_valued_whole(self, loss) -> bool:
        held = self._valued_whole.get(id(loss))
        return held is not None and held() is loss

    def current_weight(self) -> float:
        return self.weight

    def is_whole(self) -> bool:
        return self.whole

    def output_scale(self) -> float:
        """What a model's outputs' gradient is multiplied by: for a loss summed over a share, the batch's size over
        the share's, so that the share's sum counts as the whole batch's would (a stand-in counts 0 anyway)."""
        return 1.0 / self.weight if self.summed and not self.whole and self.weight > 0 else 1.0


@dataclasses.dataclass
class Pass:
    """One pass over a split loader, and what its batches showed so far."""

    sampler: SplitBatchSampler | None  # None: a loader whose batches cannot be split by index (a stream's)
    training: bool = False  # a model trained on one of its batches: its batches are split from then on (else whole)
    share: Share | None = None  # the batch last handed out
    trained: bool = False  # what the calls on that batch did
    evaluated: bool = False
    own_streams: bool = False  # this rank's own random streams (``Streams.enter_pass``) are on for this pass
    own_batches: bool | None = None  # a stream's pass: whether each rank's batches are its own (None: not seen yet)
    handed_out: int = 0  # batches handed out since the last training call (before the first: since the pass began)
    ahead: bool = False  # the gathered way: all its batches whole, cut at the models (fetched ahead, or not proven)
    watch: StepWatch | None = None  # what the script does with the batch handed out last (``step_rule``)
    evaluating: bool = False  # a batch was evaluated and none trained: not watched from then on
    watched: bool = False  # its first training step was watched, and the loader's way decided from it
    drained: bool = False  # its loader has no more, but a batch it handed out may still be on its way to a model
    loader: DataLoader | None = None
    shares_gathered: bool = False  # the gathered way, each rank reading its share, the collated shares gathered
    workers_alike: bool = False  # its loader's persistent workers start again, their seeds the same on every rank
    cuttable: bool = False  # its first batch (whole) holds only rows, one per sample (``loading.rows_cut``)
    tensors_only: bool = False  # and only tensors (``loading.tensors_of_rows``: shares that can be put together)
    own_workers: bool = False  # its loader's workers draw their seeds from this rank's own streams (its last pass
    # trained on shares: so will this one, once its first step shows it)


class Loaders:
    """Takes over the script's DataLoaders as they are iterated (``install``), and follows each pass."""

    def __init__(self, *, rank: int, world_size: int, batch: Batch, streams: Streams,
                 the_same_everywhere: Callable[[object], bool] = lambda batch: True,
                 most_anywhere: Callable[[int], int] = lambda number: number, group=None):
        self.rank = rank
        self.group = group  # the gloo group that gathers the collated shares of a loader's batches (``loading``)
        self.the_same_everywhere = the_same_everywhere  # whether a batch is the same on every rank (a collective)
        self.most_anywhere = most_anywhere  # a number's largest value over the ranks (a collective)
        self.world_size = world_size
        self.batch = batch
        self.streams = streams
        self._numbers = itertools.count()
        self._original_iter: Callable | None = None
        self._passes: list[Pass] = []  # the passes going on, the one that handed out a batch last at the end
        self._trained_before: weakref.WeakSet[SplitBatchSampler] = weakref.WeakSet()  # their last pass trained
        self._fetched_ahead: weakref.WeakSet[SplitBatchSampler] = weakref.WeakSet()  # read whole, cut at the models
        # Whether each loader's training steps take the gathered way (True) or the split way (False): ``step_rule``.
        self._gathered: weakref.WeakKeyDictionary[SplitBatchSampler, bool] = weakref.WeakKeyDictionary()
        # Whether such a loader's ranks each read their share and gather the collated shares (True), or read whole.
        self._shares_gathered: weakref.WeakKeyDictionary[SplitBatchSampler, bool] = weakref.WeakKeyDictionary()
        # Why each loader does not collate by rows (None where it does), read once (``loading.collates_by_rows``).
        self._collation: weakref.WeakKeyDictionary[SplitBatchSampler, str | None] = weakref.WeakKeyDictionary()
        self._whole_batches = itertools.count()  # batches read whole here, where the shares could not be put together
        self.watching: StepWatch | None = None  # the step being watched, if any (``unchanged.models`` sets it aside)
        self._taken: weakref.WeakSet[DataLoader] = weakref.WeakSet()  # loaders whose batch sampler is wrapped
        # How each loader's persistent workers were seeded: alike on every rank (from the start), or each rank's own.
        self._workers: weakref.WeakKeyDictionary[DataLoader, str] = weakref.WeakKeyDictionary()
        self._restarts = itertools.count()  # persistent workers started again, alike on every rank
        self._warned = False
        self._said_own_batches = False
        self._said_ahead = False
        self._said_gathered = False
        self._said_loading: set[bool] = set()  # (which of the two ways of reading was said)

    def install(self) -> None:
        self._original_iter = DataLoader.__iter__
        loaders = self

        def __iter__(loader: DataLoader):
            return loaders.iterate(loader)

        DataLoader.__iter__ = __iter__

    def uninstall(self) -> None:
        """Every loader as the script built it again: its own batch sampler (a pass going on reads whole batches to
        its end), ``DataLoader.__iter__`` PyTorch's."""
        if self._original_iter is not None:
            DataLoader.__iter__ = self._original_iter
        if self.watching is not None:  # (a step being watched: its torch function mode out of the way)
            self.watching.end()
            self.watching = None
        for loader in list(self._taken):
            split = loader.batch_sampler
            split.whole = True
            loader.__dict__["batch_sampler"] = split.batches

    def iterate(self, loader: DataLoader):
        self._end_drained()  # a new pass: what the last one handed out has reached its model
        sampler = self.split_sampler(loader)
        if sampler is None:  # a stream's batches, whole on every rank: split at the models
            return self.follow(loader, Pass(None)) if self.world_size > 1 else self._original_iter(loader)
        sampler.whole = True  # until the pass shows what it is
        sampler.shares.clear()
        return self.follow(loader, Pass(sampler))

    def follow(self, loader: DataLoader, this: Pass) -> Iterator:
        """A pass over ``loader``: its batches, this rank's weight set to each one's as it is handed out. A loader whose
        last pass trained on shares draws its workers' seeds from this rank's own random streams; the pass enters
        them once it shows that it trains on shares (its first batch is whole, and the loop's draws for it are one
        device's, from the shared streams: a loop that starts drawing its noise at a later epoch)."""
        self.batch.loader_passes += 1
        this.ahead = this.sampler is not None and (this.sampler in self._fetched_ahead
                                                   or self._gathered.get(this.sampler, False))
        this.own_workers = this.sampler is not None and this.sampler in self._trained_before and not this.ahead
        this.loader = loader
        this.shares_gathered = this.ahead and self._shares_gathered.get(this.sampler, False) \
            and threading.current_thread() is threading.main_thread()  # (a thread's collectives would race the step's)
        if this.shares_gathered:
            this.sampler.whole = False
        self._seed_workers(loader, this)
        ended = True
        try:
            for batch in self._loaded(loader, this):
                self._settle(this)
                if this.sampler is None and this.own_batches is None:
                    this.own_batches = not self.the_same_everywhere(batch)
                    self._say_own_batches(this)
                this.share = None if this.sampler is None else this.sampler.shares.popleft()
                if this.shares_gathered and not this.share.whole:
                    batch = self._put_together(this, batch)
                elif this.share is not None and this.share.cut:
                    batch = self._cut(this, batch)
                this.trained, this.evaluated = False, False
                this.handed_out += 1
                self._make_current(this)
                self._watch(this, batch)
                yield batch
                self._watched(this)  # (the script asks for the next batch: the step on this one is over)
        except GeneratorExit:
            ended = False  # the script left the loop (a break): nothing it handed out is still on its way
            raise
        finally:
            self._watched(this, decide=False)  # (left early: no step was seen to its end)
            if this.sampler is not None:
                (self._trained_before.add if this.training else self._trained_before.discard)(this.sampler)
            if this.own_streams:  # (between passes the streams are the shared ones again)
                this.own_streams = False
                self.streams.leave_pass()
            if ended and this.ahead and this.training:
                this.drained = True  # its last batch, held by the wrapper, is this pass's: until another pass begins
                self._make_current(this)  # whole, as handed out (the call on the batch before cut that one)
            else:
                self._end(this)

    def _loaded(self, loader: DataLoader, this: Pass) -> Iterator:
        """``loader``'s batches as it collates them. Where each rank reads its share of a loader's batches (a gathered
        loader's, or a split one's after a pass that trained), its workers' seeds are drawn from this rank's own random
        streams (a share's random augmentations are not another's),
        and the shared streams, which the loop draws from, take the one draw that they give the seeds where the whole
        batch is read: they stay the same on every rank, and one device's."""
        if this.workers_alike:  # (persistent workers started again: their seeds the same on every rank, not drawn from
            saved = torch.get_rng_state()  # the shared streams, from which one device draws nothing for them)
            torch.default_generator.manual_seed(derived_seed(self.streams.seed, "workers", next(self._restarts)))
            try:
                return self._original_iter(loader)
            finally:
                torch.set_rng_state(saved)
        if not (this.shares_gathered or this.own_workers):
            return self._original_iter(loader)
        self.streams.enter_pass()
        try:
            iterator = self._original_iter(loader)
        finally:
            self.streams.leave_pass()
        if not loader.persistent_workers:  # (DataLoader's draw of its workers' seeds, which one device makes each pass)
            torch.empty((), dtype=torch.int64).random_()
        return iterator

    def _seed_workers(self, loader: DataLoader, this: Pass) -> None:
        """A loader's persistent workers, seeded once as they start, are started again where a pass needs seeds other
        than theirs: each rank's own where it reads its shares (split, or gathered), so that two ranks' shares do not
        draw alike; the same on every rank where each reads the whole batch on the gathered way, so that every rank
        holds the same batch. ``DataLoader._iterator``, the private attribute that keeps them, is emptied (they end
        with it). At the first pass they start from the shared streams, as one device's."""
        need = "own" if this.own_workers or this.shares_gathered else "alike" if this.ahead else None
        if need is None or not (loader.persistent_workers and loader.num_workers and self.world_size > 1):
            return
        if self._workers.get(loader, "alike") != need:
            self._workers[loader] = need
            loader._iterator = None  # noqa: SLF001 - no public way to start a loader's persistent workers again
            this.workers_alike = need == "alike"

    def _put_together(self, this: Pass, batch):
        """The whole batch, from this rank's collated share of it and the other ranks' (``loading``); where they
        cannot be put together, read whole apart from this process (the same on every rank), and that loader read
        whole from its next pass. The share handed out is then the whole batch's."""
        share = this.share
        sizes = share_sizes(share.samples, world_size=self.world_size)
        whole = loading.gathered_rows(batch, sizes=sizes, rank=self.rank, group=self.group)
        if whole is None:
            self._shares_gathered[this.sampler] = False
            logger.debug("--unchanged: a loader's collated shares could not be put together: that batch is read "
                         "whole in the main process, and the loader whole from its next pass")
            seed = derived_seed(self.streams.seed, "whole batch", next(self._whole_batches))
            whole = loading.whole_here(this.loader, list(share.batch), seed)
        this.share = dataclasses.replace(share, indices=list(share.batch), weight=1.0, whole=True)
        return whole

    def _cut(self, this: Pass, batch):
        """This rank's rows of the whole batch, read and collated whole (``SplitBatchSampler.cut``); a stand-in share
        (a batch smaller than the world) the batch's last row, as ``share_of`` reads it. A batch that holds anything
        else than tensors of a row per sample (every rank reads the same) is handed out whole, as a pass's first is,
        and cut at the models."""
        samples = this.share.samples
        sizes = share_sizes(samples, world_size=self.world_size)
        start = sum(sizes[:self.rank])
        cut = loading.rows_cut(batch, samples, *((start, start + sizes[self.rank]) if sizes[self.rank]
                                                  else (samples - 1, samples)))
        if cut is None:
            this.share = dataclasses.replace(this.share, indices=list(this.share.batch), weight=1.0, whole=True)
            return batch
        return cut

    def _end(self, this: Pass) -> None:
        self.batch.loader_passes -= 1
        if this in self._passes:
            self._passes.remove(this)
        if self._passes:
            self._make_current(self._passes[-1])  # an enclosing pass goes on with the batch it handed out

    def _end_drained(self) -> None:
        for this in [this for this in self._passes if this.drained]:
            self._end(this)

    def witness(self, *, training: bool, current: bool = False) -> None:
        """One of the script's models was called (``unchanged.models``): in training (gradients on, training mode),
        or not. The pass that handed out a batch last learns what its batches are for. ``current``: the call was
        given rows of that batch (the batches handed out before it were skipped by the loop, not fetched ahead)."""
        if not self._passes:
            return
        this = self._passes[-1]
        if not training:
            this.evaluated = True
            return
        this.trained = True
        held, this.handed_out = this.handed_out, 0
        if not this.training:
            this.training = True
            if this.sampler is not None:  # (a stream's batches stay whole, and so do its streams: every rank reads it)
                this.ahead = this.ahead or self.fetched_ahead(this.sampler, 1 if current else held)
                if not self.watches():  # (split from here on, but at the models; or shares, gathered)
                    this.sampler.whole = (self.batch.coupled or this.ahead) and not this.shares_gathered
                    if not this.ahead:
                        self._own_streams(this)
                # (Else whole until the step shows its way, each pass's first step: ``_watched``.)

    def watches(self) -> bool:
        """Whether a loader's way is decided from its step (not where --loss-reduction sum or coupled says it)."""
        return not (self.batch.summed or self.batch.coupled)

    def _watch(self, this: Pass, batch) -> None:
        """Watch what the script does with ``batch``, where the pass's loader has no way yet and the pass did not
        evaluate (``step_rule``)."""
        if this.sampler is None or this.ahead or this.evaluating or this.watched or not self.watches():
            return
        this.cuttable = loading.rows_cut(batch, this.share.samples, 0, 1) is not None
        this.tensors_only = loading.tensors_of_rows(batch, this.share.samples) is not None
        this.watch = self.watching = StepWatch(fewest_share_rows(this.sampler.batches, self.world_size))
        this.watch.begin(batch, sys._getframe(1))

    def _watched(self, this: Pass, *, decide: bool = True) -> None:
        """The step on the batch handed out last is over: where it trained, its loader's way is decided from it (a
        collective: every rank is here, the script having asked for its next batch)."""
        watch, this.watch = this.watch, None
        if watch is None:
            return
        if self.watching is watch:
            self.watching = None
        reason = watch.end()
        this.evaluating = this.evaluating or (watch.evaluated and not watch.trained and not this.training)
        if not watch.trained or this.sampler is None or not decide:
            return
        this.watched = True  # (each pass's first training step: the way is decided again from it)
        gathered = self.most_anywhere(int(reason is not None)) > 0  # (the same on every rank)
        logger.debug("--unchanged: a loader's training step "
                     + (f"is not proven split: {reason}" if reason else "is proven split")
                     + (" here, but not on another process" if gathered and not reason else ""))
        self._gathered[this.sampler] = gathered
        if gathered:
            this.ahead = this.sampler.whole = True  # (the batch's ``gathered_way`` from its next hand-out)
            self._say_gathered(reason)
            self._decide_loading(this)
        elif this.training and not this.ahead:
            this.sampler.whole = False  # split from the next batch drawn
            self._decide_collation(this)
            self._own_streams(this)

    def collation(self, this: Pass) -> str | None:
        """Why ``this`` pass's loader does not collate by rows (None where it does), read once per loader."""
        if this.sampler not in self._collation:
            self._collation[this.sampler] = loading.collates_by_rows(this.loader, list(this.share.batch))
        return self._collation[this.sampler]

    def _decide_collation(self, this: Pass) -> None:
        """How a loader just found to take the split way gives each rank its share, once per loader: collated on its
        own where the loader collates by rows (its share of the collated batch is then the same), else read and
        collated whole, and cut to this rank's rows, where its batch holds only tensors of a row per sample: a collate
        function that pads to the batch's longest sample pads a share to the share's longest otherwise, and a model
        that reads the padding (a mean over every position, an RNN's last step) computed another share than one
        device's (``SplitBatchSampler.cut``). Every rank decides alike (one all-reduce)."""
        if self.world_size == 1 or this.sampler in self._collation:
            return
        reason = self.collation(this)
        cut = self.most_anywhere(int(reason is not None and this.cuttable)) > 0
        this.sampler.cut = cut
        if cut and self.rank == 0:
            logger.info(f"--unchanged: each process reads and collates each of a loader's batches whole and keeps its "
                        f"rows of it, so that its share is padded as one device's batch is ({reason}; "
                        f"docs/unchanged.md, \"Split or gathered\")")

    def _decide_loading(self, this: Pass) -> None:
        """How a loader just found to take the gathered way reads its batches from its next pass (this one's workers
        drew their seeds from the shared streams: it reads whole to its end): each rank its share, the collated shares
        gathered, where the loader reads in workers whose seeds each rank draws (no generator of its own) and
        collates by rows; else every rank the whole batch (``loading``). Every rank decides alike (one
        all-reduce), once per loader."""
        if self.world_size == 1:
            self._shares_gathered[this.sampler] = False  # (one process: its share is the batch)
            return
        reason = loading.whole_reading(this.loader) or (
            None if this.tensors_only else "its batches hold more than tensors of one row per sample") \
            or self.collation(this)
        gathered = self.most_anywhere(int(reason is not None)) == 0
        self._shares_gathered[this.sampler] = gathered
        self._say_loading(gathered, reason or ("its workers read and collate each sample's rows alone" if gathered
                                               else "not on another process"))

    def _say_loading(self, gathered: bool, why: str) -> None:
        """Said once each: a loader read in shares, and one read whole where it reads in workers (a loader that reads
        in the main process is cheap to read, or slow on one device already)."""
        logger.debug("--unchanged: a gathered loader's batches: " + ("each process reads its share, the shares "
                     "gathered" if gathered else "every process reads them whole") + f" ({why})")
        if self.rank == 0 and gathered not in self._said_loading and self.world_size > 1 \
                and why != loading.IN_THE_MAIN_PROCESS:
            logger.info("--unchanged: from that loader's next pass, " + (
                "each process reads its share of each batch and the collated shares are gathered" if gathered else
                "every process reads each of its batches whole") + f" ({why}; docs/unchanged.md, \"Whole batches, "
                "read once\")")
            self._said_loading.add(gathered)

    def _say_gathered(self, reason: str | None) -> None:
        if self.rank == 0 and not self._said_gathered and self.world_size > 1:
            logger.info("--unchanged: a training step that is not proven exact on split batches ("
                        + (reason or "on another process") + "): every process holds each of that loader's batches "
                        "whole and computes its share of the model's rows, the outputs gathered, so the script's loss "
                        "and numbers are one device's (docs/unchanged.md, \"Split or gathered\")")
        self._said_gathered = True

    def fetched_ahead(self, sampler: SplitBatchSampler, held: int) -> bool:
        """Whether a wrapper fetches ``sampler``'s loader's batches ahead of the step: more than one handed out before
        the pass's first training call, on any rank (a thread's count may differ: one all-reduce decides for all).
        Such a loader's batches are read whole and cut at the models from then on (see the module), said once."""
        if self.most_anywhere(held) <= 1:  # (one process too: its random streams are then used as N processes use them)
            return False
        self._fetched_ahead.add(sampler)
        if self.rank == 0 and not self._said_ahead and self.world_size > 1:
            logger.warning("--unchanged: a wrapper around a DataLoader fetches its batches ahead of the step (timm's "
                           "PrefetchLoader, a prefetching thread): every process reads that loader's batches whole, "
                           "and each batch is cut where it enters the model (exact; the loading is every process's)")
        self._said_ahead = True
        return True

    def _settle(self, this: Pass) -> None:
        """What the batch handed out last showed, before the next is handed out: a split batch of a training pass
        that the models only evaluated is said once (an evaluation pass reads whole batches to its end anyway)."""
        if this.share is None or this.trained or not this.evaluated or not this.training or this.share.whole:
            return
        if not self._warned and self.world_size > 1:
            self._warned = True
            if self.rank == 0:
                logger.warning("--unchanged: a pass over a DataLoader that trained its model split its batches, then "
                               "called the model on one without training it (gradients off, or eval mode): what the "
                               "script counts or sums from such a batch is this process's share, not one device's. "
                               "Evaluate in a loop of its own")

    def _make_current(self, this: Pass) -> None:
        if this in self._passes:
            self._passes.remove(this)
        self._passes.append(this)
        self.batch.stream = this.sampler is None
        self.batch.gathered_way = this.ahead or this.sampler is None
        self.batch.loader_share = this.sampler is not None and this.share is not None and not this.share.whole
        if this.sampler is None:
            self.batch.set_whole()
            self.batch.own_batches = bool(this.own_batches)
            return
        if this.share is None:
            return
        if this.share.whole:
            self.batch.set_whole()
        else:
            self.batch.set(this.share.weight, samples=this.share.samples)

    def _say_own_batches(self, this: Pass) -> None:
        if this.own_batches and not self._said_own_batches and self.rank == 0:
            logger.warning("--unchanged: a DataLoader over a stream gives each process batches of its own (the stream "
                           "splits itself by process, reading the rank): left as it is, each process trains on its "
                           "own batches and their gradients are averaged, as under DDP: a step takes the number of "
                           "processes times one device's batch")
        self._said_own_batches = self._said_own_batches or bool(this.own_batches)

    def _own_streams(self, this: Pass) -> None:
        if not this.own_streams:
            this.own_streams = True
            self.streams.enter_pass()

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
        self._taken.add(loader)
        return split
