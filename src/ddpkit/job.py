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

Checkpoints: ``ckpt = job.checkpointer(folder, model=model, optimizer=optimizer, loader=loader)``, then
``ckpt.resume("auto")`` before the loop and ``ckpt.save()`` at any step boundary.

Change ``strategy`` ("single", "ddp", "zero", "fsdp", "pipeline", "dp"), ``amp`` ("off", "bf16", "fp16")
or ``accumulate`` and no other line changes. The job starts the process group when it is made (reading
rank and world size from torchrun, Slurm, mp.spawn, or none) and tears it down when the ``with`` block
ends, whatever ends it: an error (a collective's timeout is explained, naming the ranks that never
arrived), Ctrl-C or SIGTERM. Without ``with``, call ``job.close()`` at the end (it also runs at exit).
"""

from __future__ import annotations

import atexit
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddpkit import checkpoint, data, strategies
from ddpkit.core import progress
from ddpkit.watch import heartbeat, pace, replicas
from ddpkit.core import process_group
from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger
from ddpkit.core.snapshot import snapshot
from ddpkit.strategies.sync_bn import convert_sync_batchnorm

AMP_DTYPES = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class Job:
    """This process's part of a training job: rank, device, strategy, precision and accumulation.

    ``strategy``: a name from ``ddpkit.strategies.STRATEGIES`` with its settings as keywords (for example
    ``Job("ddp", static_graph=True)``, ``Job("pipeline", stages=2, microbatches=4)``), or a strategy
    object. ``amp``: autocast dtype for ``autocast()``; fp16 also scales the loss in ``backward``.
    ``accumulate``: micro-steps per optimizer step. ``seed``: seeds torch's RNG on every rank at start, so
    a model built next starts from the same weights everywhere. ``sync_bn``: BatchNorm statistics over the
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
    """

    def __init__(self, strategy: str | strategies.Strategy = "ddp", *, amp: str = "off", accumulate: int = 1,
                 seed: int | None = 0, sync_bn: bool = False, clip_grad_norm: float | None = None,
                 backend: str = "auto", device: str = "auto", timeout_s: float | None = None, environment=None,
                 log_level: str | None = None, stall_timeout_s: float | None = None, check_replicas: int | None = None,
                 status_file: str | os.PathLike | None = None, **strategy_settings):
        self.strategy = strategies.create(strategy, **strategy_settings)
        if amp not in AMP_DTYPES:
            raise UsageError(f"`amp` must be one of {', '.join(AMP_DTYPES)}, got {amp!r}")
        if accumulate < 1:
            raise UsageError(f"`accumulate` must be at least 1, got {accumulate}")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise UsageError(f"`clip_grad_norm` must be positive, got {clip_grad_norm}")
        self.strategy.check_training(accumulate=accumulate, amp=amp)
        self.amp, self.accumulate, self.seed, self.sync_bn = amp, accumulate, seed, sync_bn
        self.clip_grad_norm = clip_grad_norm
        self.check_replicas = replicas.check_every(check_replicas)
        self._weights_compared: list[tuple[str, torch.Tensor]] | None = None  # the weights compared: set by setup
        self._stack = contextlib.ExitStack()
        self.runtime = self._stack.enter_context(process_group.distributed(
            backend=backend, device=device, timeout_s=timeout_s, force_group=self.strategy.needs_group,
            environment=environment, log_level=log_level))
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
        if seed is not None:
            torch.manual_seed(seed)

    # -- who am I

    rank = property(lambda self: self.runtime.rank, doc="this process's global rank, 0 .. world_size - 1")
    local_rank = property(lambda self: self.runtime.local_rank, doc="this process's rank on its machine (its GPU)")
    world_size = property(lambda self: self.runtime.world_size, doc="how many processes the job has in all")
    is_main = property(lambda self: self.runtime.is_main, doc="global rank 0: the one that prints and saves")
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
        return bool(self._stack.__exit__(*exc))

    # -- model, optimizer, data

    def setup(self, model: nn.Module, optimizer_class: type | None = None, *, example: torch.Tensor | None = None,
              **optimizer_settings):
        """The model wrapped for the strategy on this rank's device, and (given ``optimizer_class``) its
        optimizer over the wrapped parameters: ``(model, optimizer)``; only the model without one.

        ``example``: a batch of inputs on the CPU, which pipelines need to size their stages.
        """
        if self.sync_bn:
            model = convert_sync_batchnorm(model, self.runtime)
        wrapped = self.strategy.wrap(model, self.runtime, example=example)
        if self.strategy.replicated and self.world_size > 1:
            self._weights_compared = list(strategies.unwrap(wrapped).named_parameters())
        if progress.current() is not None:
            self.strategy.mark_waits(wrapped)  # this rank's waits for the others apart from its own work
        if self.accumulate > 1:
            # Set before each forward (DDP reads it there): reduce gradients on the last micro-step only.
            wrapped.register_forward_pre_hook(lambda module, args: self.strategy.set_gradient_sync(
                module, self.micro_step == self.accumulate - 1, first_backward=not self._backward_done))
        if optimizer_class is None:
            return wrapped
        return wrapped, self.strategy.make_optimizer(optimizer_class, wrapped, **optimizer_settings)

    def train_loader(self, dataset, batch_size: int, **options) -> data.DeviceLoader:
        """``ddpkit.train_loader`` for this job: this rank's share, the job's seed, whole accumulation steps."""
        return data.train_loader(dataset, batch_size=batch_size, runtime=self.runtime,
                                 seed=options.pop("seed", self.seed or 0), accumulate=self.accumulate,
                                 replica=self.strategy.data_part(self.rank, self.world_size), **options)

    def eval_loader(self, dataset, batch_size: int, **options) -> data.DeviceLoader:
        """``ddpkit.eval_loader`` for this job: every validation sample on exactly one data replica."""
        return data.eval_loader(dataset, batch_size=batch_size, runtime=self.runtime,
                                replica=self.strategy.data_part(self.rank, self.world_size), **options)

    # -- the step

    def autocast(self):
        """Mixed precision for the forward (a no-op with ``amp="off"``)."""
        return autocast(self.device, self.amp)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, divided over the micro-steps and scaled for fp16."""
        progress.mark("backward")
        self.scaler.scale(loss / self.accumulate).backward()
        self._backward_done = True

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
        self.scaler.step(optimizer)
        self.scaler.update()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        if self._weights_compared and self.check_replicas and self.global_step % self.check_replicas == 0:
            replicas.check(self._weights_compared, self.runtime, step=self.global_step)
        progress.mark("data", self.global_step)
        return True

    # -- evaluation, output

    def evaluate(self, model: nn.Module, loader, loss_fn=F.cross_entropy) -> tuple[float, float, int]:
        """Mean loss, accuracy and count over the whole validation set, each sample once, with rank 0's
        BatchNorm statistics on every rank (what ``save_model`` writes). Every rank calls it."""
        progress.mark("evaluate")
        self.strategy.sync_buffers(model, self.runtime)
        return evaluate(self.strategy.eval_module(model), loader, self.runtime, self.amp,
                        lockstep=self.strategy.eval_lockstep, loss_fn=loss_fn)

    def busy(self):
        """``with job.busy():`` around work one rank does alone while the others wait (a large file written by
        rank 0, say), so that the stall watch (``stall_timeout_s``) does not end the job for it."""
        return progress.busy()

    def compare_ranks(self) -> dict:
        """Each rank's own step time since the last call (its data, forward, backward and optimizer time,
        without its waits for the others) side by side: ``rank_step_time_s`` (one per rank), ``slowest_rank``,
        its ``slowdown_pct`` against the median of the other ranks, and ``slow_phase``, where its extra time
        goes (``ddpkit.watch.pace.compare``). Rank 0 warns when the slowdown is over 20%. Every rank calls it (one
        small all_gather), at the end of an epoch say; counting starts again."""
        compared = pace.compare(pace.gather_rows(self.pace, self.runtime))
        self.pace.reset()
        warning = pace.slow_rank_warning(compared)
        if warning is not None and self.is_main:
            logger.warning(warning)
        return compared

    def print(self, *args, **kwargs) -> None:
        """``print`` on global rank 0 only."""
        if self.is_main:
            print(*args, flush=True, **kwargs)

    def reduce_sums(self, values: list[float]) -> list[float]:
        """Each value added over all ranks (float64)."""
        return data.reduce_sums(values, self.runtime)

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The bare model's state_dict, on the CPU, on rank 0 (None elsewhere). Every rank calls it."""
        return snapshot(self.strategy.full_model_state(model, self.runtime))

    def save_model(self, model: nn.Module, path: str | os.PathLike) -> None:
        """Write the bare model's state_dict atomically from rank 0 (every rank calls it)."""
        progress.mark("checkpoint")
        state = self.full_model_state(model)
        if self.is_main:
            checkpoint.atomic_save(state, path)
        process_group.barrier(self.runtime)

    def checkpointer(self, folder: str | os.PathLike, *, model: nn.Module | None = None, optimizer=None, scheduler=None,
                     loader=None, **options) -> checkpoint.Checkpointer:
        """A ``ddpkit.Checkpointer`` on ``folder`` for this job's strategy, handed the (wrapped) model, the
        optimizer, scheduler and loader, the job's grad scaler and its step count: then ``save()`` and
        ``resume(source)`` take no other argument. ``options``: ``keep``, ``log``, ``writer``, ``sharded`` (None:
        sharded under fsdp and zero), ``async_save``."""
        return checkpoint.Checkpointer(folder, self.runtime, strategy=self.strategy, model=model, optimizer=optimizer,
                                       scheduler=scheduler, scaler=self.scaler, loader=loader, progress=self,
                                       **options)


