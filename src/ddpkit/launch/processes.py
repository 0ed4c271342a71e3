"""Processes on this machine, read from ``/proc``: what an earlier run left behind (a port or GPU memory still
held, workers of a killed launcher still writing the same folder), and this launcher's own children.

A run killed with SIGKILL can leave workers behind that keep their GPU memory and the port; the next run then
fails with "address in use" or out of memory, far from the cause. The launcher warns before it starts, and
``ddpkit doctor`` shows the same lines.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess


from ddpkit.core.logs import logger


RUN_DIR_ENV = "DDPKIT_RUN_DIR"  # set by `ddpkit train`'s launcher for its workers: the folder they write


def warn_earlier_run(output_dir: str) -> list[int]:
    """Before a run writing ``output_dir`` starts its workers: warn when processes of an earlier run writing the
    same folder are alive on this machine (a launcher killed with SIGKILL whose workers did not end, a job
    still running); return their pids. Then mark this run's workers (RUN_DIR_ENV) for the next one to find."""
    folder = os.path.abspath(output_dir)
    marker = f"{RUN_DIR_ENV}={folder}".encode()
    workers = [pid for pid in pids() if pid != os.getpid() and owned_here(pid) and marker in environ_of(pid)]
    # Their launcher, while it lives (an orphan's parent is init or a subreaper, which is not ddpkit).
    launchers = sorted({parent for pid in workers if (parent := parent_of(pid)) is not None and parent != os.getpid()
                        and b"ddpkit" in command_of(parent)} - set(workers))
    if workers:
        named = ", ".join(map(str, workers)) + (f" (launched by {', '.join(map(str, launchers))})" if launchers else "")
        logger.warning(f"processes of an earlier run writing {folder} are still alive: pid {named}; they write the "
                       f"same checkpoints and metrics as this run. End them (kill {' '.join(map(str, workers))}) or "
                       "give this run another --output-dir")
    os.environ[RUN_DIR_ENV] = folder
    return workers


def pids() -> list[int]:
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:  # no /proc (not Linux)
        return []


def environ_of(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return handle.read().split(b"\0")
    except OSError:
        return []


def command_of(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def stat_of(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces): its state, its parent,
    ...; empty for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def parent_of(pid: int) -> int | None:
    fields = stat_of(pid)
    return int(fields[1]) if len(fields) > 1 else None


def is_running(pid: int) -> bool:
    """Whether ``pid`` has not ended: a process that has ended stays a zombie until its parent waits for it."""
    return stat_of(pid)[:1] not in ([], ["Z"], ["X"])


def owned_here(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:  # not in this PID namespace (a container), or gone
        return False


def children_of(pid: int) -> list[int]:
    return [child for child in pids() if parent_of(child) == pid]


def kill_children(grace_s: float = 5.0) -> int:
    """SIGKILL this process's child processes and their process groups; return how many were alive.

    torchrun starts each worker in a session of its own (so a terminal's Ctrl-C reaches only the agent);
    killing a worker's group also ends its data-loader processes.
    """
    import time

    if not os.path.isdir("/proc"):
        return 0
    children = children_of(os.getpid())
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)  # a worker leads its own group: it and its loader processes
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    for pid in children:
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG) != (0, 0):
                    break
            except ChildProcessError:
                break
            time.sleep(0.05)
    return len(children)



def tool_output(argv: list[str], timeout: float = 10.0) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None


def gpu_processes() -> list[dict]:
    """Processes holding GPU memory (``nvidia-smi``), e.g. the leftovers of a run that was killed."""
    out = tool_output(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"])
    rows = []
    for line in (out or "").splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            rows.append({"pid": int(parts[0]), "name": parts[1], "used_mib": parts[2]})
    return rows


def port_holder_line(port: int, holder: dict) -> str:
    """What ``doctor`` and the launcher say of a process listening on the master port."""
    return (f"port {port} is held by pid {holder['pid']} ({holder['command'][:80]}); if it is a leftover of an "
            f"earlier run, end it: kill {holder['pid']}")


def gpu_holder_line(app: dict) -> str:
    """What ``doctor`` and the launcher say of a process holding GPU memory."""
    return (f"GPU memory held by pid {app['pid']} ({app['name']}, {app['used_mib']} MiB); if it is a leftover, "
            f"end it: kill {app['pid']}")


def port_holders(port: int) -> list[dict]:
    """Processes with a TCP socket listening on ``port`` (any address), read from /proc."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as handle:
            next(handle)
            for line in handle:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(inode)
    holders = []
    if not inodes:
        return holders
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{entry}/fd/{fd}")
                    if target.startswith("socket:[") and target[8:-1] in inodes:
                        with open(f"/proc/{entry}/cmdline", "rb") as handle:
                            command = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
                        holders.append({"pid": int(entry), "command": command})
                        break
    return holders
