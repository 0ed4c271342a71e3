"""``ddpkit run --replica-groups R``: torchft's lighthouse and a start barrier in this process, then R ordinary
launches of the script, one per group, each with its own rendezvous and its own ``--max-restarts``.

On several machines (``--nnodes M --node-rank K --master-addr HOST``) each machine's launcher runs R/M of the groups.
Machine 0's serves the lighthouse and the launchers' store (at ``--master-addr``:``--master-port``); the others
read the lighthouse's address and machine 0's settings from that store. Each fences its own groups only. Machine 0
keeps serving until the other machines' launchers have ended.

A group that fails is restarted by its own launcher while the others go on (``ddpkit.strategies.replica_groups``
says how the script's processes take part). The command ends when every group has ended, with the first
failure's status. Ctrl-C or SIGTERM reaches every group's launcher, which stops its workers as a plain launch does.
The fence here ends a group's process whose step outlasts its ``stall_timeout_s``, or that stopped answering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Iterator, Sequence

from ddpkit.core import signals
from ddpkit.core.errors import UsageError, first_line
from ddpkit.core.logs import logger
from ddpkit.core.network import is_loopback
from ddpkit.launch.launcher import DEFAULT_MULTINODE_PORT, wait_for_node_0

from ddpkit.core.env import LIGHTHOUSE as LIGHTHOUSE_VARIABLE
from ddpkit.core.env import MIN_REPLICAS as MIN_REPLICAS_VARIABLE
from ddpkit.core.env import REPLICA_GROUP as GROUP_VARIABLE
from ddpkit.core.env import REPLICA_GROUPS as GROUPS_VARIABLE
from ddpkit.core.env import REPLICA_STORE as STORE_VARIABLE


@contextlib.contextmanager
def lighthouse(*, heartbeat_timeout_s: float, min_replicas: int = 1, join_timeout_s: float = 10.0,
               host: str | None = None) -> Iterator[str]:
    """torchft's lighthouse, serving in this process; yields its address: http://127.0.0.1:PORT, or with ``host``
    (the name the other machines reach this one by) http://HOST:PORT, listening on every interface.

    A group whose heartbeats stop for ``heartbeat_timeout_s`` is left out of the next quorum: that is how long
    the other groups wait for a dead one. ``min_replicas``: the fewest groups of a quorum; with 1, the last one
    alive trains on. Beyond that, the lighthouse only refuses a quorum of a minority of the groups it still hears
    from."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs each quorum at INFO otherwise (read at import)
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as error:
        raise UsageError(f"--replica-groups needs torchft ({error}); install it with pip install 'ddpkit[ft]'") from None
    server = LighthouseServer(bind="127.0.0.1:0" if host is None else "[::]:0", min_replicas=min_replicas,
                              join_timeout_ms=int(join_timeout_s * 1000), quorum_tick_ms=100,
                              heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
    try:
        port = server.address().rsplit(":", 1)[1]
        # its own address names the host by this machine's name, which need not resolve where it is read
        yield f"http://{_url_host(host or '127.0.0.1')}:{port}"
    finally:
        server.shutdown()


def _url_host(host: str) -> str:
    """``host`` as a URL names it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


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


@dataclasses.dataclass(frozen=True)
class Machines:
    """Where the groups run: on ``count`` machines (``--nnodes``), each one's launcher running ``groups / count`` of
    them; this one is ``rank`` (``--node-rank``). Machine 0 serves the lighthouse and the launchers' store at
    ``master_addr``:``master_port``, which every machine reaches. ``wait_s`` (``--rdzv-timeout``): how long machine 0
    waits for the others' launchers, and they for it."""
    count: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MULTINODE_PORT
    wait_s: float = 900.0

    def groups_here(self, groups: int) -> range:
        """The groups this machine runs: the rank-th share of them, in order."""
        share = groups // self.count
        return range(self.rank * share, (self.rank + 1) * share)


JOB_KEY = "job"  # in the launchers' store: machine 0's settings and the lighthouse's address, for the other machines
START_KEY = "start"  # set by machine 0 once every machine has joined: the groups start then
STORE_TIMEOUT_S = 30.0  # a call to machine 0's store from another machine (it answers in milliseconds when up)
MACHINE_GONE_S = 10.0  # a machine's launcher whose beats (every second) stopped this long ago has ended


def run_groups(groups: int, group_command: Sequence[str], *, heartbeat_timeout_s: float | None = None,
               min_replicas: int | None = None, lighthouse_address: str | None = None,
               log_dir: str | None = None, nproc: int = 1, machines: Machines = Machines()) -> int:
    """Start this machine's copies of ``group_command`` (a ``ddpkit run`` of one group of ``nproc`` processes,
    without --replica-groups), told their group, the lighthouse and the launchers' store; wait for all; the first
    failure's exit status.

    ``lighthouse_address``: a lighthouse that serves already (http://HOST:PORT), used instead of starting one here
    with ``heartbeat_timeout_s`` (default 2 s) and ``min_replicas`` (default 1); the given one has its own.
    ``machines``: with several, machine 0 serves the lighthouse and the store; every machine runs its share of the
    groups, and must be given the same settings."""
    from ddpkit.core.process_group import usable_cores

    _check_settings(groups, heartbeat_timeout_s, min_replicas, lighthouse_address, machines)
    settings = {"--replica-groups": groups, "--nproc-per-node": nproc, "--min-replicas": min_replicas or 1,
                "--replica-heartbeat-timeout": heartbeat_timeout_s or 2.0, "--lighthouse": lighthouse_address}
    children: list[subprocess.Popen] = []
    # Ctrl-C while machine 0 waits for the others (before its groups start, or after they ended) ends the wait.
    with _job(machines, settings) as (store, store_address, address), _passed_on(children):
        here = machines.groups_here(groups)
        on = "" if machines.count == 1 else f" ({len(here)} on this machine, {machines.rank} of {machines.count})"
        waits = f"; a step waits for {min_replicas} of them" if (min_replicas or 1) > 1 else ""
        logger.info(f"{groups} replica groups{on}, lighthouse at {address}"
                    f"{'' if lighthouse_address is None else ' (given)'}{waits}")
        gpus = visible_gpus()
        with _fencing(store, here, nproc, children):
            try:
                for local, group in enumerate(here):
                    environment = {**os.environ, GROUP_VARIABLE: str(group), GROUPS_VARIABLE: str(groups),
                                   STORE_VARIABLE: store_address, LIGHTHOUSE_VARIABLE: address,
                                   MIN_REPLICAS_VARIABLE: str(min_replicas or 1)}
                    # The groups share this machine's cores: each launch alone would give its process all of them,
                    # and R x that many OpenMP threads spin against each other (3.4x slower steps on 2 cores).
                    environment.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // (len(here) * nproc))))
                    gpu = group_gpus(local, gpus, nproc, len(here))
                    if gpu is not None:
                        environment["CUDA_VISIBLE_DEVICES"] = gpu
                    # A session of its own (Ctrl-C reaches it once, passed on below) that ends with this process.
                    children.append(subprocess.Popen(_with_log_dir(group_command, log_dir, group), env=environment,
                                                     start_new_session=True, preexec_fn=signals.end_with_parent))
                statuses = [_exit_status(child.wait()) for child in children]
            finally:
                _end(children)
    failed = [(group, status) for group, status in zip(here, statuses) if status != 0]
    for group, status in failed:
        logger.error(f"replica group {group} ended with exit status {status}")
    return failed[0][1] if failed else 0


def _check_settings(groups: int, heartbeat_timeout_s: float | None, min_replicas: int | None,
                    lighthouse_address: str | None, machines: Machines) -> None:
    """UsageError for a setting of ``run_groups`` out of its range or at odds with the others, in the flags' words."""
    if groups < 1:
        raise UsageError(f"--replica-groups must be at least 1, got {groups}")
    if heartbeat_timeout_s is not None and not heartbeat_timeout_s > 0:
        raise UsageError(f"--replica-heartbeat-timeout must be positive, got {heartbeat_timeout_s}")
    if min_replicas is not None and not 1 <= min_replicas <= groups:
        raise UsageError(f"--min-replicas must be between 1 and --replica-groups ({groups}), got {min_replicas}")
    if groups % machines.count:
        raise UsageError(f"--replica-groups {groups} on --nnodes {machines.count} machines: every machine runs as many "
                         f"groups, so give a multiple of {machines.count}")
    for flag, value, own in (("--replica-heartbeat-timeout", heartbeat_timeout_s, "--heartbeat_timeout_ms"),
                             ("--min-replicas", min_replicas, "--min_replicas")):
        if lighthouse_address is not None and value is not None:
            raise UsageError(f"{flag} is the lighthouse's own setting: give it to the lighthouse at "
                             f"{lighthouse_address} (torchft_lighthouse {own}), or leave out --lighthouse (and "
                             "TORCHFT_LIGHTHOUSE) so that ddpkit starts one")


@contextlib.contextmanager
def _job(machines: Machines, settings: dict) -> Iterator[tuple[object, str, str]]:
    """The launchers' store and the lighthouse, for this machine's groups: (the store, its HOST:PORT for the groups,
    the lighthouse's address). Machine 0 serves both (starting the lighthouse unless ``settings`` name one); the
    others read machine 0's settings from its store, and refuse to run with different ones."""
    given = settings["--lighthouse"]
    if machines.rank > 0:
        with _joined(machines, settings) as joined:
            yield joined
        return
    several = machines.count > 1
    if several and given is not None and _is_loopback_url(given):
        raise UsageError(f"--lighthouse {given} names this machine by a loopback address, which the other machines "
                         "cannot reach: give its name or address on the network")
    serving = (contextlib.nullcontext(lighthouse_answering(given)) if given is not None
               else lighthouse(heartbeat_timeout_s=settings["--replica-heartbeat-timeout"],
                               min_replicas=settings["--min-replicas"], host=machines.master_addr if several else None))
    with serving as address:
        store = _serve_store(machines)
        if not several:
            yield store, f"127.0.0.1:{store.port}", address
            return
        store.set(JOB_KEY, json.dumps({**settings, "lighthouse": address}))
        logger.info(f"machine 0 of {machines.count}: waiting for the other machines' launchers at "
                    f"{machines.master_addr}:{machines.master_port} (up to {machines.wait_s:g} s: --rdzv-timeout)")
        others = "1" if machines.count == 2 else f"1 to {machines.count - 1}"
        _wait_until(lambda: store.add("joined", 0) >= machines.count - 1, machines.wait_s,
                    lambda: f"{machines.count - 1 - store.add('joined', 0)} of the other {machines.count - 1} "
                            f"machines did not join within {machines.wait_s:g} s: start ddpkit with the same "
                            f"command and --node-rank {others} there (--rdzv-timeout waits longer)")
        store.set(START_KEY, "1")  # every machine's groups start now, and meet at their start barrier
        yield store, f"{machines.master_addr}:{machines.master_port}", address
        _outlive_other_machines(store, machines)  # not after an error: this machine's groups may not have started


def _serve_store(machines: Machines):
    """The launchers' store: on 127.0.0.1 and a free port on one machine; on several, at --master-port, listening
    on the address --master-addr names when it is this machine's (else on every interface, as PyTorch's)."""
    from torch.distributed import DistNetworkError, TCPStore

    from ddpkit.core import network

    timeout = datetime.timedelta(seconds=60)
    if machines.count == 1:
        return TCPStore(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False, timeout=timeout)
    bind = network.bind_address(machines.master_addr, one_machine=False)
    try:
        if bind is not None:
            return network.store_on(bind, port=machines.master_port, timeout_s=60, wait_for_workers=False)
        return TCPStore(host_name=machines.master_addr, port=machines.master_port, is_master=True,
                        wait_for_workers=False, timeout=timeout)
    except DistNetworkError as error:
        raise UsageError(f"machine 0 cannot serve the replica groups' store at {machines.master_addr}:"
                         f"{machines.master_port} ({first_line(error)}): pick a free --master-port") from None


@contextlib.contextmanager
def _joined(machines: Machines, settings: dict) -> Iterator[tuple[object, str, str]]:
    """Machine ``machines.rank`` > 0: machine 0's store, once it answers; its settings checked against ours; a beat
    every second while this launcher runs, so that machine 0 waits for it before it stops serving."""
    from torch.distributed import TCPStore

    where = f"{machines.master_addr}:{machines.master_port}"
    wait_for_node_0(machines.master_addr, machines.master_port, machines.wait_s, what="machine 0's replica groups",
                    machine="machine 0")
    try:  # machine 0 publishes the key as soon as its store serves: a store that lacks it is someone else's
        store = TCPStore(host_name=machines.master_addr, port=machines.master_port, is_master=False,
                         timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        job = json.loads(store.get(JOB_KEY))
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"what answers at {where} is not machine 0 of ddpkit's replica groups ({first_line(error)}): "
                         "check --master-addr and --master-port") from None
    mine = {**settings, "--lighthouse": settings["--lighthouse"] or job["--lighthouse"]}
    differ = [f"{flag} {_said(mine[flag])} here, {_said(job[flag])} on machine 0" for flag in settings
              if mine[flag] != job[flag]]
    if differ:
        raise UsageError(f"every machine of the replica groups takes the same settings: {'; '.join(differ)}")
    lighthouse_answering(job["lighthouse"])  # reachable from here too
    beat = f"machine{machines.rank}"
    # One launcher per machine: a second one given the same --node-rank would train the same groups' data again.
    # A launcher that ended (done) may be started again: its groups rejoin.
    token = uuid.uuid4().hex
    if store.compare_set(f"{beat}.claimed", "", token) == token.encode():
        store.add("joined", 1)
    elif store.check([f"{beat}.done"]):  # the machine's earlier launcher ended: this one takes its place
        store.set(f"{beat}.claimed", token)
        store.delete_key(f"{beat}.done")
    else:
        raise UsageError(f"another launcher runs machine {machines.rank} of the replica groups already: give each "
                         "machine its own --node-rank")
    stop = threading.Event()

    def beats() -> None:
        own = None
        while not stop.wait(1.0):
            try:  # machine 0 may be gone, or not answering for a while: nothing to tell it then
                own = own or TCPStore(host_name=machines.master_addr, port=machines.master_port, is_master=False,
                                      timeout=datetime.timedelta(seconds=10))
                own.add(beat, 1)
            except RuntimeError:
                own = None

    thread = threading.Thread(target=beats, name="ddpkit-machine-beats", daemon=True)
    thread.start()
    try:
        # The groups start on every machine once all have joined (machine 0 says so): a group's start barrier
        # waits only a minute for the others.
        _wait_until(lambda: store.check([START_KEY]), machines.wait_s,
                    lambda: f"machine 0 did not see every machine join within {machines.wait_s:g} s: start ddpkit "
                            "on the others (--rdzv-timeout waits longer)")
        yield store, where, job["lighthouse"]
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(RuntimeError):
            store.set(f"{beat}.done", "1")


def _is_loopback_url(address: str) -> bool:
    import urllib.parse

    host = urllib.parse.urlsplit(address).hostname
    return host == "localhost" or is_loopback(host)


def _said(value) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _outlive_other_machines(store, machines: Machines) -> None:
    """Machine 0, its groups ended: keep the lighthouse and the store serving while another machine's launcher
    runs (a group of its may still train, or be restarted and ask whether the run has finished); one that stopped
    beating for ``MACHINE_GONE_S`` has ended."""
    others = range(1, machines.count)
    seen = {machine: (-1, time.monotonic()) for machine in others}

    def all_ended() -> bool:
        for machine in others:
            if store.check([f"machine{machine}.done"]):
                continue
            count, since = seen[machine]
            now = store.add(f"machine{machine}", 0)
            if now != count:
                seen[machine] = (now, time.monotonic())
            elif time.monotonic() - since > MACHINE_GONE_S:
                continue
            return False
        return True

    if not all_ended():
        logger.info("waiting for the other machines' groups to end (this machine serves their lighthouse and store; "
                    "Ctrl-C leaves now, and their groups fail without them)")
        _wait_until(all_ended, None, None)


def _wait_until(done, timeout_s: float | None, why) -> None:
    """Until ``done()``, checked twice a second; UsageError(``why()``) after ``timeout_s`` (None: no limit)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not done():
        if deadline is not None and time.monotonic() > deadline:
            raise UsageError(why())
        time.sleep(0.5)


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
def _fencing(store, groups: Sequence[int], nproc: int, children: list[subprocess.Popen]) -> Iterator[None]:
    """While the groups run, a thread that ends (SIGKILL) a group's process whose step has outlasted its
    ``stall_timeout_s``: a hung process keeps torchft's heartbeats going (the others would wait for it until their
    quorum timeout), and a stopped one cannot end itself. Its launcher restarts it, and it rejoins. ``groups``: this
    machine's (a beat's time is its own machine's clock, and its pid is a process here)."""
    from ddpkit.core.env import replica_beat_key as beat_key

    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.25):
            try:
                fence_once()
            except RuntimeError as error:  # the store is gone (machine 0 ended or is unreachable)
                logger.error(f"the replica groups' fence stops: the launchers' store does not answer "
                             f"({first_line(error)})")
                return

    def fence_once() -> None:
        for group, rank in itertools.product(groups, range(nproc)):
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