def autocast(device: torch.device, amp: str):
    """``torch.autocast`` to ``amp``'s dtype on ``device`` (a no-op context for ``"off"``)."""
    dtype = AMP_DTYPES[amp]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(model: nn.Module, loader, runtime: process_group.Runtime, amp: str = "off", *, lockstep: bool = False,
             loss_fn=F.cross_entropy) -> tuple[float, float, int]:
    """Mean loss, accuracy and sample count over the whole validation set, each sample counted once.

    ``lockstep``: every rank runs as many forwards as the rank with the most batches (a rank out of
    batches runs empty ones), for models whose forward is a collective (FSDP's all-gathers).
    """
    model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0.0
    for images, labels in lockstep_batches(loader, runtime) if lockstep else loader:
        progress.mark("evaluate")
        with autocast(runtime.device, amp):
            output = model(images)
        if output is None:  # a pipeline stage other than the last
            continue
        labels = labels.to(output.device)
        loss_sum += loss_fn(output.float(), labels, reduction="sum").item()
        correct += (output.argmax(dim=1) == labels).sum().item()
        count += labels.shape[0]
    model.train()
    loss_sum, correct, count = data.reduce_sums([loss_sum, correct, count], runtime)
    return loss_sum / max(count, 1.0), correct / max(count, 1.0), int(count)


def lockstep_batches(loader, runtime: process_group.Runtime):
    """The loader's batches, then empty batches shaped like them until every rank has run as many."""
    batches = torch.tensor([len(loader)], device=runtime.device if runtime.backend == "nccl" else "cpu")
    dist.all_reduce(batches, op=dist.ReduceOp.MAX)
    last = None
    for last in loader:
        yield last
    for _ in range(int(batches.item()) - len(loader)):
        if last is None:  # this rank holds no validation sample (fewer than ranks): shape one like the set's first
            image, label = loader.loader.dataset.dataset[0]
            last = [torch.as_tensor(image)[None].to(runtime.device), torch.as_tensor(label)[None].to(runtime.device)]
        yield [item[:0] for item in last]
