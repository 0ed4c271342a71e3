"""Shared helpers: run the real ``ddpkit`` command, and prove no process of the run outlives the suite."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, NoReturn, TypeVar

import pytest
import torch

import warm
import warm_ranks
from ddpkit.core.version import torch_at_least
from ddpkit.strategies.fsdp import FSDP_ON_CPU
from ddpkit.strategies.pipeline import PIPELINE_EVAL

# Every process a test starts inherits this variable, so leftovers (workers of a torchrun agent
# included) can be found in /proc at the end whatever their parent became.
MARKER_KEY = warm_ranks.OWNER_VARIABLE
MARKER = uuid.uuid4().hex
REPO = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "SLURM_", "TORCHELASTIC", "DDPKIT_LOG", "DDPKIT_CONFIG"))}
    env.update({MARKER_KEY: MARKER, "PYTHONUNBUFFERED": "1"}, **extra)
    return env


# What differs with the torch installed (pyproject's floor is 2.4): features ddpkit refuses on an older one, and what
# torch itself does differently there.
def _agent_reports_ended_ranks() -> bool:
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    # Newer agents count the workers they stop after a failure among the failures (pytorch#160908); torch 2.4's
    # report the failed one alone, so ddpkit cannot say which ranks the launcher ended.
    return hasattr(SubprocessContext, "_capture_process_failures")


AGENT_REPORTS_ENDED_RANKS = _agent_reports_ended_ranks()
needs_fsdp_on_cpu = pytest.mark.skipif(not torch_at_least(FSDP_ON_CPU),
                                       reason=f"FSDP2 on the CPU needs torch>={FSDP_ON_CPU} (ddpkit refuses it before)")
needs_pipeline = pytest.mark.skipif(not torch_at_least(PIPELINE_EVAL),
                                    reason=f"--strategy pipeline needs torch>={PIPELINE_EVAL} (schedule.eval)")


def warm_ranks_env(**extra: str) -> dict[str, str]:
    """``child_env(**extra)`` for a launcher whose ranks start warm (tests/warm_ranks.py; its server, started by the
    first call, carries no MARKER: it is not a leftover, and neither is a rank forked from it, until it is)."""
    return warm_ranks.environment(child_env(**extra), leave_out=(MARKER_KEY,))


def warm_python(argv: list[str], env: dict[str, str]) -> list[str]:
    """``argv`` with this interpreter (``sys.executable``) replaced by the warm rank client that ``env``
    (``warm_ranks_env``) names, for a command whose Python is started by something other than torchrun's agent
    (mpirun, srun, a node's shell): that process, too, runs forked from a warm interpreter."""
    python = env.get("PYTHON_EXEC", sys.executable)
    return [python if arg == sys.executable else arg for arg in argv]


@contextlib.contextmanager
def _locked(path: Path, mode: int):
    with path.open("a") as handle:
        fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# pytest-xdist hands whole modules to its workers (--dist loadscope), in the order of the collection (addopts:
# --no-loadscope-reorder). By its own default it orders them by their number of tests, which starts a module of few
# but long tests (one shared multi-process run, a minute under the suite's load) among the last, to end the suite
# alone. These modules, the longest in a `--durations` run of the suite, go first; the rest by their number of tests.
# (All modules ordered by their recorded times, the longest first, ran .ci/run's one session in 9:08, where this order
# had run it in 7:41 half an hour before on the same machine: no better, and it was not kept.)
LONGEST_FIRST = ("test_replica_groups_machines.py", "test_own_script.py", "test_bench.py", "test_library_loop.py",
                 "test_replica_groups_job.py", "test_public_scripts.py", "test_replica_groups.py")


def pytest_collection_modifyitems(config, items):
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1

    def order(item) -> tuple:
        name = item.path.name
        first = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        return first, -counts[name], name

    items.sort(key=order)  # stable: each module's tests keep their order


def _run_files(run: str | None = None) -> Path | None:
    """The prefix of the files the xdist workers of pytest run ``run`` (by default this worker's) share (their locks,
    ``once_per_run``'s results), or None in one process."""
    run = run or os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return None if run is None else Path(tempfile.gettempdir()) / f"ddpkit-tests-{run}"


RUN_TMPDIR = "DDPKIT_TESTS_TMPDIR"  # the folder that a pytest run's temporary files go in (``pytest_configure``)
Made = TypeVar("Made")
_made_here: dict[str, object] = {}


def once_per_run(name: str, make: Callable[[], Made]) -> Made:
    """``make()``, called once per pytest run whatever the number of its xdist workers: a session fixture runs once
    per worker, so a run that several modules read (a reference, a trained model), on workers of their own, would be
    trained once by each. The first worker to ask makes it, the others wait for it and read its pickled result (the
    folders it names are the first worker's, read only); where ``make`` fails, each worker that asks tries again
    (and fails as well, saying why)."""
    if name in _made_here:
        return _made_here[name]
    files = _run_files()
    if files is None:
        made = _made_here[name] = make()
        return made
    kept = files.with_name(f"{files.name}-{name}.pickle")
    with _locked(kept.with_suffix(".lock"), fcntl.LOCK_EX):
        if kept.exists():
            made = pickle.loads(kept.read_bytes())
        else:
            made = make()
            kept.with_suffix(".partial").write_bytes(pickle.dumps(made))
            kept.with_suffix(".partial").rename(kept)
    _made_here[name] = made
    return made


def pytest_configure(config):
    """The controller of a run gives it a temporary folder of its own (``TMPDIR``, which its workers, the warm rank
    server and every process they start inherit), removed at its end where no test failed: what the runs it starts
    leave there on purpose (the logs ddpkit keeps of a run that failed, a rank's private folder under an outer
    launcher) or when a test kills them (a launcher's pipes, multiprocessing's folders) goes with it. The controller
    of an xdist run names the run (xdist's own ``--testrunuid``, which it hands to its workers as
    ``PYTEST_XDIST_TESTRUNUID``), so that it knows the files they share."""
    if not hasattr(config, "workerinput") and RUN_TMPDIR not in os.environ:
        os.environ[RUN_TMPDIR] = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="ddpkit-tests-")
        os.chmod(os.environ[RUN_TMPDIR], 0o1777)  # (as /tmp is: daemons that tests run as other users use it)
        tempfile.tempdir = None  # (this process's too, from here on)
        config.add_cleanup(_remove_run_tmpdir)
    if not hasattr(config, "workerinput") and getattr(config.option, "testrunuid", "") is None:
        config.option.testrunuid = uuid.uuid4().hex
        if getattr(config.option, "numprocesses", None) and not config.option.collectonly:
            warm_ranks_env()  # one warm rank server for the run, which its workers share (they start after this)


