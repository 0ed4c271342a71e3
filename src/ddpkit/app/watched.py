"""What ``ddpkit run`` starts in each worker: the script, unedited, as ``python SCRIPT ARGS`` would run it, with
ddpkit's watch over it.

    python -m ddpkit.app.watched train.py --its-own-flags        # what torchrun starts, per rank
    python -m ddpkit.app.watched -m package.module --flags
    python -m ddpkit.app.watched --unchanged=SEED:REDUCTION train.py --flags    # ddpkit run --unchanged

A script that starts its own process group (``torch.distributed.init_process_group``, the tutorials' way) gets:

- ``--timeout``: the default timeout of the groups it starts without one of its own;
- the stall watch (``--stall-timeout``, default 60 s): once its group is up, heartbeats through the group's
  store, and a rank that holds the others up named with its Python stack and ended (``ddpkit.watch.heartbeat``;
  with no marks in such a script, its process's signs of work say whether it moves: ``ddpkit.watch.activity``);
- a collective that times out explained in one line naming the ranks that never reached it, with the stack of
  each one on this machine.

A script on ``ddpkit.Job`` or ``ddpkit.distributed()`` starts its group through ddpkit, which does all of this
itself; this module then stands aside. Under ``--unchanged`` ddpkit starts the group before the script
(``ddpkit.unchanged``) and watches it as it would the script's own.

A script on several processes that steps an optimizer with no process group trains a copy of its model per process:
it is told so once, with the way out (``--unchanged``); where ``--unchanged`` was asked for and stood aside, it is
stopped before that step, in one line.

Once the script has returned (or called ``sys.exit``), the process ends as Python's exit would, but without the
interpreter's teardown (``ddpkit.core.exits.leave``): a rank that did all its work is never reported failed because
gloo's threads aborted it on the way out.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import runpy
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from ddpkit.core import exits, logs, process_group, progress, signals
from ddpkit.core.errors import EXIT_USAGE, UsageError
from ddpkit.core.logs import logger
from ddpkit.watch import heartbeat
from ddpkit.watch.activity import Activity

POLL_S = 0.2  # how often the watch looks for the script's process group, until it is up
WHO_KEY = "ddpkit/who"  # each rank's host and pid in the job's store, for a timed-out collective's explanation


def main(argv: list[str]) -> None:
    """Run the script ``argv`` names (``SCRIPT ARGS`` or ``-m MODULE ARGS``) as ``python`` would, watched."""
    # Before the script, in either order: torchrun's legacy --local-rank=N (ddpkit run --local-rank-arg) and
    # ddpkit run --unchanged's setting.
    unchanged_setting, stood_aside, local_rank = None, None, []
    while argv and argv[0].startswith((UNCHANGED, STOOD_ASIDE, "--local-rank=")):
        if argv[0].startswith(UNCHANGED):
            unchanged_setting = argv.pop(0).partition("=")[2]
        elif argv[0].startswith(STOOD_ASIDE):
            stood_aside = argv.pop(0).partition("=")[2]
        else:
            local_rank = [argv.pop(0)]
    signals.end_with_parent_if_asked()  # a rank a Ray worker started ends with it
    logs.configure(rank=int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None)
    module = argv[:1] == ["-m"]
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    apply_timeout()
    global _unchanged
    if unchanged_setting is not None:
        from ddpkit import unchanged

        unchanged.install(unchanged.Setting.decode(unchanged_setting))
        _unchanged = True
    if not _unchanged:
        tell_of_copies(stood_aside)
    threading.Thread(target=watch_when_up, name="ddpkit-watch", daemon=True).start()
    sys.argv = [target, *local_rank, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT` puts the script's folder
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        exits.say_exit_message(stop)
        exits.leave(exits.status_of(stop))
    except Exception as error:  # (what a shard met as a whole tensor raises differs by torch: three kinds seen)
        explain(error)
        raise
    exits.leave(0)


UNCHANGED = "--unchanged="  # the first argument under ``ddpkit run --unchanged``: ``ddpkit.unchanged.Setting``
STOOD_ASIDE = "--unchanged-stood-aside="  # instead, where --unchanged stood aside before the start: what the script does
_unchanged = False  # --unchanged is on in this process


def source_of(target: str, module: bool) -> str | None:
    """The text of the script (or module) about to run, or None where it cannot be read."""
    path = target
    if module:
        import importlib.util

        spec = importlib.util.find_spec(target)
        path = spec.origin if spec is not None else None
    try:
        with open(path, encoding="utf-8", errors="replace") as source:
            return source.read()
    except (OSError, TypeError):
        return None


def tell_of_copies(stood_aside: str | None = None) -> None:
    """Under ``ddpkit run`` on several processes, a script that steps an optimizer with no process group trains the
    same copy once per process: say so once, on the first step (rank 0), naming the way to split its batches. Where
    ``--unchanged`` was asked for and stood aside (``stood_aside``: what the script does, as the launcher read it: a
    library it imports), copies are never what was asked: every rank stops there, before the step, in one line."""
    world_size, main = int(os.environ.get("WORLD_SIZE", "1") or 1), os.environ.get("RANK", "0") == "0"
    if world_size < 2 or (stood_aside is None and not main):
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    stepped = []
    if stood_aside is not None:
        exits.usage_errors_in_one_line()

    def first_step(optimizer, args, kwargs) -> None:
        # (Kept, not removed: removing it while torch goes through the hooks breaks the step when a hook follows it.)
        if stepped:
            return
        stepped.append(True)
        if up():
            return
        if stood_aside is not None:
            if not main:
                exits.leave(EXIT_USAGE)  # (said once: rank 0's line; every rank stops before its step)
            raise UsageError(f"--unchanged stood aside (the script {stood_aside}), and the script steps its optimizer "
                             f"with no process group: each of the {world_size} processes would train its own copy on "
                             "the same data. Run it on one process, or let its library distribute it (Lightning: "
                             f"Trainer(devices={world_size}); Accelerate: Accelerator(cpu=True) on a CPU) under "
                             "`ddpkit run`, without --unchanged")
        logger.warning(f"this script steps its optimizer with no process group: each of the {world_size} processes "
                       "trains its own copy of the model on the same data. `ddpkit run --unchanged` splits its "
                       "batches across them and averages their gradients, with no change to the script")

    register_optimizer_step_pre_hook(first_step)


def apply_timeout() -> None:
    """``ddpkit run --timeout``: the default of every group the script starts without a timeout of its own."""
    value = os.environ.get(process_group.TIMEOUT_ENV)
    if value is None:
        return
    timeout = datetime.timedelta(seconds=float(value))
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout  # what init_process_group and new_group read when given none
    distributed_c10d.default_pg_nccl_timeout = timeout


def watch_when_up() -> None:
    """Wait for the script's process group; then say who this rank is, and watch it unless ddpkit's own setup
    started the group (a Job watches itself), until the script tears its group down or ends."""
    while not up():
        time.sleep(POLL_S)
    if process_group.set_up_by_ddpkit() and not _unchanged:
        return
    try:
        store = process_group.own_connection(dist.distributed_c10d._get_default_store())  # noqa: SLF001 - the group's own store
        store.set_timeout(datetime.timedelta(seconds=heartbeat.STORE_TIMEOUT_S))
        store.set(f"{WHO_KEY}/{dist.get_rank()}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        # A stall takes longer than this to call: a script whose group lives less needs no watch, and its ranks
        # then end with no heartbeat thread waiting in the store for a rank that has gone already.
        deadline = time.monotonic() + 2 * heartbeat.beat_interval_s()
        while up() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        beat = start_heartbeat(store) if up() and (_unchanged or not process_group.set_up_by_ddpkit()) else None
    except (RuntimeError, ValueError, UsageError) as error:  # a group torn down already, a store gone, a bad setting
        logger.debug(f"no watch over this script: {error}")
        return
    if beat is None:
        return
    # The script's destroy_process_group ends the watch (its ranks may part from here on); so does a Job that adopts
    # the script's group (process_group.adopt), which watches it itself.
    while up() and (_unchanged or not process_group.set_up_by_ddpkit()):
        time.sleep(POLL_S)
    beat.close()


def up() -> bool:
    return dist.is_available() and dist.is_initialized()


def start_heartbeat(store) -> heartbeat.Heartbeat | None:
    """This rank's heartbeat through ``store``, started, when the stall watch is on; None otherwise."""
    stall_s = heartbeat.stall_setting(None)
    timeout_s = float(os.environ.get(process_group.TIMEOUT_ENV) or dist.constants.default_pg_timeout.total_seconds())
    world_size = dist.get_world_size()
    if not stall_s or world_size < 2 or timeout_s < heartbeat.min_timeout_s():
        return None
    pace = progress.Pace()
    pace.mark("running")  # the script's own code: no phases to tell apart, its signs of work say whether it moves
    beat = heartbeat.Heartbeat(store, rank=dist.get_rank(), world_size=world_size, stall_s=stall_s,
                               timeout_s=timeout_s, pace=pace,
                               activity=Activity(threading.main_thread().ident))
    atexit.register(beat.close)  # before the interpreter ends: no store call left running into its teardown
    # The start waits for every rank's first beat: not longer than a beat (a rank may be ending already).
    store.set_timeout(datetime.timedelta(seconds=heartbeat.beat_interval_s()))
    beat.start()
    store.set_timeout(datetime.timedelta(seconds=heartbeat.STORE_TIMEOUT_S))
    return beat


