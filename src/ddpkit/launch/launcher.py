"""How processes start: torchrun's own elastic agent, or torch.multiprocessing.spawn.

    >>> from ddpkit.launch.launcher import LaunchOptions, torchrun_argv
    >>> torchrun_argv(LaunchOptions(nproc_per_node=2), ["-m", "ddpkit", "train"])[:4]
    ['--nproc-per-node', '2', '--rdzv-backend', 'ddpkit-loopback']

ddpkit writes no process manager: ``elastic`` builds torchrun's command line and hands it to
``torch.distributed.run``, the code behind the ``torchrun`` command. A single-node run uses torchrun's
dynamic rendezvous on stores that listen on loopback only (``ddpkit.launch.rendezvous``), on ports the kernel
picks, so a busy 29500 never breaks it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from ddpkit.core import logs
from ddpkit.core.errors import EXIT_USAGE, UsageError, first_line
from ddpkit.core.logs import logger
from ddpkit.launch import processes

DEFAULT_MULTINODE_PORT = 29500
DEFAULT_RDZV_ID = "ddpkit"  # jobs that share a rendezvous endpoint need different --rdzv-id values
LAUNCHERS = ("torchrun", "spawn", "ray")


DEFAULT_RDZV_TIMEOUT_S = 900.0  # torchrun's


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: int = 1
    nnodes: int = 1  # with a rendezvous endpoint: the most nodes (--nnodes MIN:MAX)
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    launcher: str = "torchrun"
    rdzv_endpoint: str | None = None  # HOST:PORT of torchrun's c10d rendezvous; the nodes number themselves
    rdzv_id: str | None = None  # None: DEFAULT_RDZV_ID, with an endpoint
    min_nodes: int | None = None  # elastic: start once this many nodes joined (None: nnodes)
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S  # how long a node waits for the others to join
    rank_logs: str | None = None  # a folder: each rank's whole output in rank<N>.log there (ddpkit.launch.rank_logs)

    def __post_init__(self) -> None:
        if self.rdzv_endpoint is not None:
            _check_endpoint(self.rdzv_endpoint)
            if self.master_addr or self.master_port is not None or self.node_rank:
                raise UsageError("--rdzv-endpoint numbers the nodes itself; drop --master-addr, --master-port and "
                                 "--node-rank (they are for a static launch)")
        elif self.rdzv_id is not None:
            raise UsageError("--rdzv-id names the job at a rendezvous: it needs --rdzv-endpoint HOST:PORT")
        elif self.min_nodes is not None and self.min_nodes != self.nnodes:
            raise UsageError(f"--nnodes {self.min_nodes}:{self.nnodes} lets the job grow and shrink, which needs a "
                             "rendezvous every node can reach: add --rdzv-endpoint HOST:PORT")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes:
            raise UsageError(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {self.min_nodes}:{self.nnodes}")
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be at least 1 (or auto), got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}, got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port must be in 1..65535, got {self.master_port}")
        if not (math.isfinite(self.rdzv_timeout_s) and self.rdzv_timeout_s > 0):
            raise UsageError(f"--rdzv-timeout must be a finite number of seconds above 0, got {self.rdzv_timeout_s}")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.launcher not in LAUNCHERS:
            raise UsageError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.launcher == "spawn" and (self.nnodes > 1 or self.rdzv_endpoint):
            raise UsageError("--launcher spawn starts processes on this machine only; use torchrun for several nodes")
        if self.launcher == "spawn" and self.max_restarts > 0:
            raise UsageError("--max-restarts needs torchrun's elastic agent; drop --launcher spawn")
        if self.launcher == "ray":
            given = [flag for flag, value in (("--master-addr", self.master_addr), ("--master-port", self.master_port),
                                              ("--node-rank", self.node_rank), ("--rdzv-endpoint", self.rdzv_endpoint))
                     if value]
            if given:
                raise UsageError(f"--launcher ray: Ray places the ranks and picks rank 0's node as the master; drop "
                                 f"{', '.join(given)} (--address names the cluster)")
            return
        if self.nnodes > 1 and not self.master_addr and not self.rdzv_endpoint:
            raise UsageError(
                f"--nnodes {self.nnodes} needs --master-addr: the address of node 0 that every node can reach"
            )

    @property
    def world_size(self) -> int:
        """The processes of the whole job (elastic: at most)."""
        return self.nproc_per_node * self.nnodes


def parse_nnodes(value: str) -> tuple[int | None, int]:
    """``--nnodes N`` -> (None, N); ``--nnodes MIN:MAX`` -> (MIN, MAX)."""
    low, colon, high = value.partition(":")
    try:
        return (int(low), int(high)) if colon else (None, int(value))
    except ValueError:
        raise UsageError(f"--nnodes takes a whole number or MIN:MAX, got {value!r}") from None


def _check_endpoint(endpoint: str) -> None:
    host, colon, port = endpoint.rpartition(":")
    if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
        raise UsageError(f"--rdzv-endpoint takes HOST:PORT with a port in 1..65535, e.g. node0:29400, got {endpoint!r}")


def resolve_nproc(value: str, cuda_count: int | None = None) -> int:
    """``auto``: one process per visible GPU, or 2 on a machine without GPUs."""
    if value == "auto":
        count = torch.cuda.device_count() if cuda_count is None else cuda_count
        return count if count > 0 else 2
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"--nproc-per-node must be a whole number or auto, got {value!r}") from None


def torchrun_argv(options: LaunchOptions, command: Sequence[str]) -> list[str]:
    """torchrun's own command line for these options, followed by ``command`` (script or -m module)."""
    from ddpkit.launch import rendezvous

    argv = ["--nproc-per-node", str(options.nproc_per_node)]
    if options.rdzv_endpoint is not None:
        # torchrun's c10d rendezvous: the node whose address is the endpoint's hosts the store (on that
        # address only: ddpkit.launch.rendezvous), and the nodes that join (MIN to MAX) are numbered as they arrive.
        argv += [
            "--nnodes", f"{options.min_nodes or options.nnodes}:{options.nnodes}",
            "--rdzv-backend", rendezvous.C10D, "--rdzv-endpoint", options.rdzv_endpoint,
            "--rdzv-id", options.rdzv_id or DEFAULT_RDZV_ID,
            "--rdzv-conf", f"join_timeout={math.ceil(options.rdzv_timeout_s)}",
        ]
    elif options.nnodes == 1 and options.master_port is None:
        # torchrun's --standalone, with its stores on loopback (ddpkit.launch.rendezvous).
        argv += ["--rdzv-backend", rendezvous.BACKEND, "--rdzv-endpoint", rendezvous.ENDPOINT,
                 "--rdzv-id", f"ddpkit-{os.getpid()}"]
    else:
        # torchrun's static rendezvous (--master-addr, --master-port, --node-rank), its store on the master
        # address only (ddpkit.launch.rendezvous); the node rank goes in --rdzv-conf, where that backend reads it.
        master = f"{options.master_addr or '127.0.0.1'}:{options.master_port or DEFAULT_MULTINODE_PORT}"
        argv += [
            "--nnodes", str(options.nnodes),
            "--rdzv-backend", rendezvous.STATIC, "--rdzv-endpoint", master,
            "--rdzv-conf", f"rank={options.node_rank},timeout={math.ceil(options.rdzv_timeout_s)}",
        ]
    argv += ["--max-restarts", str(options.max_restarts)]
    if options.rank_logs is not None:
        from ddpkit.launch import rank_logs

        argv += ["--logs-specs", rank_logs.ENTRY_POINT, "--log-dir", options.rank_logs]
    return argv + list(command)


