"""`ddpkit train --launcher ray` on a Ray cluster of two nodes: a Ray head in one network namespace and a Ray worker
node in another (tests/nodes.py), one rank on each, trains the weights of the one-machine 2-process run."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import DIGITS_CONVNET, child_env, leftover_processes
from nodes import SUBNET, make_nodes
import test_ray
from test_ray import RAY_ENV, ranks_left, ray_node, stop_ray

pytestmark = [pytest.mark.slow, *test_ray.pytestmark]  # ray, and skipped without Ray Train
PORT = 6379  # each namespace has its own ports: Ray's default is free in it


@pytest.fixture
def nodes():
    yield from make_nodes()


def ray_node_in(namespace: str, host: str, address: str, *args: str, cluster: str) -> subprocess.Popen:
    """A Ray node of the cluster in ``namespace`` under the host name ``host`` (which the namespaces' /etc/hosts give
    its address, as a cluster's DNS would: gloo binds to what it resolves to)."""
    return ray_node("--node-ip-address", address, "--num-cpus", "1", *args, cluster=cluster,
                    prefix=("ip", "netns", "exec", namespace, "unshare", "--uts", "sh", "-c",
                            f'hostname {host} && exec "$@"', "node"))


def test_ddpkit_train_on_two_ray_nodes_equals_the_one_machine_run(nodes, ddp_digits, tmp_path):
    _, state, _, _ = ddp_digits
    (a, host_a), (b, host_b) = nodes
    head_address = f"{SUBNET}.1:{PORT}"
    head = ray_node_in(a, host_a, f"{SUBNET}.1", "--head", "--port", str(PORT), "--include-dashboard", "false",
                       cluster=head_address)
    try:
        worker = ray_node_in(b, host_b, f"{SUBNET}.2", "--address", head_address, cluster=head_address)
        try:
            result = subprocess.run(
                ["ip", "netns", "exec", a, sys.executable, "-m", "ddpkit", "train", "--launcher", "ray", "--address",
                 head_address, "--nnodes", "2", "--nproc-per-node", "1", *DIGITS_CONVNET, "--no-progress",
                 "--output-dir", str(tmp_path)], env=child_env(**RAY_ENV), capture_output=True, text=True, timeout=240)
        finally:
            stop_ray(worker)
    finally:
        stop_ray(head)
    said = result.stdout + result.stderr
    assert result.returncode == 0, said
    assert "2 process(es) via ray" in said, said
    assert "ip=10.231.0.1" in said and "ip=10.231.0.2" in said, said  # one Ray worker on each node
    mine = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(mine[key], state[key]) for key in state), "not the weights of --nproc-per-node 2"
    assert not leftover_processes() and not ranks_left()
