"""Data-parallel replicas that drift apart, caught: every rank compares an exact checksum of its weights.

Under DDP (and ZeRO) every rank applies the same averaged gradients with the same optimizer, so the replicas
stay bit-identical; nothing in PyTorch checks that they do. Code that changes one rank's weights outside
the optimizer step (an update under ``if rank == 0``, a weight loaded on one rank only, a faulty device)
leaves them different, and the job trains on, each rank its own model, while model.pt holds rank 0's.

The check: per parameter, the sum of its bits read as integers (exact, the same on every device and in
every order, changed by any change of any one element), all-gathered, compared. The ranks whose checksums
differ from the most ranks' (rank 0's side on a tie) are named, with the first parameter that differs.

    >>> import torch
    >>> weights = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.zeros(2)}
    >>> same = checksums(weights.items())
    >>> weights["fc.bias"][1] = 1e-30
    >>> differing(list(weights), [same, same, checksums(weights.items())])
    'rank 2 holds weights that differ from those of ranks 0, 1 (first in fc.bias; 1 of 2 parameters differ)'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from ddpkit.core.errors import UsageError

DEFAULT_EVERY = 1000  # optimizer steps between checks: ddpkit train's --check-replicas, Job(check_replicas=)

# Integer views of each element size: the bits of a float read as an integer, summed in int64 (which wraps
# exactly), so that any change of any one element changes the sum.
_AS_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicasDiffer(UsageError):
    """The data-parallel replicas no longer hold the same weights (one line; rank 0 says it)."""


def check_every(every: int | None) -> int:
    """``every`` (None: DEFAULT_EVERY), a whole number of steps, 0 for off."""
    if every is None:
        return DEFAULT_EVERY
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise UsageError(f"`check_replicas` must be 0 (off) or a number of optimizer steps, got {every!r}")
    return every


def checksums(named: Iterable[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """One int64 per tensor, on the tensors' device: the sum of its elements' bits read as integers."""
    sums = []
    for _, tensor in named:
        tensor = tensor.detach()
        as_integers = _AS_INTEGERS[tensor.element_size()]
        sums.append(tensor.view(as_integers).sum(dtype=torch.int64) if tensor.numel() else
                    torch.zeros((), dtype=torch.int64, device=tensor.device))
    return torch.stack(sums)


def differing(names: Sequence[str], rows: Sequence[torch.Tensor]) -> str | None:
    """What differs between the ranks' ``rows`` of checksums (one per rank, ``names`` their parameters), or
    None when all are equal."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, row in enumerate(rows):
        groups.setdefault(tuple(row.tolist()), []).append(rank)
    if len(groups) == 1:
        return None
    # The most ranks agree on the reference; on a tie, the side of rank 0, whose weights checkpoints save.
    reference_key = max(groups, key=lambda key: (len(groups[key]), 0 in groups[key]))
    reference = groups[reference_key]
    others = sorted(rank for key, ranks in groups.items() if key != reference_key for rank in ranks)
    wrong = [index for index in range(len(names))
             if any(rows[rank][index].item() != reference_key[index] for rank in others)]
    who = f"rank {others[0]} holds" if len(others) == 1 else f"ranks {', '.join(map(str, others))} hold"
    theirs = f"rank {reference[0]}" if len(reference) == 1 else f"ranks {', '.join(map(str, reference))}"
    return (f"{who} weights that differ from those of {theirs} (first in {names[wrong[0]]}; {len(wrong)} of "
            f"{len(names)} parameters differ)")


def check(named: Sequence[tuple[str, torch.Tensor]], runtime, *, step: int) -> None:
    """Compare this rank's weights with every other rank's (a collective: every rank calls it at the same
    step); raise ReplicasDiffer, on every rank, when they differ (rank 0 says it)."""
    world_size = runtime.world_size
    mine = checksums(named)
    rows = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(rows, mine)
    found = differing([name for name, _ in named], [row.cpu() for row in rows])
    if found is None:
        return
    two = " (of two, either may be the one that changed)" if world_size == 2 else ""
    raise ReplicasDiffer(
        f"the data-parallel replicas differ at step {step}: {found}{two}. Every rank should hold the same "
        "weights after each step; something changed one rank's outside the optimizer step (code that runs on "
        "some ranks only, a weight loaded on one rank, a faulty device). The job stops here; no checkpoint is "
        "written from this step on, the last one is kept. `check_replicas` sets how often this is checked",
        said_elsewhere=not runtime.is_main)
