"""Replica groups: data parallelism across groups that can die and come back without stopping the others.

``ddpkit run --replica-groups R script.py`` starts R groups, each an ordinary ddpkit launch of its own with its
own ``--max-restarts``, and torchft's lighthouse, which forms a quorum of the live groups at every step. In the
script, ``ReplicaGroup`` joins this process to it (torchft's ``Manager``), and ``setup`` wraps the model and the
optimizer:

* the model in torchft's ``DistributedDataParallel``, its gradients averaged over the groups that take part in
  the step, through a communication hook of ddpkit's (``drop_failed_step``): torchft 0.2.0's own hook raises
  ``AssertionError`` in the healthy groups when a peer dies during the all-reduce. In a group of several processes
  (``--nproc-per-node N``) the model is the group's own DDP instead, and each process averages the gradients with
  the same rank of the other groups in the optimizer's step (``average_gradients``). A model sharded by FSDP
  (HSDP) is averaged there too, each process its own shard of every gradient;
* the optimizer in torchft's ``Optimizer``: ``zero_grad()`` asks the lighthouse for the step's quorum, ``step()``
  applies the update only if this group's gradients were reduced over the quorum (``should_commit``); otherwise
  the step is dropped here and tried again. A group left behind that way copies the others' state at its next
  quorum.

A group that (re)joins copies the model, the optimizer and the ``state`` it is handed (``state_dict`` and
``load_state_dict`` of each) from a healthy group over HTTP before it takes part: live recovery, not a
checkpoint read. The groups start from the same seed and wait for each other once (``DDPKIT_REPLICA_STORE``,
a barrier the launcher hosts), so a run without failures is the run of plain DDP over R x N processes.

A script on ``ddpkit.Job`` needs none of this: the job makes its ``ReplicaGroup`` and drives it
(``ddpkit.strategies.replica_loop``). See docs/replica-groups.md for what is not built yet (NCCL across the groups,
a group across machines).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import importlib
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.nn as nn

from ddpkit.core import progress
from ddpkit.core.errors import UsageError, first_line
from ddpkit.core.logs import logger
from ddpkit.core.network import is_loopback
from ddpkit.strategies.base import is_shard, local_shard

from ddpkit.core.env import LIGHTHOUSE as LIGHTHOUSE_VARIABLE
from ddpkit.core.env import MIN_REPLICAS as MIN_REPLICAS_VARIABLE
from ddpkit.core.env import REPLICA_GROUP as GROUP_VARIABLE
from ddpkit.core.env import REPLICA_GROUPS as GROUPS_VARIABLE
from ddpkit.core.env import REPLICA_STORE as STORE_VARIABLE
from ddpkit.core.env import replica_beat_key as beat_key

BEAT_S = 0.5  # how often a group's process tells the launcher where it is (the fence reads it)
FINISHED_KEY = "finished"  # in the launcher's store, once a group has trained to the end


def settings_for(stall_s: float) -> dict[str, float]:
    """``ReplicaGroup``'s timeouts for a stall timeout of ``stall_s`` (``ddpkit train --stall-timeout``, ``Job``'s
    ``stall_timeout_s``; 0: off): the fence ends a group's process whose step has lasted that long; a collective
    across the groups waits for a lost one at most half that (10 s at most), then drops the step; a quorum waits
    twice that (60 s at least)."""
    return {"timeout_s": min(10.0, stall_s / 2) if stall_s else 10.0, "stall_timeout_s": stall_s,
            "quorum_timeout_s": max(60.0, 2 * stall_s)}


def require_torchft() -> None:
    """UsageError, saying how to install it, when torchft cannot be imported."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs each quorum at INFO otherwise (read at import)
    try:
        importlib.import_module("torchft")
    except ImportError as error:
        raise UsageError(f"replica groups need torchft ({error}); install it with pip install 'ddpkit[ft]' (torchft "
                         "needs torch>=2.7)") from None
    manager_log = logging.getLogger("torchft.manager")
    if without_traceback not in manager_log.filters:
        manager_log.addFilter(without_traceback)


