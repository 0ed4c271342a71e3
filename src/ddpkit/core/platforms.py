"""Where a platform, not a launcher, started this process: one node of a job, in a Kubernetes pod or on a cloud
launcher's machine, with the job's shape in environment variables and the same command run on every node.

    >>> from ddpkit.core.platforms import read_platform
    >>> shape = read_platform({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
    ...                        "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"})
    >>> (shape.platform, shape.nnodes, shape.node_rank, shape.master_addr, shape.nproc_per_node)
    ('Kubeflow TrainJob', '2', 1, 'job-node-0-0.job', '4')

What each platform gives (the sources, with versions, are in docs/kubernetes.md):

- Kubeflow Trainer's ``TrainJob`` (torch runtime): torchrun's own ``PET_`` variables, read by torchrun as its flags'
  defaults: ``PET_NNODES``, ``PET_NPROC_PER_NODE`` (a number, or ``auto``), ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
  ``PET_MASTER_PORT``.
- Kubeflow's ``PyTorchJob`` (training-operator v1): the same ``PET_`` variables, and beside them ``MASTER_ADDR``,
  ``MASTER_PORT``, ``WORLD_SIZE`` (nodes x processes per node, counting ``auto`` as 1) and ``RANK`` (the *node's*
  index, not a process's); elastic (``elasticPolicy``): ``PET_NNODES=MIN:MAX`` and ``PET_RDZV_ENDPOINT``,
  ``PET_RDZV_BACKEND``, ``PET_RDZV_ID``, ``PET_MAX_RESTARTS``. An older operator gives only the four torchrun names,
  one process per pod: that pod is one rank already (``ddpkit.core.env``), nothing here.
- A Kubernetes Indexed Job (or a JobSet, whose jobs are Indexed Jobs): ``JOB_COMPLETION_INDEX`` and a host name
  ``<job>-<index>``, reachable as ``<job>-<index>.<subdomain>`` through a headless Service named as the pod's subdomain;
  Kubernetes says nothing of the node count, so it comes from ``--nnodes``, and the master is pod 0's DNS name.
- SkyPilot: ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NUM_NODES``, ``SKYPILOT_NODE_IPS`` (one per line, the head first),
  ``SKYPILOT_NUM_GPUS_PER_NODE``.
- dstack: ``DSTACK_NODE_RANK``, ``DSTACK_NODES_NUM``, ``DSTACK_MASTER_NODE_IP``, ``DSTACK_NODES_IPS``,
  ``DSTACK_GPUS_PER_NODE``.

Every function here is pure, as in ``ddpkit.core.env``: it reads the mapping (and host name) it is given. A value
that cannot be right (a rank not below the node count, a master address missing) raises ``PlatformError`` naming the
variable; ``ddpkit.app.cli`` says it in one line (exit 2).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from ddpkit.core.env import DEFAULT_MASTER_PORT, TORCHRUN_WORKER, is_node_of_a_job

INDEX = "JOB_COMPLETION_INDEX"


class PlatformError(ValueError):
    """The platform's variables contradict each other or lack one a job needs: the message names the variable."""


@dataclasses.dataclass(frozen=True)
class NodeShape:
    """One node's part in a job, as its platform says it. ``nnodes`` is ``"N"`` or ``"MIN:MAX"`` (elastic, with a
    rendezvous endpoint); ``None`` where the platform does not say."""

    platform: str
    nnodes: str
    read: dict[str, str]  # the variables read, for ddpkit doctor
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc_per_node: str | None = None  # a number, or "auto"
    nproc_without_gpu: int | None = None  # what "auto" means on a node without GPUs, where the platform says it
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int | None = None
    nnodes_from: str = ""  # the variable (or flag) that said the node count, and the node's rank
    rank_from: str = ""

    def line(self) -> str:
        """What was read and what ddpkit makes of it, in one line."""
        where = (f"{self.nnodes} node(s) meeting at rendezvous {self.rdzv_endpoint}" if self.rdzv_endpoint else
                 f"node {self.node_rank} of {self.nnodes}, master {self.master_addr}:"
                 f"{self.master_port or DEFAULT_MASTER_PORT}")
        procs = ("" if not self.nproc_per_node else ", one process per GPU" if self.nproc_per_node == "auto" else
                 f", {self.nproc_per_node} process(es) per node")
        said = ", ".join(f"{name}={value}" for name, value in self.read.items())
        return f"{self.platform}: {where}{procs} ({said})"


