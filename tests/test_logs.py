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


class Console:
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_the_console_shows_every_rank_once_and_lines_that_echo_others_once_for_all_ranks():
    from ddpkit.launch.rank_logs import ConsoleLines, Echoes

    now = [0.0]
    echoes, console = Echoes("/runs/x/logs", clock=lambda: now[0]), Console()
    ranks = {rank: ConsoleLines(rank, console, echoes) for rank in range(4)}

    def say(rank: int, text: bytes) -> str:
        # Fed in pieces that split lines: whole lines are judged.
        return "".join(ranks[rank].feed(text[i:i + 7]).decode() for i in range(0, len(text), 7))

    # Rank 0's bytes pass as they are (a progress bar's \r too); what it says counts as shown.
    assert say(0, b"epoch 1: loss 0.52\rbar\n") == "epoch 1: loss 0.52\rbar\n"
    assert say(0, b"rank 0 of 4 done\n") == "rank 0 of 4 done\n"
    # Another rank's line that echoes nothing is shown at once, prefixed; ddpkit's own notes are rank 0's to say.
    assert say(2, b"only rank 2 says this\n[rank2]: ddpkit: 4 process(es) via torchrun\n") == (
        "[rank2]: only rank 2 says this\n")
    assert say(2, b"[rank2]: ddpkit: warning: rank 2 is slow\n") == "[rank2]: ddpkit: warning: rank 2 is slow\n"
    # Lines like one shown a moment ago, but for their numbers, are held...
    assert say(3, b"rank 3 of 4 done\n") == "" and say(1, b"rank 1 of 4 done\n") == ""
    assert say(2, b"rank 2 of 4 done\n") == ""
    for step in range(3):
        assert say(1, f"step {step}: loss 0.{step}\n".encode()) in ("[rank1]: step 0: loss 0.0\n", "")
    echoes.show_due()
    assert console.text == ""  # ...for a second
    now[0] = 1.5
    echoes.show_due()
    # ...then shown once for the ranks that said them: the first of them, and how many where a rank repeated one.
    assert console.text.splitlines() == ["[rank1-3]: rank 3 of 4 done", "[rank1]: step 1: loss 0.1 [×2]"]
    assert echoes.where_it_all_is() == ("3 line(s) of rank(s) 1-3 were shown as one with others like them; every "
                                        "rank's whole output is in /runs/x/logs/rank<N>.log")
    assert echoes.where_it_all_is() is None  # said once
    # A line left without its end is judged when the stream ends; --log-level debug shows every line at once.
    assert ranks[3].feed(b"last words") == b"" and ranks[3].flush() == b"[rank3]: last words\n"
    assert ConsoleLines(1, console, echoes, every_line=True).feed(b"rank 3 of 4 done\n") == b"[rank1]: rank 3 of 4 done\n"
    # Another rank's line never lands inside one of rank 0's (a print writes its text, then its newline)...
    console.text = ""
    echoes.write(console, b"Train Epoch: 1\tLoss: 550.5", passing=True)
    echoes.write(console, b"[rank1]: Train Epoch: 1\tLoss: 550.4\n")
    echoes.write(console, b"\n", passing=True)
    assert console.text == "Train Epoch: 1\tLoss: 550.5\n[rank1]: Train Epoch: 1\tLoss: 550.4\n"
    # ...but waits a second at most for a line that does not end (a progress bar), then has a line of its own.
    echoes.write(console, b"\r 40%", passing=True)
    echoes.write(console, b"[rank2]: hello\n")
    now[0] = 3.0
    echoes.show_due()
    assert console.text.endswith("\r 40%\n[rank2]: hello\n")
