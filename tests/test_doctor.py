"""`ddpkit doctor`: the machine report, leftovers holding the port, and a real 2-process connectivity check."""

import json
import os
import socket

from conftest import run_ddpkit
from ddpkit import doctor

TUTORIAL_VARIABLES = [
    "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SOCKET_NTHREADS", "NCCL_BUFFSIZE", "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS", "NCCL_CHECKS_DISABLE", "NCCL_CHECK_POINTERS", "NCCL_NET_GDR_LEVEL",
    "NCCL_IGNORE_CPU_AFFINITY", "NCCL_ALGO", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG",
]


def test_every_tutorial_variable_in_effect_is_explained():
    rows = doctor.variables({name: "1" for name in TUTORIAL_VARIABLES} | {"HOME": "/root", "NCCL_NEW_THING": "x"})
    explained = {row["name"]: row["meaning"] for row in rows}
    assert set(explained) == set(TUTORIAL_VARIABLES) | {"NCCL_NEW_THING"}  # HOME is not distributed
    assert all("not one ddpkit knows" not in explained[name] for name in TUTORIAL_VARIABLES)
    assert "not one ddpkit knows" in explained["NCCL_NEW_THING"]


def test_doctor_json_names_versions_backends_variables_and_who_holds_the_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = run_ddpkit("doctor", "--json", "-", "--port", str(port), NCCL_DEBUG="INFO", GLOO_SOCKET_IFNAME="lo")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"versions", "backends", "gpus", "cpu_cores", "topology", "variables", "port", "port_holders",
            "gpu_processes"} <= report.keys()
    assert report["versions"]["torch"] and report["backends"]["gloo"] is True
    names = {row["name"]: row for row in report["variables"]}
    assert names["NCCL_DEBUG"]["value"] == "INFO" and "log level" in names["NCCL_DEBUG"]["meaning"]
    assert names["GLOO_SOCKET_IFNAME"]["value"] == "lo"
    assert report["port"] == port and [h["pid"] for h in report["port_holders"]] == [os.getpid()]


def test_doctor_text_says_how_to_clear_a_leftover():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = run_ddpkit("doctor", "--port", str(port))
    assert result.returncode == 0, result.stderr
    assert f"port {port} is held by pid {os.getpid()}" in result.stdout and f"kill {os.getpid()}" in result.stdout


def test_connectivity_check_across_two_processes(tmp_path):
    out = tmp_path / "doctor.json"
    result = run_ddpkit("doctor", "--nproc-per-node", "2", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all-reduce correct on every rank" in result.stdout
    check = json.loads(out.read_text())["connectivity"]
    assert check["ok"] and check["world_size"] == 2 and check["expected_sum"] == 3
    assert [rank["rank"] for rank in check["ranks"]] == [0, 1]
    for rank in check["ranks"]:
        assert rank["allreduce_correct"] and rank["latency_us"] > 0 and rank["bus_bandwidth_gbps"] > 0
        assert rank["interface"] == "lo" and rank["address"] == "127.0.0.1"


HANG = """
import time, torch, torch.distributed as dist, ddpkit
with ddpkit.distributed() as rt:
    if rt.rank == 1:
        time.sleep(3600)  # never reaches the all-reduce
    dist.all_reduce(torch.ones(4))
"""


def test_a_rank_that_never_reaches_a_collective_is_named(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    result = run_ddpkit("run", "--find-hangs", "--timeout", "5", "--nproc-per-node", "2", str(script), timeout=90)
    assert result.returncode == 1
    assert "ddpkit: error: rank 0: a collective timed out after 5 s: rank(s) 1 never reached it" in result.stderr
    assert "rank 1 (pid" in result.stderr  # the launcher ended it too; the suite's fixture checks nothing is left


def test_without_find_hangs_a_timeout_says_how_to_find_the_rank(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    result = run_ddpkit("run", "--timeout", "5", "--nproc-per-node", "2", str(script), timeout=90)
    assert result.returncode == 1
    assert "a collective timed out waiting for another rank; rerun with --find-hangs" in result.stderr
