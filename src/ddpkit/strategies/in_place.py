"""DDP on a model object that the script keeps holding (``ddpkit run --unchanged``): PyTorch's composable
``replicate``, whose hooks run DDP's reducer (bucketed all-reduces that overlap the backward pass) on the module
itself. No wrapper: the script's ``model`` is still its own object, its ``state_dict()`` keys are unchanged, and
``isinstance(model, ItsClass)`` holds (``replicate`` gives it a subclass of its class, in place).

    >>> replicate_in_place(model, weight=lambda: 0.5)         # doctest: +SKIP

What differs from DDP's own averaging is the weight: rank r's gradient counts ``weight()`` (its share of the
batch, ``ddpkit.data.split_batches``), not 1 / world size, so that an uneven batch gives the gradient of the whole
batch. The weights of a batch sum to 1 over the ranks; a gradient accumulated over several backward passes therefore
keeps what earlier passes left in ``.grad`` (the same on every rank) as it is.

BatchNorm layers in training normalise over every rank's batch together (``sync_bn.OverAllRanks``), their
class also swapped for a subclass in place, so the module's structure and keys stay as they were.
"""


from collections.abc import Callable  # (no postponed annotations: DDP reads the hook's)

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate import replicate

from ddpkit.strategies.sync_bn import OverAllRanks

Weight = Callable[[], float]


def replicate_in_place(module: nn.Module, *, weight: Weight) -> None:
    """Make ``module`` (on every rank, at the same point of the script) a DDP replica of rank 0's, whose gradients
    are summed over the ranks, rank r's weighted by ``weight()``. Its buffers are rank 0's from here on too."""
    with torch.no_grad():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)  # the parameters DDP broadcasts itself, when it starts
    batch_norm_over_all_ranks(module, weight)
    # No device_ids: DDP then leaves the inputs where the script put them, as the module alone would.
    replicate(module)
    module.register_comm_hook(weight, weighted_all_reduce)


def weighted_all_reduce(weight: Weight, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the sum over ranks of each rank's gradients times its ``weight()``."""
    buffer = bucket.buffer()
    buffer.mul_(weight())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda done: done.value()[0])


_synced_classes: dict[type, type] = {}


def batch_norm_over_all_ranks(module: nn.Module, weight: Weight) -> None:
    """Every BatchNorm layer of ``module`` normalises over all ranks' batches in training, in place."""
    for layer in module.modules():
        kind = type(layer)
        if not isinstance(layer, nn.modules.batchnorm._BatchNorm):
            continue
        if not issubclass(kind, OverAllRanks):
            if kind not in _synced_classes:
                _synced_classes[kind] = type(kind.__name__, (OverAllRanks, kind), {"__module__": kind.__module__})
            layer.__class__ = _synced_classes[kind]
        layer.share = weight
