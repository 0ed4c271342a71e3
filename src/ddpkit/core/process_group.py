"""Process group: backend and device choice, initialisation, teardown, signals.

    >>> import ddpkit
    >>> with ddpkit.distributed() as rt:          # doctest: +SKIP
    ...     model = ddpkit.prepare_model(Net(), rt)
    ...     print(rt.rank, rt.world_size, rt.device)

``distributed()`` reads who this process is (``ddpkit.core.env``), binds it to its GPU *before* anything
touches CUDA, starts the process group when there is more than one process, and always destroys it:
on normal exit, on an exception, on Ctrl-C and on SIGTERM (which torchrun and Slurm send on shutdown).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import gc
import math
import os
import re
import signal
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ddpkit.core import env as env_mod
from ddpkit.core import exits, logs, signals
from ddpkit.core.errors import UsageError, disk_full, first_line
from ddpkit.core.logs import logger, report_usage_error
from ddpkit.core.version import torch_at_least

BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cpu", "cuda")
# PyTorch's own default collective timeout is 10 minutes (NCCL) / 30 minutes (gloo); one value for both.
LAUNCHED_BY_TORCHRUN = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent in every worker it starts
DEFAULT_TIMEOUT_S = 1800.0
MIN_TIMEOUT_S = 1.0  # below this not even two processes on one machine can connect


@dataclasses.dataclass(frozen=True)
class Runtime:
    """This process's place in the job, with the backend and device it was bound to."""

    env: env_mod.DistEnv
    backend: str | None  # None when no process group was started (one process, no DDP)
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S  # how long a collective waits (``setup``'s timeout_s)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.env.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (the index of its GPU)."""
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        """How many processes the job has in all."""
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one that prints and saves."""
        return self.env.is_main


def read_environment(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> env_mod.DistEnv:
    """``env.detect`` on this process's environment and arguments; malformed launcher variables are bad input."""
    try:
        return env_mod.detect(os.environ if environ is None else environ, sys.argv if argv is None else argv)
    except ValueError as error:
        raise UsageError(f"cannot read the launcher's environment: {error}") from None