_run_failed: list[int] = []  # the controller's exit status where its session failed (``pytest_sessionfinish``)


def pytest_sessionfinish(session, exitstatus):
    if not hasattr(session.config, "workerinput") and exitstatus != 0:
        _run_failed.append(int(exitstatus))


def _remove_run_tmpdir() -> None:
    """The run's temporary folder removed, but where a test failed: then kept, and named, with what its runs left
    there (the logs ddpkit keeps of a run that failed)."""
    folder = os.environ.pop(RUN_TMPDIR)
    if _run_failed:
        sys.stderr.write(f"tests: the run failed; its temporary folder is kept, with what its runs left: {folder}\n")
    else:
        shutil.rmtree(folder)


def pytest_unconfigure(config):
    """The controller of an xdist run, after its workers have ended: the files they shared go, and the warm rank
    server it started for them (its log kept in the run's folder where the run failed)."""
    run = getattr(config.option, "testrunuid", None)
    if run and not hasattr(config, "workerinput"):
        warm_ranks.stop(keep_log_in=os.environ.get(RUN_TMPDIR) if _run_failed else None)
        files = _run_files(run)
        for path in files.parent.glob(f"{files.name}*"):
            path.unlink(missing_ok=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist's workers, a test marked ``alone`` has the machine to itself, its fixtures' runs
    included: it waits for the test the other worker is running, and the other worker waits for it.

    Every test holds the machine's lock shared, an ``alone`` test exclusively; both pass a turnstile first, so a
    waiting ``alone`` test is not starved by the other worker's next tests. In one process nothing is locked.
    """
    base = _run_files()
    if base is None:
        yield
        return
    turnstile, machine = base.with_suffix(".turnstile"), base.with_suffix(".machine")
    if item.get_closest_marker("alone") is not None:
        with _locked(turnstile, fcntl.LOCK_EX), _locked(machine, fcntl.LOCK_EX):
            yield
        return
    with _locked(turnstile, fcntl.LOCK_EX):
        pass
    with _locked(machine, fcntl.LOCK_SH):
        yield


@pytest.fixture
def group_of_one():
    """A gloo group of one in this process, started as a script (or Ray) would, and destroyed after the test as ddpkit
    destroys its own (``process_group.teardown``: on torch before 2.8, gloo's destructor can wait for a worker that
    waits for the GIL, right after a broadcast; it hung the floor's session once)."""
    import datetime

    import torch.distributed as dist

    from ddpkit.core import process_group

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        process_group.teardown()
        if dist.is_initialized():  # (a Job of the test adopted it and did not end: the first call left it up)
            process_group.teardown()


@pytest.fixture(autouse=True)
def ddpkit_logger_as_the_command_sets_it(monkeypatch):
    """Each test starts with the ``ddpkit`` logger of a launcher at the default level, whatever rank or
    stream an earlier test in this process configured it with."""
    from ddpkit.core import logs

    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    logs.configure()


def _pids_with(key: str, value: str) -> list[int]:
    """Processes whose environment holds ``key=value``, whatever their parent or session became."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if f"{key}={value}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def run_command(argv: list[str], *, timeout: float, cwd: Path | None = None, warm: bool = False,
                **extra_env: str) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, timeout=...)`` that leaves no process behind, even when it times out. ``warm``: the
    command's ``sys.executable`` and the ranks it starts run warm (``warm_python``).

    subprocess.run's timeout kills only the launcher; torchrun starts each worker in a session of its
    own, so the workers would live on holding the output pipes. Here a timeout sends SIGTERM to the
    launcher's group (torchrun's agent then stops its workers), and after a grace period kills whatever
    still carries this run's marker.
    """
    run_marker = uuid.uuid4().hex
    env = (warm_ranks_env if warm else child_env)(DDPKIT_TEST_RUN=run_marker, **extra_env)
    if warm:
        argv = warm_python(argv, env)
    with subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                stdout, stderr = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                _kill_run(run_marker)
                stdout, stderr = proc.communicate(timeout=20)
            _ran_past(argv, timeout, stdout, stderr)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _kill_run(run_marker: str, *pids: int) -> None:
    """SIGKILL every process that carries the run's marker, and ``pids``."""
    for pid in [*_pids_with("DDPKIT_TEST_RUN", run_marker), *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _ran_past(argv: list[str], timeout: float, stdout: str | None, stderr: str | None) -> NoReturn:
    pytest.fail(f"{' '.join(argv)} ran past {timeout} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}")


def run_ddpkit(*args: str, timeout: float = 240, cwd: Path | None = None, fresh: bool = False,
               **extra_env: str) -> subprocess.CompletedProcess:
    """``python -m ddpkit ARGS`` as a user would run it; output captured.

    It runs forked from a warm interpreter (tests/warm.py: no 3 s of importing torch per launcher), and so do its
    ranks (tests/warm_ranks.py: about 5 s of CPU less each); ``fresh``: the launcher and its ranks each in a new
    interpreter, for a test that reads a launcher's or a rank's command line or parent, or what starts them.
    """
    if fresh or not warm.wanted(extra_env):
        return run_command([sys.executable, "-m", "ddpkit", *args], timeout=timeout, cwd=cwd, **extra_env)
    return _run_warm(list(args), timeout=timeout, cwd=cwd, **extra_env)


def _run_warm(args: list[str], *, timeout: float, cwd: Path | None, **extra_env: str) -> subprocess.CompletedProcess:
    """``run_command`` for ``python -m ddpkit ARGS``, the launcher forked from a warm interpreter (tests/warm.py)."""
    run_marker = uuid.uuid4().hex
    argv = [sys.executable, "-m", "ddpkit", *args]
    outputs = {}
    pipes = [os.pipe(), os.pipe()]
    try:
        env = warm_ranks_env(DDPKIT_TEST_RUN=run_marker, **extra_env)
        process = warm.start(args, env, str(cwd or os.getcwd()), pipes[0][1], pipes[1][1])
    except BaseException:
        for read_end, _ in pipes:
            os.close(read_end)
        raise
    finally:
        for _, write_end in pipes:
            os.close(write_end)

    def drain(name: str, read_end: int) -> None:
        with open(read_end, "rb") as handle:
            outputs[name] = io.TextIOWrapper(io.BytesIO(handle.read())).read()  # universal newlines, as text=True

    readers = [threading.Thread(target=drain, args=(name, pipe[0]), daemon=True)
               for name, pipe in zip(("stdout", "stderr"), pipes)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    process.join(timeout)
    for reader in readers:  # the output ends when the launcher and whatever it started have closed it
        reader.join(max(0.0, deadline - time.monotonic()))
    if process.exitcode is None or any(reader.is_alive() for reader in readers):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.join(20)
        _kill_run(run_marker, *([process.pid] if process.exitcode is None else []))
        process.join(20)
        for reader in readers:
            reader.join(20)
        _ran_past(argv, timeout, outputs.get("stdout"), outputs.get("stderr"))
    return subprocess.CompletedProcess(argv, process.exitcode, outputs["stdout"], outputs["stderr"])


def train(tmp: Path, *args: str, timeout: float = 240) -> tuple[dict, list[dict]]:
    """Run ``ddpkit train`` into ``tmp``; return (model state_dict, metrics rows). Fails the test on error."""
    result = run_ddpkit("train", "--output-dir", str(tmp), "--no-progress", *args, timeout=timeout)
    assert result.returncode == 0, f"ddpkit train {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    state = torch.load(tmp / "model.pt", weights_only=True)
    rows = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return state, rows


def train_here(tmp: Path, *args: str) -> tuple[dict, list[dict]]:
    """``ddpkit train --nproc-per-node 1 ARGS`` in this process, as ``main`` runs it (one process starts no
    launcher and no workers: the same code, without 3-4 s of starting Python and torch); (state, rows)."""
    from ddpkit.app.cli import main

    status = main(["train", "--output-dir", str(tmp), "--no-progress", *args, "--nproc-per-node", "1"])
    assert status == 0, f"ddpkit train {' '.join(args)} exited {status}"
    state = torch.load(tmp / "model.pt", weights_only=True)
    rows = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return state, rows


# convnet (no BatchNorm) on the real digits, SGD: one epoch of 22 steps, still learning at the end.
DIGITS_CONVNET = ["--data", "digits", "--model", "convnet", "--optimizer", "sgd", "--lr", "0.01", "--batch-size", "32",
                  "--epochs", "1"]


@pytest.fixture(scope="session")
def ddp_digits(tmp_path_factory):
    """One 2-process DDP run of DIGITS_CONVNET that several modules compare against: (folder, state, rows, result),
    run once per pytest run (``once_per_run``).

    It checkpoints every 5 steps, compares the replicas' weights at every step (which a healthy run passes),
    and sets NCCL variables (which gloo ignores) to show they are said once and recorded.
    """
    def make() -> tuple:
        folder = tmp_path_factory.mktemp("ddp_digits")
        result = run_ddpkit("train", *DIGITS_CONVNET, "--nproc-per-node", "2", "--no-progress", "--output-dir",
                            str(folder), "--checkpoint-every", "5", "--keep-checkpoints", "10", "--check-replicas", "1",
                            "--nccl", "NCCL_ALGO=Ring", "--nccl", "no-ib", "--nccl", "NCCL_ALGO=Tree")
        assert result.returncode == 0, result.stdout + result.stderr
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return folder, torch.load(folder / "model.pt", weights_only=True), rows, result

    return once_per_run("ddp_digits", make)


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """``ddpkit train`` with its defaults (net with BatchNorm, the digits, 2 processes on a machine without
    GPUs) for 2 epochs, at --debug, which changes what is said, not what is trained: (result, folder).

    test_train_multiprocess reads its output and files; test_resume compares its model with the same run
    checkpointed and resumed: run once per pytest run (``once_per_run``). Cold (``fresh``), as a user starts the main
    job: the launcher and each rank import torch after ddpkit, which a warm rank (tests/warm_ranks.py) has done before
    it.
    """
    def make() -> tuple:
        folder = tmp_path_factory.mktemp("default")
        result = run_ddpkit("train", "--epochs", "2", "--debug", "--output-dir", str(folder), fresh=True)
        assert result.returncode == 0, result.stdout + result.stderr
        return result, folder

    return once_per_run("default_run", make)


CORPUS = REPO.parent / "shared" / "corpus"  # other people's scripts, byte for byte, beside the repository


def conversions():
    """``benchmarks/conversions/convert.py``, imported: the public scripts' conversions, kept as their changes."""
    if "convert" not in sys.modules:
        import importlib.util

        spec = importlib.util.spec_from_file_location("convert", REPO / "benchmarks" / "conversions" / "convert.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["convert"] = module  # (count.py imports it under this name; its dataclasses look it up there)
        spec.loader.exec_module(module)
    return sys.modules["convert"]


def needs_corpus() -> None:
    """Skip, saying why, where the corpus is not beside the repository."""
    if not CORPUS.is_dir():
        pytest.skip(f"no corpus at {CORPUS}: the shared folder beside the repository (docs/testing.md)")


def public_scripts_data(folder: Path) -> Path:
    """The data the public scripts' runs share (benchmarks/conversions/make_data.py: MNIST files made from
    scikit-learn's digits, a small image folder, a character corpus), made in ``folder``; the runs that read it check
    it, so the maker's own check (and its import of torch) is left out."""
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "conversions" / "make_data.py"), "--out", str(folder),
                    "--no-check"], check=True, capture_output=True, timeout=120)
    return folder


def max_relative_difference(a: dict, b: dict) -> float:
    """max over tensors of max|a - b| / max|b| (float tensors only; integer buffers must be equal)."""
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        if not a[key].is_floating_point():
            assert torch.equal(a[key], b[key]), key
            continue
        scale = b[key].abs().max().item() or 1.0
        worst = max(worst, (a[key] - b[key]).abs().max().item() / scale)
    return worst


def children_of(launcher: int) -> list[int]:
    """Every process below ``launcher``."""
    from ddpkit.launch import processes

    return processes.children_of(launcher)


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the worker of ``launcher`` (torchrun's agent runs in it) that holds ``rank`` (the process that
    runs it, for a rank started warm: tests/warm_ranks.py)."""
    for pid in children_of(launcher):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return warm_ranks.worker_of(pid)
        except OSError:
            continue
    return None


def leftover_processes() -> list[str]:
    found = []
    for pid in _pids_with(MARKER_KEY, MARKER) + warm_ranks.running(MARKER):
        try:
            found.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    warm_ranks_env()  # the warm rank server starts importing now, before the first run needs it
    yield
    deadline = time.monotonic() + 10  # a process that is exiting gets a moment to finish
    while leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = leftover_processes()
    warm_ranks.stop()
    assert not left, "processes started by the tests are still running:\n" + "\n".join(left)


# -------------------------------------------------------------------- runs stopped and killed on purpose


def worker_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of the process that runs global rank ``rank`` of ``launcher``: its child that holds the rank (read from
    its environment), or the process that child has running it, for a rank started warm (tests/warm_ranks.py)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher.pid and f"RANK={rank}".encode() in environ:
            return warm_ranks.worker_of(int(entry.name))
    return None


def start_train(tmp_path: Path, *args: str) -> subprocess.Popen:
    """``ddpkit train`` into ``tmp_path`` in the background, in a session of its own (``finish`` ends it); a fresh
    launcher, its ranks warm (tests/warm_ranks.py)."""
    return subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", "--output-dir", str(tmp_path), "--no-progress", *args],
        env=warm_ranks_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of ``proc``; its whole session killed if it has not ended within ``timeout``."""
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


# A folder through the script's own DataLoader (job.prepare), a pack through job.train_loader.
RANKS_SCRIPT = textwrap.dedent("""
    import json, sys
    import ddpkit
    from torch.utils.data import DataLoader

    out, parts = sys.argv[1], sys.argv[2:]
    with ddpkit.Job() as job:
        for part in parts:
            kind, _, path = part.partition(":")
            if kind == "folder":
                loader = job.prepare(DataLoader(ddpkit.image_folder(path, size=8), batch_size=4, shuffle=True))
            else:
                loader = job.train_loader(ddpkit.image_shards(path, size=8), batch_size=4, workers=0)
            seen = [[], []]
            for epoch in range(2):
                for images, labels in loader:
                    assert images.shape == (4, 3, 8, 8) and images.dtype.is_floating_point
                    seen[epoch] += labels.tolist()
            with open(f"{out}.{kind}.{job.rank}", "w") as handle:
                json.dump(seen, handle)
""")


@pytest.fixture(scope="module")
def one_image_per_class(tmp_path_factory) -> Path:
    """16 classes of one image each: a sample's label is the sample. Packed too; and a script that writes the labels
    each rank is dealt in two epochs (tests/test_images.py deals in one process, tests/test_multinode.py runs the
    script on two nodes)."""
    from ddpkit.data import sample_images, shards

    root = tmp_path_factory.mktemp("unique")
    sample_images.write_folder(str(root / "jpegs"), images=16, classes=16, size=(32, 24))
    shards.pack(str(root / "jpegs"), str(root / "packed"), shard_mb=0.01)
    (root / "ranks.py").write_text(RANKS_SCRIPT)
    return root


def every_sample_once(out: Path, ranks: int = 2) -> None:
    seen = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(ranks)]
    for epoch in range(2):
        labels = [label for rank in seen for label in rank[epoch]]
        assert sorted(labels) == list(range(16)), (epoch, seen)
    assert seen[0][0] != seen[0][1]  # a new order in the second epoch
