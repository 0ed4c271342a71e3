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

import functools
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset, default_collate

from ddpkit.core import progress, signals
from ddpkit.core.errors import UsageError
from ddpkit.core.process_group import Runtime, decided_by_main, usable_cores
from ddpkit.data.evaluation import wait_until_only_python_holds
from ddpkit.data.images import image_data_in, loader_hooks, takes_epoch
from ddpkit.data.sampler import ResumableSampler, eval_indices


MAX_WORKERS = 32  # past this, loader processes cost memory and start-up time more than they add


def default_workers(runtime: Runtime, in_memory: bool | None = False, dataset: Dataset | None = None) -> int:
    """A share of this machine's cores for one rank's loader worker processes (what ``workers="auto"`` and
    ``ddpkit train`` use): none for tensors already in memory (a TensorDataset, or ``in_memory=True``)."""
    if in_memory is None:
        in_memory = isinstance(dataset, TensorDataset)
    if in_memory:
        return 0
    # One core of each rank's share is the rank's own; the rest decode. A 16-core GPU machine's one rank needs its
    # 15 to decode JPEGs at a GPU's pace: the cap is 32, not the 8 that starved it.
    return max(1, min(MAX_WORKERS, usable_cores() // max(1, runtime.env.local_world_size) - 1))


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) batch to ``device``: tensors, lists, tuples (named too) and mappings."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields as arguments
        return type(batch)(*(to_device(item, device, non_blocking) for item in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(item, device, non_blocking) for item in batch)
    if isinstance(batch, Mapping):
        moved = {key: to_device(value, device, non_blocking) for key, value in batch.items()}
        try:
            return type(batch)(moved)  # a dict subclass (a tokenizer's BatchEncoding) stays what it was
        except TypeError:
            return moved
    return batch


class DeviceLoader:
    """A DataLoader whose batches arrive on ``device`` (pinned memory and non-blocking copies on GPU), in an order
    that depends only on the seed and the epoch, never on the world size.

    Epochs. A pass that runs to its end advances the epoch: the next ``iter()`` deals the next epoch's order, so
    forgetting ``sampler.set_epoch(epoch)``, the classic DDP bug, cannot repeat an order. A pass left before its
    end (a peek with ``next(iter(loader))``, a ``break``) does not: the next ``iter()`` starts that epoch again.
    ``set_epoch(epoch)`` chooses the epoch of the next ``iter()``, as DistributedSampler's does.

    ``state_dict()`` is the position in the global sample order (epoch, samples consumed by all ranks),
    and ``load_state_dict()`` makes the next ``iter()`` continue from there: the resumed run sees
    exactly the batches the interrupted one had not reached, for any world size.

    ``accumulate``: batches per optimizer step; an epoch then ends at the last whole group of that many.
    ``phase``: what this rank is doing while it consumes the batches (``ddpkit.core.progress``).
    ``lockstep``: for an evaluation loader whose model's every forward is a collective (FSDP's all-gathers), the
    runtime over which each pass first compares the ranks' batch counts: unequal ones are a ``UsageError`` at once
    (a loop of one's own would wait forever in a rank's extra forward), not a hang. ``ddpkit.evaluate`` runs such
    ranks in lockstep instead (``without_count_check``).

    Evaluating over a training loader (set by ``Job``). A training pass that keeps every sample (``drop_last``
    False) is padded with repeated samples, so that every rank has as many batches: sums over it count those twice.
    ``evaluation_twin`` makes the evaluation loader of the same data and settings (each sample on exactly one rank,
    none repeated: ``for_evaluation()``); a pass for which ``is_evaluation`` says True (the model in eval mode,
    gradients off) deals that loader's batches instead, and leaves this loader's epoch and position alone.
    ``steps`` counts the optimizer's steps: a padded pass that took none, after some were taken, was an evaluation
    that nobody saw coming, and is said once in a warning.
    """

    def __init__(self, loader: DataLoader, device: torch.device, sampler: DistributedSampler | None = None,
                 seed: int = 0, rank: int = 0, accumulate: int = 1, phase: str | None = None,
                 finish: Callable[..., Any] | None = None, lockstep: Runtime | None = None):
        if accumulate < 1:
            raise UsageError(f"accumulate must be at least 1, got {accumulate}")
        self.loader = loader
        self.accumulate = accumulate
        self.sampler = sampler
        self.device = device
        self._epoch = 0  # the epoch the next iter() runs
        self.seed = seed
        self.rank = rank
        self._start = 0  # global samples of that epoch to skip (a resumed position)
        self._running: tuple[int, int] | None = None  # (epoch, start) of the iteration in progress
        self._yielded = 0
        self._non_blocking = device.type == "cuda" and loader.pin_memory
        self.phase = phase  # the heartbeat's phase once a batch is handed over ("forward" for training)
        # A data set that finishes its own batches (ddpkit.data.images: decoding on the GPU, normalising) moves them.
        self.finish = finish
        # Under replica groups (set by Job): called before the script reads where the loader stands (``epoch``)
        # and before each pass (a restarted group copies the live groups' state, their position included, before
        # its loop begins), and after each batch, for what comes next: the next batch (0), the same one again
        # (-1: its step was dropped), or k batches further (the groups committed k steps this group did not
        # take part in).
        self.before_use: Callable[[], Any] | None = None
        self.replay: Callable[[], int] | None = None
        self.lockstep = lockstep
        self.evaluation_twin: Callable[[], DeviceLoader] | None = None
        self.is_evaluation: Callable[[], bool] | None = None
        self.steps: Callable[[], int] | None = None
        self._twin: DeviceLoader | None = None
        self._live_passes = 0
        self._warned_repeats = False

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` runs (a loop that resumes reads it: ``range(loader.epoch, epochs)``)."""
        if self.before_use is not None:
            self.before_use()
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` runs, from its start (or from a loaded position in it)."""
        if epoch != self._epoch:
            self._start = 0
        self._epoch = epoch
        self._running = None

    @property
    def dataset(self) -> Dataset:
        """The data set this rank reads its share of (the script's own)."""
        dataset = self.loader.dataset
        return dataset.dataset if isinstance(dataset, Subset) and self.sampler is None else dataset

    @property
    def batch_size(self) -> int | None:
        """Samples in one of this rank's batches."""
        return self.loader.batch_size

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
        return {"epoch": self._epoch, "samples": self._start, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (a ``state_dict()``) at the next ``iter()``."""
        self._epoch = int(state["epoch"])
        self._start = int(state["samples"])
        self._running = None

    def __len__(self) -> int:
        self._position_sampler(self._epoch, self._start)
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
        if self.is_evaluation is not None and self.evaluation_twin is not None and self.is_evaluation():
            return iter(self.for_evaluation())
        if self.lockstep is not None:
            check_equal_batches(self, self.lockstep, evaluation=True)
        return self.without_count_check()

    def for_evaluation(self) -> DeviceLoader:
        """The loader an evaluation over this one's data reads: each sample on exactly one rank, none repeated (this
        loader itself where it is one already, or where nothing can make it: ``evaluation_twin``)."""
        if self.evaluation_twin is None:
            return self
        if self._twin is None:
            self._twin = self.evaluation_twin()
        return self._twin

    @property
    def in_evaluation_pass(self) -> bool:
        """Whether a pass dealt as an evaluation (``is_evaluation``) is under way."""
        return self._twin is not None and self._twin.in_pass

    @property
    def in_pass(self) -> bool:
        """Whether a pass over this loader is under way: begun, and neither run to its end nor left."""
        return self._live_passes > 0

    @property
    def repeated_samples(self) -> int:
        """Samples a whole epoch repeats to give every rank as many batches (DistributedSampler's padding), in all
        ranks together: 0 where the last incomplete global batch is cut instead, or nothing needs evening out."""
        if self.sampler is None or self.sampler.drop_last:
            return 0
        return max(0, self.sampler.total_size - len(self.sampler.dataset))

    def without_count_check(self) -> Iterator[Any]:
        """A pass, as ``iter()`` starts it, without comparing the ranks' batch counts first (``lockstep``)."""
        if self.before_use is not None:
            self.before_use()
        if self._running is not None:
            self._warn_unfinished()
            self._epoch, self._start = self._running  # a pass left before its end: that epoch again, from its start
        epoch, start = self._epoch, self._start
        self._position_sampler(epoch, start)
        # The loader draws its workers' seeds from this generator, not from the global RNG: a resumed
        # run's global RNG (dropout, augmentation) then continues exactly where it was saved.
        if self.loader.generator is not None:
            self.loader.generator.manual_seed(_epoch_seed(self.seed, self.rank, epoch))
        self._running, self._yielded = (epoch, start), 0
        return self._batches(epoch, None if self.steps is None else self.steps())

    def _batches(self, epoch: int, steps_before: int | None) -> Iterator[Any]:
        self._live_passes += 1  # until the pass ends, or is left (its generator closed)
        try:
            ahead = yield from self._pass()
            self._running = None
            self._epoch, self._start = epoch + 1, ahead * self.batch_samples
            # No step in a whole pass, in a job whose optimizer has stepped before (one the job does not see never
            # does): an evaluation over a padded training loader, most likely.
            if steps_before and self._yielded and self.steps() == steps_before:
                self._warn_repeats()
        finally:
            self._live_passes -= 1

    def _pass(self) -> Iterator[Any]:
        """The pass's batches; returns how many batches the next pass leaves out (replica groups)."""
        whole = len(self.loader) - len(self.loader) % self.accumulate
        batches = itertools.islice(self.loader, whole)
        # On a GPU, made ready on a thread and a stream of their own, ahead of the step that takes them, where
        # worker processes make the batches or the data set finishes them (nvJPEG): a data set read in this
        # process (no workers) stays on the training thread, which its random draws and handles may belong to.
        moved = ahead_on_a_thread(batches, self._move, self.device) if self._ahead_on_a_thread else \
            map(self._move, batches)
        ahead = 0  # batches still to leave out, from the next pass on where this one ends first
        for batch in moved:
            self._yielded += 1  # counted as handed over: a checkpoint taken now is past this batch
            if self.phase:
                progress.mark(self.phase)
            yield batch
            while (after := self.replay() if self.replay is not None else 0) < 0:
                if self.phase:
                    progress.mark(self.phase)
                yield batch  # its step was dropped: tried again on the same batch
            for ahead in range(after, 0, -1):
                if next(moved, None) is None:
                    break
                self._yielded += 1
            else:
                ahead = 0
        return ahead

    def _warn_repeats(self) -> None:
        """Once: this padded training loader's pass took no optimizer step (an evaluation of one's own, most likely)."""
        if self._warned_repeats or not self.repeated_samples or self.rank != 0:
            return
        from ddpkit.core.logs import logger

        self._warned_repeats = True
        total = len(self.sampler.dataset)
        logger.warning(
            f"a whole pass over a training loader took no optimizer step: an evaluation? A training loader repeats "
            f"samples to give every rank as many batches ({self.repeated_samples} of {total} here), and sums over it "
            f"(job.sum, job.gather) count {total + self.repeated_samples} samples, not {total}. Evaluate over a "
            "DataLoader made with shuffle=False (job.prepare makes it an evaluation loader), job.eval_loader(loader), or "
            "job.evaluate; a pass begun under torch.no_grad() is dealt as an evaluation by itself")

    @property
    def _ahead_on_a_thread(self) -> bool:
        return self.device.type == "cuda" and (self.finish is not None or self.loader.num_workers > 0)

    def _move(self, batch: Any) -> Any:
        if self.finish is not None:  # a data set that finishes its own batches: decodes, normalises, moves
            return self.finish(batch, self.device, self._non_blocking)
        return to_device(batch, self.device, self._non_blocking)

    def _warn_unfinished(self) -> None:
        if self._yielded > 1:  # a peek takes one batch; a loop that broke off took more
            from ddpkit.core.logs import logger

            epoch, _ = self._running
            logger.warning(f"a pass over this loader stopped after {self._yielded} of {len(self.loader)} batches, so "
                           f"epoch {epoch} did not end: this pass deals epoch {epoch}'s order again. Call "
                           "loader.set_epoch(epoch) before each pass when your loop leaves its passes early")


AHEAD = 2  # batches a GPU loader's thread makes ready before the training thread asks for them
JOIN_S = 10.0  # how long a pass that ends waits for its thread (which finishes the batch it is making) to end


def ahead_on_a_thread(batches: Iterator[Any], move: Callable[[Any], Any], device: torch.device,
                      ahead: int = AHEAD) -> Iterator[Any]:
    """``move(batch)`` of each batch, run on a thread of its own up to ``ahead`` batches before the one the caller
    takes: the wait for the loader's workers, the copy to the device and what ``move`` does there (nvJPEG's
    decoding and the crops, for image files) happen while the training thread runs the step before.

    On a GPU the thread queues its work on a stream of its own, and the training stream waits for a batch's
    event alone when it takes it; the batch's memory is marked as in use on the training stream, so the caching
    allocator does not hand it out again while the step still reads it. (nvJPEG's ``decode_jpeg`` waits on the
    host for its own stream: on the training thread that wait was a third of a step.) An error on the thread
    (an unreadable batch, a worker that died) is raised by the caller's ``next()``, in order; a caller that
    stops early stops the thread, which leaves the batches it had made ready. ``batches`` is made in the
    caller's thread (a DataLoader's iterator starts its workers and signal handlers there)."""
    import queue
    import threading

    ready: queue.Queue = queue.Queue(maxsize=max(1, ahead - 1))  # + the one the thread holds = ``ahead``
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def make_ready() -> None:
        try:
            _move_each(batches, move, device, put, stop)
        except BaseException as error:  # noqa: BLE001 - handed to the training thread, which raises it
            put((error, done))
            return
        put((None, done))  # not put once stopped: the caller has left

    thread = threading.Thread(target=make_ready, name="ddpkit-batches-ahead", daemon=True)
    thread.start()
    try:
        while True:
            batch, event = ready.get()
            if event is done:
                if batch is not None:
                    raise batch
                return
            yield _on_current_stream(batch, event, device) if event is not None else batch
    finally:
        stop.set()
        thread.join(timeout=JOIN_S)
        if thread.is_alive():  # inside the loader's next(), on a worker that does not answer: left, a daemon
            from ddpkit.core.logs import logger

            logger.warning(f"the loader's thread did not end within {JOIN_S:.0f} s of its pass (a loader worker "
                           "that does not answer?); left to end with the process")


def _move_each(batches: Iterator[Any], move: Callable[[Any], Any], device: torch.device,
               put: Callable[[tuple], bool], stop) -> None:
    """``ahead_on_a_thread``'s thread: each batch moved (on a GPU, on a stream of its own) and ``put`` with the event
    that marks it ready, until the batches end, ``stop`` is set or ``put`` finds it set."""
    side = None
    if device.type == "cuda":
        # A new thread's current device is GPU 0: without this, leaving the stream's context would make it so, and
        # rank r > 0 would open a CUDA context (and put what moves by default) on GPU 0.
        torch.cuda.set_device(device)
        side = torch.cuda.Stream(device)
    for batch in batches:
        if stop.is_set() or not put(_moved(batch, move, side)):
            return


def _moved(batch: Any, move: Callable[[Any], Any], side) -> tuple[Any, Any]:
    """(``move(batch)``, None), or on a CUDA stream ``side``: (what it made there, the event recorded after it)."""
    if side is None:
        return move(batch), None
    with torch.cuda.stream(side):
        moved = move(batch)
        event = torch.cuda.Event()
        event.record(side)
    return moved, event


def _on_current_stream(batch: Any, ready: torch.cuda.Event, device: torch.device) -> Any:
    current = torch.cuda.current_stream(device)
    current.wait_event(ready)
    for tensor in tensors_in(batch):
        if tensor.is_cuda:
            tensor.record_stream(current)
    return batch


def tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a (nested) batch: tensors, lists, tuples and mappings."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from tensors_in(item)
    elif isinstance(batch, Mapping):
        for item in batch.values():
            yield from tensors_in(item)


def _epoch_seed(seed: int, rank: int, epoch: int) -> int:
    return (seed * 1_000_003 + rank * 7_919 + epoch) % (2**63)


# What a DataLoader was made with, read back from its attributes: a loader rebuilt around ddpkit's sampler keeps
# all of it (its collate_fn, per-process batch size, workers, pin_memory, drop_last, worker_init_fn, ...).
KEPT_SETTINGS = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
                 "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers", "pin_memory_device",
                 "in_order")


def loader_settings(loader: DataLoader) -> dict[str, Any]:
    """The keyword arguments that make a DataLoader like ``loader`` (its dataset and sampler aside)."""
    import inspect

    accepted = inspect.signature(DataLoader).parameters
    return {name: getattr(loader, name) for name in KEPT_SETTINGS if name in accepted and hasattr(loader, name)}


def sampling_of(loader: DataLoader) -> tuple[bool, int | None]:
    """(shuffle, seed) of the script's loader, whose sampler ddpkit replaces; UsageError for one it cannot."""
    from torch.utils.data import IterableDataset, RandomSampler, SequentialSampler

    if isinstance(loader.dataset, IterableDataset):
        raise UsageError(f"a DataLoader over an IterableDataset ({type(loader.dataset).__name__}) cannot be split "
                         "by sample index: let the data set yield this rank's part itself (from job.rank and "
                         "job.world_size) and move its batches with ddpkit.to_device(batch, job.device)")
    if loader.batch_size is None:
        raise UsageError(f"this DataLoader takes its batches from a batch_sampler of its own "
                         f"({type(loader.batch_sampler).__name__}); ddpkit deals samples to the ranks itself and "
                         "needs batch_size= with shuffle=True or False (or split the batches yourself by job.rank)")
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        return sampler.shuffle, sampler.seed
    if isinstance(sampler, RandomSampler) and not sampler.replacement and sampler._num_samples is None:  # noqa: SLF001
        return True, None
    if isinstance(sampler, SequentialSampler):
        return False, None
    raise UsageError(f"this DataLoader draws with a {type(sampler).__name__}; ddpkit deals samples to the ranks "
                     "itself and takes loaders made with shuffle=True or shuffle=False (or a DistributedSampler). "
                     "Keep your sampler and split its indices by job.rank yourself, moving batches with "
                     "ddpkit.to_device(batch, job.device)")


def _settings(data: Dataset | DataLoader, batch_size: int | None, workers: int | str | None, in_memory: bool | None,
              runtime: Runtime, options: dict[str, Any]) -> tuple[Dataset, dict[str, Any]]:
    """The data set and the DataLoader settings of a loader ddpkit makes from ``data`` (a data set, or the script's
    own DataLoader, whose settings are kept); the keyword arguments given override them."""
    if isinstance(data, DeviceLoader):
        data = data.loader
    if isinstance(data, DataLoader):
        dataset, settings = data.dataset, loader_settings(data)
    else:
        if batch_size is None:
            raise UsageError("`batch_size` is needed to load a data set (a DataLoader brings its own)")
        dataset, settings = data, {"num_workers": 0}
    if batch_size is not None:
        if batch_size < 1:
            raise UsageError(f"`batch_size` must be at least 1, got {batch_size}")
        settings["batch_size"] = batch_size
    if workers == "auto" or (workers is None and in_memory is False):
        workers = default_workers(runtime, False)
    if workers is not None:
        settings["num_workers"] = workers
    settings.update(options)
    # Stop signals belong to the rank (it finishes its step, then ends the workers), and a CUDA rank pins its batches.
    settings["worker_init_fn"] = _ignoring_stop_signals(settings.get("worker_init_fn"))
    settings.setdefault("generator", None)
    if settings["generator"] is None:
        settings["generator"] = torch.Generator()
    image_data = image_data_in(dataset)
    if image_data is not None:
        # decode="auto" becomes gpu or cpu for this loader's device and workers, chosen by rank 0 for every rank
        image_data.for_device(runtime.device, settings["num_workers"], functools.partial(decided_by_main, runtime))
        if settings.get("collate_fn") in (None, default_collate):
            settings["collate_fn"] = image_data.collate  # its items are uint8 crops or encoded bytes
    if runtime.device.type == "cuda":
        settings["pin_memory"] = True
    if not settings["num_workers"]:
        for name in ("prefetch_factor", "persistent_workers", "timeout"):
            settings.pop(name, None)  # DataLoader refuses them without worker processes
    return dataset, settings


def keeps_its_workers(data: Dataset | DataLoader, dataset: Dataset, settings: dict[str, Any],
                      options: dict[str, Any]) -> bool:
    """Whether a training loader ddpkit makes over image files (``ddpkit.data.images``) keeps its worker processes
    from one epoch to the next: otherwise each epoch starts a rank's N decoding processes again and waits for their
    first batches. Safe for those data sets: a sample's crop comes from (seed, epoch, index), not from a worker's
    random state, and workers that outlive a loop are ended at exit (``signals.kill_children_ignoring_sigterm_at_exit``).
    A script's own DataLoader, or ``persistent_workers=`` given, keeps its choice."""
    return (image_data_in(dataset) is not None and not isinstance(data, (DataLoader, DeviceLoader))
            and bool(settings.get("num_workers")) and "persistent_workers" not in options)


def _ignoring_stop_signals(init: Callable[[int], None] | None) -> Callable[[int], None]:
    signals.kill_children_ignoring_sigterm_at_exit()  # a loader still held at exit: its workers would not end
    if init is None or init is signals.ignore_stop_signals:
        return signals.ignore_stop_signals
    return functools.partial(_then, init)


def _then(init: Callable[[int], None], worker_id: int) -> None:
    signals.ignore_stop_signals(worker_id)
    init(worker_id)


def train_loader(
    data: Dataset | DataLoader,
    batch_size: int | None = None,
    *,
    runtime: Runtime,
    seed: int | None = None,
    shuffle: bool | None = None,
    workers: int | str | None = None,
    in_memory: bool | None = None,
    drop_last: bool | None = None,
    replica: tuple[int, int] | None = None,
    accumulate: int = 1,
    **loader_options,
) -> DeviceLoader:
    """This rank's share of ``data`` in per-process batches; the global batch is ``batch_size`` x the ways the data
    is split (``world_size``, or the count in ``replica``).

    ``data``: a data set, or the script's own DataLoader, whose settings (collate_fn, batch size, workers,
    pin_memory, drop_last, worker_init_fn, generator, ...) are kept and whose sampler is replaced by one that
    deals the same order for every world size (``shuffle`` from the loader's: a RandomSampler shuffles).
    ``seed``: of the order (None: the DistributedSampler's, else 0). ``workers``: loader processes (None: the
    loader's, or none; ``"auto"``: a share of the cores). ``drop_last`` (default True for a data set, the loader's
    otherwise): True cuts the last incomplete *global* batch, so N processes x batch B take exactly the batches of
    1 x N*B; False keeps every sample, at a price: the epoch is padded with up to world_size - 1 repeated samples.
    ``replica=(index, count)``: split the data ``count`` ways and take part ``index`` instead of this rank's part of
    world_size (the stages of one pipeline all take the same part). ``accumulate``: micro-steps per optimizer step;
    each epoch ends at its last whole step. Other keywords go to the DataLoader.
    """
    if isinstance(data, DataLoader):
        loader_shuffle, loader_seed = sampling_of(data)
        shuffle = loader_shuffle if shuffle is None else shuffle
        seed = loader_seed if seed is None else seed
    dataset, settings = _settings(data, batch_size, workers, in_memory, runtime, loader_options)
    if keeps_its_workers(data, dataset, settings, loader_options):
        settings["persistent_workers"] = True
    shuffle = True if shuffle is None else shuffle
    seed = 0 if seed is None else seed
    if drop_last is None:  # the script's loader's choice, else ddpkit's: whole global batches only
        drop_last = settings["drop_last"] if isinstance(data, DataLoader) else True
    index, count = replica or (runtime.rank, runtime.world_size)
    global_batch = settings["batch_size"] * count
    if drop_last and len(dataset) < global_batch:
        raise UsageError(
            f"the training set has {len(dataset)} samples, fewer than one global batch of {global_batch} "
            f"({settings['batch_size']} per process x {count} data-parallel processes); lower `batch_size`",
            said_elsewhere=not runtime.is_main,  # every rank finds it: rank 0 says it
        )
    sampler = ResumableSampler(dataset, num_replicas=count, rank=index, shuffle=shuffle, seed=seed, drop_last=drop_last,
                               keyed=takes_epoch(dataset))
    settings["drop_last"] = drop_last
    loader = DataLoader(dataset, sampler=sampler, **settings)
    return DeviceLoader(loader, runtime.device, sampler, seed=seed, rank=index, accumulate=accumulate, phase="forward",
                        finish=loader_hooks(dataset)[1])


def eval_loader(
    data: Dataset | DataLoader,
    batch_size: int | None = None,
    *,
    runtime: Runtime,
    workers: int | str | None = None,
    in_memory: bool | None = None,
    replica: tuple[int, int] | None = None,
    lockstep: bool = False,
    **loader_options,
) -> DeviceLoader:
    """Each sample of ``data`` (a data set, or the script's own DataLoader, whose settings are kept) goes to exactly
    one rank, in order, with no padding: ranks may hold one sample fewer, and sums over them count every sample
    once (``Job.sum``, ``Job.gather``, ``ddpkit.reduce_sums``). Batches arrive on this rank's device.

    ``replica=(index, count)``: as in ``train_loader``, a part of ``count`` rather than of world_size.
    ``lockstep``: the model's forwards are collectives (FSDP): each pass compares the ranks' batch counts first, and
    unequal ones are one ``UsageError`` (``DeviceLoader``), not a hang.
    """
    if isinstance(data, DataLoader):
        sampling_of(data)  # a sampler of its own is refused here too
    dataset, settings = _settings(data, batch_size, workers, in_memory, runtime, loader_options)
    settings["drop_last"] = False  # evaluation counts every sample
    index, count = replica or (runtime.rank, runtime.world_size)
    shard = Subset(dataset, eval_indices(len(dataset), index, count))
    return DeviceLoader(DataLoader(shard, shuffle=False, **settings), runtime.device, rank=runtime.rank,
                        phase="evaluate", finish=loader_hooks(dataset)[1],
                        lockstep=runtime if lockstep and runtime.world_size > 1 else None)


def check_equal_batches(loader, runtime: Runtime, *, evaluation: bool = False) -> int:
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
        if evaluation:
            raise UsageError(
                f"the ranks hold different numbers of evaluation batches ({shown}{more}), and every forward of this "
                "model is a collective (fsdp): in a loop of your own the ranks with more would wait forever in their "
                "extra forwards. Evaluate with job.evaluate(model, loader), which runs the ranks in lockstep, or "
                "give every rank a whole number of batches (a batch size that divides its share)",
                said_elsewhere=not runtime.is_main,
            )
        raise UsageError(
            f"the ranks have unequal numbers of batches per epoch ({shown}{more}); the ranks with more would wait "
            "forever in their extra steps' all-reduce. Shard with ddpkit.train_loader or DistributedSampler "
            "(equal shares), or wrap the loop in torch.distributed.algorithms.Join([model])",
            said_elsewhere=not runtime.is_main,
        )
    return count
