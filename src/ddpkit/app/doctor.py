"""``ddpkit doctor``: what this machine (and, under a launcher, the whole job) can do, and what is in the way.

    $ ddpkit doctor                         # versions, backends, GPUs, variables, leftovers of earlier runs
    $ ddpkit doctor --json -                # the same as JSON on stdout
    $ ddpkit doctor --nproc-per-node 2      # plus a connectivity check across 2 processes

The connectivity check runs on every rank: it reaches the master (the process group comes up), all-reduces
a known tensor and compares with the known sum, and measures the latency of a small all-reduce and the bus
bandwidth of a large one; each rank reports the network interface it used to reach the master.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import time

import torch

from ddpkit.launch import nccl, processes
from ddpkit.core.network import GLOO_VARIABLE, interface_for, loopback_name_warning

DEFAULT_PORT = 29500

# The variables the tutorials tune, and the ones that decide which network is used. One line each.
VARIABLES = {
    "NCCL_DEBUG": "NCCL's log level (WARN, INFO, TRACE); INFO shows the rings, transports and interfaces chosen",
    "NCCL_SOCKET_IFNAME": "network interface(s) NCCL uses for its sockets, e.g. eth0 or ^docker,lo to exclude",
    "GLOO_SOCKET_IFNAME": "network interface gloo binds to; set it when a node has several and the default is wrong",
    "NCCL_P2P_DISABLE": "1 turns off direct GPU-to-GPU copies (NVLink/PCIe P2P); a workaround for broken P2P, slower",
    "NCCL_P2P_LEVEL": "how far apart two GPUs may be for P2P (LOC, NVL, PIX, PXB, PHB, SYS)",
    "NCCL_SOCKET_NTHREADS": "CPU threads per network connection for the socket transport (1-16)",
    "NCCL_BUFFSIZE": "bytes of buffer per channel between two GPUs (default 4 MiB)",
    "NCCL_MIN_NCHANNELS": "at least this many channels (parallel rings/trees) per collective",
    "NCCL_MAX_NCHANNELS": "at most this many channels per collective",
    "NCCL_CHECKS_DISABLE": "1 skips argument checks on each collective (older NCCL; slightly faster, less safe)",
    "NCCL_CHECK_POINTERS": "1 checks that buffers are valid CUDA pointers on every call (debugging, slower)",
    "NCCL_NET_GDR_LEVEL": "how close a NIC and a GPU must be for GPUDirect RDMA (LOC, PIX, PXB, PHB, SYS)",
    "NCCL_IGNORE_CPU_AFFINITY": "1 lets NCCL ignore the job's CPU affinity and pick cores near the GPU itself",
    "NCCL_ALGO": "force the collective algorithm (Ring, Tree, CollnetDirect, NVLS, ...)",
    "NCCL_VERSION": "set by NVIDIA's container images to the NCCL they install; NCCL does not read it, and PyTorch "
                    "uses the NCCL it was built with (the NCCL on the first line)",
    "NCCL_IB_HCA": "which InfiniBand adapters (and ports) NCCL may use, e.g. mlx5_0:1",
    "NCCL_IB_DISABLE": "1 turns InfiniBand off: NCCL falls back to sockets",
    "NCCL_ASYNC_ERROR_HANDLING": "older name of TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "what the NCCL watchdog does on a timeout or error (3: tear down and abort)",
    "TORCH_NCCL_BLOCKING_WAIT": "1 makes NCCL collectives block the calling thread and honour the timeout there",
    "TORCH_DISTRIBUTED_DEBUG": "OFF, INFO or DETAIL: extra checks, e.g. DETAIL names parameters that got no gradient",
    "TORCH_CPP_LOG_LEVEL": "log level of PyTorch's C++ side (INFO shows c10d's messages)",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "entries kept by NCCL's flight recorder (0: off); dumped on a timeout",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1: workers get their own store, not the rendezvous one (ddpkit sets it)",
    "MASTER_ADDR": "address of the process that hosts the rendezvous store (rank 0's node)",
    "MASTER_PORT": "its TCP port",
    "OMP_NUM_THREADS": "CPU threads per process for intra-op work (ddpkit: cores / processes by default)",
    "CUDA_VISIBLE_DEVICES": "which GPUs this process may see, renumbered from 0",
    "TORCHELASTIC_RESTART_COUNT": "how many times torchrun's agent has restarted this group (ddpkit train resumes when > 0)",
    "TORCHELASTIC_MAX_RESTARTS": "how many restarts the agent allows (--max-restarts)",
    "TORCHELASTIC_RUN_ID": "the rendezvous id shared by every node of the job",
    "TORCHELASTIC_USE_AGENT_STORE": "True: the workers use the agent's TCP store instead of rank 0 hosting one",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "signals the agent catches and passes on to the workers",
    "TORCHELASTIC_ERROR_FILE": "where a failing worker writes its error for the agent to report",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "seconds the agent gives workers to exit after a signal before SIGKILL (30)",
}
PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCHELASTIC_", "TORCH_ELASTIC_")


def variables(environ: dict[str, str] | None = None) -> list[dict[str, str]]:
    """Every distributed-related variable that is set, with what it does (or a note that ddpkit does not know it);
    the values of secrets hidden (``nccl.shown``)."""
    environ = dict(os.environ if environ is None else environ)
    names = sorted(name for name in environ if name in VARIABLES or name.startswith(PREFIXES))
    return [{"name": name, "value": nccl.shown(name, environ[name]),
             "meaning": VARIABLES.get(name, "not one ddpkit knows; see the NCCL / PyTorch documentation")}
            for name in names]


def launched_by(environ: dict[str, str] | None = None) -> dict | None:
    """Which launcher made this process a rank and what ddpkit read from it (None when none did): torchrun, Slurm,
    MPI, or a Ray worker (Ray Train's TorchTrainer, or a rank ``--launcher ray`` started from one)."""
    from ddpkit.core import env as env_mod

    environ = dict(os.environ if environ is None else environ)
    try:
        if not env_mod.is_launched(environ):
            return None
        found = env_mod.detect(environ)
    except ValueError as error:
        return {"launcher": "unreadable", "error": str(error)}
    read = {"launcher": found.launcher, "rank": found.rank, "world_size": found.world_size,
            "local_rank": found.local_rank, "local_world_size": found.local_world_size, "node_rank": found.node_rank,
            "master": f"{found.master_addr}:{found.master_port}", "restart_count": found.restart_count}
    if found.launcher == "ray":
        read["ray"] = {name: environ[name] for name in ("RAY_RAYLET_PID", "RAY_JOB_ID", "RAY_NODE_ID")
                       if name in environ}
    return read


def launched_line(read: dict) -> str:
    """``launched_by``'s finding in one line."""
    if read["launcher"] == "unreadable":
        return f"started by a launcher whose variables ddpkit cannot read: {read['error']}"
    where = read["launcher"]
    if where == "ray":
        where = "a Ray worker (Ray Train; " + ", ".join(f"{name}={value}" for name, value in read["ray"].items()) + ")"
    restarted = f", restart {read['restart_count']}" if read["restart_count"] else ""
    return (f"started by {where}: rank {read['rank']} of {read['world_size']}, local rank {read['local_rank']} of "
            f"{read['local_world_size']}, node {read['node_rank']}, master {read['master']}{restarted}")


def platform_of(environ: dict[str, str] | None = None, fqdn: str | None = None) -> dict | None:
    """The platform that started this machine as a node of a job (``ddpkit.core.platforms``) and what ddpkit makes of
    its variables, or why it cannot read them; a Kubernetes pod with torchrun's own names (an older PyTorchJob: one
    rank per pod, ``launched_by``) says so too. None elsewhere."""
    from ddpkit.core import platforms

    environ = dict(os.environ if environ is None else environ)
    indexed = platforms.INDEX in environ
    if indexed and fqdn is None:
        fqdn = socket.getfqdn()
    try:
        # An Indexed Job's pod does not say how many pods there are (--nnodes does): read it as one of index + 1.
        nodes = max(2, int(environ[platforms.INDEX]) + 1) if environ.get(platforms.INDEX, "").isdigit() else 2
        shape = platforms.read_platform(environ, nnodes=nodes, fqdn=fqdn or "")
    except platforms.PlatformError as error:
        return {"platform": "unreadable", "error": str(error)}
    if shape is not None:
        return {"platform": shape.platform, "line": shape.line(), "read": shape.read, "nnodes": shape.nnodes,
                "node_rank": shape.node_rank, "master": shape.master_addr, "master_port": shape.master_port,
                "nproc_per_node": shape.nproc_per_node, "rdzv_endpoint": shape.rdzv_endpoint}
    if platforms.is_kubernetes_pod(environ) and "RANK" in environ and "WORLD_SIZE" in environ:
        read = {name: environ[name] for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if name in environ}
        said = ", ".join(f"{name}={value}" for name, value in read.items())
        return {"platform": "Kubernetes pod", "read": read,
                "line": f"Kubernetes pod with torchrun's variables (a PyTorchJob's: one rank per pod; {said})"}
    return None


def platform_line(found: dict) -> str:
    """``platform_of``'s finding in one line."""
    if found["platform"] == "unreadable":
        return f"platform: its variables cannot be read: {found['error']}"
    return f"platform: {found['line']}"


def gpus() -> list[dict]:
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append({"index": index, "name": props.name, "memory_bytes": int(props.total_memory),
                      "capability": f"{props.major}.{props.minor}"})
    return found


def machine_report(port: int | None = None) -> dict:
    import torch.distributed as dist

    port = port or int(os.environ.get("MASTER_PORT", DEFAULT_PORT))
    cuda = torch.cuda.is_available()
    report = {
        "versions": {
            "torch": str(torch.__version__), "python": platform.python_version(), "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else None,
        },
        "backends": {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()},
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpus": gpus(),
        "topology": processes.tool_output(["nvidia-smi", "topo", "-m"]) if cuda else None,
        "variables": variables(),
        "port": port,
        "port_holders": processes.port_holders(port),
        "gpu_processes": processes.gpu_processes() if cuda else [],
        "host_name": None if os.environ.get(GLOO_VARIABLE) else loopback_name_warning(),
        "launched_by": launched_by(),
        "platform": platform_of(),
    }
    return report


def connectivity(runtime, *, small_repeats: int = 20, big_bytes: int = 8 << 20, big_repeats: int = 5) -> dict:
    """On every rank: a known all-reduce, its latency and bandwidth, and the interface to the master."""
    import torch.distributed as dist

    from ddpkit.core.process_group import synchronize

    device = runtime.device
    world = runtime.world_size
    known = torch.full((4,), float(runtime.rank + 1), device=device)
    dist.all_reduce(known)
    expected = world * (world + 1) / 2
    correct = bool(torch.all(known == expected).item())

    small = torch.ones(1, device=device)
    latencies = []
    for _ in range(small_repeats):
        started = time.perf_counter()
        dist.all_reduce(small)
        synchronize(device)
        latencies.append(time.perf_counter() - started)
    big = torch.ones(big_bytes // 4, device=device)
    durations = []
    for _ in range(big_repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(big)
        synchronize(device)
        durations.append(time.perf_counter() - started)
    from ddpkit.app.projection import ring_allreduce_bytes

    mine = {
        "rank": runtime.rank, "host": socket.gethostname(), "pid": os.getpid(), "device": str(device),
        "allreduce_correct": correct, "latency_us": statistics.median(latencies) * 1e6,
        "bus_bandwidth_gbps": ring_allreduce_bytes(world, big_bytes) / statistics.median(durations) * 8 / 1e9,
        **interface_for(runtime.env.master_addr),
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return {"world_size": world, "backend": runtime.backend, "master": f"{runtime.env.master_addr}:{runtime.env.master_port}",
            "expected_sum": expected, "ranks": everyone, "ok": all(r["allreduce_correct"] for r in everyone)}


def format_report(report: dict) -> str:
    v = report["versions"]
    lines = [f"torch {v['torch']}, python {v['python']}, CUDA {v['cuda'] or '-'}, cuDNN {v['cudnn'] or '-'}, "
             f"NCCL {v['nccl'] or '-'}",
             *([launched_line(report["launched_by"])] if report.get("launched_by") else []),
             *([platform_line(report["platform"])] if report.get("platform") else []),
             "backends: " + ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in report["backends"].items()),
             f"CPU cores usable: {report['cpu_cores']}"]
    if report["gpus"]:
        for gpu in report["gpus"]:
            lines.append(f"GPU {gpu['index']}: {gpu['name']}, {gpu['memory_bytes'] / 2**30:.1f} GiB, sm {gpu['capability']}")
    else:
        lines.append("GPUs: none visible (ddpkit trains on CPU with gloo)")
    if report["topology"]:
        lines += ["topology (nvidia-smi topo -m):", report["topology"]]
    if report["variables"]:
        lines.append("variables in effect:")
        lines += [f"  {row['name']}={row['value']}: {row['meaning']}" for row in report["variables"]]
    else:
        lines.append("variables in effect: none of NCCL_*, GLOO_*, TORCH_* (distributed), MASTER_*")
    if report["port"] is None:
        pass  # under a launcher: the job's own store holds the master port
    elif report["port_holders"]:
        lines += [processes.port_holder_line(report["port"], holder) for holder in report["port_holders"]]
    else:
        lines.append(f"port {report['port']}: free")
    lines += [processes.gpu_holder_line(app) for app in report["gpu_processes"]]
    if report.get("host_name"):
        lines.append(report["host_name"])
    check = report.get("connectivity")
    if check:
        lines.append(f"connectivity: {check['world_size']} ranks over {check['backend']}, master {check['master']}: "
                     + ("all-reduce correct on every rank" if check["ok"] else "WRONG all-reduce result on some rank"))
        for rank in check["ranks"]:
            lines.append(f"  rank {rank['rank']} on {rank['host']} ({rank['device']}): latency {rank['latency_us']:.0f} us, "
                         f"bus bandwidth {rank['bus_bandwidth_gbps']:.2f} Gb/s, via {rank.get('interface') or '?'} "
                         f"({rank.get('address') or '?'})" + ("" if rank["allreduce_correct"] else "  <- wrong sum"))
    return "\n".join(lines)
