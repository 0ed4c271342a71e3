"""``ddpkit run --replica-groups R``: torchft's lighthouse and a start barrier in this process, then R ordinary
launches of the script, one per group, each with its own rendezvous and its own ``--max-restarts``.

A group that fails is restarted by its own launcher while the others go on (``ddpkit.strategies.replica_groups``
says how the script's processes take part). The command ends when every group has ended, with the first
failure's status. Ctrl-C or SIGTERM reaches every group's launcher, which stops its workers as a plain launch does.
The fence here ends a group's process whose step outlasts its ``stall_timeout_s``, or that stopped answering.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from typing import Iterator, Sequence

from ddpkit.core import signals
from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger

from ddpkit.core.env import LIGHTHOUSE as LIGHTHOUSE_VARIABLE
from ddpkit.core.env import MIN_REPLICAS as MIN_REPLICAS_VARIABLE
from ddpkit.core.env import REPLICA_GROUP as GROUP_VARIABLE
from ddpkit.core.env import REPLICA_GROUPS as GROUPS_VARIABLE
from ddpkit.core.env import REPLICA_STORE as STORE_VARIABLE


@contextlib.contextmanager
def lighthouse(*, heartbeat_timeout_s: float, min_replicas: int = 1, join_timeout_s: float = 10.0) -> Iterator[str]:
    """torchft's lighthouse, serving in this process; yields its address (http://127.0.0.1:PORT).

    A group whose heartbeats stop for ``heartbeat_timeout_s`` is left out of the next quorum: that is how long
    the other groups wait for a dead one. ``min_replicas``: the fewest groups of a quorum; with 1, the last one
    alive trains on. Beyond that, the lighthouse only refuses a quorum of a minority of the groups it still hears
    from."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs each quorum at INFO otherwise (read at import)
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as error:
        raise UsageError(f"--replica-groups needs torchft ({error}); install it with pip install 'ddpkit[ft]'") from None
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=int(join_timeout_s * 1000),
                              quorum_tick_ms=100, heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
    try:
        port = server.address().rsplit(":", 1)[1]
        yield f"http://127.0.0.1:{port}"  # its own address names the host by a name that need not resolve here
    finally:
        server.shutdown()


def lighthouse_answering(address: str, *, timeout_s: float = 3.0) -> str:
    """``address``, checked: an http://HOST:PORT on which something accepts connections (a lighthouse started
    elsewhere, with ``torchft_lighthouse``)."""
    import socket
    import urllib.parse

    parsed = urllib.parse.urlsplit(address)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "http" or not parsed.hostname or port is None:
        raise UsageError(f"a lighthouse's address is http://HOST:PORT, got {address!r} (--lighthouse or "
                         "TORCHFT_LIGHTHOUSE)")
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout_s).close()
    except OSError as error:
        raise UsageError(f"no lighthouse answers at {address} ({error.strerror or error}): start one there "
                         "(torchft_lighthouse), or leave out --lighthouse and TORCHFT_LIGHTHOUSE so that ddpkit starts "
                         "its own") from None
    return address