def _threads_per_process(nproc: int) -> str:
    from ddpkit.core.process_group import usable_cores

    return str(max(1, usable_cores() // nproc))


def elastic(options: LaunchOptions, command: Sequence[str], *, local_rank_arg: bool = False) -> int:
    """Run ``command`` on every process of this node through torchrun's agent; returns an exit status."""
    from torch.distributed import run as torchrun

    # torchrun would force 1 thread per process (and warn); a fair share of the cores is faster on CPU.
    os.environ.setdefault("OMP_NUM_THREADS", _threads_per_process(options.nproc_per_node))
    # By default the workers' process group shares the rendezvous' TCP store, and after a restart the
    # new workers can read the dead ones' addresses and hang in init_process_group (PyTorch issue
    # 135712, seen here with torch 2.15 and --max-restarts). A store of their own avoids it. (On one
    # machine ddpkit's rendezvous serves them a fresh one each round instead: ddpkit.launch.rendezvous.)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # torchrun takes PET_<FLAG> (a Kubeflow pod's PET_NNODES, PET_NODE_RANK, ...) as the default of each flag it is
    # not given: ddpkit gives every flag it means, having read those variables already (ddpkit.core.platforms),
    # and they must not add what it did not mean (PET_NNODES under a one-node launch), here or in the workers.
    for name in [name for name in os.environ if name.startswith("PET_")]:
        del os.environ[name]
    check_names(options)
    warn_leftovers(options)
    if options.nnodes > 1:
        choose_gloo_interface(options)
    if options.nnodes > 1 and options.rdzv_endpoint is None and options.node_rank > 0:
        wait_for_node_0(options.master_addr, options.master_port or DEFAULT_MULTINODE_PORT, options.rdzv_timeout_s)
    if options.rdzv_endpoint is not None:
        host, port, _ = rendezvous_host(options)
        if not is_this_machine(host):  # the machine that hosts the rendezvous starts its store: nothing to wait for
            wait_for_node_0(host, port, options.rdzv_timeout_s, what="the rendezvous endpoint",
                            flags="--rdzv-endpoint", machine="the node it names")
    if options.nnodes > 1:
        watch_rendezvous_host(options)
    # The agent logs each worker it stops and each one that failed ("failed (exitcode: 2) local_rank: 1 ...");
    # report_failures says the same once per rank that failed of its own accord (none after a usage error,
    # which rank 0 has said in one line already).
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    from ddpkit.launch import rendezvous

    rendezvous.register()
    with _rank_logs_environment(options) as options:
        args = torchrun.parse_args(torchrun_argv(options, command))
        # The legacy torch.distributed.launch behaviour: pass --local-rank=N instead of only LOCAL_RANK.
        args.use_env = not local_rank_arg
        return _run_agent(torchrun, args, options)


def _run_agent(torchrun, args, options: LaunchOptions) -> int:
    """torchrun's agent on ``args``; its failures said as ddpkit says them."""
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from ddpkit.launch import rank_logs

    try:
        torchrun.run(args)
    except ChildFailedError as failed:
        rank_logs.drain()  # every line the failed ranks wrote is on the console and in their files first
        return report_failures({rank: (f.exitcode, f.pid) for rank, f in failed.failures.items()},
                               options.rank_logs)
    except SignalException as stopped:
        # Ctrl-C or SIGTERM reached the agent, which passed it on and gave the workers its grace period
        # to checkpoint and exit. A second signal interrupts that wait: end whatever is left, now.
        killed = processes.kill_children()
        detail = f"; {killed} worker(s) still running were killed" if killed else ""
        rank_logs.drain(2.0)  # the workers' last lines (rank 0's checkpoint) before this one
        logger.info(f"stopped by signal {stopped.sigval.name}{detail}")
        # Leave now. The interrupted agent can leave threads behind (its rendezvous' keep-alive) that hold
        # the interpreter's exit: once in a CI run the launcher printed this line and never exited.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + int(stopped.sigval))
    except (DistNetworkError, RendezvousError) as error:
        if options.rdzv_endpoint is not None:
            raise UsageError(
                f"could not join the rendezvous at {options.rdzv_endpoint} ({first_line(error)}); check that the "
                "endpoint's host is one of the nodes (it hosts the rendezvous), that every node reaches it, and that "
                "the port is free there"
            ) from None
        where = f"{options.master_addr or '127.0.0.1'}:{options.master_port or DEFAULT_MULTINODE_PORT}"
        raise UsageError(
            f"could not set up the rendezvous at {where} ({first_line(error)}); "
            "check --master-addr, and that --master-port is free on node 0 (or omit it on one node)"
        ) from None
    finally:
        rank_logs.drain()
    return 0


@contextlib.contextmanager
def _rank_logs_environment(options: LaunchOptions):
    """``options`` with their workers' output kept per rank (ddpkit.launch.rank_logs), when asked for and when torchrun
    can find ddpkit's log plugin, and the workers' variables for it set meanwhile. Without the plugin (ddpkit
    used from its source folder, not installed), the workers write to the console as they would under
    torchrun, and the rank files keep ddpkit's messages only."""
    from ddpkit.launch import rank_logs

    if options.rank_logs is None:
        yield options
        return
    if not rank_logs.available():
        logger.debug("ddpkit's torchrun log plugin is not installed (pip install ddpkit): each rank writes to the "
                     "console, and logs/rank<N>.log holds its ddpkit messages only")
        yield dataclasses.replace(options, rank_logs=None)
        return
    # PYTHONUNBUFFERED: a worker's prints reach its file and the console as printed.
    variables = {rank_logs.ENV: "1", "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")}
    if sys.stderr.isatty():  # rank 0's progress bar writes there, not into its file
        variables[logs.TERMINAL_ENV] = os.ttyname(sys.stderr.fileno())
    with variables_set(variables):
        yield options


@contextlib.contextmanager
def variables_set(variables: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``variables`` set inside the block (the workers started there inherit them), and as
    it was before after it."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


WATCH_INTERVAL_S = 2.0


def rendezvous_host(options: LaunchOptions) -> tuple[str, int, str]:
    """Where a job across machines has its rendezvous store: (host, port, the flag that names it)."""
    if options.rdzv_endpoint is not None:
        host, _, port = options.rdzv_endpoint.rpartition(":")
        return host, int(port), "--rdzv-endpoint"
    return options.master_addr, options.master_port or DEFAULT_MULTINODE_PORT, "--master-addr"


def watch_rendezvous_host(options: LaunchOptions) -> None:
    """On a node that does not host the rendezvous: once this node's workers have ended, end the launcher
    with one line if the rendezvous host does not answer. torchrun's agent would otherwise go on calling its
    store (closing the rendezvous, 60 s per call, again and again: a partitioned node waited for minutes)."""
    import threading

    from ddpkit.core import network
    from ddpkit.launch import rank_logs

    host, port, flags = rendezvous_host(options)
    if is_this_machine(host) or not os.path.isdir("/proc"):
        return

    def watch() -> None:
        had_workers = False
        while True:
            time.sleep(WATCH_INTERVAL_S)
            # A worker that ended is a zombie while the agent, blocked in a call to the store, has not seen it.
            if any(processes.is_running(child) for child in processes.children_of(os.getpid())):
                had_workers = True
                continue
            if had_workers and not network.answers(host, port):
                logger.error(f"this node's workers have ended, and the rendezvous host {host}:{port} "
                             f"({flags}) does not answer: the network to it is cut, or it is down; ending this "
                             "node now instead of waiting on it")
                rank_logs.drain(2.0)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)

    threading.Thread(target=watch, name="ddpkit-rendezvous-watch", daemon=True).start()


def choose_gloo_interface(options: LaunchOptions) -> None:
    """Across machines, when this machine's name resolves to a loopback address: set GLOO_SOCKET_IFNAME (for
    the workers) to the interface that reaches the other nodes, and say so; or one line naming the choices."""
    from ddpkit.core import network

    if os.environ.get(network.GLOO_VARIABLE):
        return
    peer = rendezvous_host(options)[0]
    chosen = network.gloo_interface(peer)
    if chosen is None:
        return
    name, address = network.own_name_address()
    os.environ[network.GLOO_VARIABLE] = chosen[0]
    resolves = f"resolves to {address}, a loopback address" if address else "does not resolve"
    logger.info(f"this machine's name {name} {resolves}, which gloo would advertise to the other nodes: using "
                f"{network.GLOO_VARIABLE}={chosen[0]} ({chosen[1]}), the interface that reaches {peer}")


def wait_for_node_0(host: str, port: int, timeout_s: float, *, what: str = "node 0",
                    flags: str = "--master-addr and --master-port", machine: str = "node 0") -> None:
    """On a node other than 0 of a static launch (or one that does not host the c10d rendezvous): wait until
    node 0's store accepts a connection, or end with one line after ``timeout_s``. (torchrun's own client
    would retry for its whole timeout, or a minute past a c10d one, logging a C++ stack trace, and an
    unreachable address would never be named.)"""
    import socket

    logger.info(f"waiting for {what} at {host}:{port} (up to {timeout_s:g} s: --rdzv-timeout)")
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, left))):
                return
        except OSError as error:
            last = error.strerror or type(error).__name__  # "Connection refused", "Network is unreachable", ...
        if time.monotonic() + 1.0 > deadline:
            raise UsageError(f"{what} at {host}:{port} did not answer in {timeout_s:g} s (last try: {last}); check "
                             f"{flags}, that {machine} has started, and that the machines reach each other on that "
                             "port (--rdzv-timeout waits longer)")
        time.sleep(1.0)


