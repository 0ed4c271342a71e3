"""Who am I: rank, local rank, world size and master address, read from a launcher's environment.

    >>> from ddpkit.core.env import detect
    >>> e = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
    ...             "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"})
    >>> (e.launcher, e.rank, e.world_size, e.master_addr)
    ('torchrun', 1, 2, '10.0.0.1')

Every function here is pure: it reads the mapping it is given and never writes ``os.environ``,
so each launcher's conventions can be unit-tested without starting a process.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500

# What `ddpkit run --replica-groups R` tells each group's processes (ddpkit.launch.replica_groups, read by
# ddpkit.strategies.replica_groups): their group (0..R-1), R, the launcher's store (the groups' start barrier, and
# where each process publishes its beat for the launcher's fence), the fewest groups a step may take, and, in
# torchft's own name, the lighthouse.
REPLICA_GROUP = "DDPKIT_REPLICA_GROUP"
REPLICA_GROUPS = "DDPKIT_REPLICA_GROUPS"
REPLICA_STORE = "DDPKIT_REPLICA_STORE"
MIN_REPLICAS = "DDPKIT_MIN_REPLICAS"
LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"


def replica_beat_key(group: int, rank: int = 0) -> str:
    """The key of the launcher's store under which ``group``'s process of rank ``rank`` publishes its beat."""
    return f"beat/{group}/{rank}"


# Slurm gives no port; derive one from the job id so that every task of a job agrees on it
# without talking, and two jobs sharing a node are unlikely to collide. The span ends below Linux's default
# ephemeral range (32768-60999): there any outgoing connection may hold the port when rank 0 binds it.
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 17000


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the job. ``rank`` is global; "main" means ``rank == 0``."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int | None = None
    # How many times torchrun's elastic agent has restarted this worker group.
    restart_count: int = 0
    # "single", "torchrun", "torch.distributed.launch", "ray", "env", "slurm", "mpi" or "spawn".
    launcher: str = "single"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1} (world size {self.world_size})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local rank {self.local_rank} is outside 0..{self.local_world_size - 1} "
                f"(local world size {self.local_world_size})"
            )
        if self.local_world_size > self.world_size:
            raise ValueError(f"local world size {self.local_world_size} exceeds world size {self.world_size}")

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one that prints and saves."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """More than one process in the job."""
        return self.world_size > 1

    @property
    def num_nodes(self) -> int:
        """How many machines the job runs on (as many processes on each)."""
        return max(1, self.world_size // self.local_world_size)


def _int(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = environ.get(key)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"environment variable {key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def _port(environ: Mapping[str, str]) -> int | None:
    return _int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else None


def local_rank_from_argv(argv: Sequence[str]) -> int | None:
    """The ``--local-rank=N`` / ``--local_rank N`` argument of ``python -m torch.distributed.launch``."""
    for i, arg in enumerate(argv):
        for flag in ("--local-rank", "--local_rank"):
            if arg == flag and i + 1 < len(argv):
                return int(argv[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return None


def from_torchrun(environ: Mapping[str, str], argv: Sequence[str] = ()) -> DistEnv:
    """torchrun, ``torch.distributed.launch`` or any launcher that sets RANK and WORLD_SIZE."""
    world_size = _int(environ, "WORLD_SIZE")
    argv_local_rank = local_rank_from_argv(argv)
    # The legacy launcher runs torchrun's agent too (so TORCHELASTIC_RUN_ID is set); what tells it
    # apart is the --local-rank argument it adds.
    if argv_local_rank is not None:
        launcher = "torch.distributed.launch"
    elif "TORCHELASTIC_RUN_ID" in environ:
        launcher = "torchrun"
    elif is_ray_worker(environ):
        launcher = "ray"
    else:
        launcher = "env"
    local_rank = _int(environ, "LOCAL_RANK", argv_local_rank if argv_local_rank is not None else 0)
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE", 0) or _guess_local_world_size(world_size, local_rank)
    return DistEnv(
        rank=_int(environ, "RANK"),
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        # torchrun calls the node's rank GROUP_RANK; the legacy launcher exports NODE_RANK at most.
        node_rank=_int(environ, "GROUP_RANK", _int(environ, "NODE_RANK", 0)),
        master_addr=environ.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
        master_port=_port(environ),
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
        launcher=launcher,
    )


# Set by Ray in every process it starts (its workers and theirs): the node's raylet.
RAY_WORKER = "RAY_RAYLET_PID"


def is_ray_worker(environ: Mapping[str, str]) -> bool:
    """True in a process that Ray started (a Ray Train worker, or a rank ``ddpkit run --launcher ray`` started
    from one): Ray Train gives it torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) and nothing of its own."""
    return bool(environ.get(RAY_WORKER))


def _guess_local_world_size(world_size: int, local_rank: int) -> int:
    # Without LOCAL_WORLD_SIZE (legacy launchers) we only know this node has local_rank + 1 processes.
    return min(world_size, max(local_rank + 1, 1))


def torchrun_variables(environment: DistEnv) -> dict[str, str]:
    """The variables torchrun gives each worker, for a rank some other launcher started (Slurm's srun, a Ray worker)."""
    return {
        "RANK": str(environment.rank),
        "LOCAL_RANK": str(environment.local_rank),
        "WORLD_SIZE": str(environment.world_size),
        "LOCAL_WORLD_SIZE": str(environment.local_world_size),
        "GROUP_RANK": str(environment.node_rank),
        "MASTER_ADDR": environment.master_addr,
        "MASTER_PORT": str(environment.master_port),
    }


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list.

    >>> expand_nodelist("gpu[01-04,07],cpu3")
    ['gpu01', 'gpu02', 'gpu03', 'gpu04', 'gpu07', 'cpu3']
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_host(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm node list {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in Slurm node list {text!r}")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_host(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    hosts = []
    for value in _expand_ranges(match.group(1), item):
        # The tail may hold further bracket groups ("rack[1-2]-n[1-2]"): a cartesian product.
        hosts.extend(head + value + rest for rest in _expand_host(tail))
    return hosts


def _expand_ranges(spec: str, item: str) -> list[str]:
    values = []
    for part in spec.split(","):
        if re.fullmatch(r"\d+", part):
            values.append(part)
            continue
        bounds = re.fullmatch(r"(\d+)-(\d+)", part)
        if bounds is None:
            raise ValueError(f"cannot read range {part!r} in Slurm node list item {item!r}")
        low, high = bounds.group(1), bounds.group(2)
        if int(high) < int(low):
            raise ValueError(f"range {part!r} runs backwards in Slurm node list item {item!r}")
        width = len(low)  # zero padding is kept: gpu[01-03] -> gpu01, gpu02, gpu03
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE: ``"4(x2),2"`` -> ``[4, 4, 2]`` (one count per node, in node order)."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"cannot read SLURM_TASKS_PER_NODE={spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def from_slurm(environ: Mapping[str, str]) -> DistEnv:
    """One rank per Slurm task (``srun -n N ...``); master = first host of the job's node list."""
    world_size = _int(environ, "SLURM_NTASKS")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    hosts = expand_nodelist(nodelist) if nodelist else []
    master_addr = environ.get("MASTER_ADDR") or (hosts[0] if hosts else DEFAULT_MASTER_ADDR)
    if environ.get("MASTER_PORT"):
        master_port = _int(environ, "MASTER_PORT")
    elif environ.get("SLURM_JOB_ID"):
        master_port = SLURM_PORT_BASE + _int(environ, "SLURM_JOB_ID") % SLURM_PORT_SPAN
    else:
        master_port = DEFAULT_MASTER_PORT
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    node_rank = _int(environ, "SLURM_NODEID", 0)
    if per_node:
        counts = tasks_per_node(per_node)
        if node_rank >= len(counts):
            raise ValueError(f"SLURM_NODEID={node_rank} but SLURM_TASKS_PER_NODE={per_node!r} lists {len(counts)} node(s)")
        local_world_size = counts[node_rank]  # nodes may run different numbers of tasks
    elif environ.get("SLURM_NTASKS_PER_NODE"):
        local_world_size = _int(environ, "SLURM_NTASKS_PER_NODE")
    else:
        local_world_size = max(1, world_size // max(1, len(hosts)))
    local_rank = _int(environ, "SLURM_LOCALID", 0)
    return DistEnv(
        rank=_int(environ, "SLURM_PROCID"),
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=max(local_world_size, local_rank + 1),
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        launcher="slurm",
    )


# mpirun: Open MPI names its variables OMPI_COMM_WORLD_*, MPICH's (and Intel MPI's) Hydra PMI_* and MPI_LOCAL*.
OPEN_MPI = {"rank": "OMPI_COMM_WORLD_RANK", "size": "OMPI_COMM_WORLD_SIZE", "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
            "local_size": "OMPI_COMM_WORLD_LOCAL_SIZE", "node_rank": "OMPI_COMM_WORLD_NODE_RANK"}
MPICH = {"rank": "PMI_RANK", "size": "PMI_SIZE", "local_rank": "MPI_LOCALRANKID", "local_size": "MPI_LOCALNRANKS",
         "node_rank": None}
# What every rank of one mpirun shares and another mpirun does not: the job's name, for a port all agree on.
MPI_JOB_IDS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_KVSNAME", "PMI_JOBID")


def _mpi_names(environ: Mapping[str, str]) -> dict[str, str | None] | None:
    for names in (OPEN_MPI, MPICH):
        if names["rank"] in environ and names["size"] in environ:
            return names
    return None


def is_mpi_task(environ: Mapping[str, str]) -> bool:
    """True in a process of ``mpirun -np N`` with N > 1 (Open MPI or MPICH): each is already one rank."""
    names = _mpi_names(environ)
    return names is not None and _int(environ, names["size"], 1) > 1


def from_mpi(environ: Mapping[str, str]) -> DistEnv:
    """One rank per MPI process (``mpirun -np N ...``). MPI says nothing of a master: on one machine it is this
    one; across machines MASTER_ADDR must name node 0 (``mpirun -x MASTER_ADDR=node0``). The port is
    MASTER_PORT, else derived from the job's name, so that every rank agrees on it without talking."""
    import zlib

    names = _mpi_names(environ)
    if names is None:
        raise ValueError("not an MPI process: no OMPI_COMM_WORLD_RANK/SIZE or PMI_RANK/SIZE")
    rank, world_size = _int(environ, names["rank"]), _int(environ, names["size"])
    local_rank = _int(environ, names["local_rank"], 0)
    local_world_size = _int(environ, names["local_size"], world_size)
    if not 0 <= rank < world_size or not 0 <= local_rank < local_world_size:
        raise ValueError(f"{names['rank']}={rank} with {names['size']}={world_size}, {names['local_rank']}={local_rank} "
                         f"with {names['local_size']}={local_world_size}")
    if names["node_rank"] and names["node_rank"] in environ:
        node_rank = _int(environ, names["node_rank"])
    else:
        node_rank = rank // local_world_size  # mpirun's default: ranks placed node after node
    master_addr = environ.get("MASTER_ADDR")
    if not master_addr:
        if local_world_size < world_size:
            raise ValueError(f"mpirun runs {world_size} ranks on several machines ({local_world_size} on this one) and "
                             "MPI does not say where rank 0 is: pass node 0's address, mpirun -x MASTER_ADDR=HOST")
        master_addr = DEFAULT_MASTER_ADDR
    if environ.get("MASTER_PORT"):
        master_port = _int(environ, "MASTER_PORT")
    else:
        job = next((environ[key] for key in MPI_JOB_IDS if environ.get(key)), None)
        master_port = SLURM_PORT_BASE + zlib.crc32(job.encode()) % SLURM_PORT_SPAN if job else DEFAULT_MASTER_PORT
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size,
                   node_rank=node_rank, master_addr=master_addr, master_port=master_port, launcher="mpi")


def from_spawn(rank: int, world_size: int, master_addr: str = DEFAULT_MASTER_ADDR, master_port: int | None = None) -> DistEnv:
    """Where a process started by ``torch.multiprocessing.spawn`` stands: the rank arrives as an argument.

        def worker(rank, world_size, port):
            with ddpkit.distributed(environment=ddpkit.from_spawn(rank, world_size, master_port=port)) as rt:
                ...
    """
    return DistEnv(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        master_addr=master_addr,
        master_port=master_port,
        launcher="spawn",
    )


def is_slurm_task(environ: Mapping[str, str]) -> bool:
    """True inside ``srun -n N`` with N > 1: each task is already one rank, so launch no more."""
    return bool(environ.get("SLURM_PROCID")) and _int(environ, "SLURM_NTASKS", 1) > 1


TORCHRUN_WORKER = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent in its workers: a rank, not a node
PET_NODE_LEVEL = ("PET_NNODES", "PET_NPROC_PER_NODE")  # torchrun's flags as variables, as Kubeflow's pods get them


def is_node_of_a_job(environ: Mapping[str, str]) -> bool:
    """True where torchrun's node-level ``PET_`` variables say this process is a node to launch ranks on, not a rank:
    a Kubeflow pod (whose ``RANK``/``WORLD_SIZE``, where set, are the node's), not one of torchrun's own workers.
    What such a node is to do: ``ddpkit.core.platforms``."""
    return any(name in environ for name in PET_NODE_LEVEL) and TORCHRUN_WORKER not in environ


def is_launched(environ: Mapping[str, str]) -> bool:
    """True when some launcher has already made this process one rank of a group. Not in a Kubeflow pod whose
    torchrun ``PET_`` variables make it a node to launch ranks on (``is_node_of_a_job``): the ``RANK`` and
    ``WORLD_SIZE`` a PyTorchJob also sets there are the node's index and the job's size."""
    if is_node_of_a_job(environ):
        return False
    return ("RANK" in environ and "WORLD_SIZE" in environ) or is_mpi_task(environ) or is_slurm_task(environ)


def detect(environ: Mapping[str, str], argv: Sequence[str] = ()) -> DistEnv:
    """Read the environment of whichever launcher started this process: torchrun first, then mpirun, then
    Slurm (an mpirun inside a Slurm allocation inherits the allocation's SLURM_* variables, which describe
    the batch script, not this rank). In a Kubeflow pod that is a node, not a rank (``is_node_of_a_job``), one
    process."""
    if "RANK" in environ and "WORLD_SIZE" in environ and not is_node_of_a_job(environ):
        return from_torchrun(environ, argv)
    if is_mpi_task(environ):
        return from_mpi(environ)
    if is_slurm_task(environ):
        return from_slurm(environ)
    local_rank = local_rank_from_argv(argv)
    if local_rank is not None:
        raise ValueError(
            f"--local-rank={local_rank} was passed but RANK and WORLD_SIZE are not set; "
            "start the script with `ddpkit run` or torchrun"
        )
    return DistEnv(master_addr=environ.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR, master_port=_port(environ))