def choose_device(requested: str, *, local_rank: int, local_world_size: int, cuda_count: int) -> str:
    """"cuda" or "cpu" for this process. ``auto`` takes the GPU when every local process gets its own."""
    if requested not in DEVICES:
        raise UsageError(f"`device` must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested == "cpu":
        return "cpu"
    if requested == "cuda":
        if cuda_count == 0:
            raise UsageError("`device` cuda was asked for but no CUDA GPU is visible; use `device` cpu")
        if local_rank >= cuda_count:
            raise UsageError(
                f"local rank {local_rank} has no GPU of its own: {cuda_count} visible for "
                f"{local_world_size} processes on this node; lower `nproc_per_node` to {cuda_count}"
            )
        return "cuda"
    return "cuda" if 0 < cuda_count and local_world_size <= cuda_count else "cpu"


def choose_backend(requested: str, *, device: str, local_world_size: int, cuda_count: int) -> str:
    """NCCL when each process has its own CUDA device, gloo otherwise; ``nccl`` without one is refused."""
    if requested not in BACKENDS:
        raise UsageError(f"`backend` must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if requested == "nccl":
        if device != "cuda":
            raise UsageError(
                f"`backend` nccl needs one CUDA GPU per process, but {cuda_count} GPU(s) are visible for "
                f"{local_world_size} process(es) on this node; use `backend` gloo (or auto)"
            )
        if not dist.is_nccl_available():
            raise UsageError("`backend` nccl: this PyTorch build has no NCCL; use `backend` gloo")
        return "nccl"
    if requested == "gloo":
        return "gloo"
    return "nccl" if device == "cuda" and dist.is_nccl_available() else "gloo"


def setup(
    *,
    backend: str = "auto",
    device: str = "auto",
    init_method: str | None = None,
    timeout_s: float | None = None,
    force_group: bool = True,
    environ: Mapping[str, str] | None = None,
    argv: Sequence[str] | None = None,
    environment: env_mod.DistEnv | None = None,
    log_level: str | None = None,
    own_gpu: bool = False,
) -> Runtime:
    """Bind this process to its device and start the process group.

    With one process, ``force_group`` (the default) still starts a group of one on a free local port,
    because DistributedDataParallel needs one: the same script then runs under ``python script.py``
    and under a launcher. Pass ``force_group=False`` to skip it when nothing will communicate.
    ``log_level``: for the ``ddpkit`` logger, which this configures for this rank (``ddpkit.core.logs``).
    ``own_gpu``: the process sees its own GPU as its only one (CUDA_VISIBLE_DEVICES names it alone): bind GPU 0.
    """
    if timeout_s is None:
        timeout_s = _timeout_from(os.environ if environ is None else environ)
    check_timeout(timeout_s)
    if environment is None:
        environment = read_environment(environ, argv)
    logs.configure(rank=environment.rank, level=log_level)
    if environment.launcher == "mpi":
        share_cores(environment.local_world_size, os.environ if environ is None else environ)
    cuda_count = torch.cuda.device_count()
    gpu, sharing = (0, 1) if own_gpu else (environment.local_rank, environment.local_world_size)
    device_type = choose_device(device, local_rank=gpu, local_world_size=sharing, cuda_count=cuda_count)
    adopting = dist.is_available() and dist.is_initialized()  # the group's backend is decided: ``adopt`` checks it
    chosen_backend = None if adopting else choose_backend(
        backend, device=device_type, local_world_size=environment.local_world_size, cuda_count=cuda_count
    )
    bound = _bind_device(device_type, gpu)
    signals.catch((signal.SIGTERM,), signals.raise_terminated)
    under_agent = under_launcher_agent(environ)
    if under_agent:
        signals.end_with_parent()  # the agent is the parent: if it is killed, this rank ends too
    exits.usage_errors_in_one_line()  # a script's own UsageError outside `with Job()`: one line, status 2 too
    if adopting:
        return adopt(environment, backend, bound, timeout_s)
    if not (environment.is_distributed or force_group or init_method):
        return Runtime(env=environment, backend=None, device=bound, timeout_s=timeout_s)
    return _start_group(environment, chosen_backend, bound, timeout_s, init_method=init_method, quiet=under_agent)


def _bind_device(device_type: str, gpu: int) -> torch.device:
    """The device this process is bound to: on "cuda", GPU ``gpu``, made the current one."""
    if device_type == "cuda":
        # Before anything else touches CUDA: otherwise every process builds a context on GPU 0.
        torch.cuda.set_device(gpu)
        return torch.device("cuda", gpu)
    return torch.device("cpu")


def _start_group(environment: env_mod.DistEnv, backend: str | None, bound: torch.device, timeout_s: float, *,
                 init_method: str | None, quiet: bool) -> Runtime:
    """Start the process group over ``backend`` and return its Runtime. ``quiet``: a stop while it starts is
    reported at debug level (torchrun's agent, which stops its ranks, says why itself)."""
    # ddpkit makes the store itself unless the caller named a rendezvous or torchrun's agent hosts one.
    own_store = init_method is None and not _agent_serves_store(environment)
    if own_store and environment.world_size > 1 and environment.master_port is None:
        raise ValueError("no master port known: set MASTER_PORT or pass init_method='tcp://HOST:PORT'")
    if not own_store:
        init_method = init_method or "env://"  # the agent exported MASTER_ADDR and MASTER_PORT
    collect_garbage_at_exit()
    where = f"{environment.master_addr}:{environment.master_port}" if init_method in (None, "env://") else init_method
    # Until the group is up a stop ends this process at once: it waits in C++ for ranks that may never come.
    signals.starting(f"starting the process group at {where} (rank {environment.rank} of {environment.world_size})",
                     quiet=quiet)
    try:
        store = job_store(environment, timeout_s) if own_store else None
        dist.init_process_group(
            backend=backend,
            init_method=None if own_store else init_method,
            store=store,
            rank=environment.rank,
            world_size=environment.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=bound if backend == "nccl" else None,
        )
    except (dist.DistNetworkError, OSError) as error:
        raise UsageError(
            f"cannot start the process group at {where} ({first_line(error)}); "
            "is the port already in use (a stale MASTER_PORT?) or the master address unreachable?"
        ) from None
    finally:
        signals.started()
    global _set_up_here
    _set_up_here = True
    return Runtime(env=environment, backend=backend, device=bound, timeout_s=timeout_s)


def adopt(environment: env_mod.DistEnv, backend: str, device: torch.device, timeout_s: float) -> Runtime:
    """The Runtime of a process group that is up already: one Ray Train started in its worker, or the script's own
    ``init_process_group`` before its Job. ddpkit uses it as it is (no second group) and leaves it up at the end
    (``teardown`` destroys only ddpkit's side groups): whoever started it ends it. Its rank and size must be what
    the launcher's variables say, and a backend asked for by name must be its own."""
    global _adopted
    if backend not in BACKENDS:
        raise UsageError(f"`backend` must be one of {', '.join(BACKENDS)}, got {backend!r}")
    rank, world_size, running = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    if (rank, world_size) != (environment.rank, environment.world_size):
        raise UsageError(
            f"a process group is up already as rank {rank} of {world_size}, but the launcher ({environment.launcher}) "
            f"says rank {environment.rank} of {environment.world_size}: start the group with RANK and WORLD_SIZE "
            "as the launcher set them, or let ddpkit start it (no init_process_group before the Job)")
    if backend not in ("auto", running):
        raise UsageError(f"`backend` {backend} was asked for, but the process group that is up already (started by "
                         f"{'Ray' if environment.launcher == 'ray' else 'the script'}) uses {running}: ask for "
                         f"`backend` auto or {running}")
    logger.debug(f"using the process group that is up already: rank {rank} of {world_size} over {running}")
    _adopted = True
    return Runtime(env=environment, backend=running, device=device, timeout_s=timeout_s)


def under_launcher_agent(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun's agent (``ddpkit run``/``train``'s launcher) started this process (read from ``environ``,
    by default this process's environment)."""
    return LAUNCHED_BY_TORCHRUN in (os.environ if environ is None else environ)


_set_up_here = False  # this process's group was started by ``setup`` (a Job, ``ddpkit.distributed``), not by a script
_adopted = False  # ``setup`` found a group up already (Ray's, the script's own) and uses it: ``adopt``


def set_up_by_ddpkit() -> bool:
    """Whether ddpkit's own setup runs the process group that is up, having started it or adopted it, rather than
    a script on its own ``init_process_group`` only (``ddpkit run`` watches such a script itself:
    ``ddpkit.app.watched``)."""
    return (_set_up_here or _adopted) and dist.is_available() and dist.is_initialized()


def _agent_serves_store(environment: env_mod.DistEnv) -> bool:
    """Whether torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT (the workers are all clients)."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and environment.launcher in ("torchrun", "torch.distributed.launch", "env"))


def job_store(environment: env_mod.DistEnv, timeout_s: float) -> dist.Store:
    """The job's key-value store, which rank 0 hosts, listening only where it must (PyTorch's own listens on
    every interface): on loopback when every rank runs on this machine (they all connect there), else on
    the address MASTER_ADDR names, when it is one of this machine's and not loopback; else everywhere.
    Wrapped like ``init_process_group``'s own (the "default_pg" key prefix)."""
    from ddpkit.core import network

    one_machine = environment.local_world_size >= environment.world_size
    host = network.LOOPBACK if one_machine else environment.master_addr
    port = environment.master_port or 0  # none known: one process (no client needs to find it)
    timeout = datetime.timedelta(seconds=timeout_s)
    if environment.rank != 0:
        store = dist.TCPStore(host, port, environment.world_size, is_master=False, timeout=timeout)
    else:
        bind = network.bind_address(host, one_machine=one_machine)
        if bind is None:
            store = dist.TCPStore(host, port, environment.world_size, is_master=True, timeout=timeout)
        else:
            store = network.store_on(bind, port=port, world_size=environment.world_size, timeout_s=timeout_s)
    return dist.PrefixStore("default_pg", store)


def own_connection(store: dist.Store) -> dist.Store:
    """A connection of its own to the default group's ``store`` (``dist.distributed_c10d._get_default_store()``),
    for a thread that must never wait behind the main thread's store calls, nor change their timeout.

    ``Store.clone`` does that from torch 2.8. Before, a new client of the TCPStore underneath, under the prefixes
    that torch puts on it (a PrefixStore does not tell its prefix there): the group's name, over "default_pg"
    (``init_process_group``'s, or ``job_store``'s), over "/worker/attempt_N" where torchrun's agent hosts the store.
    Another chain: a RuntimeError."""
    if hasattr(store, "clone"):
        return store.clone()
    depth, base = 0, store
    while isinstance(base, dist.PrefixStore):
        depth, base = depth + 1, base.underlying_store
    if not isinstance(base, dist.TCPStore) or depth not in (2, 3):
        raise RuntimeError(f"no second connection to a {type(base).__name__} under {depth} prefixes on torch "
                           f"{torch.__version__} (Store.clone needs torch>=2.8)")
    connection: dist.Store = dist.TCPStore(base.host, base.port, is_master=False, timeout=base.timeout)
    if depth == 3:
        connection = dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                                      connection)
    return dist.PrefixStore(f"{dist.group.WORLD.group_name}/", dist.PrefixStore("default_pg", connection))


def collect_garbage_at_exit() -> None:
    """Make this process collect cyclic garbage (DDP models, their reducers and process groups) when it
    exits, before the interpreter shuts down; called by ``setup``, not at import.

    A DDP model only reachable through reference cycles is otherwise freed during interpreter
    finalization, and tearing gloo's C++ objects down then aborts the process now and then ("terminate
    called without an active exception", signal 6) after the work is done; see docs/examples.md.
    Unregistering first keeps it to one entry however often it is called.
    """
    atexit.unregister(gc.collect)
    atexit.register(gc.collect)


def freeze_for_exit() -> None:
    """For a process whose work is done and whose process group is torn down (``ddpkit train``'s ranks, and
    the launcher once its workers are gone): collect the garbage now, then freeze what is left, so that
    the interpreter's shutdown does not walk it.

    What is left is mostly torch's modules (torch._dynamo alone, which DDP imports, is tens of thousands
    of objects): the last collections at shutdown spend 1.5 to 2 s on them on a small CPU, and about 1 s
    in a launcher, which holds torch without torch._dynamo. Not for a user's script, whose globals may
    still hold a DDP model: frozen, its cycles would be torn down in another order, and that ended a
    test run with the signal-6 abort above.

    One cost: objects of C extensions that are still alive at shutdown stay so, and triton's (which
    ``torch._dynamo`` imports wherever triton is installed) then prints nanobind's leak report, 27 lines
    per process, after the work is done. Where triton is loaded, what the interpreter's teardown writes to
    stderr is therefore dropped (``_quiet_teardown``); the exit status still says if the teardown failed.
    """
    gc.collect()
    gc.freeze()
    if "triton" in sys.modules:
        atexit.unregister(_quiet_teardown)
        atexit.register(_quiet_teardown)  # registered last, so it runs first of the exit handlers


def _quiet_teardown() -> None:
    """At exit: flush what Python has buffered, then point file descriptor 2 at the null device."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)


def teardown() -> None:
    """Destroy the process group if one is up; safe to call twice. An adopted group (``adopt``) stays up for whoever
    started it: only ddpkit's side groups beside it go."""
    global _set_up_here, _adopted
    side_groups = list(_side_groups.values())
    _side_groups.clear()
    adopted, _adopted, _set_up_here = _adopted, False, False
    if not (dist.is_available() and dist.is_initialized()):
        return
    if not adopted:
        side_groups.clear()  # destroy_process_group() ends them with the rest
        _destroy(None)
    else:
        _destroy(side_groups)


def _destroy(groups: list | None) -> None:
    """``dist.destroy_process_group`` for each of ``groups`` (``None``: every group, the default one included),
    emptying the list; before torch 2.8, without the hang below.

    Before torch 2.8 (pytorch#154976) a ProcessGroup is freed holding the GIL, and with it its gloo backend,
    whose destructor takes the backend's lock and joins gloo's worker threads. A worker that has just run a
    collective frees that work holding the lock, and with it the work's tensors; one whose Python object is
    already gone (a flag made for one broadcast, torch's own in broadcast_object_list) must take the GIL to be
    freed. Each then waits for the other: on torch 2.4, a hang in ``destroy_process_group`` about once in 200
    groups destroyed right after such a broadcast, or later, when a cycle that holds a group (a script's
    globals) is collected. So, there: each gloo backend is held here while its groups are destroyed; this
    thread then lets go of the GIL for a moment, in which a worker that waits for it frees its work; and the
    backends are freed last, through their own Python objects, which release the GIL first (a group that
    something else still holds keeps its backend, with no work left to free).
    """
    backends = [] if torch_at_least("2.8") else _gloo_backends(groups)
    if groups is None:
        dist.destroy_process_group()
    while groups:
        dist.destroy_process_group(groups.pop())
    if backends:
        time.sleep(GIL_HANDOVER_S)
    del backends  # the last references, unless a group lives on: each backend's destructor runs without the GIL


GIL_HANDOVER_S = 0.05  # a thread waiting for the GIL takes it as soon as it is let go; this allows for a busy CPU


def _gloo_backends(groups: list | None) -> list:
    """The gloo backends of ``groups`` (``None``: every group there is), held here: no reference to a group itself."""
    world = getattr(dist.distributed_c10d, "_world", None)
    targets = list(getattr(world, "pg_map", ())) if groups is None else groups
    return [backend for backend in map(_gloo_backend, targets) if backend is not None]


def _gloo_backend(group):
    """``group``'s gloo backend for CPU tensors; None if it has none (an NCCL-only group)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError, ValueError):
        return None
    return backend if isinstance(backend, getattr(dist, "ProcessGroupGloo", ())) else None


# Waiting for rank 0 to finish writing a checkpoint may take long on a slow disk; that wait must not be
# bounded by --timeout, which is meant for collectives of the training step.
CONTROL_TIMEOUT_S = 24 * 3600.0
_side_groups: dict[str, dist.ProcessGroup] = {}  # gloo groups beside the training one, by purpose


def _side_group(purpose: str, runtime: Runtime):
    if runtime.backend is None:
        return None
    if purpose not in _side_groups:
        _side_groups[purpose] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    return _side_groups[purpose]


def control_group(runtime: Runtime):
    """A gloo group beside the training one, for small CPU messages (stop flags, checkpoint hand-offs).

    It has its own long timeout and works whatever the main backend is (NCCL cannot carry CPU objects).
    Created on first use; every rank must make its first call at the same point, like any collective.
    ``None`` when there is no process group.
    """
    return _side_group("control", runtime)


def background_group(runtime: Runtime):
    """A gloo group for collectives that run in a background thread (asynchronous checkpoint saves), which
    must not share a group with the main thread's. Created on first use, by every rank at the same point;
    ``None`` when there is no process group."""
    return _side_group("background", runtime)


TIMEOUT_ENV = "DDPKIT_TIMEOUT_S"  # set by `ddpkit run --timeout`: the default for setup(timeout_s=None)


def check_timeout(timeout_s: float) -> float:
    """``timeout_s`` if a collective can be given it; else UsageError. NaN and infinity would end in
    a traceback inside torch, and a timeout far below a second in a group that never forms."""
    if not (math.isfinite(timeout_s) and timeout_s >= MIN_TIMEOUT_S):
        raise UsageError(f"`timeout_s` must be a finite number of seconds, at least {MIN_TIMEOUT_S:g}, got {timeout_s}")
    return timeout_s


def _timeout_from(environ: Mapping[str, str]) -> float:
    value = environ.get(TIMEOUT_ENV)
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        return check_timeout(float(value))
    except (ValueError, UsageError):
        raise UsageError(f"{TIMEOUT_ENV} must be a finite number of seconds, at least {MIN_TIMEOUT_S:g}, "
                         f"got {value!r}") from None


_MISSING_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier in (\d+) ms")


_STUCK_HINT = ("they are stuck before it; `ddpkit train --debug` prints each rank's pid, `py-spy dump --pid PID` "
               "shows where it is")


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective's timeout (gloo's or NCCL's words), not, say, a DataLoader's."""
    text = str(error)
    lowered = text.lower()
    timed_out = "timed out" in lowered or "timing out" in lowered
    return timed_out and ("gloo" in lowered or "WorkNCCL" in text or "monitoredBarrier" in text or "ProcessGroup" in text)


# NCCL's watchdog names the operation: "WorkNCCL(SeqNum=12, OpType=ALLREDUCE, ...) ran for ... ms".
_NCCL_WORK = re.compile(r"SeqNum=(\d+), OpType=(\w+)")


def explain_hang(error: BaseException, missing_ranks: list[int] | None = None) -> str | None:
    """One line for a collective that timed out, naming the ranks that never arrived when they are known.

    PyTorch names them with TORCH_DISTRIBUTED_DEBUG=DETAIL (``--find-hangs``); otherwise ``missing_ranks``
    (from ``ranks_missing_at_store``) does. NCCL's errors also name the collective and its number.
    """
    text = str(error)
    work = _NCCL_WORK.search(text)
    what = f"a collective ({work.group(2)}, the group's #{work.group(1)})" if work else "a collective"
    missing = _MISSING_RANKS.search(text)
    if missing:
        ranks = missing.group(1).strip().rstrip(",")
        return (f"{what} timed out after {int(missing.group(2)) / 1000:g} s: rank(s) {ranks} never reached it "
                f"({_STUCK_HINT})")
    if not is_timeout(error):
        return None
    if missing_ranks:
        return (f"{what} timed out: rank(s) {', '.join(map(str, missing_ranks))} never reached it (the others "
                f"checked in at the job's store after the timeout; {_STUCK_HINT})")
    return (f"{what} timed out waiting for another rank; rerun with --find-hangs to learn which rank "
            "never reached it")


# A peer's end of a collective went away: gloo's read/write errors on a connection the other side closed or
# reset (its process died; a node whose kernel is up answers with a reset), NCCL's "remote process exited".
_LOST_PEER = (re.compile(r"(?:Read|Write) error \[(?P<host>[^\]]+)\]:(?P<port>\d+): (?P<what>Connection reset by peer|"
                         r"Broken pipe)"),
              re.compile(r"(?P<what>Connection closed by peer) \[(?P<host>[^\]]+)\]:(?P<port>\d+)"),
              re.compile(r"(?P<what>remote process exited or there was a network error)"))


def explain_lost_peer(error: BaseException) -> str | None:
    """One line for a collective that failed because another rank's connection went away, or None."""
    lost = next(filter(None, (pattern.search(str(error)) for pattern in _LOST_PEER)), None)
    if lost is None:
        return None
    where = lost.groupdict()
    seen = f"{where['what']}, from {where['host']}:{where['port']}" if where.get("host") else where["what"]
    return (f"a collective failed: another rank's connection went away ({seen}): that rank, or its whole node, "
            "died or was killed. Its own output (on its node: its launcher's console, OUTPUT_DIR/logs/rank<N>.log) "
            "says why; the last checkpoint written is kept")


CHECK_IN_WAIT_S = 5.0  # how long a timed-out rank waits for the others' check-ins


def ranks_missing_at_store(runtime: Runtime, wait_s: float = CHECK_IN_WAIT_S) -> list[int] | None:
    """After a collective timed out on this rank: check in at the job's key-value store and wait for the
    other ranks' check-ins. Every rank that waited in the collective times out too and checks in; the
    ranks that do not are the ones that never reached it. None when the store cannot be reached.

    Costs nothing while training (it runs only after a timeout), unlike ``--find-hangs``.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        # The store's own timeout is the group's (--timeout): a store that went away must not double the wait.
        store.set_timeout(datetime.timedelta(seconds=wait_s))
        store.set(f"ddpkit/timed-out/{runtime.rank}", "1")
        keys = [f"ddpkit/timed-out/{rank}" for rank in range(runtime.world_size)]
        deadline = time.monotonic() + wait_s
        while True:
            missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except (RuntimeError, AttributeError):  # the store went with a dead rank 0, or this torch lacks the call
        return None


def explain_timeout(error: BaseException, runtime: Runtime) -> tuple[str | None, list[int] | None]:
    """After ``error`` ended a collective on this rank: the line this rank should say (None when it is not a
    collective's timeout, or when another rank says it) and the ranks that never reached the collective (None
    when unknown). Every rank whose collective timed out calls it: they check in at the job's store."""
    missing = None
    if is_timeout(error) and not _MISSING_RANKS.search(str(error)) and runtime.backend is not None:
        missing = ranks_missing_at_store(runtime)
    explanation = explain_hang(error, missing)
    # With the missing ranks known, one line for the job: from the first rank that checked in (each would say
    # the same). Without (the store is gone too), each rank says what it saw.
    first = min(set(range(runtime.world_size)) - set(missing or []), default=runtime.rank)
    return (explanation if not missing or runtime.rank == first else None), missing


@contextlib.contextmanager
def distributed(**kwargs) -> Iterator[Runtime]:
    """``setup(**kwargs)``, then ``teardown()`` however the block ends (error, Ctrl-C, SIGTERM)."""
    previous = signals.current((signal.SIGTERM,))
    runtime = setup(**kwargs)
    try:
        yield runtime
    except RuntimeError as error:
        lost = explain_lost_peer(error)
        if lost is not None:  # one line, no traceback: nothing in this rank's own code went wrong
            logger.error("%s", lost)
            raise SystemExit(1) from None
        explanation, _ = explain_timeout(error, runtime)
        if explanation:
            logger.error("%s", explanation)
        raise
    except UsageError as error:
        # A user mistake ddpkit found inside the job (bad data, a checkpoint of another model): one line, exit 2.
        raise SystemExit(report_usage_error(error)) from None
    except OSError as error:
        full = disk_full(error)  # metrics, a log, the user's own file: one line that says the disk is full
        if full is None:
            raise
        raise SystemExit(report_usage_error(full)) from None
    finally:
        # The handler that raises Terminated goes first: a SIGTERM that reaches a rank while its group is
        # torn down (torchrun's agent sends one to the others as soon as one rank has exited, which after a
        # usage error every rank does at once) must end it, not raise in the middle of destroy_process_group
        # and leave a gloo thread running into the interpreter's exit (std::terminate, signal 6). Unless it
        # repeats the SIGTERM this block ends of: a launcher killed with SIGKILL sends its ranks one per
        # thread of it as they end, and the second, ending a rank in its teardown, skipped its finally blocks.
        if signals.is_repeat():
            signals.restore_dropping_repeats(previous)
        else:
            signals.restore(previous)
        teardown()


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which Slurm and containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def share_cores(local_world_size: int, environ: Mapping[str, str]) -> None:
    """Give this rank its share of the machine's cores for torch's threads, as torchrun and ddpkit's launcher
    do through OMP_NUM_THREADS, for launchers that set none (mpirun): otherwise every rank starts a thread per
    core, and the ranks of one machine slow each other down many times over. A rank that mpirun bound to
    fewer cores than its share keeps its own. OMP_NUM_THREADS, where set, decides."""
    if environ.get("OMP_NUM_THREADS"):
        return
    torch.set_num_threads(max(1, min(usable_cores(), (os.cpu_count() or 1) // local_world_size)))


LOWEST_PICKED_PORT = 10000  # below it, well-known services' ports are many


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for a store that a process binds later (``mp.spawn``'s rank 0).

    Picked at random below the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``) and
    checked bindable: the kernel hands the ephemeral ports out to every outgoing connection, so a port it
    picked (bind to port 0) can be taken by any connection in the seconds before the store binds it, and
    rank 0 then fails with "address already in use". Where that range leaves no room, the kernel's pick.
    """
    import random
    import socket

    low = ephemeral_ports()[0]
    candidates = random.Random().sample(range(LOWEST_PICKED_PORT, low), min(64, max(0, low - LOWEST_PICKED_PORT)))
    for port in [*candidates, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:  # taken: the next one
                continue
            return sock.getsockname()[1]
    raise OSError(f"no free TCP port on {host}")


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections and port-0 binds (Linux's default where unreadable)."""
    try:
        with open(path) as ranges:
            low, high = (int(field) for field in ranges.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU): before reading a clock, say."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(runtime: Runtime) -> None:
    """Wait until every rank has come here (nothing to wait for without a process group)."""
    if runtime.backend is not None:
        dist.barrier()


def broadcast_buffers(model: torch.nn.Module, runtime: Runtime, group=None) -> None:
    """Give every rank global rank 0's buffers (BatchNorm running statistics); with ``group``, its first rank's."""
    if runtime.backend is None:
        return
    source = 0 if group is None else dist.get_global_rank(group, 0)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=source, group=group)


def broadcast_state(model: torch.nn.Module, runtime: Runtime) -> None:
    """Give every rank global rank 0's parameters and buffers, in place: replicas that start alike whatever each
    rank's random state was. Tensors on the CPU travel over the gloo control group (NCCL carries device tensors
    only), so a model too large for one device is not moved there for it."""
    if runtime.backend is None or runtime.world_size < 2:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            on_device = tensor.device.type != "cpu"
            dist.broadcast(tensor.data, src=0, group=None if on_device else control_group(runtime))


def decided_by_main(runtime: Runtime, decide: Callable[[], Any]) -> Any:
    """``decide()``'s answer, worked out by global rank 0 alone and given to every rank over the control group (a
    collective: every rank calls it at the same point). Without a process group, this process decides."""
    answer = [decide() if runtime.is_main else None]
    if runtime.backend is not None and runtime.world_size > 1:
        dist.broadcast_object_list(answer, src=0, group=control_group(runtime))
    return answer[0]


@contextlib.contextmanager
def main_process_first(runtime: Runtime) -> Iterator[None]:
    """Let global rank 0 go first (download, cache), the others wait, then run the same block."""
    if not runtime.is_main:
        barrier(runtime)
    try:
        yield
    finally:
        if runtime.is_main:
            barrier(runtime)


def fingerprint(batch) -> torch.Tensor:
    """Four numbers of ``batch`` (a loader's: tensors, numbers and strings in lists, tuples and dicts), on the CPU, that
    differ where its values or their order differ: compared across the ranks (``gathered.the_same_on_every_rank``)
    to tell a stream that gives each rank batches of its own, and to pair a model's copies with rank 0's
    (``strategies.sharded_in_place.in_rank_zeros_order``)."""
    fingerprint = torch.zeros(4, dtype=torch.float64)
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            values = leaf.detach().reshape(-1).to(torch.float64)
            order = torch.arange(1, values.numel() + 1, dtype=torch.float64, device=values.device) % 997
            fingerprint += torch.stack([torch.tensor(float(values.numel()), dtype=torch.float64), values.sum().cpu(),
                                        values.abs().sum().cpu(), (values * order).sum().cpu()])
        elif isinstance(leaf, (str, bytes, int, float, bool)):
            data = leaf.encode() if isinstance(leaf, str) else leaf if isinstance(leaf, bytes) else repr(leaf).encode()
            fingerprint[3] += zlib.crc32(data)
    return fingerprint