def is_this_machine(host: str) -> bool:
    """Whether ``host`` names this machine: one of its addresses can be bound here (a loopback address, a
    local interface's). A name that does not resolve is not this machine."""
    import socket

    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, kind, _, _, address in addresses:
        with socket.socket(family, kind) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:  # not an address of this machine's
                continue
            return True
    return False


def check_names(options: LaunchOptions) -> None:
    """The master's or the rendezvous' host name resolves: torchrun would retry a name that never will."""
    import socket

    for flag, host in (("--master-addr", options.master_addr),
                       ("--rdzv-endpoint", options.rdzv_endpoint.rpartition(":")[0] if options.rdzv_endpoint else None)):
        if host:
            try:
                socket.getaddrinfo(host, None)
            except (socket.gaierror, UnicodeError):
                raise UsageError(f"{flag}: cannot resolve host {host!r} on this machine; give a name or address "
                                 "of a machine of the job that every machine can resolve") from None


def warn_leftovers(options: LaunchOptions) -> list[str]:
    """Warn about processes of an earlier run that hold the master port or GPU memory; return the warnings.

    A run killed with SIGKILL can leave workers behind that keep their GPU memory and the port; the
    next run then fails with "address in use" or out of memory, far from the cause.
    """
    found = []
    port = options.master_port
    if port is None and options.nnodes > 1 and options.rdzv_endpoint is None:
        port = DEFAULT_MULTINODE_PORT  # what a static multi-machine launch binds on machine 0
    if port is not None and options.node_rank == 0:
        found += [processes.port_holder_line(port, holder) for holder in processes.port_holders(port)]
    if torch.cuda.is_available():
        # Only this user's processes that this machine's /proc shows: others' jobs are not ours to kill.
        found += [processes.gpu_holder_line(app) for app in processes.gpu_processes() if processes.owned_here(app["pid"])]
    for what in found:
        logger.warning(what)
    return found



