"""The epochs of a ``ddpkit train`` run (``EpochLoop``): the optimizer steps of each, with mid-epoch checkpoints and
the stop-signal check, then the epoch's evaluation and metrics record; written on ``Job``, as a script would."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import torch
import torch.nn as nn

from ddpkit.app.train.lr_schedule import place_scheduler
from ddpkit.app.train.records import memory, skipped_samples
from ddpkit.app.train.replicas import OthersFinished, Rejoined
from ddpkit.app.train.state import RunState
from ddpkit.core import logs, preempt, process_group
from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger
from ddpkit.launch import nccl


class EpochLoop:
    """The optimizer steps of each epoch, with mid-epoch checkpoints and the stop-signal check, then the
    epoch's evaluation and metrics record; ``ddpkit train``'s loop, written on ``Job``."""

    def __init__(self, run_state: RunState):
        self.run = run_state
        self.stop: preempt.StopSignal | None = None
        self.last_samples, self.last_partial = 0, [0.0, 0.0]  # where the last steps() ended, for a stop there
        self.skipped_before = skipped_samples(run_state)  # unreadable images left out so far, on this rank
        self.participants: list[int] = []  # under replica groups: the groups in each step committed this epoch

    def save(self, epoch: int, samples: int, partial: list[float], *, if_idle: bool) -> None:
        run = self.run
        if run.replica is not None and not run.replica.leads:
            return  # the group that led the last step writes the run's checkpoints (every process of it)
        with run.paused():
            self._save(epoch, samples, partial, if_idle=if_idle)

    def _save(self, epoch: int, samples: int, partial: list[float], *, if_idle: bool) -> None:
        run = self.run
        totals = [0.0, 0.0]
        if samples:  # mid-epoch (an epoch's end was checked by run_epoch): never a checkpoint of a diverged model
            # Every rank's non-finite parameters, summed with the epoch's partial loss: one all-reduce for both.
            loss_total, seen, broken = run.job.reduce_sums([*partial, float(nonfinite_parameters(run.model))])
            self.check_finite(loss_total, broken, epoch)
            totals = [loss_total, seen]
        run.ckpt.save(
            model=run.model, optimizer=run.optimizer, scheduler=run.scheduler, scaler=run.job.scaler,
            loader=run.loader, epoch=epoch, samples=samples, global_step=run.job.global_step,
            config=dataclasses.asdict(run.cfg), extra={"partial_total": totals},
            rank_state={"partial": [float(v) for v in partial]}, if_idle=if_idle, global_batch=run.global_batch,
        )

    def run_epoch(self, epoch: int) -> dict:
        """Train the epoch (from where a resume left it), evaluate, and return its metrics record."""
        run, job = self.run, self.run.job
        position = run.position
        start = position.samples if epoch == position.epoch else 0
        run.loader.load_state_dict({"epoch": epoch, "samples": start})
        started = time.perf_counter()
        train_loss, steps_run = self.steps(epoch, start, position.partial if start else [0.0, 0.0])
        ranks = job.compare_ranks()  # each rank's own step time this epoch: the slowest named
        self.check_finite(train_loss, job.reduce_sums([float(nonfinite_parameters(run.model))])[0], epoch)
        if self.stop is not None and self.stop.requested(now=True):
            # Signalled late in the epoch: stop before a long evaluation eats the grace period.
            self.stop_now(epoch, self.last_samples, self.last_partial, None)
        process_group.synchronize(job.device)
        elapsed = time.perf_counter() - started
        with run.paused():
            val_loss, val_acc, val_count = job.evaluate(run.model, run.val_loader, report=False)  # the epoch's, below
        record = {
            "epoch": epoch, "train_loss": train_loss, "val_loss": val_loss, "val_acc": val_acc, "val_count": val_count,
            "images_per_sec": steps_run * run.global_batch / elapsed, "epoch_time_s": elapsed,
            "world_size": job.world_size, "global_batch": run.global_batch, "steps": run.steps_per_epoch,
            "lr": run.optimizer.param_groups[0]["lr"], **memory(job, run.model, run.optimizer), **ranks,
            "nccl": nccl.in_effect(),
        }
        if run.replica is not None:
            record.update(self.replicas_record(elapsed))
        if start:
            record["resumed_at_step"] = run.steps_per_epoch - steps_run
        skipped = skipped_samples(run)
        if skipped is not None:  # image files: how many this epoch's passes left out, all ranks together
            record["skipped_samples"] = int(job.reduce_sums([float(skipped - self.skipped_before)])[0])
            self.skipped_before = skipped
        return record

    def replicas_record(self, elapsed: float) -> dict:
        """The replica groups that took part in this epoch's steps run here: how many on average and at least, the
        mean global batch they trained on, and the images per second that makes."""
        taken = self.participants or [self.run.replica.last_participants]
        mean = sum(taken) / len(taken)
        per_group = self.run.global_batch // self.run.replica.groups  # one micro-step per step under replica groups
        return {"replica_groups": self.run.replica.groups, "replicas": mean, "replicas_min": min(taken),
                "effective_global_batch": per_group * mean, "images_per_sec": per_group * sum(taken) / elapsed}

    def stepped(self, before: int) -> bool:
        """After ``job.step`` under replica groups: whether the step was committed (False: dropped, to be tried again
        on the same batch). Raises ``Rejoined`` when this group copied the others' state and jumped to their step."""
        run = self.run
        now = run.replica.step
        run.job.global_step = now
        place_scheduler(run.scheduler, now)  # the schedule follows the committed steps, not the tries
        if now == before:
            return False
        if now != before + 1:
            raise Rejoined(now)
        if run.replica.last_participants < run.replica.groups and run.replica.others_finished():
            raise OthersFinished  # alone now because the others are done: training on would redo their steps
        self.participants.append(run.replica.last_participants)
        return True

    def steps(self, epoch: int, start: int, partial: list[float]) -> tuple[float, int]:
        """Train from ``start`` samples into ``epoch``; return the epoch's mean loss and the steps run here."""
        run, job, cfg = self.run, self.run.job, self.run.cfg
        run.model.train()
        steps = len(run.loader) // cfg.accumulate
        progress = progress_bar(job.is_main and cfg.progress, steps * run.global_batch,
                                f"epoch {epoch + 1}/{cfg.epochs}")
        loss_sum = torch.tensor(partial[0], dtype=torch.float64, device=job.device)
        seen = partial[1]
        batches = iter(run.loader)
        self.participants = []
        for step in range(steps):
            for micro in range(cfg.accumulate):
                images, labels = next(batches)
                if step == 0 and micro == 0:
                    logger.debug(f"local rank {job.local_rank}, pid {os.getpid()}: data: {images.device}, "
                                 f"model: {next(run.model.parameters()).device}")
                while True:  # once, or under replica groups until a step on this batch is committed
                    before = job.global_step
                    loss = job.forward_backward(run.model, images, labels)
                    job.step(run.optimizer, run.scheduler)
                    if run.replica is None or self.stepped(before):
                        break
                if loss is not None:  # None: a pipeline stage other than the last has no loss
                    loss_sum += loss.detach().double() * labels.shape[0]
                    seen += labels.shape[0]
            if progress is not None:
                progress.update(run.global_batch)
            done = start + (step + 1) * run.global_batch
            if self.stop is not None and self.stop.requested():
                self.stop_now(epoch, done, [loss_sum.item(), seen], progress)
            every = cfg.checkpoint_every
            if every and job.global_step % every == 0 and step + 1 < steps:
                self.save(epoch, done, [loss_sum.item(), seen], if_idle=True)
        if progress is not None:
            progress.close()
        self.last_samples, self.last_partial = start + steps * run.global_batch, [loss_sum.item(), seen]
        # The loss in any single rank's batches is a sample; the epoch's loss is the sum over all ranks.
        total, count = job.reduce_sums([loss_sum.item(), float(seen)])
        return total / max(count, 1.0), steps

    def check_finite(self, loss: float, nonfinite: float, epoch: int) -> None:
        """Stop a diverged run before it writes anything more. ``loss`` and ``nonfinite`` (the parameters
        holding a NaN or infinity, summed over the ranks) are the same on every rank, so all stop together;
        rank 0 says why."""
        if math.isfinite(loss) and not nonfinite:
            return
        lr = self.run.optimizer.param_groups[0]["lr"]
        what = f"the train loss is {loss}" if not math.isfinite(loss) else "the model's parameters are not finite"
        raise UsageError(f"training diverged: {what} in epoch {epoch + 1}, by step {self.run.job.global_step}; "
                         f"no checkpoint or model.pt was written from there on. Lower `lr` (it is {lr:g} now), or "
                         "look for bad inputs", said_elsewhere=not self.run.job.is_main)

    def stop_now(self, epoch: int, samples: int, partial: list[float], progress) -> None:
        """Every rank got here at the same step: write one checkpoint, wait for it, leave."""
        if progress is not None:
            progress.close()
        self.save(epoch, samples, partial, if_idle=False)
        self.run.ckpt.wait()
        # Every rank says it (a warning): which ranks stopped where is the evidence of a clean stop.
        logger.warning(f"stopped by {self.stop.signal_name} at epoch {epoch + 1}, step {self.run.job.global_step}; "
                       f"checkpoint {self.run.ckpt.last_path or 'written by rank 0'}")
        raise preempt.StopNow(self.stop.exit_code)


def nonfinite_parameters(model: nn.Module) -> int:
    """How many of this rank's parameters (or shards of them) hold a NaN or an infinity."""
    flags = [torch.isfinite(p).all() for p in model.parameters()]
    return int((~torch.stack(flags)).sum().item()) if flags else 0


def progress_bar(shown: bool, images: int, description: str):
    """A bar over an epoch's ``images`` (global images, so its rate reads as images/s and its ETA as the time left in
    the epoch) when ``shown``, else None."""
    if not shown:
        return None
    from tqdm import tqdm

    # disable=None: only on a terminal, so logs and CI output stay free of carriage returns. Where the launcher
    # keeps this rank's output in a file, the bar goes straight to the launcher's terminal, if it has one.
    stream = logs.launcher_terminal() or sys.stderr
    return tqdm(total=images, desc=description, unit="img", unit_scale=True, disable=None, leave=False, file=stream)
