"""Two "nodes" on one machine, for the tests that run a job across machines: network namespaces joined by a veth
pair, each with its own address (10.231.0.1 and .2) and, through ``unshare --uts``, its own hostname (node-a,
node-b); both namespaces' /etc/hosts (``ip netns exec`` mounts /etc/netns/NAME/hosts over it) name both nodes, as a
cluster's DNS would. Needs root (to make namespaces); skipped, saying so, elsewhere."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import _pids_with, warm_python, warm_ranks_env

SUBNET = "10.231.0"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def make_nodes(own_name_loopback: bool = False, names: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())):
    """Yields [(namespace, hostname), (namespace, hostname)], torn down afterwards whatever happened; with
    ``own_name_loopback``, each one's /etc/hosts maps its own name to 127.0.1.1 (as Debian installs it). ``names``:
    more names of each node in both /etc/hosts, first on its line (as a pod's own file and a cluster's DNS give a
    pod's service name: the first is what ``socket.getfqdn`` returns)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns)")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` command")
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's `unshare` (to give each node its own hostname)")
    tag = uuid.uuid4().hex[:6]
    nodes = [(f"ddpk{tag}{side}", f"{SUBNET}.{index + 1}", f"v{tag}{side}") for index, side in enumerate("ab")]
    made: list[str] = []
    try:
        for own, (name, _, _) in zip("ab", nodes):
            ip("netns", "add", name)
            made.append(name)
            (Path("/etc/netns") / name).mkdir(parents=True, exist_ok=True)
            hosts = "127.0.0.1 localhost\n" + "".join(
                f"{'127.0.1.1' if own_name_loopback and side == own else f'{SUBNET}.{index + 1}'} "
                f"{' '.join([*names[index], f'node-{side}'])}\n" for index, side in enumerate("ab"))
            (Path("/etc/netns") / name / "hosts").write_text(hosts)
        (a, _, veth_a), (b, _, veth_b) = nodes
        ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        for name, address, veth in nodes:
            ip("link", "set", veth, "netns", name)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", veth)
            ip("-n", name, "link", "set", veth, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield [(name, f"node-{side}") for (name, _, _), side in zip(nodes, "ab")]
    finally:
        for name in made:
            with contextlib.suppress(subprocess.CalledProcessError):
                ip("netns", "delete", name)  # deletes its end of the veth pair, and with it the other
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


def run_on_nodes(commands: list[tuple[str, str, list[str]]], timeout: float,
                  meanwhile: Callable[[list[subprocess.Popen]], None] | None = None) -> list[subprocess.CompletedProcess]:
    """Start each command in its namespace, under its hostname, at once; call ``meanwhile(processes)``; wait for all. On
    a timeout, kill every process of the run (torchrun's workers have sessions of their own: found by their
    marker).

    The Python of a command (``sys.executable``), and its ranks, start warm (tests/warm_ranks.py: forked from a warm
    interpreter, in the node's namespaces): a test that reads a process of the node (its sockets, its children)
    asks ``warm_ranks.worker_of`` for the one that does the work."""
    marker = uuid.uuid4().hex
    # One thread per process, as the one-node reference's 2 processes on 2 cores have (ddpkit gives each process
    # its share of the cores): the same sums, to the bit.
    env = warm_ranks_env(DDPKIT_TEST_RUN=marker, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c",
                               f'hostname {host} && exec "$@"', "node", *warm_python(argv, env)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for name, host, argv in commands]
    results = []
    deadline = time.monotonic() + timeout  # one deadline for all nodes
    try:
        if meanwhile is not None:
            meanwhile(procs)
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for pid in _pids_with("DDPKIT_TEST_RUN", marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        outputs = [proc.communicate(timeout=30) for proc in procs]
        pytest.fail(f"the nodes ran past {timeout} s:\n" + "\n".join(out + err for out, err in outputs))
    return results