def report_failures(failures: dict[int, tuple[int, int]], rank_logs_dir: str | None = None) -> int:
    """One line per failed rank; exit 2 if a rank rejected its input (it printed why), else 1.
    ``rank_logs_dir``: where each rank's whole output is (ddpkit.launch.rank_logs), named in the line.

    When a rank rejected its input, the ranks the agent then stopped with SIGTERM are not failures of
    their own, and are not reported; after another failure they are said to have been ended (not an error).
    """
    codes = [exitcode for exitcode, _ in failures.values()]
    # Ended by SIGTERM: killed by it, or (ddpkit's own handler, when the rank was in Python) exited 128 + 15.
    ended = (-signal.SIGTERM, 128 + signal.SIGTERM)
    # A rank that ended by SIGTERM while another failed otherwise was ended by the agent, after that one.
    collateral = any(code not in ended for code in codes)
    for rank, (exitcode, pid) in sorted(failures.items()):
        if EXIT_USAGE in codes and exitcode in ended:
            continue
        if collateral and exitcode in ended:
            logger.info(f"rank {rank} (pid {pid}) was ended by the launcher (SIGTERM) when another rank failed")
        elif exitcode != EXIT_USAGE:
            how = f"killed by signal {-exitcode}" if exitcode < 0 else f"exited with status {exitcode}"
            if rank_logs_dir is None or rank == 0:
                where = "its output is above"
            else:
                from ddpkit.launch.rank_logs import path_for

                where = f"its errors are above, all its output in {path_for(rank_logs_dir, rank)}"
            logger.error(f"rank {rank} (pid {pid}) {how}; {where}")
    return EXIT_USAGE if EXIT_USAGE in codes else 1


def _pid(failed: Exception) -> int:
    """The failed worker's pid from spawn's exception: ``error_pid`` on newer torch, ``pid`` on torch 2.4."""
    return getattr(failed, "error_pid", None) or failed.pid


def spawn(worker: Callable[..., object], nproc: int, args: tuple = ()) -> int:
    """The tutorials' way: ``torch.multiprocessing.spawn(worker, args=(port, *args))``, rank first."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import (
        ProcessExitedException,
        ProcessRaisedException,
    )

    from ddpkit.core.process_group import free_port

    os.environ.setdefault("OMP_NUM_THREADS", _threads_per_process(nproc))
    try:
        mp.spawn(worker, args=(nproc, free_port(), *args), nprocs=nproc, join=True)
    except ProcessExitedException as failed:
        return report_failures({failed.error_index: (failed.exit_code, _pid(failed))})
    except ProcessRaisedException as failed:
        # spawn hands the worker's traceback over in the exception instead of printing it.
        print(failed, file=sys.stderr)  # the worker's traceback: program output, not a message of ours
        logger.error(f"rank {failed.error_index} (pid {_pid(failed)}) raised the exception above")
        return 1
    return 0