def without_traceback(record: logging.LogRecord) -> bool:
    """torchft's manager logs a collective that failed (a group died in it) with the whole traceback, in every
    process of every live group; its message names the error already, and ddpkit says the dropped step in one line
    (``step N dropped (...)``). That traceback is left out, the message kept; torchft's other records (a failed
    recovery, say) keep theirs."""
    if "got exception in future" in str(record.msg):
        record.exc_info, record.exc_text = None, None
    return True


def drop_failed_step(manager, bucket):  # no annotation: DDP checks it against the object, not a string
    """DDP communication hook: ``bucket`` averaged over the groups of this step's quorum, through ``manager``.

    The all-reduce runs while backward goes on (the hook returns its future at once, as DDP's own hook does; torchft
    0.2.0's waits for each bucket, which serialises communication and computation). When it fails (a group died or
    hung in the middle of it), the manager records the error (its ``wrap_future``) and then refuses to commit the
    step in this group; the bucket is zeroed and handed back completed, so backward ends normally instead of
    raising in the healthy groups (torchft 0.2.0's hook asserts there)."""
    return average_across(manager, bucket.buffer())


def average_across(manager, buffer: torch.Tensor) -> torch.futures.Future:
    """``buffer`` averaged in place over the groups of this step's quorum (``manager``'s); a future of it. On a
    failure the manager records the error (the step is not committed here) and ``buffer`` is zeroed."""
    try:
        participants = manager.num_participants()  # of this step's quorum (it waits for the quorum to form)
        work = manager.allreduce(buffer)  # starts the sum over the groups (a no-op once the step has failed)
        # The collective's own future. Not torchft's managed chain: built before the collective ends (by
        # synchronize()), torchft 0.2.0's chain runs its callbacks against the wrong link (AssertionError).
        started = getattr(work, "_work", None)
        future = None if started is None else manager.wrap_future(started.get_future(), [buffer])
    except Exception as error:  # noqa: BLE001 - any failure to start the collective drops this step here
        manager.report_error(error)
        future = None

    def settled(_done) -> torch.Tensor:
        if manager.errored() is not None:
            buffer.zero_()  # never applied: should_commit() is False for this step
        else:
            buffer.div_(max(1, participants))
        return buffer

    if future is None:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(settled(None))
        return done
    return future.then(settled)


