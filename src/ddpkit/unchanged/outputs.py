"""What the script writes, once (``ddpkit run --unchanged``): its console, its files and its trackers' runs, as one
device would write them. Every rank runs the script; rank 0 speaks and writes for the job.

- **The console.** Under ddpkit's own launcher the console shows rank 0's stdout (``launch.rank_logs``). Under a
  launcher that shows every rank's output as it is (an outer torchrun, mpirun, srun, Ray, pods), each rank other than
  0 sends its stdout to ``rank<N>.log`` in a folder that rank 0 names once (``one_console``); their stderr (warnings,
  errors) stays where it was. tqdm draws rank 0's bar only (``TQDM_DISABLE``, read when tqdm is imported).
- **Files.** On a rank other than 0, a file of the script's output that it opens for writing or appending through
  Python's ``open`` (``builtins.open``, ``io.open``, and what calls them: ``pathlib``, ``csv`` and ``json`` on a file it
  opened, PIL's ``Image.save``, NumPy's ``save``, matplotlib's ``savefig``, TensorBoard's event files) is opened at
  the same path below a folder of the rank's own instead (``PrivateFiles``), made empty at start and removed at exit;
  reading a path that the rank wrote reads its own copy, so a script that reads back what it wrote works. Appending
  to a file that exists starts from a copy of it.
- **What is never made private** (``left_as_it_is``): what is not the script's output, but the work of the libraries
  under it, which is made for many processes already: what torch writes itself (inductor's generated code and its
  cache, the modules it generates: the innermost caller outside Python's standard library is torch or Triton), the
  files of temporary names (``tempfile``'s: each process's own by construction), caches (``~/.cache``, and every
  folder that an environment variable names as a cache or a home: ``HF_HOME``, ``TORCH_HOME``,
  ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``, ``MPLCONFIGDIR``, ...), the Python installation, paths under
  /dev, /proc and /sys, paths that are not regular files (a FIFO, a socket) and ddpkit's own files.
- **Trackers.** Weights & Biases: ``WANDB_MODE=disabled`` on the other ranks, its own switch. MLflow: their runs go to
  a file store in the rank's folder (``MLFLOW_TRACKING_URI``), so that a tracking server sees one run. TensorBoard
  writes through ``open``: one event file.

Not covered (docs/unchanged.md): writes from native code (a C++ extension, ``os.open``/``os.write``), files written
by a library that kept its own reference to ``open`` before the script ran (``logging.FileHandler``, ``tarfile``),
directories made (``os.makedirs``: the other ranks make the same folders, empty), sockets, and a tracker's URI that
the script sets in code (``mlflow.set_tracking_uri``).
"""

from __future__ import annotations

import atexit
import builtins
import functools
import io
import os
import re
import shutil
import site
import sys
import tempfile

from ddpkit.core import logs, process_group
from ddpkit.core.logs import logger
from ddpkit.unchanged.callers import innermost, package

LEFT_AS_THEY_ARE = ("/dev/", "/proc/", "/sys/")
WRITING = frozenset("wax+")
COPIED_FIRST = frozenset("a+")  # modes that keep what the file holds: the rank's copy starts from the real file
# Environment variables that name a cache or a library's home: HF_HOME, TORCH_HOME, TORCHINDUCTOR_CACHE_DIR, ...
CACHE_VARIABLE = re.compile(r"^[A-Z0-9_]*(CACHE|CACHE_DIR|CACHE_HOME|_HOME|CONFIGDIR)$")
CACHE_FOLDERS = ("~/.cache", "~/.triton", "~/.nv", "~/.config/matplotlib")
TEMPORARY_NAME = re.compile(r"tmp[a-z0-9_]{8}")  # tempfile's names (its template: "tmp" and 8 of these characters)
WRITTEN_BY_ITSELF = ("torch", "triton", "ddpkit")  # code that writes its own files, never the script's output


