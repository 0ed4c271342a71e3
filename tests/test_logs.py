"""ddpkit's messages through Python's logging: rank first, rank 0 alone by default, every rank at debug."""

import doctest
import importlib.util
import io
import logging
import subprocess
import sys

import pytest

from conftest import child_env, run_ddpkit
from ddpkit.core import logs
from ddpkit.core.errors import UsageError


def test_the_module_docstring_example_runs():
    assert doctest.testmod(logs).failed == 0


def lines_logged(rank, level):
    stream = io.StringIO()
    logs.configure(rank=rank, level=level, stream=stream)
    logs.logger.debug("d")
    logs.logger.info("i")
    logs.logger.warning("w")
    logs.logger.error("e")
    return stream.getvalue().splitlines()


def test_what_each_rank_says_at_each_level():
    assert lines_logged(0, "info") == ["[rank0]: ddpkit: i", "[rank0]: ddpkit: warning: w", "[rank0]: ddpkit: error: e"]
    assert lines_logged(3, "info") == ["[rank3]: ddpkit: warning: w", "[rank3]: ddpkit: error: e"]
    assert lines_logged(3, "debug") == ["[rank3]: ddpkit: d", "[rank3]: ddpkit: i", "[rank3]: ddpkit: warning: w",
                                        "[rank3]: ddpkit: error: e"]
    assert lines_logged(0, "error") == ["[rank0]: ddpkit: error: e"]
    assert lines_logged(None, "info") == ["ddpkit: i", "ddpkit: warning: w", "ddpkit: error: e"]  # the launcher
    # Configured again, it replaces its handler: one line per message, never two.
    assert lines_logged(0, "warning") == ["[rank0]: ddpkit: warning: w", "[rank0]: ddpkit: error: e"]


def test_a_ranks_file_holds_its_info_lines_and_survives_reconfiguring(tmp_path):
    path = tmp_path / "logs" / "rank3.log"
    with logs.kept_in_file(path, 3):
        console = lines_logged(3, "info")  # configure again: the console handler is replaced, the file's stays
    logs.logger.info("after the block: not in the file")
    with logs.kept_in_file(path, 3):  # a restart: appended
        logs.logger.info("again")
    assert console == ["[rank3]: ddpkit: warning: w", "[rank3]: ddpkit: error: e"]
    assert path.read_text().splitlines() == ["[rank3]: ddpkit: i", "[rank3]: ddpkit: warning: w",
                                             "[rank3]: ddpkit: error: e", "[rank3]: ddpkit: again"]
    assert not any(isinstance(handler, logs.FileRankHandler) for handler in logs.logger.handlers)


def test_a_handler_of_the_users_own_stays_and_ddpkits_is_never_doubled():
    records = []
    own = logging.Handler()
    own.emit = records.append
    logs.logger.addHandler(own)
    try:
        logs.configure(rank=1, level="debug")
        logs.configure(rank=1, level="debug")
        assert sum(isinstance(handler, logs.RankHandler) for handler in logs.logger.handlers) == 1
        assert own in logs.logger.handlers
        logs.logger.warning("w")
        assert [record.getMessage() for record in records] == ["w"]
    finally:
        logs.logger.removeHandler(own)


def test_a_bad_level_is_a_usage_error_said_the_usual_way(monkeypatch, capsys):
    with pytest.raises(UsageError, match="`log_level` must be one of debug, info, warning, error, got 'loud'"):
        logs.configure(level="loud")
    monkeypatch.setenv(logs.LEVEL_ENV, "loud")
    with pytest.raises(UsageError, match="DDPKIT_LOG_LEVEL must be one of") as caught:
        logs.configure()
    logs.report_usage_error(caught.value)
    assert capsys.readouterr().err.startswith("ddpkit: error: DDPKIT_LOG_LEVEL must be one of")


SCRIPT = """
import ddpkit
from ddpkit.core.logs import logger

with ddpkit.Job("ddp", device="cpu") as job:
    logger.info(f"info from {job.rank}")
    logger.warning(f"warning from {job.rank}")
"""


def test_log_level_debug_reaches_every_rank_of_a_run(tmp_path):
    script = tmp_path / "speak.py"
    script.write_text(SCRIPT)
    result = run_ddpkit("run", "--nproc-per-node", "2", "--log-level", "debug", str(script), timeout=120)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert result.stderr.count(f"[rank{rank}]: ddpkit: info from {rank}\n") == 1
        assert result.stderr.count(f"[rank{rank}]: ddpkit: warning: warning from {rank}\n") == 1


QUICK_EXIT = """
import sys
import triton  # what torch._dynamo (which DDP imports) imports wherever triton is installed
from ddpkit.core.process_group import freeze_for_exit
freeze_for_exit()
print("done", file=sys.stderr)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_rank_that_freezes_its_heap_at_exit_prints_no_leak_report():
    # Frozen, triton's objects outlive its nanobind module, which then printed 27 lines of "leaked instance"
    # after every successful run of every rank. What the process writes before it exits still shows.
    done = subprocess.run([sys.executable, "-c", QUICK_EXIT], capture_output=True, text=True, env=child_env(),
                          timeout=120)
    assert done.returncode == 0 and done.stderr == "done\n", done.stderr[-2000:]


def test_the_console_shows_another_ranks_warnings_errors_and_tracebacks_only():
    from ddpkit.launch.rank_logs import ConsoleLines

    lines = ConsoleLines(2)
    text = (b"a print of its own\n"
            b"[rank2]: ddpkit: 2 process(es) via torchrun\n"
            b"[rank2]: ddpkit: warning: rank 2 is slow\n"
            b"/tmp/model.py:11: UserWarning: careful\n"
            b"  warnings.warn('careful')\n"
            b"[W1126 03:24:38.295000 2844 ProcessGroupGloo.cpp:9] a c10d warning\n"
            b"Traceback (most recent call last):\n"
            b"  File \"train.py\", line 3, in <module>\n"
            b"    main()\n"
            b"ValueError: bad value\n"
            b"after the traceback\n"
            b"a line without its end")
    # Fed in pieces that split lines: whole lines are judged.
    shown = b"".join(lines.feed(text[i:i + 7]) for i in range(0, len(text), 7)) + lines.flush()
    assert shown.decode().splitlines() == [
        "[rank2]: ddpkit: warning: rank 2 is slow",
        "[rank2]: /tmp/model.py:11: UserWarning: careful",
        "[rank2]: [W1126 03:24:38.295000 2844 ProcessGroupGloo.cpp:9] a c10d warning",
        "[rank2]: Traceback (most recent call last):",
        "[rank2]:   File \"train.py\", line 3, in <module>",
        "[rank2]:     main()",
        "[rank2]: ValueError: bad value",
    ]
    # A traceback PyTorch prefixed already keeps its one prefix; at --log-level debug every line is shown.
    prefixed = ConsoleLines(1).feed(b"[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\"\n"
                                    b"[rank1]: RuntimeError: boom\n[rank1]: later\n")
    assert prefixed.decode().splitlines() == ["[rank1]: Traceback (most recent call last):", "[rank1]:   File \"x.py\"",
                                              "[rank1]: RuntimeError: boom"]
    assert ConsoleLines(1, every_line=True).feed(b"a print\n") == b"[rank1]: a print\n"