def run_groups(groups: int, group_command: Sequence[str], *, heartbeat_timeout_s: float | None = None,
               min_replicas: int | None = None, lighthouse_address: str | None = None,
               log_dir: str | None = None, nproc: int = 1) -> int:
    """Start ``groups`` copies of ``group_command`` (a ``ddpkit run`` of one group of ``nproc`` processes, without
    --replica-groups), told their group, the lighthouse and the barrier store; wait for all; the first failure's
    exit status.

    ``lighthouse_address``: a lighthouse that serves already (http://HOST:PORT), used instead of starting one here
    with ``heartbeat_timeout_s`` (default 2 s) and ``min_replicas`` (default 1); the given one has its own."""
    from torch.distributed import TCPStore

    from ddpkit.core.process_group import usable_cores

    if groups < 1:
        raise UsageError(f"--replica-groups must be at least 1, got {groups}")
    if heartbeat_timeout_s is not None and not heartbeat_timeout_s > 0:
        raise UsageError(f"--replica-heartbeat-timeout must be positive, got {heartbeat_timeout_s}")
    if min_replicas is not None and not 1 <= min_replicas <= groups:
        raise UsageError(f"--min-replicas must be between 1 and --replica-groups ({groups}), got {min_replicas}")
    for flag, value, own in (("--replica-heartbeat-timeout", heartbeat_timeout_s, "--heartbeat_timeout_ms"),
                             ("--min-replicas", min_replicas, "--min_replicas")):
        if lighthouse_address is not None and value is not None:
            raise UsageError(f"{flag} is the lighthouse's own setting: give it to the lighthouse at {lighthouse_address} "
                             f"(torchft_lighthouse {own}), or leave out --lighthouse (and TORCHFT_LIGHTHOUSE) so that "
                             "ddpkit starts one")
    serving = (contextlib.nullcontext(lighthouse_answering(lighthouse_address)) if lighthouse_address is not None
               else lighthouse(heartbeat_timeout_s=2.0 if heartbeat_timeout_s is None else heartbeat_timeout_s,
                               min_replicas=min_replicas or 1))
    with serving as address:
        store = TCPStore(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))
        waits = f"; a step waits for {min_replicas} of them" if (min_replicas or 1) > 1 else ""
        logger.info(f"{groups} replica groups, lighthouse at {address}"
                    f"{'' if lighthouse_address is None else ' (given)'}{waits}")
        children: list[subprocess.Popen] = []
        gpus = visible_gpus()
        with _passed_on(children), _fencing(store, groups, nproc, children):
            try:
                for group in range(groups):
                    environment = {**os.environ, GROUP_VARIABLE: str(group), GROUPS_VARIABLE: str(groups),
                                   STORE_VARIABLE: f"127.0.0.1:{store.port}", LIGHTHOUSE_VARIABLE: address,
                                   MIN_REPLICAS_VARIABLE: str(min_replicas or 1)}
                    # The groups share this machine's cores: each launch alone would give its process all of them,
                    # and R x that many OpenMP threads spin against each other (3.4x slower steps on 2 cores).
                    environment.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // (groups * nproc))))
                    gpu = group_gpus(group, gpus, nproc, groups)
                    if gpu is not None:
                        environment["CUDA_VISIBLE_DEVICES"] = gpu
                    # A session of its own (Ctrl-C reaches it once, passed on below) that ends with this process.
                    children.append(subprocess.Popen(_with_log_dir(group_command, log_dir, group), env=environment,
                                                     start_new_session=True, preexec_fn=signals.end_with_parent))
                statuses = [_exit_status(child.wait()) for child in children]
            finally:
                _end(children)
    failed = [(group, status) for group, status in enumerate(statuses) if status != 0]
    for group, status in failed:
        logger.error(f"replica group {group} ended with exit status {status}")
    return failed[0][1] if failed else 0


def visible_gpus() -> list[str]:
    """The CUDA devices this process may hand out, as CUDA_VISIBLE_DEVICES names them (none on a CPU machine)."""
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None:
        return [name.strip() for name in named.split(",") if name.strip()]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def group_gpus(group: int, gpus: Sequence[str], nproc: int = 1, groups: int = 1) -> str | None:
    """CUDA_VISIBLE_DEVICES for ``group``'s ``nproc`` processes (of ``groups`` groups): the groups take the GPUs in
    turn, ``nproc`` each (without it, every group's local rank 0 would drive the first GPU). Groups of one process,
    with fewer GPUs than groups, share them round robin, which works (the groups' all-reduce is gloo's) but is for
    trials. None without GPUs, or with fewer than every group's processes need: the variable is left alone."""
    if not gpus:
        return None
    if nproc == 1:
        return gpus[group % len(gpus)]
    if len(gpus) < nproc * groups:
        return None
    return ",".join(gpus[group * nproc:(group + 1) * nproc])


SILENT_S = 2.0  # a process whose beats (every 0.5 s) stopped this long ago is stopped or frozen, not just busy


def fence_reason(beat: dict, now: float) -> str | None:
    """Why the process that published ``beat`` (``ReplicaGroup``'s, at wall-clock ``beat["t"]``) must be ended at
    ``now``, or None: a step of it has lasted its ``stall_s``, counting the time since its beats stopped, or its
    beats have stopped that long."""
    if not beat.get("stall_s"):
        return None  # no fence asked for
    silent = now - beat["t"]
    if (beat["moved_s"] or 0.0) + silent <= beat["stall_s"]:
        return None  # before its first step (start-up, loading), only a process that stopped answering is fenced
    if silent > SILENT_S:
        how = f"its process {beat['pid']} is stopped or frozen, silent for {silent:.0f} s, last at {beat['where']}"
    else:
        how = f"stuck at {beat['where']}"
    return f"no step for {beat['stall_s']:g} s ({how})"


