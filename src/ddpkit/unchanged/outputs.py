"""What the script writes, once (``ddpkit run --unchanged``): its console, its files and its trackers' runs, as one
device would write them. Every rank runs the script; rank 0 speaks and writes for the job.

- **The console.** Under ddpkit's own launcher the console shows rank 0's stdout (``launch.rank_logs``). Under a
  launcher that shows every rank's output as it is (an outer torchrun, mpirun, srun, Ray, pods), each rank other than
  0 sends its stdout to ``rank<N>.log`` in a folder that rank 0 names once (``one_console``); their stderr (warnings,
  errors) stays where it was. tqdm draws rank 0's bar only (``TQDM_DISABLE``, read when tqdm is imported).
- **Files.** On a rank other than 0, a file that the script opens for writing or appending through Python's ``open``
  (``builtins.open``, ``io.open``, and what calls them: ``pathlib``, ``csv`` and ``json`` on a file it opened, PIL's
  ``Image.save``, NumPy's ``save``, TensorBoard's event files) is opened at the same path below a folder of the rank's
  own instead (``PrivateFiles``), made empty at start and removed at exit; reading a path that the rank wrote reads
  its own copy, so a script that reads back what it wrote works. Appending to a file that exists starts from a copy
  of it. Paths under /dev, /proc and /sys, paths that are not regular files (a FIFO, a socket) and ddpkit's own
  files are left as they are.
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
import io
import os
import shutil
import sys
import tempfile

from ddpkit.core import logs, process_group
from ddpkit.core.logs import logger

LEFT_AS_THEY_ARE = ("/dev/", "/proc/", "/sys/")
WRITING = frozenset("wax+")
COPIED_FIRST = frozenset("a+")  # modes that keep what the file holds: the rank's copy starts from the real file


def install(runtime: process_group.Runtime) -> None:
    """The console once (under a launcher that shows every rank), files and trackers' runs written by rank 0."""
    one_console(runtime)
    if runtime.is_main:
        return
    root = tempfile.mkdtemp(prefix=f"ddpkit-rank{runtime.rank}-files-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    os.environ["WANDB_MODE"] = "disabled"
    os.environ["MLFLOW_TRACKING_URI"] = "file://" + os.path.join(root, "mlruns")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 uses a file store only when told
    PrivateFiles(root).install()


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

    def open(self, file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and not _called_by_ddpkit():
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
        if not os.path.exists(own):
            os.makedirs(os.path.dirname(own), exist_ok=True)
            if COPIED_FIRST.intersection(mode) and os.path.isfile(path):
                shutil.copyfile(path, own)
        return own


def _called_by_ddpkit() -> bool:
    """Whether ddpkit's own code opens the file (its logs, its status files): those are each rank's own already."""
    frame = sys._getframe(2)  # the caller of ``open``
    for _ in range(3):  # through pathlib's or io's own frames
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith("ddpkit."):
            return True
        frame = frame.f_back
    return False
