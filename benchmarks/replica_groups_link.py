"""Replica groups on two machines joined by a slow link: what crosses the link per step, and how fast they train.

    python benchmarks/replica_groups_link.py [--rate 100mbit] [--epochs 3] [--rounds 2]
                                             [--ddpkit CMD ...] [--json FILE]          # as root

Two "machines": network namespaces on this one (``tests/nodes.py``, as the tests make them: node-a and node-b,
each with its own address and host name), joined by a veth pair whose two ends are each limited to ``--rate`` by
a token-bucket filter (``tc ... tbf``). On them, ``ddpkit train --model convnet --strategy ddp --replica-groups 2
--nproc-per-node 2 --nnodes 2``: one group of two DDP processes per machine, node-a serving the lighthouse.

Each ``--ddpkit`` (the ``ddpkit`` command of an install: two checkouts' virtual environments, to compare two
versions) runs it ``--rounds`` times, the commands alternating. Reported per run: the images per second of each
epoch after the first (the leading group's ``metrics.jsonl``) and the bytes each machine sent over the link (its
veth's counters), per optimizer step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from nodes import make_nodes, run_on_nodes  # noqa: E402



def veth(namespace: str) -> str:
    """The veth end inside ``namespace``."""
    links = json.loads(subprocess.run(["ip", "-n", namespace, "-j", "link", "show", "type", "veth"], check=True,
                                      capture_output=True, text=True).stdout)
    return links[0]["ifname"]


def sent_bytes(namespace: str) -> int:
    stats = json.loads(subprocess.run(["ip", "-n", namespace, "-s", "-j", "link", "show", "dev", veth(namespace)],
                                      check=True, capture_output=True, text=True).stdout)
    return stats[0]["stats64"]["tx"]["bytes"]


def limit(namespace: str, rate: str) -> None:
    subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", veth(namespace), "root", "tbf", "rate", rate,
                    "burst", "256kb", "latency", "200ms"], check=True, capture_output=True, text=True)


def one_run(nodes, ddpkit: list[str], epochs: int, folder: Path) -> dict:
    (_, node_0), _ = nodes
    before = [sent_bytes(name) for name, _ in nodes]
    results = run_on_nodes([(name, host, [*ddpkit, "train", "--model", "convnet", "--epochs", str(epochs),
                                          "--no-progress", "--strategy", "ddp", "--batch-size", "32",
                                          "--replica-groups", "2", "--nproc-per-node", "2", "--nnodes", "2",
                                          "--node-rank", str(rank), "--master-addr", node_0,
                                          "--output-dir", str(folder)])
                            for rank, (name, host) in enumerate(nodes)], timeout=900)
    for result in results:
        if result.returncode != 0:
            raise SystemExit(f"{' '.join(ddpkit)} failed:\n{result.stdout}\n{result.stderr}")
    sent = [sent_bytes(name) - start for (name, _), start in zip(nodes, before)]
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = sum(row["steps"] for row in rows)
    return {"ddpkit": " ".join(ddpkit), "images_per_sec": [round(row["images_per_sec"]) for row in rows[1:]],
            "sent_mb_per_step": [round(value / steps / 1e6, 3) for value in sent]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="each end's limit, as tc says it (default: 100mbit)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ddpkit", action="append", default=None, metavar="CMD",
                        help="a ddpkit command to run (repeat to compare; default: this interpreter's -m ddpkit)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root, to make network namespaces and limit their link")
    commands = [command.split() for command in args.ddpkit] if args.ddpkit else [[sys.executable, "-m", "ddpkit"]]
    runs = []
    with contextlib.contextmanager(make_nodes)() as nodes, tempfile.TemporaryDirectory() as scratch:
        for name, _ in nodes:
            limit(name, args.rate)
        for round_ in range(args.rounds):
            for index, command in enumerate(commands):
                run = one_run(nodes, command, args.epochs, Path(scratch) / f"run{round_}-{index}")
                runs.append({"round": round_, **run})
                print(json.dumps(runs[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rate": args.rate, "epochs": args.epochs, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