@contextlib.contextmanager
def _fencing(store, groups: int, nproc: int, children: list[subprocess.Popen]) -> Iterator[None]:
    """While the groups run, a thread that ends (SIGKILL) a group's process whose step has outlasted its
    ``stall_timeout_s``: a hung process keeps torchft's heartbeats going (the others would wait for it until their
    quorum timeout), and a stopped one cannot end itself. Its launcher restarts it, and it rejoins."""
    import threading

    from ddpkit.core.env import replica_beat_key as beat_key

    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.25):
            for group, rank in itertools.product(range(groups), range(nproc)):
                key = beat_key(group, rank)
                if not store.check([key]):
                    continue
                beat = json.loads(store.get(key))
                reason = fence_reason(beat, time.time())
                if reason is None:
                    continue
                store.delete_key(key)  # once per process: its next one publishes anew
                if _runs_under(beat["pid"], {child.pid for child in children}):
                    who = f"replica group {group}" + (f", rank {rank}" if nproc > 1 else "")
                    logger.error(f"{who}: {reason}; ending it so that the other groups go on and its launcher "
                                 "restarts it")
                    with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
                        os.kill(beat["pid"], signal.SIGKILL)

    thread = threading.Thread(target=watch, name="ddpkit-replica-fence", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _runs_under(pid: int, ancestors: set[int]) -> bool:
    """Whether ``pid`` is a live process (not a zombie) started by one of ``ancestors`` or their children: a pid
    read from a beat is never a stranger's that reused it."""
    for _ in range(4):
        try:
            with open(f"/proc/{pid}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return False
        if fields[0] == "Z":
            return False
        pid = int(fields[1])  # its parent
        if pid in ancestors:
            return True
    return False


def _with_log_dir(command: Sequence[str], log_dir: str | None, group: int) -> list[str]:
    """``command`` with ``--log-dir LOG_DIR/group<N>`` after its ``run``, when a folder is given."""
    command = list(command)
    if log_dir is not None:
        at = command.index("run") + 1
        command[at:at] = ["--log-dir", os.path.join(log_dir, f"group{group}")]
    return command


def _exit_status(status: int) -> int:
    """A child's status as a shell says it: 128 + N for one ended by signal N."""
    return 128 - status if status < 0 else status


def _end(children: list[subprocess.Popen], grace_s: float = 30.0) -> None:
    """Every child still running (this process is leaving early): SIGTERM, then SIGKILL after ``grace_s``."""
    running = [child for child in children if child.poll() is None]
    for child in running:
        child.terminate()
    for child in running:
        try:
            child.wait(grace_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@contextlib.contextmanager
def _passed_on(children: list[subprocess.Popen]) -> Iterator[None]:
    """SIGTERM and SIGINT passed on to every group's launcher while they run (each runs in a session of its own,
    so a terminal's Ctrl-C reaches it only this way, once: a second one would end its ranks at once)."""
    def pass_on(signum, frame) -> None:  # noqa: ARG001
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = signals.catch((signal.SIGTERM, signal.SIGINT), pass_on)
    try:
        yield
    finally:
        signals.restore(previous)


def group_nproc(nproc_per_node: str) -> int:
    """The processes of each group: ``--nproc-per-node`` (a whole number; "auto" is one)."""
    if nproc_per_node == "auto":
        return 1
    try:
        nproc = int(nproc_per_node)
    except ValueError:
        nproc = 0
    if nproc < 1:
        raise UsageError(f"--nproc-per-node with --replica-groups is the processes of each group, a whole number of at "
                         f"least 1, got {nproc_per_node!r}")
    return nproc


def group_command(*, nproc: int, max_restarts: int, extra: Sequence[str], script: Sequence[str]) -> list[str]:
    """The ``ddpkit run`` command line of one group of ``nproc`` processes (``group_nproc``; DDP or FSDP among
    them)."""
    return [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            *extra, *script]