def explain(error: Exception) -> None:
    """A collective's timeout in one line naming the ranks that never reached it, with their stacks (those on this
    machine); a sharded parameter that an unchanged script used as a whole one, in one line; nothing for other errors,
    or where ddpkit's own setup explains it."""
    if _unchanged and "ddpkit.strategies.sharded_in_place" in sys.modules:
        from ddpkit.strategies.sharded_in_place import read_directly

        if (said := read_directly(error)) is not None:
            logger.error("%s", said)
            return
    if (process_group.set_up_by_ddpkit() and not _unchanged) or not up():
        return
    environ = None
    if _unchanged:
        from ddpkit import unchanged

        environ = unchanged.launcher_environment()  # (the script's own environment lacks the launcher's variables)
    runtime = process_group.Runtime(env=process_group.read_environment(environ), backend=dist.get_backend(),
                                    device=torch.device("cpu"))
    explanation, missing = process_group.explain_timeout(error, runtime)
    if explanation:
        logger.error("%s", "\n".join([explanation, *filter(None, map(stack_of_rank, missing or []))]))


def stack_of_rank(rank: int) -> str | None:
    """Rank ``rank``'s Python stack, where its host and pid are in the store and it runs on this machine."""
    try:
        store = dist.distributed_c10d._get_default_store()  # noqa: SLF001
        who = json.loads(store.get(f"{WHO_KEY}/{rank}"))
    except (RuntimeError, ValueError):
        return None
    return f"rank {rank} (host {who['host']}, pid {who['pid']}): {heartbeat.stack_of(who['host'], who['pid'])}"


if __name__ == "__main__":
    main(sys.argv[1:])
