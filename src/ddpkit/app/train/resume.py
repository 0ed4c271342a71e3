"""Resuming a ``ddpkit train`` run: the checkpointer opened on ``--output-dir`` and the checkpoint ``--resume``
names loaded, then the optimizer, scaler and random states restored, the schedule placed at the step, and what
changed since the checkpoint's run said in one line each."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch.nn as nn

from ddpkit import checkpoint
from ddpkit.app.train.lr_schedule import place_scheduler
from ddpkit.app.train.config import TrainConfig
from ddpkit.app.train.replicas import opens_the_run
from ddpkit.app.train.state import Position, RunState
from ddpkit.core.logs import logger
from ddpkit.job import Job


def open_checkpoints(cfg: TrainConfig, job: Job, model: nn.Module, replica=None) -> tuple[checkpoint.Checkpointer, Any]:
    """The run's Checkpointer, and the checkpoint to resume (its weights loaded into the bare model), if any."""
    folder = os.path.join(cfg.output_dir, checkpoint.FOLDER)
    source = cfg.resume
    if replica is not None and replica.restarts > 0:
        # A replica group's process restarted: the others go on, and it copies their state at its first step; the
        # newest checkpoint only brings it close (less to copy when they have all died).
        source = "auto" if checkpoint.list_checkpoints(folder) else None
    elif job.env.restart_count > 0 and (source is None or checkpoint.list_checkpoints(folder)):
        # torchrun restarted the group after a failure: carry on from this run's newest checkpoint (a
        # --resume PATH was the starting point of the first attempt only).
        source = "auto"
        logger.info(f"restart {job.env.restart_count} of the group: resuming from the newest checkpoint")
    if source is None and job.is_main and opens_the_run(replica):
        moved = checkpoint.set_aside(folder)
        if moved is not None:
            logger.info(f"starting fresh (no --resume); the earlier run's checkpoints were moved to {moved}")
    sharded = {"auto": None, "full": False, "sharded": True}[cfg.checkpoint_format]
    ckpt = job.checkpointer(folder, keep=cfg.keep_checkpoints, sharded=sharded, async_save=cfg.async_checkpoint)
    # Weights go into the bare model, before wrapping; the rest once the optimizer exists.
    resumed = ckpt.load(source, model=model)
    if source == "auto" and resumed is None:
        logger.info(f"--resume auto: no checkpoint in {folder}, starting fresh")
    return ckpt, resumed


def restore(run_state: RunState, resumed) -> Position:
    """Load the optimizer, schedule, scaler and RNG; say what changed; return where to continue."""
    cfg, job = run_state.cfg, run_state.job
    contents = resumed.contents
    # The schedule is not loaded: it is a function of the step, placed there below, from this run's
    # --lr (the checkpoint's, unless --lr changed it), which the scheduler took when it was built.
    resumed.restore(optimizer=run_state.optimizer, scaler=job.scaler, model=run_state.model)
    samples, steps_per_epoch = resumed.samples, run_state.steps_per_epoch
    step_in_epoch = samples // run_state.global_batch
    # The schedule counts optimizer steps of this run's size, whatever size wrote the checkpoint.
    place_scheduler(run_state.scheduler, resumed.epoch * steps_per_epoch + step_in_epoch)
    if resumed.epoch >= cfg.epochs:
        where = f"nothing left to train: it ends epoch {resumed.epoch} and --epochs is {cfg.epochs}"
    else:
        where = ("continuing at epoch " + str(resumed.epoch + 1)
                 + (f" after {samples} samples (step {step_in_epoch} of {steps_per_epoch})" if samples else ""))
    logger.info(f"resumed from {resumed.path} ({contents.layout}): {where}")
    if not contents.from_ddpkit:
        parts = ["weights"] + (["optimizer"] if contents.optimizer is not None else [])
        logger.info(f"that file holds {' and '.join(parts)} only: no RNG or data position, so the run "
                    "continues from an epoch's start, not bit for bit")
    say_what_changed(run_state, resumed)
    partial = resumed.rank_state.get("partial") if resumed.same_world_size else None
    if partial is None:
        # Another world size: the epoch's running loss so far goes to rank 0, which adds it up anyway.
        totals = contents.extra.get("partial_total") if contents.extra else None
        partial = list(totals) if (totals and job.is_main) else [0.0, 0.0]
    return Position(epoch=resumed.epoch, samples=samples, partial=list(partial),
                    global_step=resumed.global_step or resumed.epoch * steps_per_epoch + step_in_epoch)


def say_what_changed(run_state: RunState, resumed) -> None:
    """Settings and global batch that differ from the checkpoint's run, in one line each."""
    cfg, job, global_batch = run_state.cfg, run_state.job, run_state.global_batch
    config = resumed.contents.config
    if config:
        changed = [f"{key} {config[key]!r} -> {value!r}" for key, value in dataclasses.asdict(cfg).items()
                   if key in config and config[key] != value and key not in RESUME_FREE]
        if changed:
            logger.info(f"settings differ from the checkpoint's run: {', '.join(changed)}")
    if resumed.global_batch is not None and resumed.global_batch != global_batch:
        per_process = job.data_replicas * cfg.accumulate
        keep = (f"; to keep global batch {resumed.global_batch}, pass --batch-size {resumed.global_batch // per_process}"
                if resumed.global_batch % per_process == 0 else "")
        logger.info(f"the checkpoint was written with global batch {resumed.global_batch} "
                    f"({resumed.world_size} process(es)); this run's is {global_batch} ({job.world_size} x "
                    f"{cfg.batch_size}{f' x {cfg.accumulate}' if cfg.accumulate > 1 else ''}). The data order "
                    f"continues where it stopped; the learning rate is not rescaled{keep}")
    elif resumed.world_size is not None and not resumed.same_world_size:
        logger.info(f"the checkpoint was written by {resumed.world_size} process(es), now "
                    f"{job.world_size}: the same global batch {global_batch}; the ranks' random states are not "
                    "restored (they continue from the seed)")
    if resumed.world_size is not None and not resumed.same_world_size and not cfg.sync_bn and has_batchnorm(run_state.model):
        logger.warning(f"the model has BatchNorm, which normalises each process's own batch: {job.world_size} "
                       f"process(es) of {cfg.batch_size} now, {resumed.world_size} before, so the run does not go on "
                       "as it would have even with the same global batch; --sync-bn normalises over the global batch")


BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(module, BATCHNORMS) for module in model.modules())


# Fields that may change between an interrupted run and its resumption without comment.
RESUME_FREE = {"resume", "epochs", "decode", "debug", "log_level", "progress", "workers", "output_dir", "timeout", "stall_timeout",
               "check_replicas", "checkpoint_every", "keep_checkpoints"}
