"""``ddpkit status OUTPUT_DIR``: every rank's step, phase, last heartbeat, step time and memory, for a job
that runs or has ended.

Rank 0's heartbeat thread (``ddpkit.watch.heartbeat``) writes ``OUTPUT_DIR/status.json`` every few seconds with
what it last saw of every rank, and once more when the job ends (how: ended, failed, stopped, stalled);
``ddpkit train`` writes it in its output folder, a script through ``Job(status_file=...)``. This module
writes it (``write``, ``memory_mb``) and reads it back with the last line of ``metrics.jsonl``
(``describe``). Without heartbeats (one process, ``--stall-timeout 0``) there is no status file; the
metrics are shown alone.

    >>> import time
    >>> beat = {"rank": 0, "host": "node0", "pid": 4242, "step": 412, "phase": "backward", "idle_s": 0.01,
    ...         "silent_s": 0.0, "step_s": 0.0241, "memory_mb": 310.2}
    >>> stalled = dict(beat, rank=1, pid=4243, step=380, phase="forward", silent_s=42.0)
    >>> print(describe({"state": "running", "updated": 1000.0, "interval_s": 5.0, "ranks": [beat, stalled]},
    ...                None, now=1002.0, here="elsewhere"))
    running: status written 2 s ago by rank 0 (pid 4242 on node0)
    rank  host    pid  step  phase     last beat  step time  memory
       0  node0  4242   412  backward    2 s ago    24.1 ms  310 MB
       1  node0  4243   380  forward    44 s ago    24.1 ms  310 MB
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time

from ddpkit.core.errors import UsageError

STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
STALE_BEATS = 3  # a running job's status older than this many heartbeat intervals: its rank 0 is not writing


def memory_mb() -> float | None:
    """This process's resident memory plus the memory its GPU has allocated for it, in MiB (None off Linux)."""
    try:
        with open("/proc/self/statm") as statm:
            resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
    torch = sys.modules.get("torch")  # a GPU's memory only where torch is in use and CUDA started
    if torch is not None and torch.cuda.is_initialized():
        resident += torch.cuda.memory_allocated()
    return round(resident / 2**20, 1)


def write(path: str, *, state: str, interval_s: float, ranks: list[dict], verdict: str | None = None) -> None:
    """``path`` replaced in one piece by the job's status (never read half-written). Not
    ``checkpoint.atomic_write``: the heartbeat thread writes this every few seconds, and an fsync on a slow
    shared file system could hold its beats back long enough to look like a stall; a status lost to a
    crash is rewritten by the next run."""
    record = {"state": state, "updated": time.time(), "interval_s": interval_s, "world_size": len(ranks),
              "verdict": verdict, "ranks": ranks}
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".status-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read(folder: str) -> tuple[dict | None, dict | None]:
    """(the status, the last epoch's metrics record) of the run in ``folder``; None for what is not there."""
    status = None
    try:
        with open(os.path.join(folder, STATUS_FILE)) as handle:
            status = json.load(handle)
    except FileNotFoundError:
        pass
    except ValueError:
        raise UsageError(f"{os.path.join(folder, STATUS_FILE)} is not a ddpkit status file") from None
    records = read_metrics(folder)
    return status, (records[-1] if records else None)


def read_metrics(folder: str) -> list[dict]:
    """Every whole record of the metrics.jsonl in ``folder``, in order ([] without one). A line being appended,
    or cut by a crash, is left out."""
    try:
        with open(os.path.join(folder, METRICS_FILE)) as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def _process_state(pid: int) -> str:
    """How process ``pid`` of this machine is: "gone", "stopped" or "alive"."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return "stopped" if state in ("T", "t") else "gone" if state in ("Z", "X") else "alive"


def gone(status: dict) -> bool:
    """A running job's status that its rank 0, on this machine, will never write again: its process is gone."""
    import socket

    main = status["ranks"][0]
    return main["host"] == socket.gethostname() and _process_state(main["pid"]) == "gone"


