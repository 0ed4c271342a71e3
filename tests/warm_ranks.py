"""The suite's Python processes without starting Python and torch for each: torchrun's agent starts a tiny client in
place of the interpreter (``PYTHON_EXEC``, which torchrun reads), and the client has its rank run in a process forked
from a warm one (``serve``: torch, torch._dynamo, torchvision and ddpkit imported once per pytest run, for all of its
xdist workers).

A fresh rank spends about 5 s of CPU before its first line of work (importing torch, then torch._dynamo, which
DDP's constructor imports): the suite starts about 150 of them. ``tests/warm.py`` does the same for launchers, from a
server of each pytest worker's that imports less (a launcher forked from this one took 0.5 s of CPU more: torch's
rendezvous reads the stack with ``inspect``, which walks every module imported, and the launcher's last
``gc.collect()`` walks every object).

What the agent sees is a process of its own, as ever: the client, with the rank's environment, command line and
process group. The client passes its environment and the file descriptors it inherited (standard input and output,
and any other: multiprocessing's spawn passes two) to the server, which forks the rank (``_become``: those
descriptors at their numbers, that environment, folder, ``sys.argv``, ``sys.path``, signal handlers and thread
count, its output unbuffered as ``python -u``'s; ``-m MODULE``, ``-c CODE`` or a script), and answers with the rank's
pid, then with how it ended; the client forwards the signals a rank gets from its launcher (SIGTERM, SIGINT, ...) to
the rank's process group, ends as the rank ended (its status, or killed by its signal), and ends the rank when the
launcher dies (``PR_SET_PDEATHSIG``, as ddpkit's own ranks ask for). The server kills a rank whose client is gone.
While the server is starting, the client waits for it; where it is not there or is gone, the client runs the real
interpreter in its place (``exec``): a run is never lost to this.

The same client starts what something other than torchrun starts as Python (``conftest.warm_python``: mpirun's and
srun's tasks, a node's launcher in tests/nodes.py), and a warm process's own ``sys.executable`` is the client
(``warm.python_is``): a replica group's launcher, `ddpkit run`'s script under a scheduler, multiprocessing's spawn.
A client started in other namespaces (a node of tests/nodes.py: its network, host name and /etc/hosts) has its
process join them (``_join_namespaces``).

What differs from a fresh rank, and where a test needs one (``run_ddpkit(..., fresh=True)``, or a launcher
started by the test itself, which never sets ``PYTHON_EXEC``): the rank's pid is not the one its agent started
(``worker_of`` maps one to the other for a test that stops or kills a rank), its ``/proc`` command line and
environment are the server's, its parent is the server (ddpkit's replica-group fence, which ends only its launcher's
descendants, needs fresh ranks); every rank shares the server's hash seed (a fresh one draws its own), so code
whose collectives follow the order of a set of strings can pass here and deadlock fresh; and what the server imported
is frozen (``gc.freeze()``), so a rank's collections and ``gc.get_objects()`` leave it out.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import gc
import importlib
import io
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import warm

SERVER_VARIABLE = "DDPKIT_TEST_RANK_SERVER"  # the server's socket, in the environment of a warm run's ranks
# The server's folder, set by the pytest process that started it for the processes it starts (pytest-xdist's
# workers): one server for a pytest run, not one per worker (each imports PRELOAD: about 6 s of CPU).
SHARED_VARIABLE = "DDPKIT_TEST_RANK_SERVER_FOLDER"
# The variable that names the pytest process whose test asked for a rank (tests/conftest.py's marker): each worker
# counts the ranks it asked for (``running``), not another's.
OWNER_VARIABLE = "DDPKIT_TEST_SESSION"
# A process started with this variable set outlasts the test that started it, on purpose (a test Ray node's daemons
# and workers, which run warm too: a module's cluster): ``running`` does not count it, ``lasting(value)`` names it.
LASTING_VARIABLE = "DDPKIT_TEST_LASTING"
COLD_VARIABLE = "DDPKIT_TEST_FRESH_RANKS"  # set (to anything) for pytest: every rank starts fresh, to compare
# What ranks of `ddpkit train`, `ddpkit run` and `ddpkit bench` import, once per pytest run; no module a rank runs
# as __main__ (ddpkit.__main__, ddpkit.app.watched, ddpkit.app.bench: runpy would warn, and each is run afresh).
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch.distributed.checkpoint",
           "torchvision", "torchvision.models", "numpy", "sklearn.datasets", "ddpkit", "ddpkit.app.train.trainer",
           "ddpkit.app.cli", "ddpkit.job"]
MESSAGE_MAX = 1 << 20
FDS_MAX = 64  # the file descriptors a client hands over, at most
# Variables torchrun and ddpkit's launcher set for every rank that start with one of tests/warm.py's IMPORT_TIME
# prefixes, but that are read when they are used, not when a module is imported. A rank whose environment differs
# from the server's in another such variable (--find-hangs sets TORCH_DISTRIBUTED_DEBUG, which torch.distributed
# reads when it is imported) starts fresh.
READ_AT_RUN_TIME = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")

_server: subprocess.Popen | None = None  # the server, where this process started it
_folder: Path | None = None
_folder_served = ""  # in the server: its folder (the client is its `python`)


# ------------------------------------------------------------------------------------------------ in pytest


def environment(base: dict[str, str], *, leave_out: tuple[str, ...]) -> dict[str, str]:
    """The variables that make a run's ranks start warm: ``base`` with torchrun's ``PYTHON_EXEC`` set to the
    client and the server's socket. The server is the one that the process which started this one named
    (``SHARED_VARIABLE``: the pytest process of xdist's workers), or else started on the first call (its first runs
    start fresh, by the client's fallback, until it has imported what it preloads), its environment this process's
    without the variables ``leave_out`` names; the processes this one starts afterwards share it."""
    global _server, _folder
    if os.environ.get(COLD_VARIABLE):
        return base
    if _folder is None and os.environ.get(SHARED_VARIABLE):
        _folder = Path(os.environ[SHARED_VARIABLE])
    if _folder is None:
        _folder = Path(tempfile.mkdtemp(prefix="ddpkit-warm-ranks-"))
        client = _folder / "python"
        client.write_text(f"#!{sys.executable} -IS\n" + CLIENT.replace("REAL_PYTHON", repr(sys.executable))
                          .replace("SERVER_VARIABLE", repr(SERVER_VARIABLE)))
        client.chmod(0o755)
        # What ddpkit looks for beside its Python (tests/warm.py's python_is): the stack tests' py-spy.
        spy = shutil.which("py-spy", path=os.path.dirname(sys.executable))
        if spy:
            (_folder / "py-spy").symlink_to(spy)
        # The server's own environment is what modules read when they are imported: the pytest process's, without
        # variables read at import that a run may set (tests/warm.py's IMPORT_TIME: such runs start fresh) and
        # OpenMP's thread count (each rank sets its own).
        env = {key: value for key, value in os.environ.items()
               if key not in leave_out and not key.startswith(warm.IMPORT_TIME) and key != "OMP_NUM_THREADS"}
        (_folder / "starting").touch()  # until the server accepts ranks (or has ended): clients wait for it
        with (_folder / "server.log").open("w") as log:
            _server = subprocess.Popen([sys.executable, __file__, str(_folder / "socket"), str(_folder)], env=env,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                       start_new_session=True)
        (_folder / "server.pid").write_text(str(_server.pid))
        os.environ[SHARED_VARIABLE] = str(_folder)
        atexit.register(stop)
    return {**base, "PYTHON_EXEC": str(_folder / "python"), SERVER_VARIABLE: str(_folder / "socket")}


def server_pid() -> int | None:
    """The server's pid, while it runs."""
    try:
        pid = _server.pid if _server is not None else int((_folder / "server.pid").read_text())
    except (OSError, ValueError, TypeError):  # (no folder, or none yet)
        return None
    from ddpkit.launch import processes

    return pid if (_server is None or _server.poll() is None) and processes.is_running(pid) else None


def wait_until_serving(timeout_s: float = 60.0) -> int:
    """Until the server accepts ranks (it imports PRELOAD first: 5-10 s); returns its pid."""
    deadline = time.monotonic() + timeout_s
    while _folder is None or not (_folder / "socket").exists():
        if time.monotonic() > deadline or (_folder is not None and server_pid() is None):
            log = (_folder / "server.log").read_text() if _folder is not None else ""
            raise RuntimeError(f"the warm rank server did not start:\n{log}")
        time.sleep(0.1)
    return server_pid()


def worker_of(pid: int) -> int:
    """The process that runs the rank whose client is ``pid`` (``pid`` itself for a rank that started fresh, and for
    one whose client has not reached the server yet: a test that stops or kills a rank waits for a sign of its work
    first, a line or a file it writes)."""
    if _folder is None:
        return pid
    try:
        return int((_folder / f"{pid}.pid").read_text())
    except (OSError, ValueError):
        return pid


def running(owner: str) -> list[int]:
    """The ranks the server runs now (each forked from it) for the processes whose ``OWNER_VARIABLE`` is ``owner``,
    but those meant to outlast their test (``lasting``)."""
    server = server_pid()
    if server is None:
        return []
    from ddpkit.launch import processes

    meant = set(lasting())
    found = []
    for pid in processes.children_of(server):
        try:
            theirs = (_folder / f"{pid}.owner").read_text()
        except OSError:  # ended meanwhile, or asked for by no test's process
            continue
        if theirs == owner and processes.is_running(pid) and pid not in meant:
            found.append(pid)
    return found


def lasting(value: str | None = None) -> list[int]:
    """The processes the server forked for a client whose environment set LASTING_VARIABLE (to ``value``, if given),
    that still run."""
    if _folder is None:
        return []
    found = []
    for record in _folder.glob("*.lasting"):
        try:
            pid, said = int(record.stem), record.read_text()
        except (OSError, ValueError):  # removed meanwhile: it ended
            continue
        if (value is None or said == value) and os.path.exists(f"/proc/{pid}"):
            found.append(pid)
    return found


def stop(keep_log_in: str | None = None) -> None:
    """End the server where this process started it (and any rank it still runs: it kills them as it ends), and
    remove its folder; a server of another's is left to it. ``keep_log_in``: a folder that its log is copied into
    first (a run that failed keeps it), with how the server ended where it ended before it was asked to."""
    global _server, _folder
    if _server is None:
        _folder = None
        return
    if keep_log_in is not None and (_folder / "server.log").exists():
        kept = Path(keep_log_in) / "warm-ranks-server.log"
        shutil.copyfile(_folder / "server.log", kept)
        if _server.poll() is not None:
            with kept.open("a") as log:
                log.write(f"\n(the server had ended before the run's end, with status {_server.returncode})\n")
    if _server.poll() is None:
        _server.terminate()
        try:
            _server.wait(10)
        except subprocess.TimeoutExpired:
            _server.kill()
            _server.wait()
    shutil.rmtree(_folder, ignore_errors=True)
    if os.environ.get(SHARED_VARIABLE) == str(_folder):
        del os.environ[SHARED_VARIABLE]
    _server = _folder = None


# ------------------------------------------------------------------------------------------------ the client

# Run by torchrun's agent as the interpreter, `client -u [-m MODULE | SCRIPT] ARGS`, and as Python by whatever a warm
# process or a test starts (`-c CODE`: multiprocessing's spawn). Standard library only, and Python started with -I
# -S: it costs a few milliseconds, not seconds.
CLIENT = r'''
import ctypes, json, os, signal, socket, sys, time

real = REAL_PYTHON
path = os.environ.get(SERVER_VARIABLE, "")
starting = os.path.join(os.path.dirname(path), "starting") if path else ""
for _ in range(600):  # the server still importing (up to 30 s): wait for it, rather than import all of it again
    if not starting or os.path.exists(path) or not os.path.exists(starting):
        break
    time.sleep(0.05)
# What it inherited: standard input and output, and any other (multiprocessing's spawn passes a pipe and its
# resource tracker's), handed to the rank at the same numbers.
inherited = sorted(int(name) for name in os.listdir("/proc/self/fd"))
inherited = [fd for fd in inherited if fd > 2 and os.path.exists(f"/proc/self/fd/{fd}")]
try:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.connect(path)
except OSError:  # no server (yet): the real interpreter, as the agent would have started it
    os.execv(real, [real, *sys.argv[1:]])
socket.send_fds(server, [json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(),
                                     "fds": [0, 1, 2, *inherited]}).encode()], [0, 1, 2, *inherited])
started = json.loads(server.recv(4096) or b'{"fresh": true}')
if started.get("fresh"):  # variables of its own that torch reads when it is imported: a fresh interpreter
    server.close()
    os.execv(real, [real, *sys.argv[1:]])
worker = started["pid"]


def forward(signum, frame):
    try:
        os.killpg(worker, signum)
    except ProcessLookupError:
        pass


for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
    signal.signal(getattr(signal, name), forward)
ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: the agent gone, the rank is stopped
if os.getppid() == 1:
    forward(signal.SIGTERM, None)
reply = server.recv(4096)
if not reply:
    sys.exit("ddpkit tests: the warm rank server ended before the rank")
ended = json.loads(reply)
if "signal" in ended:  # killed by it: so is this process, its default action restored (SIGKILL has no other)
    if ended["signal"] != signal.SIGKILL:
        signal.signal(ended["signal"], signal.SIG_DFL)
    os.kill(os.getpid(), ended["signal"])
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(ended["status"])
'''


# ------------------------------------------------------------------------------------------------ the server


def serve(path: str, folder: str) -> None:
    """Import PRELOAD, then fork a rank for each client that connects to ``path``, until SIGTERM."""
    import ctypes

    global _folder_served
    _folder_served = folder
    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: ends with its pytest process
    try:
        if os.getppid() == 1:  # which ended before the request was made
            return
        for name in PRELOAD:
            importlib.import_module(name)
        warm.interpreter_path()  # asked once, before the first rank needs it
        # What it imported is left out of the collector's walks in the ranks (gc.get_objects, a full collection,
        # ddpkit's flush of open files at a rank's exit): a walk touches each object's header, and in a forked
        # process each page it touches is copied. Per rank about 0.3 s of CPU less at its exit alone.
        warm.known_modules()
        gc.collect()
        gc.freeze()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(path + ".new")
        listener.listen(64)
        os.rename(path + ".new", path)  # clients connect once it accepts
    finally:  # accepting, or failed to: no client waits any longer
        Path(folder, "starting").unlink(missing_ok=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, ("accept",))
    ranks: dict[int, tuple[int, socket.socket | None, int]] = {}  # pidfd -> (pid, the client's connection, its pid)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while not stopping:
        for key, _ in selector.select(timeout=0.1):  # SIGTERM seen within 0.1 s
            what = key.data
            if what[0] == "accept":
                connection, _ = listener.accept()
                selector.register(connection, selectors.EVENT_READ, ("request",))
            elif what[0] == "request":
                connection = key.fileobj
                selector.unregister(connection)
                try:
                    message, fds, _, _ = socket.recv_fds(connection, MESSAGE_MAX, FDS_MAX)
                except OSError:  # (its connection reset: a client killed as it asked)
                    message, fds = b"", []
                request = json.loads(message) if message else {}
                if not message or len(fds) != len(request.get("fds", ())):  # a client gone before it asked
                    for fd in fds:
                        os.close(fd)
                    connection.close()
                    continue
                if _read_at_import(request["env"]):
                    for fd in fds:
                        os.close(fd)
                    connection.send(json.dumps({"fresh": True}).encode())
                    connection.close()
                    continue
                client = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                     struct.calcsize("3i")))[0]
                pid = _fork(request, fds, client)
                for fd in fds:
                    os.close(fd)
                Path(folder, f"{client}.pid").write_text(str(pid))
                if LASTING_VARIABLE in request["env"]:
                    Path(folder, f"{pid}.lasting").write_text(request["env"][LASTING_VARIABLE])
                if OWNER_VARIABLE in request["env"]:
                    Path(folder, f"{pid}.owner").write_text(request["env"][OWNER_VARIABLE])
                try:
                    connection.send(json.dumps({"pid": pid}).encode())
                except OSError:  # the client gone since it asked (killed with its launcher): so goes its rank, which
                    connection.close()  # is then reaped as any other (unguarded, the error ended the server)
                    connection = None
                    for kill in (os.killpg, os.kill):  # (its group, or itself before it made one)
                        with contextlib.suppress(ProcessLookupError):
                            kill(pid, signal.SIGKILL)
                pidfd = os.pidfd_open(pid)
                ranks[pidfd] = (pid, connection, client)
                selector.register(pidfd, selectors.EVENT_READ, ("ended", pidfd))
                if connection is not None:
                    selector.register(connection, selectors.EVENT_READ, ("client", pidfd))
            elif what[0] == "client":  # the client sends nothing more: readable means it is gone
                if ranks.get(what[1], (None, None))[1] is not key.fileobj:
                    continue  # (its rank ended in this same select, before: reaped, its connection closed already)
                pid, connection, client = ranks[what[1]]
                selector.unregister(connection)
                connection.close()
                ranks[what[1]] = (pid, None, client)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            else:  # the rank ended
                pidfd = what[1]
                pid, connection, client = ranks.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                Path(folder, f"{client}.pid").unlink(missing_ok=True)
                Path(folder, f"{pid}.lasting").unlink(missing_ok=True)
                Path(folder, f"{pid}.owner").unlink(missing_ok=True)
                if connection is not None:
                    selector.unregister(connection)
                    ended = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                             else {"status": os.waitstatus_to_exitcode(status)})
                    with contextlib.suppress(OSError):
                        connection.send(json.dumps(ended).encode())
                    connection.close()
    for pid, _, _ in ranks.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    for pid, _, _ in ranks.values():
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _read_at_import(env: dict[str, str]) -> list[str]:
    """The variables of a rank's environment that a module it imports reads then, set otherwise than in this one's."""
    names = {name for name in [*env, *os.environ] if name.startswith(warm.IMPORT_TIME)} - set(READ_AT_RUN_TIME)
    return sorted(name for name in names if env.get(name) != os.environ.get(name))


