"""``ddpkit.Job``: the whole training loop's distributed side in one object.

    import ddpkit, torch, torch.nn.functional as F

    with ddpkit.Job(strategy="ddp", amp="bf16", accumulate=2, seed=0) as job:
        model, optimizer = job.setup(Net(), torch.optim.Adam, lr=1e-3)
        loader = job.train_loader(train_set, batch_size=32)
        for epoch in range(3):
            for images, labels in loader:              # this rank's share, on its device, a new order each epoch
                with job.autocast():
                    loss = F.cross_entropy(model(images), labels)
                job.backward(loss)                     # scaled for fp16; gradients reduced on every 2nd only
                job.step(optimizer)                    # steps (and zeroes the gradients) every 2nd call
            val_loss, val_acc, count = job.evaluate(model, job.eval_loader(val_set, batch_size=256))
            job.print(f"epoch {epoch}: val_acc {val_acc:.2%} over {count} samples")   # rank 0 only
        job.save_model(model, "model.pt")              # the bare model's weights, written by rank 0

A script of one's own keeps its objects: ``model, optimizer, scheduler, train_dl, val_dl =
job.prepare(model, optimizer, scheduler, train_dl, val_dl)`` wraps the model, keeps the optimizer and
scheduler driving it, and gives each DataLoader this rank's share (its collate_fn, batch size, workers and the
rest kept); ``loss.backward()`` and ``optimizer.step()`` then work as they did, and after the validation loop
``total, count = job.sum(total, count)`` counts every sample once.

Checkpoints: ``ckpt = job.checkpointer(folder, model=model, optimizer=optimizer, loader=loader)``, then
``ckpt.resume("auto")`` before the loop and ``ckpt.save()`` at any step boundary; or the script's own dict with
``"job": job.state_dict()`` in it, written by ``job.save(obj, path)`` and read back with ``job.load_state_dict``.

Replica groups: the same script under ``ddpkit run --replica-groups R`` trains as R groups that go on when one
dies (``Job`` joins this process's group and wraps the model and the optimizer for it; a dropped step is tried
again on the same batch; a restarted group copies the live groups' state before its loop). See ``replica_group``.

Change ``strategy`` ("single", "ddp", "zero", "fsdp", "pipeline", "dp"), ``amp`` ("off", "bf16", "fp16")
or ``accumulate`` and no other line changes. The job starts the process group when it is made (reading
rank and world size from torchrun, Slurm, mp.spawn, or none) and tears it down when the ``with`` block
ends, whatever ends it: an error (a collective's timeout is explained, naming the ranks that never
arrived), Ctrl-C or SIGTERM. Without ``with``, call ``job.close()`` at the end (it also runs at exit). A mistake
ddpkit finds (a ``UsageError``) is one line and exit status 2, inside ``with`` or not. Before the first step a
SIGTERM or Ctrl-C ends the process at once (status 143 or 130: nothing to save yet, and the wait for the other ranks
is a call Python cannot interrupt); from the first step on, the script's own handling (``ddpkit.stop_on_signal``)
stops at a step's end.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ddpkit import checkpoint, data, strategies
from ddpkit.core import progress
from ddpkit.core import ray_reports
from ddpkit.watch import heartbeat, pace, replicas
from ddpkit.core import process_group, signals
from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger
from ddpkit.core.precision import AMP_DTYPES, autocast
from ddpkit.core.snapshot import snapshot
from ddpkit.data.evaluation import evaluate, gather, sums
from ddpkit.strategies import replica_loop
from ddpkit.strategies.sync_bn import convert_sync_batchnorm


class Job:
    """This process's part of a training job: rank, device, strategy, precision and accumulation.

    ``strategy``: a name from ``ddpkit.strategies.STRATEGIES`` with its settings as keywords (for example
    ``Job("ddp", static_graph=True)``, ``Job("pipeline", stages=2, microbatches=4)``), or a strategy
    object. ``amp``: autocast dtype for ``autocast()``; fp16 also scales the loss in ``backward``.
    ``accumulate``: micro-steps per optimizer step. ``seed``: seeds torch's RNG on every rank at start (None, the
    default: leaves the script's own seeding alone; every strategy starts each replica from rank 0's weights
    either way). ``sync_bn``: BatchNorm statistics over the
    global batch. ``clip_grad_norm``: clip the gradients' total norm before each step.
    ``backend``, ``device``, ``timeout_s``, ``environment``, ``log_level``: as ``ddpkit.setup``.
    ``stall_timeout_s``: end the job, naming the rank that holds it up, once no rank has advanced for this
    long (at least 20 typical steps, at most ``timeout_s``; ``ddpkit.watch.heartbeat``); 0 turns it off. Default:
    DDPKIT_STALL_TIMEOUT_S, else 60. ``check_replicas``: every this many optimizer steps, compare an exact
    checksum of every rank's weights where the strategy replicates them (ddp, zero) and stop the job, naming
    the rank that differs (``ddpkit.watch.replicas``); 0 turns it off. Default: 1000. ``status_file``: rank 0
    writes every rank's step, phase, last heartbeat, step time and memory there every few seconds, and how
    the job ended (``ddpkit status`` reads it from a folder's ``status.json``). Messages
    go to the ``ddpkit`` logger (``ddpkit.core.logs``): rank 0's, and every rank's warnings and errors.

    ``replica_group``: under ``ddpkit run --replica-groups R`` (None, the default) the job joins this process's
    replica group (``ddpkit.ReplicaGroup``, its timeouts from ``stall_timeout_s``), or the one given. Then
    ``setup``/``prepare`` wrap the model and its optimizer for the groups; ``train_loader`` deals each group its
    part of the global batch, and after a dropped step hands the same batch again; ``global_step`` and the
    schedulers count committed steps only; a restarted group copies the live groups' state (weights, optimizer,
    schedulers, the loaders' positions) at ``Checkpointer.resume``, where the loop reads a training loader's
    ``epoch``, or at the loader's first pass, whichever comes first, so a loop written ``for epoch in
    range(loader.epoch, epochs)`` starts in their epoch. ``is_main`` is rank 0 of the
    group that led the last step: it prints and saves. A group restarted after the others finished stops
    (``SystemExit`` 0) at once. The strategy must be ddp, with ``accumulate=1``.
    """

    def __init__(self, strategy: str | strategies.Strategy = "ddp", *, amp: str = "off", accumulate: int = 1,
                 seed: int | None = None, sync_bn: bool = False, clip_grad_norm: float | None = None,
                 backend: str = "auto", device: str = "auto", timeout_s: float | None = None, environment=None,
                 log_level: str | None = None, stall_timeout_s: float | None = None, check_replicas: int | None = None,
                 status_file: str | os.PathLike | None = None, replica_group=None, **strategy_settings):
        self.strategy = strategies.create(strategy, **strategy_settings)
        if amp not in AMP_DTYPES:
            raise UsageError(f"`amp` must be one of {', '.join(AMP_DTYPES)}, got {amp!r}")
        if accumulate < 1:
            raise UsageError(f"`accumulate` must be at least 1, got {accumulate}")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise UsageError(f"`clip_grad_norm` must be positive, got {clip_grad_norm}")
        self.strategy.check_training(accumulate=accumulate, amp=amp)
        if replica_group is not False and (replica_group is not None or in_replica_groups()):
            check_replica_settings(self.strategy, accumulate)
        self.amp, self.accumulate, self.seed, self.sync_bn = amp, accumulate, seed, sync_bn
        self.clip_grad_norm = clip_grad_norm
        self.check_replicas = replicas.check_every(check_replicas)
        self._weights_compared: list[tuple[str, torch.Tensor]] | None = None  # the weights compared: set by setup
        self._stack = contextlib.ExitStack()
        self.runtime = self._stack.enter_context(process_group.distributed(
            backend=backend, device=device, timeout_s=timeout_s, force_group=self.strategy.needs_group,
            environment=environment, log_level=log_level))
        # Until the first step a stop ends this rank at once (nothing to save yet; DDP's first broadcast and the
        # replica groups' start wait in C++ for ranks that may never come); from then on, at a step boundary.
        signals.starting(f"setting up rank {self.rank} of {self.world_size}, before its first step",
                         quiet=process_group.under_launcher_agent())
        self._stack.callback(signals.started)
        # This rank's phases and steps, marked as it trains: each rank's own step time, and its heartbeat.
        self.pace = self._stack.enter_context(progress.kept(progress.Pace()))
        self.heartbeat = self._stack.enter_context(heartbeat.watch(
            self.runtime, pace=self.pace, stall_s=heartbeat.stall_setting(stall_timeout_s),
            timeout_s=self.runtime.timeout_s, status_path=None if status_file is None else os.fspath(status_file)))
        atexit.register(self.close)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=amp == "fp16")
        self.micro_step = 0  # micro-steps since the last optimizer step
        self.global_step = 0  # optimizer steps taken (a resume sets it)
        self._backward_done = False
        self._in_step = False  # inside job.step: the optimizer's own step hook leaves the counting to it
        self.loaders: list[data.DeviceLoader] = []  # every loader made or prepared here, for state_dict
        self._models: list[nn.Module] = []  # every model wrapped here (whether a pass is an evaluation)
        self._slow_ranks = pace.SlowRanks()  # when compare_ranks warns of a slow rank
        try:
            self.replica = self._join_replica_groups(replica_group, stall_timeout_s)
        except BaseException:
            self._stack.close()
            raise
        if seed is not None:
            torch.manual_seed(seed)

    # -- who am I

    rank = property(lambda self: self.runtime.rank, doc="this process's global rank, 0 .. world_size - 1")
    local_rank = property(lambda self: self.runtime.local_rank, doc="this process's rank on its machine (its GPU)")
    world_size = property(lambda self: self.runtime.world_size, doc="how many processes the job has in all")

    @property
    def is_main(self) -> bool:
        """Global rank 0, the one that prints and saves; under replica groups, that of the group that led the
        last step."""
        return self.runtime.is_main and (self.replica is None or self.replica.leads)

    device = property(lambda self: self.runtime.device, doc="the torch.device this rank computes on")
    backend = property(lambda self: self.runtime.backend, doc="the process group's backend (nccl, gloo; None: none)")
    env = property(lambda self: self.runtime.env, doc="where this process stands, as its launcher said (DistEnv)")

    @property
    def data_replicas(self) -> int:
        """How many ways the data is split (the world size, or the pipelines' count)."""
        return self.strategy.data_part(self.rank, self.world_size)[1]

    # -- lifetime

    def close(self) -> None:
        """Tear the process group down (safe to call twice)."""
        self._stack.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> bool:
        if exc[0] is None and self.replica is not None:
            self.replica.finish()  # a group restarted from now on stops at once instead of training alone
        return bool(self._stack.__exit__(*exc))

    def _join_replica_groups(self, given, stall_timeout_s: float | None):
        """This process's ``ReplicaGroup`` (``given``, or under ``ddpkit run --replica-groups`` one made here), its
        settings checked; None outside replica groups, or with ``given=False`` (``ddpkit train`` drives its own)."""
        if given is False or (given is None and not in_replica_groups()):
            return None
        if given is None:
            from ddpkit.strategies.replica_groups import ReplicaGroup, settings_for

            given = ReplicaGroup(**settings_for(heartbeat.stall_setting(stall_timeout_s)))
        self._stack.callback(given.close)
        self._loop = replica_loop.Loop(self, given)
        return given

    # -- model, optimizer, data

    def setup(self, model: nn.Module, optimizer_class: type | None = None, *, example: torch.Tensor | None = None,
              **optimizer_settings):
        """The model wrapped for the strategy on this rank's device, and (given ``optimizer_class``) its
        optimizer over the wrapped parameters: ``(model, optimizer)``; only the model without one.

        ``example``: a batch of inputs on the CPU, which pipelines need to size their stages.
        """
        wrapped = self._setup_model(model, example)
        if optimizer_class is None:
            if self.replica is not None:
                raise UsageError("under replica groups the model and its optimizer are wrapped together: "
                                 "job.setup(model, OptimizerClass, ...) or job.prepare(model, optimizer, ...)")
            return wrapped
        optimizer = self._counted(self.strategy.make_optimizer(optimizer_class, wrapped, **optimizer_settings))
        return self._in_replica_groups(wrapped, optimizer)

    def _setup_model(self, model: nn.Module, example: torch.Tensor | None) -> nn.Module:
        """``model`` wrapped for the strategy, with the job's hooks (the replica groups' wrapping comes after)."""
        if self.sync_bn:
            model = convert_sync_batchnorm(model, self.runtime)
        if self.strategy.needs_group and not self.strategy.syncs_weights:
            process_group.broadcast_state(model, self.runtime)  # every rank starts from rank 0's weights
        wrapped = self.strategy.wrap(model, self.runtime, example=example)
        self._models.append(wrapped)
        # Any forward of the model, the bare module's too (an evaluation of one's own), is this rank at work.
        strategies.unwrap(wrapped).register_forward_pre_hook(lambda module, args: progress.touch())
        if self.strategy.replicated and self.world_size > 1:
            self._weights_compared = list(strategies.unwrap(wrapped).named_parameters())
        if progress.current() is not None:
            self.strategy.mark_waits(wrapped)  # this rank's waits for the others apart from its own work
        if self.accumulate > 1:
            # Set before each forward (DDP reads it there): reduce gradients on the last micro-step only.
            wrapped.register_forward_pre_hook(lambda module, args: self.strategy.set_gradient_sync(
                module, self.micro_step == self.accumulate - 1, first_backward=not self._backward_done))
        return wrapped

    def _in_replica_groups(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """``(model, optimizer)`` wrapped for the replica groups (unchanged outside them)."""
        if self.replica is None:
            return model, optimizer
        return self.replica.setup(model, optimizer, state={"job": self._loop})

    def prepare(self, *objects, example: torch.Tensor | None = None):
        """The script's own objects, ready for this job, returned in the order given (one object: itself).

            model, optimizer, scheduler, train_dl, val_dl = job.prepare(model, optimizer, scheduler, train_dl, val_dl)

        A model (``nn.Module``) is wrapped as ``setup`` does. An optimizer made over a model's parameters keeps
        driving it: the same object where wrapping kept the tensors, pointed at FSDP's shards under fsdp, ZeRO's
        under zero (its LR scheduler follows). A DataLoader is rebuilt around this rank's share, keeping its
        collate_fn, batch size (now per process), workers, pin_memory, drop_last, worker_init_fn and the rest: one
        that shuffles is a training loader (``train_loader``), one that does not an evaluation loader, every sample
        on exactly one rank (``eval_loader``); give a loader that must not shuffle for training to
        ``job.train_loader(loader, shuffle=False)``. A pass over a shuffling one that begins with the model in eval
        mode or under ``torch.no_grad()`` is an evaluation, and reads every sample once (one helper often makes a
        script's training and test loaders alike). None comes back as None (an optional scheduler, say). Then
        ``loss.backward()`` and ``optimizer.step()`` work as before (``job.backward`` and ``job.step`` add amp scaling
        and accumulation), and ``job.global_step`` counts the optimizer's steps. A wrapped model's ``state_dict()``
        is the bare model's (no ``module.`` prefix), and its ``load_state_dict`` takes either.
        """
        ready = list(objects)
        names: dict[int, str] = {}
        models: dict[int, nn.Module] = {}  # id of each parameter before wrapping -> the wrapped model
        for index, thing in enumerate(objects):
            if isinstance(thing, nn.Module):
                before = {id(p): name for name, p in thing.named_parameters()}
                ready[index] = self._setup_model(thing, example)
                names.update(before)
                models.update(dict.fromkeys(before, ready[index]))
        adopted = {}
        for index, thing in enumerate(objects):
            if isinstance(thing, torch.optim.Optimizer):
                ready[index] = adopted[id(thing)] = self._adopt(thing, models, names)
            elif isinstance(thing, (DataLoader, data.DeviceLoader)):
                ready[index] = self._loader_for(thing)
            elif thing is not None and not isinstance(thing, (nn.Module, torch.optim.lr_scheduler.LRScheduler)):
                raise UsageError(f"`prepare` takes models, optimizers, LR schedulers and DataLoaders (and None, handed "
                                 f"back as it is), not {type(thing).__name__}")
        for index, thing in enumerate(objects):
            if isinstance(thing, torch.optim.lr_scheduler.LRScheduler):
                ready[index] = follow(thing, adopted.get(id(thing.optimizer), thing.optimizer))
                if self.replica is not None:
                    self._loop.follow_commits(ready[index])
        if self.replica is not None:
            self._prepare_for_replica_groups(ready)
        return ready[0] if len(ready) == 1 else tuple(ready)

    def _prepare_for_replica_groups(self, ready: list) -> None:
        """The one model and its optimizer among ``ready`` wrapped for the replica groups, in place."""
        models = [index for index, thing in enumerate(ready) if isinstance(thing, nn.Module)]
        optimizers = [index for index, thing in enumerate(ready) if isinstance(thing, torch.optim.Optimizer)]
        if len(models) != 1 or len(optimizers) != 1:
            raise UsageError(f"under replica groups, prepare one model with its optimizer in one call (got "
                             f"{len(models)} model(s) and {len(optimizers)} optimizer(s))")
        ready[models[0]], ready[optimizers[0]] = self._in_replica_groups(ready[models[0]], ready[optimizers[0]])

    def _adopt(self, optimizer: torch.optim.Optimizer, models: dict[int, nn.Module], names: dict[int, str]):
        owners = {id(models[id(p)]) for group in optimizer.param_groups for p in group["params"] if id(p) in models}
        if not owners:  # made over a model prepared before (its wrapped parameters): only its steps to count
            return self._counted(optimizer)
        model = next(model for model in models.values() if id(model) in owners)
        return self._counted(self.strategy.adopt_optimizer(optimizer, model, names))

    def _loader_for(self, loader) -> data.DeviceLoader:
        if isinstance(loader, data.DeviceLoader):  # made by ddpkit already: this rank's share
            if loader not in self.loaders:
                self.loaders.append(loader)
            return loader
        shuffles, _ = data.loaders.sampling_of(loader)
        if not shuffles:
            return self.eval_loader(loader)
        # Taken for training because it shuffles, which an evaluation loader may do too (one helper makes both): a
        # pass begun with the model in eval mode, or without gradients, is an evaluation, every sample once.
        prepared = self.train_loader(loader)
        prepared.is_evaluation = self._evaluating
        return prepared

    def _evaluating(self) -> bool:
        """Whether a pass begun now over a loader ``prepare`` took for training is an evaluation: gradients are off,
        or every model this job wrapped is in eval mode."""
        return not torch.is_grad_enabled() or (bool(self._models) and not any(
            strategies.unwrap(model).training for model in self._models))

    def _counted(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer``, whose every step (``job.step``'s or the script's own ``optimizer.step()``) counts in
        ``global_step`` and in the watch over this rank."""
        optimizer.register_step_post_hook(lambda *_: None if self._in_step else self._stepped())
        return optimizer

    def _stepped(self) -> None:
        self._backward_done = True  # a step follows a backward
        signals.started()  # from the first step on, a stop waits for the step's end (ddpkit.stop_on_signal)
        for loader in self.loaders:
            if loader.in_evaluation_pass:
                raise UsageError(
                    "the optimizer stepped in a pass over a training loader that was dealt as an evaluation, each "
                    "sample on one rank (the pass began with the model in eval mode, or without gradients): call "
                    "model.train() before a training loop, or, for a model that trains in eval mode (frozen "
                    "BatchNorm), make the loader with job.train_loader(loader) rather than job.prepare")
        if self.replica is not None:
            self._loop.after_commit()  # the groups' step count (it jumps when this group copied their state)
        else:
            self.global_step += 1
        if self._weights_compared and self.check_replicas and self.global_step % self.check_replicas == 0:
            replicas.check(self._weights_compared, self.runtime, step=self.global_step)
        progress.mark("data", self.global_step)

    def train_loader(self, dataset, batch_size: int | None = None, **options) -> data.DeviceLoader:
        """``ddpkit.train_loader`` for this job: this rank's share of a data set or of the script's own DataLoader,
        the job's seed, whole accumulation steps. ``replica=(index, count)``: another split of the data than the
        ranks' (``ddpkit train --replica-groups`` splits it over the groups)."""
        seed = options.pop("seed", self.seed)
        replica = options.pop("replica", None) or self._data_part()
        loader = data.train_loader(dataset, batch_size, runtime=self.runtime, seed=seed, accumulate=self.accumulate,
                                   replica=replica, **options)
        self.loaders.append(loader)
        # An evaluation over it (job.evaluate, or a pass begun without gradients) reads every sample once, not the
        # training pass's padded one; a padded pass that took no optimizer step is said once in a warning.
        eval_options = {key: value for key, value in options.items() if key not in ("shuffle", "drop_last")}
        loader.evaluation_twin = lambda: data.eval_loader(
            dataset, batch_size, runtime=self.runtime, replica=self.strategy.data_part(self.rank, self.world_size),
            lockstep=self.strategy.eval_lockstep, **eval_options)
        loader.is_evaluation = lambda: not torch.is_grad_enabled()
        loader.steps = lambda: self.global_step
        if self.replica is not None:  # a restarted group joins before its loop; a dropped step's batch comes again
            loader.before_use, loader.replay = self._loop.join, self._loop.replay
            self._loop.loaders.append(loader)
        return loader

    def _data_part(self) -> tuple[int, int]:
        """(index, count): this rank's part of the training data; under replica groups, this group's."""
        if self.replica is not None:
            return self.replica.data_part
        return self.strategy.data_part(self.rank, self.world_size)

    def eval_loader(self, dataset, batch_size: int | None = None, **options) -> data.DeviceLoader:
        """``ddpkit.eval_loader`` for this job: every validation sample (of a data set, or of the script's own
        DataLoader) on exactly one data replica."""
        loader = data.eval_loader(dataset, batch_size, runtime=self.runtime,
                                  replica=self.strategy.data_part(self.rank, self.world_size),
                                  lockstep=self.strategy.eval_lockstep, **options)
        self.loaders.append(loader)
        return loader

    # -- the step

    def autocast(self):
        """Mixed precision for the forward (a no-op with ``amp="off"``)."""
        return autocast(self.device, self.amp)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, divided over the micro-steps and scaled for fp16."""
        progress.mark("backward")
        self.scaler.scale(loss / self.accumulate).backward()
        self._backward_done = True

    def sync_gradients(self, model: nn.Module, enabled: bool = True) -> None:
        """Whether the next forward and backward of ``model`` reduce its gradients over the ranks: pass False on the
        micro-steps of an accumulation but the last, in a loop of the script's own (DDP's ``no_sync``, FSDP's
        ``set_requires_gradient_sync``: the strategy knows which). ``Job(accumulate=K)`` with ``job.backward`` and
        ``job.step`` does it by itself.

            job.sync_gradients(model, micro_step == accumulation_steps - 1)
        """
        self.strategy.set_gradient_sync(model, enabled, first_backward=not self._backward_done)

    def forward_backward(self, model: nn.Module, inputs, targets, loss_fn=F.cross_entropy) -> torch.Tensor | None:
        """``autocast``, ``loss_fn(model(inputs), targets)`` and ``backward`` in one call: the form that also
        runs pipelines, whose schedule does both (their loss is cross-entropy). None where a rank has no loss."""
        return self.strategy.forward_backward(model, inputs, targets, loss_fn, self.backward, self.autocast)

    def step(self, optimizer: torch.optim.Optimizer, scheduler=None) -> bool:
        """Count one micro-step; on the last of ``accumulate``, step the optimizer (unscaling and clipping
        first), the scaler and the scheduler, and zero the gradients. True when it stepped."""
        progress.mark("optimizer")
        self.micro_step += 1
        if self.micro_step < self.accumulate:
            progress.mark("data")
            return False
        self.micro_step = 0
        if self.clip_grad_norm is not None:
            self.scaler.unscale_(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        if self.replica is not None and scheduler is not None:
            self._loop.follow_commits(scheduler)  # before the step: a state copied in it brings the scheduler's
        self._in_step = True
        try:
            self.scaler.step(optimizer)  # may skip the optimizer's step (fp16 overflow); the job's step counts
        finally:
            self._in_step = False
        self.scaler.update()
        if self.replica is not None and not self._loop.committed():
            optimizer.zero_grad(set_to_none=True)  # dropped: the loader hands the same batch again
            return False
        if scheduler is not None:
            scheduler.step()
        self._stepped()  # before the next step's quorum (zero_grad's): a joining group copies what it notes
        optimizer.zero_grad(set_to_none=True)
        return True

    # -- evaluation, output

    def evaluate(self, model: nn.Module, loader, loss_fn=F.cross_entropy, *, topk=(1,), report: bool = True) -> tuple:
        """``(loss, accuracy, count)`` over the whole validation set, each sample once, with rank 0's BatchNorm
        statistics on every rank (what ``save_model`` writes); ``topk=(1, 5)``: ``(loss, top1, top5, count)``;
        ``topk=()``: ``(loss, count)``. Per token for a language model's outputs, on the first item of a model
        that returns a tuple (``ddpkit.evaluate``). Every rank calls it. Under Ray Train (``report``, the default)
        the result also goes to ``ray.train.report`` as ``val_loss``, ``val_acc`` (or ``val_top1``, ``val_top5``),
        ``val_count`` and ``global_step``, from every rank (``ddpkit.core.ray_reports``); elsewhere ``report`` does
        nothing.

            loss, top1, top5, count = job.evaluate(model, val_loader, topk=(1, 5))
        """
        progress.mark("evaluate")
        self.strategy.sync_buffers(model, self.runtime)
        if isinstance(loader, data.DeviceLoader):
            loader = loader.for_evaluation()  # a training loader's data, each sample once (not its padded pass)
        with self._between_steps():
            result = evaluate(self.strategy.eval_module(model), loader, self.runtime, self.amp,
                              lockstep=self.strategy.eval_lockstep, loss_fn=loss_fn, topk=topk)
        if report:
            ray_reports.report(evaluation_metrics(result, topk, self.global_step))
        return result

    def _between_steps(self):
        """A block between two steps that the replica groups' fence does not time (evaluation, saving)."""
        return self.replica.paused() if self.replica is not None else contextlib.nullcontext()

    def sum(self, *values):
        """Each value (a number, or a tensor of any shape) added over all ranks, in one all-reduce; one value
        back for one given, a tuple for several. After a loop over an ``eval_loader``, where each sample is on
        exactly one rank, the sums count every sample once. Every rank calls it.

            loss_sum, correct, count = job.sum(loss_sum, correct, count)
        """
        total = sums(values, self.runtime)
        return total[0] if len(values) == 1 else tuple(total)

    def gather(self, *tensors: torch.Tensor):
        """Every rank's rows of each tensor, concatenated (in rank order) on every rank; one tensor back for one
        given. For metrics over all predictions (AUC, F1): gather once after the loop. Every rank calls it.

            predictions, labels = job.gather(torch.cat(predictions), torch.cat(labels))
        """
        every = gather(tensors, self.runtime)
        return every[0] if len(tensors) == 1 else tuple(every)

    def busy(self):
        """``with job.busy():`` around work one rank does alone while the others wait (a large file written by
        rank 0, say), so that the stall watch (``stall_timeout_s``) does not end the job for it."""
        return progress.busy()

    def compare_ranks(self) -> dict:
        """Each rank's own step time since the last call (its data, forward, backward and optimizer time,
        without its waits for the others) side by side: ``rank_step_time_s`` (one per rank), ``slowest_rank``,
        its ``slowdown_pct`` against the median of the other ranks, and ``slow_phase``, where its extra time
        goes (``ddpkit.watch.pace.compare``). Rank 0 warns when the same rank has stood out over the last two calls
        (more than 20% slower, and by more than the step-to-step noise of the others' step times), once, and again
        only if its slowdown grows by half (``ddpkit.watch.pace.SlowRanks``). Every rank calls it (one small
        all_gather), at the end of an epoch say; counting starts again."""
        rows = pace.gather_rows(self.pace, self.runtime)
        compared = pace.compare(rows)
        self.pace.reset()
        warning = self._slow_ranks.warning(compared, rows)
        if self.is_main:
            logger.debug(f"slowest rank {compared['slowest_rank']}: {compared['slowdown_pct']}% slower, its extra time "
                         f"{pace.over_noise(compared, rows):.1f} times the spread of the others' step times")
            if warning is not None:
                logger.warning(warning)
        return compared

    def print(self, *args, **kwargs) -> None:
        """``print`` on global rank 0 only (flushed, unless ``flush=False``)."""
        if self.is_main:
            kwargs.setdefault("flush", True)
            print(*args, **kwargs)

    def reduce_sums(self, values: list[float]) -> list[float]:
        """Each value added over all ranks (float64): ``job.sum`` for a list."""
        return data.reduce_sums(values, self.runtime)

    def state_dict(self) -> dict[str, Any]:
        """What the job knows of the run, for a checkpoint of the script's own: every loader's position (mid-epoch
        too), every rank's random states, the optimizer steps and the grad scaler. Every rank calls it (the
        random states are gathered); ``load_state_dict`` puts it back.

            job.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "job": job.state_dict()}, path)
        """
        mine = checkpoint.rng_state(self.device)
        every: list = [mine]
        group = process_group.control_group(self.runtime)
        if group is not None:
            every = [None] * self.world_size
            dist.all_gather_object(every, mine, group=group)
        return {"loaders": [loader.state_dict() for loader in self.loaders], "rng": every,
                "global_step": self.global_step, "scaler": self.scaler.state_dict(), "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``: the loaders (in the order they were made) resume where they were,
        mid-epoch; this rank's random states come back when the world size is the one that saved them (another
        world size continues from its own); the step count and the grad scaler. Call it right before the loop."""
        loaders = state.get("loaders", [])
        if len(loaders) != len(self.loaders):
            raise UsageError(f"the saved job state has {len(loaders)} loader position(s), this job made "
                             f"{len(self.loaders)} loader(s): make the same loaders, in the same order, before loading")
        for loader, position in zip(self.loaders, loaders):
            loader.load_state_dict(position)
        self.global_step = int(state.get("global_step", 0))
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if state.get("world_size") == self.world_size and state.get("rng"):
            checkpoint.set_rng_state(state["rng"][self.rank], self.device)

    def save(self, obj: Any, path: str | os.PathLike) -> None:
        """``torch.save(obj, path)`` by rank 0 only, atomically (a crash leaves the old file or the new one, never
        a torn one); the other ranks go on. Call it from every rank, or from rank 0 alone: it has no collective.
        Under fsdp a model's ``state_dict()`` is each rank's shard: save ``job.full_model_state(model)`` instead."""
        if self.is_main:
            with progress.busy(), self._between_steps():  # working alone while the others may wait: not a stall
                checkpoint.atomic_save(obj, path)

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The bare model's state_dict, on the CPU, on rank 0 (None elsewhere). Every rank calls it."""
        return snapshot(self.strategy.full_model_state(model, self.runtime))

    def save_model(self, model: nn.Module, path: str | os.PathLike) -> None:
        """Write the bare model's state_dict atomically from rank 0 (every rank calls it)."""
        progress.mark("checkpoint")
        with self._between_steps():
            state = self.full_model_state(model)
            if self.is_main:
                checkpoint.atomic_save(state, path)
            process_group.barrier(self.runtime)

    def checkpointer(self, folder: str | os.PathLike, *, model: nn.Module | None = None, optimizer=None, scheduler=None,
                     loader=None, **options) -> checkpoint.Checkpointer:
        """A ``ddpkit.Checkpointer`` on ``folder`` for this job's strategy, handed the (wrapped) model, the
        optimizer, scheduler and loader, the job's grad scaler and its step count: then ``save()`` and
        ``resume(source)`` take no other argument. ``options``: ``keep``, ``log``, ``writer``, ``sharded`` (None:
        sharded under fsdp and zero), ``async_save``. Under replica groups the group that led the last step
        writes, and a restarted group's ``resume`` copies the live groups' state instead of reading a checkpoint
        (it reads one when every group restarted)."""
        kind = checkpoint.Checkpointer if self.replica is None else GroupCheckpointer
        if self.replica is not None and scheduler is not None:
            self._loop.follow_commits(scheduler)
        return kind(folder, self.runtime, strategy=self.strategy, model=model, optimizer=optimizer,
                    scheduler=scheduler, scaler=self.scaler, loader=loader, progress=self, **options)


class GroupCheckpointer(checkpoint.Checkpointer):
    """A ``Checkpointer`` under replica groups (``progress`` is the ``Job``): only the group that led the last step
    writes, outside the fence's clock; ``resume`` in a restarted group copies the live groups' state instead."""

    def save(self, **options):
        if not self.progress.replica.leads:  # every process of the leading group (a save is collective in it)
            return None
        with self.progress.replica.paused():
            return super().save(**options)

    def resume(self, source: str | os.PathLike | None = "auto"):
        return self.progress._loop.join(read=lambda: super(GroupCheckpointer, self).resume(source))


def evaluation_metrics(result: tuple, topk, global_step: int) -> dict:
    """``Job.evaluate``'s result by name: val_loss, val_acc (one k of 1) or val_top<k> for each k, val_count."""
    loss, *accuracies, count = result
    topk = tuple(topk)
    names = ["val_acc"] if topk == (1,) else [f"val_top{k}" for k in topk]
    return {"val_loss": float(loss), **{name: float(value) for name, value in zip(names, accuracies)},
            "val_count": int(count), "global_step": global_step}


def in_replica_groups() -> bool:
    """Whether ``ddpkit run --replica-groups`` started this process."""
    from ddpkit.core.env import REPLICA_GROUP

    return REPLICA_GROUP in os.environ


def check_replica_settings(strategy: strategies.Strategy, accumulate: int) -> None:
    """UsageError for a job's settings that replica groups cannot train with yet."""
    if not strategy.in_replica_groups:
        raise UsageError(f"replica groups train with the ddp or the fsdp strategy inside each group (data parallel "
                         f"across the groups) for now, not {strategy.name}")
    if accumulate != 1:
        raise UsageError(f"replica groups take one micro-step per optimizer step for now: `accumulate` must be 1, "
                         f"got {accumulate}")


def follow(scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer):
    """``scheduler``, driving ``optimizer`` where ``prepare`` replaced the one it was made with (ZeRO's)."""
    if scheduler.optimizer is optimizer:
        return scheduler
    scheduler.optimizer = optimizer
    step = optimizer.step
    if not hasattr(step, "_wrapped_by_lr_sched"):
        # What a scheduler does to the optimizer it is made with: note each step, so that its first step checks
        # that the optimizer's came first.
        def noted(*args, **kwargs):
            optimizer._opt_called = True
            return step(*args, **kwargs)

        noted._wrapped_by_lr_sched = True
        optimizer.step = noted
    return scheduler
