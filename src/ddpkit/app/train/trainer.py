"""The loop ``ddpkit train`` runs in every process: the reference for what the library does.

    >>> from ddpkit.app.train.trainer import TrainConfig, run
    >>> run(TrainConfig(model="net", data="digits", epochs=1))      # doctest: +SKIP
    {'epoch': 0, 'train_loss': ..., 'val_acc': ..., ...}

One optimizer step consumes ``batch_size`` samples on each of the ``world_size`` processes, for
``accumulate`` micro-steps: the global batch is ``batch_size * world_size * accumulate``. Gradients
are all-reduced only on the last micro-step (DDP's ``no_sync`` on the others).

This module is the run's top: ``run`` (the job and its logs), ``train`` (the epochs, ``model.pt``) and ``start``
(everything built in the order it needs). Each concern below it has a module of its own in this package (its
docstring names them); docs/architecture.md says why the lines run there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from ddpkit import checkpoint, data, zoo
from ddpkit.app import trackers
from ddpkit.app.train import records, replicas, resume
from ddpkit.app.train.lr_schedule import make_scheduler
from ddpkit.app.train.config import TrainConfig, in_train_flags, optimizer_settings
from ddpkit.app.train.loop import EpochLoop
from ddpkit.app.train.state import Position, RunState
from ddpkit.core import logs, preempt, process_group, ray_reports
from ddpkit.core.env import DistEnv
from ddpkit.core.errors import UsageError, said_once
from ddpkit.core.logs import logger
from ddpkit.data import images
from ddpkit.job import Job
from ddpkit.watch import status

LOGS_FOLDER = "logs"  # OUTPUT_DIR/logs/rank<N>.log: all each rank wrote (ddpkit.launch.rank_logs), or its ddpkit messages


def run(cfg: TrainConfig, environment: DistEnv | None = None) -> dict:
    """Set up this process's place in the job, train, and tear the process group down whatever happens.

    ``environment`` is read from the launcher's variables when not given (``mp.spawn`` passes its own).
    """
    cfg.validate()
    if replicas.in_a_replica_group():
        cfg.check_for_replica_groups()
    replica = replicas.replica_group(cfg.stall_timeout)
    logs_folder = os.path.join(cfg.output_dir, LOGS_FOLDER, *([f"group{replica.group}"] if replica else []))
    with in_train_flags():  # the library's errors name its parameters; this command's user knows its flags
        # replica_group=False: this command drives its ReplicaGroup itself (train's loop, not Job's).
        job = Job(cfg.make_strategy(), replica_group=False, amp=cfg.amp, accumulate=cfg.accumulate, seed=cfg.seed,
                  sync_bn=cfg.sync_bn,
                  backend=cfg.backend, device=cfg.device, timeout_s=cfg.timeout, stall_timeout_s=cfg.stall_timeout,
                  check_replicas=cfg.check_replicas, status_file=os.path.join(cfg.output_dir, status.STATUS_FILE),
                  environment=environment,
                  log_level="debug" if cfg.debug else cfg.log_level)
    # Each rank's own messages, those the console leaves out too (ranks other than 0 say info lines there).
    with logs.kept_in_file(os.path.join(logs_folder, f"rank{job.rank}.log"), job.rank):
        with job, in_train_flags(), contextlib.ExitStack() as leaving:  # translated before the job's exit reports them
            if replica is not None:
                leaving.callback(replica.close)
            return train(cfg, job, replica)


def train(cfg: TrainConfig, job: Job, replica=None) -> dict:
    """The whole run in this process: build, resume, the epochs, model.pt. Returns the last epoch's metrics."""
    run_state = start(cfg, job, replica)
    if run_state.too_late:
        return replicas.others_finished(replica, {})
    metrics_path = os.path.join(cfg.output_dir, records.METRICS_FILE)
    if job.is_main and replicas.opens_the_run(replica):
        records.keep_metrics_before(metrics_path, run_state.position.epoch)
    record: dict = {}
    loop = EpochLoop(run_state)
    tracked = trackers.Trackers(cfg.tracker if job.is_main else (), cfg.output_dir, dataclasses.asdict(cfg))
    with preempt.stop_on_signal(job.runtime) as loop.stop, contextlib.closing(tracked):
        epoch = run_state.position.epoch
        while epoch < cfg.epochs:
            try:
                record = loop.run_epoch(epoch)
            except replicas.Rejoined as rejoined:  # this replica group copied the others' state: on from their step
                run_state.position = rejoined.position(run_state)
                epoch = run_state.position.epoch
                continue
            except replicas.OthersFinished:
                return replicas.others_finished(replica, record)
            ray_reports.report(record)  # under Ray: to ray.train.report, from every rank
            if run_state.leads:
                records.append_record(metrics_path, record)
                tracked.log(record)
                job.print(f"epoch {epoch + 1}/{cfg.epochs}: train_loss {record['train_loss']:.4f}  val_loss "
                          f"{record['val_loss']:.4f}  val_acc {record['val_acc']:.2%} ({record['val_count']} samples)  "
                          f"{record['images_per_sec']:.0f} images/s" + records.replicas_said(record))
            loop.save(epoch + 1, 0, [0.0, 0.0], if_idle=False)
            epoch += 1
    run_state.ckpt.wait()
    if replica is not None:
        replica.finish()
    if replica is None or replica.leads:  # under replica groups the leading group alone writes it
        job.save_model(run_state.model, os.path.join(cfg.output_dir, checkpoint.MODEL_FILE))  # a collective under fsdp, pipeline
        job.print(f"saved {os.path.join(cfg.output_dir, checkpoint.MODEL_FILE)} and {metrics_path}")
    # Nobody leaves (and tears the group down) before rank 0 has written the model.
    run_state.ckpt.wait()
    return record