class ReplicaGroup:
    """This process's place among the replica groups that ``ddpkit run --replica-groups R`` started.

    ``timeout_s``: how long a collective across the groups waits for a peer before the step is dropped (a hung
    group costs this much once). ``quorum_timeout_s``: how long a step waits for the lighthouse's quorum.
    ``stall_timeout_s``: a step of this process that takes longer is ended by the launcher (one line, with where it
    is stuck; the process killed, so that its launcher restarts it and the other groups go on). This process tells
    the launcher twice a second where it is; a hung process keeps torchft's heartbeats going, and the others would
    wait for it at their next quorum until ``quorum_timeout_s`` failed them, and a stopped one (SIGSTOP) cannot end
    itself. It must lie between ``timeout_s`` (a healthy group waiting in a collective for the hung one gives up on
    it first) and ``quorum_timeout_s``, and the launcher's heartbeat timeout must be shorter than ``timeout_s``; 0
    turns it off. Armed at the first ``zero_grad()``: count evaluation or a checkpoint between two steps in it.
    ``environment``: the variables to read (default: this process's). ``min_replicas`` (the launcher's
    ``--min-replicas``): the fewest groups a step may take; while fewer are alive, ``zero_grad()`` waits for the
    quorum, up to ``quorum_timeout_s``, and the fence does not count that wait.
    """

    def __init__(self, *, timeout_s: float = 10.0, quorum_timeout_s: float = 60.0, stall_timeout_s: float = 30.0,
                 environment: dict[str, str] | None = None):
        environment = dict(os.environ if environment is None else environment)
        require_torchft()
        missing = [name for name in (GROUP_VARIABLE, GROUPS_VARIABLE, LIGHTHOUSE_VARIABLE) if not environment.get(name)]
        if missing:
            raise UsageError(f"this process is not in a replica group ({', '.join(missing)} not set): start the script "
                             "with ddpkit run --replica-groups N")
        if not timeout_s > 0 or not quorum_timeout_s > 0:
            raise UsageError(f"timeout_s and quorum_timeout_s must be positive, got {timeout_s}, {quorum_timeout_s}")
        if stall_timeout_s and not timeout_s < stall_timeout_s < quorum_timeout_s:
            # A healthy group waiting in a collective for a hung one must reach the collective's timeout (and go on)
            # before its own fence would end it; the hung one must be ended before the others' quorum gives up.
            raise UsageError(f"stall_timeout_s must be 0 (off) or between timeout_s ({timeout_s:g}) and "
                             f"quorum_timeout_s ({quorum_timeout_s:g}), got {stall_timeout_s:g}")
        try:
            self.group, self.groups = int(environment[GROUP_VARIABLE]), int(environment[GROUPS_VARIABLE])
            # the fewest groups a step may take (--min-replicas); while fewer are alive, a step waits for them
            self.min_replicas = int(environment.get(MIN_REPLICAS_VARIABLE) or 1)
        except ValueError:
            raise UsageError(f"{GROUP_VARIABLE}, {GROUPS_VARIABLE} and {MIN_REPLICAS_VARIABLE} must be whole "
                             f"numbers, got {environment[GROUP_VARIABLE]!r}, {environment[GROUPS_VARIABLE]!r} and "
                             f"{environment.get(MIN_REPLICAS_VARIABLE)!r}") from None
        if not 1 <= self.min_replicas <= self.groups:
            raise UsageError(f"{MIN_REPLICAS_VARIABLE} must be between 1 and the number of groups ({self.groups}), "
                             f"got {self.min_replicas}")
        self.lighthouse = environment[LIGHTHOUSE_VARIABLE]
        # This process's rank in its group, and the group's processes (DDP among them, torchft across the groups).
        self.rank, self.nproc = int(environment.get("RANK", "0")), int(environment.get("WORLD_SIZE", "1"))
        self.restarts = int(environment.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.timeout_s, self.quorum_timeout_s, self.stall_timeout_s = timeout_s, quorum_timeout_s, stall_timeout_s
        self._moved: float | None = None  # when this process last began or ended a step (None: not yet)
        self._store_address = environment.get(STORE_VARIABLE)
        self._launcher_store = _client(self._store_address, timeout_s=quorum_timeout_s)
        self._stopping, self._beats = threading.Event(), None
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._state: dict[str, Any] = {}
        self.manager = None
        self._store = None
        self.last_participants = self.groups  # the groups that took part in the last committed step
        self.last_rank: int | None = self.group  # this group's rank among them (None: it was healing)
        self.last_outcome: tuple[int, int] | None = None  # (steps before, after) the last optimizer step
        self._asked = False  # this step's quorum asked for (begin_step), not yet used by a step
        self._ddp: nn.Module | None = None  # the model as setup wrapped it, and the optimizer
        self._group_optimizer = None
        self.sharded = False  # FSDP inside the group (HSDP): setup says

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              state: dict[str, Any] | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        """(the model in torchft's DDP with ``drop_failed_step``, the optimizer in torchft's ``Optimizer``).

        ``state``: more objects with ``state_dict()`` and ``load_state_dict()`` (a scheduler, a loader) that a
        joining group copies from a healthy one with the model and the optimizer. Give every group the same
        initial weights (the same seed): the groups start together and nobody copies anything then."""
        import torchft

        host = advertised_host(self._store_address)  # what the other groups reach this one's store and manager by
        # FSDP inside the group (HSDP), or several processes: the gradients are averaged across the groups after
        # backward (average_gradients), each process its own shard, or its Nth of the group's average.
        self.sharded = is_sharded(model)
        if self.nproc > 1 and not self.sharded and not isinstance(model, nn.parallel.DistributedDataParallel):
            model = nn.parallel.DistributedDataParallel(model)  # averages the gradients among the group's processes
        self._model, self._optimizer, self._state = model, optimizer, dict(state or {})
        self.manager = self._new_manager(host, self._group_store_port(host))
        if self.nproc > 1:
            # Every process's manager has reached the group's store before rank 0, which hosts it, can go on: a
            # rank 0 that stops at once (the other groups finished the run) would leave the others connecting to a
            # store that is gone, until their timeout.
            torch.distributed.barrier()
        if self._launcher_store is not None:
            if self.restarts == 0:
                self._wait_for_the_other_groups()
            if self.stall_timeout_s:
                self._beats = threading.Thread(target=self._publish_beats, name="ddpkit-replica-beats", daemon=True)
                self._beats.start()
                atexit.register(self._stop_beats)

        class GroupDDP(torchft.DistributedDataParallel):  # torchft's wrapper registers cls._comm_hook
            _comm_hook = staticmethod(drop_failed_step)

        # One process per group: torchft's DDP, its all-reduce across the groups overlapping backward. Several, or
        # FSDP: the group's own DDP or FSDP, then the average across the groups in the optimizer's step.
        self._ddp = model if self._after_backward else GroupDDP(self.manager, model)
        self._group_optimizer = _optimizer_class()(self, optimizer)
        # A training forward asks for the step's quorum if zero_grad() has not (a loop that zeroes the gradients
        # after its step, or never: set_to_none by the step of the loop before).
        self._ddp.register_forward_pre_hook(self._before_forward)
        return self._ddp, self._group_optimizer

    def _group_store_port(self, host: str) -> int:
        """The port of the group's own store at ``host``, which its rank 0 starts (and keeps) and tells the others."""
        from torch.distributed import TCPStore

        # The group's own store (its managers are its clients), hosted by its rank 0; the other groups are told its
        # address. A new one at each start of the group: nothing of an earlier one's managers is left in it.
        if self.rank == 0:
            self._store = TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False)
        store_port = self._store.port if self.rank == 0 else None
        if self.nproc > 1:
            told = [store_port]
            torch.distributed.broadcast_object_list(told, src=0)
            store_port = told[0]
        return store_port

    def _new_manager(self, host: str, store_port: int):
        """torchft's Manager for this process: it takes part in the lighthouse's quorums as group ``self.group``,
        serves this process's state to a joining group (or loads a healthy one's), over the group's store at
        ``host``:``store_port``."""
        import torchft

        timeout = datetime.timedelta(seconds=self.timeout_s)
        return torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout),  # the gloo timeout is set here, not by timeout=
            load_state_dict=self._load_state_dict, state_dict=self._state_dict, min_replica_size=self.min_replicas,
            replica_id=str(self.group), lighthouse_addr=self.lighthouse, store_addr=host, store_port=store_port,
            rank=self.rank, world_size=self.nproc, port=0, timeout=timeout, hostname=host,  # what it tells others
            quorum_timeout=datetime.timedelta(seconds=self.quorum_timeout_s),
            # Same seed everywhere instead of a copy at step 0: torchft's init_sync with its asynchronous quorum
            # halves the first step's gradient (the group being synced contributes zeros, counted as a member).
            init_sync=False, heartbeat_interval=datetime.timedelta(milliseconds=100),
        )

    @property
    def _after_backward(self) -> bool:
        """Whether the average across the groups runs after backward (``average_gradients``): with several
        processes, or FSDP, in the group; else torchft's DDP runs it during backward."""
        return self.nproc > 1 or self.sharded

    def _before_forward(self, module: nn.Module, args) -> None:  # noqa: ARG002
        """A forward of the model. A training one asks for the step's quorum (once per step). Then, under FSDP, no
        joining group may read this process's state until the optimizer's step: torchft reads it from another
        thread, while FSDP swaps whole parameters in for the forward and the backward and frees them after (a read
        then finds freed storage). The read waits instead; the step lets it in before its all-reduce, which the
        joining group enters only once it has the state. (After begin_step, which with ``min_replicas`` > 1 waits
        for the quorum, and so for the read.)"""
        if module.training and torch.is_grad_enabled():
            self.begin_step()
        if self.sharded:
            self._manager().disallow_state_dict_read()

    def allow_state_reads(self) -> None:
        """The model's parameters are this process's shards again (backward is over): a joining group may read."""
        if self.sharded:
            self._manager().allow_state_dict_read()

    def begin_step(self) -> None:
        """Ask the lighthouse for the next step's quorum (it forms in the background), once per step: the optimizer's
        ``zero_grad()`` and the model's training forward call it, and only the first of them asks. With
        ``min_replicas`` > 1 it waits for the quorum, which forms only once enough groups are alive: waiting for a
        restarted one is not a stall (the fence would end this healthy process), and ``quorum_timeout_s`` bounds
        it."""
        if self._asked:
            return
        manager = self._manager()
        self.moved()
        manager.start_quorum()
        self._asked = True
        if self.min_replicas > 1:
            with self.paused():
                manager.wait_quorum()

    def join(self) -> bool:
        """Copy the live groups' state before the training loop starts: what a restarted process does, so that its
        loop begins where the groups are (``Job`` calls it: ``ddpkit.strategies.replica_loop``). True when this group
        copied their state (``step`` is then theirs); False when nobody was ahead of it (every group restarted from
        the same checkpoint): the quorum asked for then serves the first step.

        The copy comes with a step of the others (torchft heals inside a step), whose gradient all-reduce waits for
        every group of the quorum. This group takes part without data: it runs the communication hook on each of
        DDP's buckets filled with zeros (a healing group contributes zeros anyway), as ``torch.distributed``'s
        ``Join`` does for a rank out of data. It does not commit that step: the next one, its loop's first, copies
        the others' state once more and commits with them, so the script's own code after each step (a
        scheduler's step, a print) runs for every step this group commits."""
        manager = self._manager()
        self.begin_step()
        with self.paused():  # the copy of the others' state arrives with the quorum
            manager.wait_quorum()
        if manager.is_participating():
            return False
        if manager.errored() is not None:  # the copy failed: this process ends, and its launcher starts another
            raise RuntimeError(f"replica group {self.group} could not copy the live groups' state: "
                               f"{first_line(manager.errored().original_exception)}")
        with self.paused():
            if not self._after_backward:
                reducer = self._ddp.reducer
                # Zeros shaped like DDP's buckets, in the order the others reduce theirs (torchft's DDP finds unused
                # parameters, so its buckets are never rebuilt); the hook's all-reduce is theirs.
                settled = [reducer._run_comm_hook(bucket) for bucket in reducer._get_zeros_like_grad_buckets()]
            else:  # zeros shaped like the others' pieces of their flat gradients (average_gradients)
                settled = [average_across(manager, torch.zeros_like(self._piece(flat)[1]))
                           for flat, _ in self._flat_gradients()]
            for future in settled:
                future.wait()
            manager.report_error(RuntimeError("this group joined before its loop: the step is the others' alone"))
            manager.should_commit()  # applies the copied state; commits nothing here
        self._asked = False
        self.last_outcome = None
        logger.info(f"replica group {self.group}: copied the live groups' state at step {manager.current_step()}")
        return True

    def _piece(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``flat``, or a copy padded to a multiple of N; the part of it that this process averages across the
        groups). In a group of N DDP processes (each holds the group's average): its rank's Nth, as the same rank of
        every group takes, so each sends 1/N of the gradients across the groups instead of all of them. Under FSDP
        (``flat`` is this process's shards already) or alone in its group: all of ``flat``."""
        if self.sharded or self.nproc == 1:
            return flat, flat
        return part_of(flat, self.rank, self.nproc)

    def _flat_gradients(self) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """The optimizer's gradients, one flat tensor per dtype and device, with the parameters in it (a missing
        gradient counts as zeros). Of a sharded parameter, this process's shard: the same rank of every group holds
        the same one."""
        parameters: dict[tuple, list[torch.Tensor]] = {}
        for group in self._optimizer.param_groups:
            for parameter in group["params"]:
                parameters.setdefault((parameter.dtype, parameter.device), []).append(parameter)
        return [(torch.cat([local_shard(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                            for p in kept]), kept) for kept in parameters.values()]

    def average_gradients(self) -> None:
        """Groups of several processes, or FSDP inside the group: after backward (the group's DDP averaged the
        gradients among its processes, or its FSDP reduce-scattered them), average them across the groups of the
        step's quorum, each process with the same rank of the other groups, 1/N of the gradients from each of N
        processes: under FSDP its own shard; under DDP its Nth of the group's average (``_piece``), which the group
        then gathers. A failure leaves the step to be dropped by the commit vote, as the hook's does."""
        flats = self._flat_gradients()
        pieces = [self._piece(flat) for flat, _ in flats]
        for future in [average_across(self.manager, piece) for _, piece in pieces]:
            future.wait()
        for (_, parameters), (whole, piece) in zip(flats, pieces):
            if piece is not whole:  # each process of the group gives the others its Nth, averaged across the groups
                torch.distributed.all_gather(list(whole.chunk(self.nproc)), piece.clone())
            offset = 0
            for parameter in parameters:
                shard = local_shard(parameter)
                averaged = whole[offset:offset + shard.numel()].view_as(shard)
                offset += shard.numel()
                if parameter.grad is None:
                    parameter.grad = like(parameter, averaged.clone())
                else:
                    local_shard(parameter.grad).copy_(averaged)

    def moved(self) -> None:
        """This process began or ended a step (the fence's clock)."""
        self._moved = time.monotonic()

    @contextlib.contextmanager
    def paused(self):
        """A block between two steps that may outlast ``stall_timeout_s`` (an evaluation, a checkpoint): the fence
        then ends this process only if it stops answering."""
        self._moved = None
        try:
            yield
        finally:
            self.moved()

    @property
    def leads(self) -> bool:
        """Whether this group was the first of those that took part in the last committed step: the one that
        writes what the run keeps (checkpoints, metrics, the model). Exactly one group leads at each step."""
        return self.last_rank == 0

    def resume_at(self, step: int) -> None:
        """Count the steps from ``step`` (a checkpoint's), before the first: the groups that resumed from it agree,
        and a group restarted from an older one copies the others' state at its first step."""
        self._manager().load_state_dict({"step": step, "batches_committed": step * self.groups})

    def _publish_beats(self) -> None:
        """Every ``BEAT_S``, to the launcher's store: this process's pid, how long its current step has lasted and
        where its main thread is. The launcher ends it when that reaches ``stall_timeout_s``, or when the beats
        stop with a step open (SIGSTOP, a frozen interpreter): the fence works from outside, on a stopped
        process too."""
        main = threading.main_thread()
        store = _client(self._store_address, timeout_s=self.quorum_timeout_s)  # this thread's own connection
        while main.is_alive():  # the first at once: a process may stop within its first half second
            frame = sys._current_frames().get(main.ident)
            where = traceback.format_stack(frame, limit=1)[0].strip().splitlines()[0] if frame else "?"
            moved = None if self._moved is None else time.monotonic() - self._moved
            beat = {"pid": os.getpid(), "t": time.time(), "moved_s": moved, "stall_s": self.stall_timeout_s,
                    "where": where}
            store.set(beat_key(self.group, self.rank), json.dumps(beat))
            if self._stopping.wait(BEAT_S):
                return

    def _stop_beats(self) -> None:
        """No more beats, and a last one that asks for no fence: a process that ends is not fenced. (Not the key
        deleted: the launcher's fence, which finds the key and then reads it, would wait for it there, up to the
        store's timeout, a minute in which the fence and the launcher's end hang.)"""
        if self._beats is not None:
            self._stopping.set()
            self._beats.join()
            self._beats = None
            ended = {"pid": os.getpid(), "t": time.time(), "moved_s": None, "stall_s": None, "where": "ended"}
            self._launcher_store.set(beat_key(self.group, self.rank), json.dumps(ended))

    def finish(self) -> None:
        """Tell the launcher that this group trained to the end: a group restarted from now on stops at once
        (``others_finished``) instead of training alone from an older state."""
        if self._launcher_store is not None:
            self._launcher_store.set(FINISHED_KEY, str(self.group))

    def others_finished(self) -> bool:
        """Whether another group has trained to the end of the run (``finish``)."""
        return self._launcher_store is not None and self._launcher_store.check([FINISHED_KEY])

    def _wait_for_the_other_groups(self) -> None:
        """Every group's manager is up (heartbeating) before any asks for a quorum: the first quorum then holds
        them all, and no group starts alone only to be joined later."""
        self._launcher_store.add("ready", 1)
        _wait_count(self._launcher_store, "ready", self.groups * self.nproc, self.quorum_timeout_s)

    def _state_dict(self) -> dict[str, Any]:
        """What a joining group copies from this process (the same rank of a joining group): of sharded tensors
        (FSDP's), this process's shards."""
        state = {"model": shards(self._model.state_dict()), "optimizer": shards(self._optimizer.state_dict())}
        return state | {name: value.state_dict() for name, value in self._state.items()}

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        load_shards(self._model, state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        reshard_optimizer_state(self._optimizer)
        for name, value in self._state.items():
            value.load_state_dict(state[name])

    @property
    def step(self) -> int:
        """Steps committed so far by the groups (a joining group's jumps to theirs): index the data with it, so a
        dropped step is tried again on the same batch."""
        return self._manager().current_step()

    @property
    def data_part(self) -> tuple[int, int]:
        """(index, count): this process's part of each global batch. Every process of every group reads its own,
        in the order group x processes per group + rank, so R groups of N train on the batches of plain DDP over
        R x N processes."""
        return self.group * self.nproc + self.rank, self.groups * self.nproc

    @property
    def participants(self) -> int:
        """Groups that took part in the last quorum."""
        return self._manager().num_participants()

    def _manager(self):
        if self.manager is None:
            raise UsageError("call ReplicaGroup.setup(model, optimizer) first: it joins this process to the groups")
        return self.manager

    def close(self) -> None:
        """Leave the groups: stop this process's torchft manager (its heartbeats end; the others go on)."""
        self._stop_beats()
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        self._store = None


def _optimizer_class():
    import torchft

    class GroupOptimizer(torchft.Optimizer):
        """torchft's optimizer wrapper (``zero_grad`` asks for the quorum, ``step`` commits only what every group of
        it reduced), saying in one line each a dropped step and each change in the groups taking part."""

        def __init__(self, group: ReplicaGroup, optimizer: torch.optim.Optimizer):
            super().__init__(group.manager, optimizer)
            self.group = group
            self.seen = group.groups  # the groups that took part in the last step

        def zero_grad(self, set_to_none: bool = True) -> None:
            self.group.begin_step()  # asks for the quorum, once per step
            self.optim.zero_grad(set_to_none)

        def step(self, closure=None) -> None:
            self.group.moved()
            self.group.allow_state_reads()
            manager, before = self.manager, self.manager.current_step()
            if self.group._after_backward:
                self.group.average_gradients()  # across the groups; the group's DDP or FSDP reduced them within it
            error = manager.errored()
            try:
                super().step(closure)  # commits (applying a copied state first) or drops the step
            finally:
                self.group._asked = False
            self.group.last_outcome = (before, manager.current_step())
            if manager.current_step() == before:
                why = _short(error.original_exception) if error is not None else "a group did not take part"
                logger.warning(f"replica group {self.group.group}: step {before + 1} dropped ({why}); trying it "
                               "again with the groups that answer")
                return
            participants = manager.num_participants()
            self.group.last_participants, self.group.last_rank = participants, manager.participating_rank()
            if participants != self.seen:
                healing = "" if manager.is_participating() else " (this group copied its state from them)"
                logger.warning(f"replica group {self.group.group}: {participants} of {self.group.groups} groups "
                               f"took part in step {manager.current_step()}{healing}")
                self.seen = participants
            progress.mark("data", step=manager.current_step())
            self.group.moved()

    return GroupOptimizer


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP (``fully_shard``): its parameters are DTensors."""
    return any(is_shard(parameter) for parameter in model.parameters())


def like(template: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` as this process's part of a tensor laid out as ``template`` (a DTensor, or ``shard`` itself)."""
    if not is_shard(template):
        return shard
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(shard, template.device_mesh, template.placements, shape=template.shape,
                              stride=template.stride(), run_check=False)


def shards(state: Any) -> Any:
    """``state`` (a nested state dict) with each DTensor replaced by this process's shard of it: what goes over
    the wire to the same rank of a joining group, whose process group and mesh are its own."""
    if isinstance(state, dict):
        return {key: shards(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(shards(value) for value in state)
    return local_shard(state) if isinstance(state, torch.Tensor) else state


def load_shards(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``state`` (``shards`` of a peer's ``state_dict()``) into ``model``: a sharded model's shards copied into its
    own, in place; any other model through ``load_state_dict``."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    own = model.state_dict()
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    if missing or unexpected:
        raise RuntimeError(f"the copied model state does not match this model: missing {sorted(missing)[:4]}, "
                           f"unexpected {sorted(unexpected)[:4]}")
    with torch.no_grad():
        for name, tensor in own.items():
            local_shard(tensor).copy_(state[name])


def reshard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` of ``shards`` of a peer's state: each state tensor shaped like its sharded
    parameter's shard made a DTensor laid out as the parameter (the optimizer's step needs it so)."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if not is_shard(parameter):
                continue
            values = optimizer.state.get(parameter, {})
            for key, value in values.items():
                if (isinstance(value, torch.Tensor) and not is_shard(value) and value.dim() > 0
                        and value.shape == local_shard(parameter).shape):
                    values[key] = like(parameter, value)


def _short(error: BaseException) -> str:
    """A collective's error in a few words: gloo's source location and its advice left out."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", first_line(error))
    return text.split(". This is typically")[0]


def part_of(flat: torch.Tensor, rank: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``flat``, padded with zeros to a multiple of ``parts`` if it is not one; ``rank``'s part of that, a view):
    the parts of ranks 0..parts-1, in order, make up the padded tensor."""
    size = -(-flat.numel() // parts)
    whole = flat if flat.numel() == size * parts else torch.cat([flat, flat.new_zeros(size * parts - flat.numel())])
    return whole, whole[rank * size:(rank + 1) * size]


def advertised_host(store_address: str | None) -> str:
    """The name the other groups reach this process's machine by: 127.0.0.1 when the launchers' store is at a
    loopback address (every group on this machine) or there is none (groups started by hand), else this machine's
    host name, which torchft's live copy (its HTTP transport) names it by anyway: on several machines each one's
    name must resolve on the others."""
    host = store_address.rpartition(":")[0] if store_address else "127.0.0.1"  # a name: machines meet at machine 0's
    return "127.0.0.1" if is_loopback(host) else socket.gethostname()


def _client(address: str | None, *, timeout_s: float):
    """A client of the launcher's store at ``address`` (HOST:PORT), or None outside ``ddpkit run --replica-groups``."""
    if not address:
        return None
    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    return TCPStore(host_name=host, port=int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _wait_count(store, key: str, count: int, timeout_s: float) -> None:
    """Until the counter ``key`` of ``store`` reaches ``count``."""
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < count:
        if time.monotonic() > deadline:
            raise UsageError(f"the replica groups did not all start within {timeout_s:.0f} s; see the other groups' "
                             "output for why")
        time.sleep(0.05)