def headline(status: dict, now: float, here: str) -> str:
    """The job's state in one line: what rank 0 last wrote, and whether it still writes."""
    age = now - status["updated"]
    main = status["ranks"][0]
    who = f"rank 0 (pid {main['pid']} on {main['host']})"
    line = f"{status['state']}: status written {_ago(age)} by {who}"
    if status["state"] == "stalled" and status.get("verdict"):
        line += f"\n  {status['verdict'].split('. ')[0]}"
    elif status["state"] == "running" and age > STALE_BEATS * status["interval_s"]:
        line += f", which writes it every {status['interval_s']:g} s"
        if main["host"] == here:
            line += {"gone": "; its process is gone: the job died without ending (killed, or its machine lost)",
                     "stopped": "; its process is stopped (SIGSTOP, a debugger)",
                     "alive": "; its process is alive but frozen (its heartbeat thread does not run)"
                     }[_process_state(main["pid"])]
        else:
            line += f"; look at its processes on {main['host']}"
    return line


def rank_table(status: dict, now: float) -> list[str]:
    age = now - status["updated"]
    header = ("rank", "host", "pid", "step", "phase", "last beat", "step time", "memory")
    rows = [header] + [(str(beat["rank"]), beat["host"], str(beat["pid"]), str(beat["step"]), beat["phase"],
                        _ago(age + beat["silent_s"]),
                        "-" if beat.get("step_s") is None else f"{beat['step_s'] * 1e3:.1f} ms",
                        "-" if beat.get("memory_mb") is None else f"{beat['memory_mb']:.0f} MB")
                       for beat in status["ranks"]]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    left = {1, 4}  # host and phase read left to right; numbers line up on the right
    return ["  ".join(cell.ljust(width) if column in left else cell.rjust(width)
                      for column, (cell, width) in enumerate(zip(row, widths))).rstrip() for row in rows]


def epoch_line(record: dict) -> str:
    line = (f"last epoch: {record['epoch'] + 1}, train_loss {record['train_loss']:.4f}, val_acc "
            f"{record['val_acc']:.2%} ({record['val_count']} samples), {record['images_per_sec']:.0f} images/s")
    if record.get("slowest_rank") is not None:
        line += f", slowest rank {record['slowest_rank']} (+{record['slowdown_pct']:.1f}%)"
    words = replicas_words(record)
    return line + (f", {words}" if words else "")


def replicas_words(record: dict) -> str:
    """A metrics record's replica groups (``ddpkit train --replica-groups``) when some did not take part in every
    step of the epoch: how many did on average and at least, and the effective global batch; else ''."""
    if "replicas" not in record or record["replicas_min"] == record["replica_groups"]:
        return ""
    return (f"replica groups {record['replicas']:.2f} of {record['replica_groups']} on average (at least "
            f"{record['replicas_min']}), effective global batch {record['effective_global_batch']:.0f}")


def describe(status: dict | None, last: dict | None, *, now: float | None = None, here: str | None = None) -> str:
    """What ``ddpkit status`` prints for a run's status and last metrics record."""
    import socket

    now = time.time() if now is None else now
    here = socket.gethostname() if here is None else here
    lines = []
    if status is not None:
        lines += [headline(status, now, here), *rank_table(status, now)]
    else:
        lines.append(f"no {STATUS_FILE}: the run had one process or its heartbeats off (--stall-timeout 0)")
    if last is not None:
        lines.append(epoch_line(last))
    return "\n".join(lines)


def show(folder: str, *, watch: bool = False, every_s: float = 5.0) -> int:
    """``ddpkit status``: print the run in ``folder`` (with ``watch``, again every ``every_s`` seconds while
    it runs). Exit status 0."""
    if not os.path.isdir(folder):
        raise UsageError(f"ddpkit status {folder}: no such folder (give a run's --output-dir)")
    while True:
        status, last = read(folder)
        if status is None and last is None:
            raise UsageError(f"ddpkit status {folder}: no {STATUS_FILE} or {METRICS_FILE} there: not a ddpkit "
                             "train output folder, or its run has not started training yet")
        print(describe(status, last), flush=True)
        if not watch or status is None or status["state"] != "running" or gone(status):
            return 0
        time.sleep(every_s)
        print(flush=True)