def start(cfg: TrainConfig, job: Job, replica=None) -> RunState:
    """Data, model, checkpoint to resume, wrapping, optimizer, loaders and schedule, in the order they need."""
    # Before any data is loaded: a rank that hangs later can still be found and attached to.
    logger.debug(f"local rank {job.local_rank}, pid {os.getpid()}: process group up, "
                     f"backend {job.backend or 'none'}, device {job.device}")
    spec = zoo.parse_data_spec(cfg.data)
    torch.manual_seed(cfg.seed)  # a data function of the user's own that draws random numbers draws the same on every rank
    # Rank 0 first: a download (MNIST) happens once, the other ranks then read the files.
    with process_group.main_process_first(job.runtime), said_once(job.is_main):
        sets, channels, image_size = zoo.load_for_model(cfg.model, spec, cfg.image_size, cfg.data_arguments(),
                                                        decode=images.check_decode(cfg.decode, job.device),
                                                        seed=cfg.seed)
    # The same seed on every rank and for every world size: identical initial weights.
    torch.manual_seed(cfg.seed)
    with said_once(job.is_main):
        model = zoo.build_model(cfg.model, in_channels=channels, num_classes=sets.num_classes, image_size=image_size,
                                arguments=cfg.model_arguments())
    job.strategy.check(world_size=job.world_size, cuda_count=torch.cuda.device_count(), batch_size=cfg.batch_size)
    ckpt, resumed = resume.open_checkpoints(cfg, job, model, replica)
    optimizer_class, settings = optimizer_settings(cfg.optimizer, cfg.lr)
    example = zoo.example_batch(sets, cfg.batch_size, channels, image_size)
    wrapped, optimizer = job.setup(model, optimizer_class, example=example, **settings)
    if replica is not None:  # torchft's DDP across the groups and its optimizer, which commits only agreed steps
        wrapped, optimizer = replica.setup(wrapped, optimizer)
    # --workers, else a share of the cores (none for tensors already in memory).
    workers = data.default_workers(job.runtime, None, sets.train) if cfg.workers is None else cfg.workers
    # Under replica groups the training data is split over the groups: each reads its share of the global batch.
    split = {} if replica is None else {"replica": replica.data_part}
    loader = job.train_loader(sets.train, cfg.batch_size, workers=workers, **split)
    val_loader = job.eval_loader(sets.val, cfg.batch_size, workers=workers)
    steps_per_epoch = len(loader) // cfg.accumulate
    if steps_per_epoch == 0:
        raise UsageError(f"one epoch has {len(loader.loader)} batches per process, fewer than --accumulate "
                         f"{cfg.accumulate}; lower --accumulate or --batch-size", said_elsewhere=not job.is_main)
    groups = replica.groups if replica is not None else 1
    run_state = RunState(cfg, job, wrapped, optimizer, make_scheduler(cfg.lr_schedule(), optimizer, steps_per_epoch),
                         loader, val_loader, ckpt, steps_per_epoch, position=Position(), replica=replica,
                         global_batch=cfg.batch_size * job.data_replicas * cfg.accumulate * groups)
    records.announce(run_state, sets, sum(p.numel() for p in model.parameters()))
    if resumed is not None:
        run_state.position = resume.restore(run_state, resumed)
    job.global_step = run_state.position.global_step
    if replica is not None:
        replica.resume_at(job.global_step)
        # Restarted after the others finished: no quorum, whose background configuration would spend seconds on the
        # finished groups' stores, gone, and print torchft's tracebacks of it.
        run_state.too_late = replica.restarts > 0 and replica.others_finished()
        if not run_state.too_late:
            optimizer.zero_grad()  # asks for the first step's quorum (job.step asks for each next one as it ends)
    return run_state
