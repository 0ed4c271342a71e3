"""What a ``ddpkit train`` run says and keeps: its opening line, each epoch's record (``metrics.jsonl``, one JSON
line per epoch, with every rank's memory and the image files left out), and the epoch's line on the console."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit import checkpoint
from ddpkit.app.train.state import RunState
from ddpkit.core import process_group
from ddpkit.core.errors import disk_full
from ddpkit.core.logs import logger
from ddpkit.data import images
from ddpkit.job import Job
from ddpkit.watch import status

METRICS_FILE = status.METRICS_FILE


def image_loading(data: images.ImageData, workers: int) -> str:
    """Where image files are decoded, and by how many loader processes (``announce``'s words)."""
    who = f"{workers} loader process{'es' if workers != 1 else ''}" if workers else "the training process"
    if data.decode == "gpu":
        return f" (JPEGs decoded on the GPU; files read by {who})"
    return f" (JPEGs decoded by {who})"


def announce(run_state: RunState, sets, n_params: int) -> None:
    cfg, job = run_state.cfg, run_state.job
    replicas = job.data_replicas
    stages = job.world_size // replicas
    split = (f"pipeline x {replicas} pipeline(s) of {stages} stages ({cfg.microbatches or 2 * stages} micro-batches, "
             f"{cfg.pipeline_schedule})" if replicas != job.world_size
             else f"process x {job.world_size} processes")
    say = logger.info if run_state.replica is None or run_state.replica.group == 0 else logger.debug  # said once
    say(
        f"{job.world_size} process(es) via {job.env.launcher}, backend {job.backend or 'none'}, device "
        f"{job.device.type}, strategy {cfg.strategy}; model {cfg.model} ({n_params:,} parameters); data {cfg.data}: "
        f"{len(sets.train)} train / {len(sets.val)} val"
        + (image_loading(sets.train, run_state.loader.loader.num_workers)
           if isinstance(sets.train, images.ImageData) else "")
        + f"; batch {cfg.batch_size} per {split}"
        + (f" x {run_state.replica.groups} replica groups" if run_state.replica is not None else "")
        + (f" x {cfg.accumulate} micro-steps" if cfg.accumulate > 1 else "")
        + f" = global batch {run_state.global_batch}; {run_state.steps_per_epoch} steps per epoch"
    )


def replicas_said(record: dict) -> str:
    """The epoch line's words on the replica groups that took part, when some did not."""
    words = status.replicas_words(record)
    return f"  {words}" if words else ""


def append_record(path: str, record: dict) -> None:
    """``record`` as one more JSON line of ``path``; a full disk is said as such, naming the file."""
    try:
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
    except OSError as error:
        full = disk_full(error, writing=path)
        if full is None:
            raise
        raise full from None


def keep_metrics_before(path: str, epoch: int) -> None:
    """metrics.jsonl keeps the lines of the epochs before ``epoch`` (all of a fresh run's are dropped)."""
    kept = []
    if epoch > 0 and os.path.exists(path):
        with open(path) as handle:
            for line in handle:
                try:
                    if json.loads(line)["epoch"] < epoch:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a crash
    checkpoint.atomic_write(path, lambda handle: handle.write("".join(kept).encode()))


def skipped_samples(run: RunState) -> int | None:
    """Unreadable image files this rank's loaders have left out so far; None when the data are not image files."""
    counts = [dataset.skipped for dataset in (run.loader.dataset, run.val_loader.dataset)
              if isinstance(dataset, images.ImageData)]
    return sum(counts) if counts else None


def memory(job: Job, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[float]]:
    """Per rank, in MiB: the peak memory (the GPU's allocated peak; on CPU the process's peak resident set)
    and what the training state takes (parameters, gradients, optimizer state: FSDP and ZeRO shrink it)."""
    if job.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(job.device)
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    mine = torch.tensor([peak, job.strategy.train_state_bytes(model, optimizer)], dtype=torch.float64) / 2**20
    every = [mine]
    group = process_group.control_group(job.runtime)
    if group is not None:
        every = [torch.empty_like(mine) for _ in range(job.world_size)]
        dist.all_gather(every, mine, group=group)
    return {"peak_memory_mb": [round(float(rank[0]), 1) for rank in every],
            "train_state_mb": [round(float(rank[1]), 3) for rank in every]}