def install(runtime: process_group.Runtime) -> PrivateFiles | None:
    """The console once (under a launcher that shows every rank), files and trackers' runs written by rank 0; the
    private files on a rank other than 0 (None on rank 0)."""
    one_console(runtime)
    if runtime.is_main:
        return None
    root = tempfile.mkdtemp(prefix=f"ddpkit-rank{runtime.rank}-files-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    os.environ["WANDB_MODE"] = "disabled"
    os.environ["MLFLOW_TRACKING_URI"] = "file://" + os.path.join(root, "mlruns")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 uses a file store only when told
    private = PrivateFiles(root)
    private.install()
    return private


def one_console(runtime: process_group.Runtime) -> None:
    """Under a launcher that shows every rank's stdout (not ddpkit's own), ranks other than 0 write theirs to
    ``FOLDER/rank<N>.log``; rank 0 names the folder once. (A collective where it applies: every rank calls it.)"""
    if logs.output_kept_by_launcher() or runtime.world_size == 1:
        return
    folder = process_group.decided_by_main(runtime, lambda: tempfile.mkdtemp(prefix="ddpkit-unchanged-"))
    if runtime.is_main:
        logger.info(f"--unchanged: the console shows rank 0's output; the other ranks' is in "
                    f"{os.path.join(folder, 'rank<N>.log')} on their machines")
        return
    os.makedirs(folder, exist_ok=True)
    sys.stdout.flush()
    log = os.open(os.path.join(folder, f"rank{runtime.rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, sys.stdout.fileno())  # the file descriptor: print, and what native code and children write
    os.close(log)


class PrivateFiles:
    """``open`` on a rank other than 0: what the script writes goes below ``root`` (see the module)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.original = builtins.open

    def install(self) -> None:
        builtins.open = io.open = self.open  # (io.open is builtins.open: both names, for code that calls either)

    def uninstall(self) -> None:
        if builtins.open == self.open:
            builtins.open = io.open = self.original

    def open(self, file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)):
            file = self.path_for(file, mode)
        return self.original(file, mode, *args, **kwargs)

    def path_for(self, file, mode: str):
        """Where this rank opens ``file`` in ``mode``: its own copy, or the file itself."""
        path = os.path.abspath(os.fsdecode(file))
        if path.startswith(LEFT_AS_THEY_ARE) or path == self.root or path.startswith(self.root + os.sep):
            return file
        own = self.root + path
        if not WRITING.intersection(mode):
            return own if os.path.exists(own) else file
        if os.path.exists(path) and not os.path.isfile(path):
            return file  # a FIFO, a socket, a device: the script talks through it, as on one device
        if left_as_it_is(path, writer=_writer(sys._getframe(2))):
            return file
        if not os.path.exists(own):
            os.makedirs(os.path.dirname(own), exist_ok=True)
            if COPIED_FIRST.intersection(mode) and os.path.isfile(path):
                shutil.copyfile(path, own)
        return own


def left_as_it_is(path: str, *, writer: str) -> bool:
    """Whether a write to ``path`` (absolute) by code of the package ``writer`` is left to the real path on every
    rank: not the script's output, but a library's own work (the module's text says which)."""
    if writer in WRITTEN_BY_ITSELF:
        return True
    temporary = tempfile.gettempdir() + os.sep
    if path.startswith(temporary) and any(TEMPORARY_NAME.fullmatch(part)
                                          for part in path[len(temporary):].split(os.sep)):
        return True
    return any(path == folder or path.startswith(folder + os.sep) for folder in _shared_folders())


def _shared_folders() -> list[str]:
    """Caches, libraries' homes and the Python installation; the variables as they are now (the script may set one)."""
    folders = [value for name, value in os.environ.items()
               if CACHE_VARIABLE.match(name) and name != "HOME" and os.path.isabs(value)]
    return [*_fixed_folders(), *(os.path.abspath(folder) for folder in folders if folder != os.sep)]


@functools.cache
def _fixed_folders() -> tuple[str, ...]:
    """The cache folders by their usual names, and the Python installation: the same for the whole run."""
    folders = [os.path.expanduser(folder) for folder in CACHE_FOLDERS]
    folders += [sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(), site.getusersitepackages()]
    return tuple(os.path.abspath(folder) for folder in folders if folder and folder != os.sep)


def _writer(frame) -> str:
    """The package of the code that opens a file: the innermost caller outside Python's standard library (its
    ``io``, ``pathlib``, ``json``, ``tempfile``, ... only pass the call on)."""
    frame = innermost(frame)
    return package(frame) if frame is not None else ""
