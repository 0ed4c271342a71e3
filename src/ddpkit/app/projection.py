"""Projected DDP efficiency for machines we do not have, from a measured step time and link bandwidth.

    >>> ring_allreduce_bytes(4, 100e6)          # each rank sends (and receives) 2(N-1)/N of the data
    150000000.0
    >>> round(projected_efficiency(compute_s=0.3, allreduce_s=0.25, overlap=0.6), 3)
    0.811

The model. A DDP step is the forward and backward of one device (``compute_s``, measured) plus the
gradient all-reduce. Ring all-reduce moves 2(N-1)/N x the gradient bytes over each link in 2(N-1) hops,
so it takes ``2(N-1) * latency + 2(N-1)/N * bytes / bandwidth``. DDP starts all-reducing buckets while
the backward pass still runs, so up to ``overlap x compute_s`` of the all-reduce is hidden (the
backward is about two thirds of a step: 0.6 is a fair default). What is not hidden is added to the
step. Efficiency is ``compute_s / step``: the share of a perfectly linear speed-up.

This is a projection, never a measurement: it ignores contention for PCIe and host memory, NCCL's tree
algorithms and the last bucket that cannot overlap; ``ddpkit bench`` prints it apart from what it measured.
"""

from __future__ import annotations

import dataclasses

DEFAULT_OVERLAP = 0.6
DEFAULT_LATENCY_S = 5e-6  # per hop, a NIC/NVLink order of magnitude


def ring_allreduce_bytes(world_size: int, grad_bytes: float) -> float:
    """Bytes each rank sends in a ring all-reduce of ``grad_bytes``."""
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    return 2.0 * (world_size - 1) / world_size * grad_bytes


def allreduce_seconds(world_size: int, grad_bytes: float, bandwidth_bytes_per_s: float,
                      latency_s: float = DEFAULT_LATENCY_S) -> float:
    """Time of one ring all-reduce over links of ``bandwidth_bytes_per_s``."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
    if world_size == 1:
        return 0.0
    return 2 * (world_size - 1) * latency_s + ring_allreduce_bytes(world_size, grad_bytes) / bandwidth_bytes_per_s


def projected_step_seconds(compute_s: float, allreduce_s: float, overlap: float = DEFAULT_OVERLAP) -> float:
    """Compute, plus the part of the all-reduce the backward pass does not hide."""
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    return compute_s + max(0.0, allreduce_s - overlap * compute_s)


def projected_efficiency(compute_s: float, allreduce_s: float, overlap: float = DEFAULT_OVERLAP) -> float:
    return compute_s / projected_step_seconds(compute_s, allreduce_s, overlap)


@dataclasses.dataclass(frozen=True)
class Projection:
    world_size: int
    link: str  # what the bandwidth describes, e.g. "measured gloo" or "100 Gb/s"
    bandwidth_gbps: float  # gigabits per second
    compute_s: float
    allreduce_s: float
    step_s: float
    efficiency: float
    images_per_sec: float  # the whole job's, at this efficiency


def project(*, world_sizes: list[int], compute_s: float, grad_bytes: float, global_batch_per_device: int,
            links: dict[str, float], overlap: float = DEFAULT_OVERLAP,
            latency_s: float = DEFAULT_LATENCY_S) -> list[Projection]:
    """One projection per (world size, link); ``links`` maps a label to bytes per second."""
    rows = []
    for label, bandwidth in links.items():
        for world in world_sizes:
            allreduce = allreduce_seconds(world, grad_bytes, bandwidth, latency_s)
            step = projected_step_seconds(compute_s, allreduce, overlap)
            rows.append(Projection(
                world_size=world, link=label, bandwidth_gbps=bandwidth * 8 / 1e9, compute_s=compute_s,
                allreduce_s=allreduce, step_s=step, efficiency=compute_s / step,
                images_per_sec=world * global_batch_per_device / step,
            ))
    return rows