def _fork(request: dict, fds: list[int], client: int) -> int:
    """Fork the rank ``request`` describes, its standard input and output ``fds``, in the namespaces of the process
    ``client``; returns its pid."""
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        _join_namespaces(client)
        status = _become(request, fds)
    except BaseException:  # noqa: BLE001 - a failure to start the rank: said on its stderr, status 1
        traceback.print_exc()
    finally:
        os._exit(status)


# The namespaces a client may have apart from the server's: a "node" of tests/nodes.py is a network namespace and a
# mount namespace (`ip netns exec` mounts the node's /etc/hosts) with a host name of its own (`unshare --uts`).
NAMESPACES = {"net": 0x40000000, "uts": 0x04000000, "mnt": 0x00020000}  # CLONE_NEWNET, CLONE_NEWUTS, CLONE_NEWNS


def _join_namespaces(client: int) -> None:
    """In the forked process (one thread, as setns wants for a mount namespace): into each of the client's
    namespaces that is not the server's, so that the rank listens, connects, resolves names and calls itself as
    where its client was started. Root only, as the tests that make such nodes are."""
    import ctypes

    joins = []
    for name, kind in NAMESPACES.items():
        theirs, ours = os.stat(f"/proc/{client}/ns/{name}"), os.stat(f"/proc/self/ns/{name}")
        if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
            joins.append((name, kind, os.open(f"/proc/{client}/ns/{name}", os.O_RDONLY)))  # all opened first
    libc = ctypes.CDLL(None, use_errno=True)
    for name, kind, fd in joins:
        if libc.setns(fd, kind) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot join the client's {name} namespace: {os.strerror(error)}")
        os.close(fd)