def _number(environ: Mapping[str, str], name: str, read: dict[str, str], *, required: bool = True) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        if required:
            raise PlatformError(f"{name} is not set")
        return None
    read[name] = raw
    if not raw.isdigit():
        raise PlatformError(f"{name}={raw!r} is not a whole number")
    return int(raw)


def _rank_below(rank: int, nodes: int, name: str, nodes_name: str) -> int:
    if nodes < 1:
        raise PlatformError(f"{nodes_name}: a job has at least one node")
    if rank >= nodes:
        raise PlatformError(f"{name}={rank} but {nodes_name} says {nodes} node(s): a node's rank is 0..{nodes - 1}")
    return rank


def _port(environ: Mapping[str, str], name: str, read: dict[str, str]) -> int | None:
    port = _number(environ, name, read, required=False)
    if port is not None and not 0 < port < 65536:
        raise PlatformError(f"{name}={port} is not a port (1..65535)")
    return port


def from_kubeflow(environ: Mapping[str, str]) -> NodeShape:
    """A TrainJob's or a PyTorchJob's pod: torchrun's ``PET_`` variables (``is_node_of_a_job``)."""
    read: dict[str, str] = {}
    pytorchjob = any(name in environ for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "PET_RDZV_ENDPOINT"))
    platform = "Kubeflow PyTorchJob" if pytorchjob else "Kubeflow TrainJob"
    nnodes = environ.get("PET_NNODES", "1").strip()
    read["PET_NNODES"] = nnodes
    if not re.fullmatch(r"\d+(:\d+)?", nnodes):
        raise PlatformError(f"PET_NNODES={nnodes!r} is neither a number of nodes nor MIN:MAX")
    nproc = environ.get("PET_NPROC_PER_NODE", "").strip() or None
    if nproc is not None:
        read["PET_NPROC_PER_NODE"] = nproc
        if nproc == "gpu":
            nproc = "auto"  # torchrun's "gpu": one per GPU, which is ddpkit's auto where there are GPUs
        elif not (nproc.isdigit() or nproc in ("auto", "cpu")):
            raise PlatformError(f"PET_NPROC_PER_NODE={nproc!r}: expected a number, auto, gpu or cpu")
    max_restarts = _number(environ, "PET_MAX_RESTARTS", read, required=False)
    endpoint = environ.get("PET_RDZV_ENDPOINT", "").strip() or None
    if endpoint is not None:
        read["PET_RDZV_ENDPOINT"] = endpoint
        backend = environ.get("PET_RDZV_BACKEND", "c10d").strip()
        read["PET_RDZV_BACKEND"] = backend
        if backend != "c10d":
            raise PlatformError(f"PET_RDZV_BACKEND={backend}: ddpkit's elastic rendezvous is torchrun's c10d; set the "
                                "job's elasticPolicy.rdzvBackend to c10d")
        rdzv_id = environ.get("PET_RDZV_ID", "").strip() or None
        if rdzv_id:
            read["PET_RDZV_ID"] = rdzv_id
        return NodeShape(platform, nnodes, read, nproc_per_node=nproc, rdzv_endpoint=endpoint, rdzv_id=rdzv_id,
                         max_restarts=max_restarts, nnodes_from="PET_NNODES")
    nodes = int(nnodes.partition(":")[2] or nnodes)
    if ":" in nnodes and nnodes.partition(":")[0] != nnodes.partition(":")[2]:
        raise PlatformError(f"PET_NNODES={nnodes} lets the job grow and shrink, which needs a rendezvous: "
                            "PET_RDZV_ENDPOINT is not set")
    rank = _number(environ, "PET_NODE_RANK", read, required=nodes > 1)
    rank = _rank_below(rank or 0, nodes, "PET_NODE_RANK", f"PET_NNODES={nnodes}")
    master = environ.get("PET_MASTER_ADDR", "").strip() or None
    if master is None and nodes > 1:
        raise PlatformError(f"PET_MASTER_ADDR is not set, and PET_NNODES={nnodes} nodes must find node 0")
    if master is not None:
        read["PET_MASTER_ADDR"] = master
    port = _port(environ, "PET_MASTER_PORT", read)
    without_gpu = None
    if pytorchjob and nproc in (None, "auto") and environ.get("WORLD_SIZE", "").strip().isdigit():
        # The operator counts "auto" as one process per pod in WORLD_SIZE: on a node without GPUs, that is what the
        # job was sized for (a classic one-process-per-pod PyTorchJob, which a newer operator also gives PET_ names).
        read["WORLD_SIZE"] = environ["WORLD_SIZE"].strip()
        without_gpu = max(1, int(read["WORLD_SIZE"]) // nodes)
    return NodeShape(platform, str(nodes), read, node_rank=rank, master_addr=master, master_port=port,
                     nproc_per_node=nproc, nproc_without_gpu=without_gpu, max_restarts=max_restarts,
                     nnodes_from="PET_NNODES", rank_from="PET_NODE_RANK")


def _ips(environ: Mapping[str, str], name: str, read: dict[str, str]) -> list[str]:
    raw = environ.get(name, "")
    if raw.strip():
        read[name] = raw.strip().replace("\n", ",")
    return [line.strip() for line in raw.replace(",", "\n").splitlines() if line.strip()]


def _cloud_node(environ: Mapping[str, str], platform: str, nodes_name: str, rank_name: str, ips_name: str,
                gpus_name: str, master_name: str | None = None) -> NodeShape:
    """A node of a cloud launcher's multi-node task: the node count, this node's rank, every node's address (one per
    line, the master's first unless ``master_name`` names it apart) and the GPUs per node, each in a variable."""
    read: dict[str, str] = {}
    nodes = _number(environ, nodes_name, read) or 0
    rank = _rank_below(_number(environ, rank_name, read) or 0, nodes, rank_name, f"{nodes_name}={nodes}")
    ips = _ips(environ, ips_name, read)
    master = ips[0] if ips else None
    if master_name is not None and environ.get(master_name, "").strip():
        master = read[master_name] = environ[master_name].strip()
    if nodes > 1 and not master:
        raise PlatformError(f"{master_name or ips_name} is not set: the master node's address is where the others "
                            "meet")
    if ips and len(ips) != nodes:
        raise PlatformError(f"{ips_name} lists {len(ips)} address(es) but {nodes_name}={nodes}")
    gpus = _number(environ, gpus_name, read, required=False)
    return NodeShape(platform, str(nodes), read, node_rank=rank, master_addr=master,
                     nproc_per_node=str(gpus) if gpus else None, nnodes_from=nodes_name, rank_from=rank_name)


def from_skypilot(environ: Mapping[str, str]) -> NodeShape:
    """A node of a SkyPilot task (``num_nodes: N``): the head is the first of ``SKYPILOT_NODE_IPS``."""
    return _cloud_node(environ, "SkyPilot", "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS",
                       "SKYPILOT_NUM_GPUS_PER_NODE")


def from_dstack(environ: Mapping[str, str]) -> NodeShape:
    """A node of a dstack task (``nodes: N``): the master is ``DSTACK_MASTER_NODE_IP``."""
    return _cloud_node(environ, "dstack", "DSTACK_NODES_NUM", "DSTACK_NODE_RANK", "DSTACK_NODES_IPS",
                       "DSTACK_GPUS_PER_NODE", master_name="DSTACK_MASTER_NODE_IP")


def from_indexed_job(environ: Mapping[str, str], nnodes: int, fqdn: str) -> NodeShape:
    """A pod of a Kubernetes Indexed Job (or JobSet) of ``nnodes`` pods (``--nnodes``; Kubernetes does not say it),
    whose fully qualified name is ``fqdn``: its index is its node rank, and pod 0's DNS name, its own with the index
    0, is the master's."""
    read: dict[str, str] = {}
    rank = _rank_below(_number(environ, INDEX, read) or 0, nnodes, INDEX, f"--nnodes {nnodes}")
    host, dot, domain = fqdn.partition(".")
    read["hostname"] = fqdn
    if not host.endswith(f"-{rank}"):
        raise PlatformError(f"{INDEX}={rank} but this pod's host name {host} does not end in -{rank}: not an Indexed "
                            "Job's pod (its host name is <job>-<index>); give --master-addr and --node-rank")
    if not dot:
        raise PlatformError(f"this Indexed Job's pod {host} has no DNS name through which the others reach pod 0: set "
                            "the pod template's subdomain to a headless Service's name (`ddpkit manifest indexed-job` "
                            "writes both), or give --master-addr")
    master = f"{host[: -len(str(rank))]}0.{domain}"
    return NodeShape("Kubernetes Indexed Job", str(nnodes), read, node_rank=rank, master_addr=master,
                     nnodes_from="--nnodes", rank_from=INDEX)


def read_platform(environ: Mapping[str, str], *, nnodes: int = 1, fqdn: str = "") -> NodeShape | None:
    """The platform that made this process a node of a job, and what it says (None: none did, or this process is
    a rank already). ``nnodes``: the node count the command line asks for, which an Indexed Job's pod needs (one
    node: an Indexed Job of independent runs, nothing to read); ``fqdn``: this machine's fully qualified name."""
    if TORCHRUN_WORKER in environ:
        return None
    if is_node_of_a_job(environ):
        return from_kubeflow(environ)
    if "SKYPILOT_NUM_NODES" in environ:
        return from_skypilot(environ)
    if "DSTACK_NODES_NUM" in environ:
        return from_dstack(environ)
    if INDEX in environ and nnodes > 1 and not ("RANK" in environ and "WORLD_SIZE" in environ):
        return from_indexed_job(environ, nnodes, fqdn)
    return None


def is_kubernetes_pod(environ: Mapping[str, str]) -> bool:
    """True in a Kubernetes pod (every container gets the API server's address)."""
    return "KUBERNETES_SERVICE_HOST" in environ


@dataclasses.dataclass(frozen=True)
class LaunchFlags:
    """The launch flags of ``ddpkit train`` and ``ddpkit run`` as given (their defaults where not)."""

    nnodes: str = "1"
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    nproc_per_node: str = "auto"
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0


def _nodes(nnodes: str) -> str:
    """``N:N`` is ``N``."""
    low, colon, high = nnodes.partition(":")
    return low if colon and low == high else nnodes


def merge(shape: NodeShape, given: LaunchFlags, *, gpus: int, cpus: int) -> LaunchFlags:
    """The launch flags for this node: what the platform says, where the command line did not say otherwise. A
    flag that sets the job's shape (``--nnodes``, ``--node-rank``) and disagrees with the platform is a mistake (one
    side would wait for nodes that never come): ``PlatformError``, naming both. The others override: ``--master-addr``
    and ``--master-port`` (another name for the same node), ``--nproc-per-node`` (fewer processes than GPUs),
    ``--max-restarts``, ``--rdzv-endpoint``/``--rdzv-id``. ``gpus``/``cpus``: this node's, for ``auto``/``cpu``."""
    said = f"{shape.platform} says"
    if given.nnodes != "1" and _nodes(given.nnodes) != _nodes(shape.nnodes):
        raise PlatformError(f"--nnodes {given.nnodes}, but {said} {shape.nnodes} node(s) ({shape.nnodes_from}="
                            f"{shape.read.get(shape.nnodes_from, shape.nnodes)}): drop --nnodes, ddpkit reads it")
    elastic = shape.rdzv_endpoint is not None or given.rdzv_endpoint is not None
    if given.node_rank and (elastic or given.node_rank != shape.node_rank):
        where = "the nodes number themselves at its rendezvous" if elastic else \
            f"this is node {shape.node_rank} ({shape.rank_from}={shape.read.get(shape.rank_from)})"
        raise PlatformError(f"--node-rank {given.node_rank}, but {said} {where}: drop --node-rank, ddpkit reads it")
    nproc = given.nproc_per_node
    if nproc == "auto" and shape.nproc_per_node is not None:
        nproc = shape.nproc_per_node
    if nproc == "cpu":
        nproc = str(max(1, cpus))
    if nproc == "auto" and not gpus and shape.nproc_without_gpu:
        nproc = str(shape.nproc_without_gpu)
    restarts = given.max_restarts or shape.max_restarts or 0
    if elastic:
        return LaunchFlags(nnodes=shape.nnodes, nproc_per_node=nproc, max_restarts=restarts,
                           rdzv_endpoint=given.rdzv_endpoint or shape.rdzv_endpoint,
                           rdzv_id=given.rdzv_id or shape.rdzv_id, master_addr=given.master_addr,
                           master_port=given.master_port)
    return LaunchFlags(nnodes=shape.nnodes, node_rank=shape.node_rank or 0,
                       master_addr=given.master_addr or shape.master_addr,
                       master_port=given.master_port if given.master_port is not None else shape.master_port,
                       nproc_per_node=nproc, rdzv_id=given.rdzv_id, max_restarts=restarts)