def _become(request: dict, fds: list[int]) -> int:
    """In the forked process: run what ``python ARGV`` started in the client's folder with its environment would
    run, and return its exit status (after what the interpreter runs at exit)."""
    os.setsid()  # a process group of its own, which the client signals
    # The client's descriptors at its numbers (through copies above them all: a number may be one of the received),
    # and no other.
    targets = request["fds"]
    copies = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, max([*fds, *targets]) + 1) for fd in fds]
    for copy, target in zip(copies, targets):
        os.dup2(copy, target)
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in targets:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
                os.close(int(name))
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for number in range(1, signal.NSIG):
        if number in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as the interpreter sets them at start
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    argv = list(request["argv"])
    while argv and argv[0] in ("-u", "-B", "-E", "-s"):  # -u: warm.become's streams are unbuffered
        argv.pop(0)
    module = argv[1] if argv[:1] == ["-m"] else None
    code = argv[1] if argv[:1] == ["-c"] else None
    # sys.path's first entry as Python sets it: the current folder under -m, '' under -c, else the script's.
    first = (request["cwd"] if module else "" if code is not None
             else os.path.dirname(os.path.abspath(os.path.join(request["cwd"], argv[0]))))
    warm.become(request["env"], request["cwd"], first, warm.interpreter_path())
    warm.python_is(os.path.join(_folder_served, "python"))
    import numpy
    import torch

    numpy.random.seed()  # a fresh process draws its own global NumPy state
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # what OpenMP reads when torch loads it
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        if code is not None:  # in a new __main__, as the interpreter runs `-c CODE`
            sys.argv = ["-c", *argv[2:]]
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(code, "<string>", "exec"), main.__dict__)  # noqa: S102 - what the client was asked to run
        elif module:
            sys.argv = [module, *argv[2:]]
            # Run afresh as __main__, as in a fresh interpreter, where nothing imported it before (a package runs
            # its __main__, and stays imported).
            sys.modules.pop(module + ".__main__", None)
            if not hasattr(sys.modules.get(module), "__path__"):
                sys.modules.pop(module, None)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as stop:
        status = _status_of(stop.code)
    except KeyboardInterrupt as interrupt:
        warm.uncaught(interrupt)
        warm.run_exit_functions()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException as error:  # noqa: BLE001 - as the interpreter: sys.excepthook, then status 1
        status = _status_of(warm.uncaught(error))  # the traceback from runpy's frames on, without this module's
    warm.run_exit_functions()
    return status


def _status_of(code) -> int:
    """The exit status ``sys.exit(code)`` gives, its message printed as the interpreter prints it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(*sys.argv[1:3])
    os._exit(0)  # its ranks ended: nothing of the interpreter's own teardown (torch's) is needed
