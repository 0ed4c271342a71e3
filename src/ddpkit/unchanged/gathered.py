"""A model's outputs, computed by each rank on its share of a batch, gathered into the whole batch's on every rank
(``ddpkit run --unchanged``): DataParallel's gather, across processes. The ranks' shares are
``data.split_batches.share_of``'s (their sizes: ``share_sizes``).

A tensor whose first dimension is the share's is batch-shaped: its shares are put back together in rank order (a
tuple, a list, a dict or a dataclass of tensors, at any depth, likewise). With ``with_gradients``, the backward of a
gathered tensor keeps this rank's own rows of the gradient, without communicating: every rank computes the same loss
from the same whole outputs, so the gradient of its rows is the whole batch's, and DDP's all-reduce sums the ranks'
(each weighs 1). A tensor output that is not batch-shaped (a temperature, a returned scalar) is the same on every
rank: its gradient, the whole loss's on each rank, counts 1/N of it, so that the sum is one device's. One that differs
across the ranks (a loss the model computed from its share) cannot be made whole, and is refused in one line, but for
the losses that a split keeps, made the batch's before (``kept``: ``at_the_model.check_both_ways``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ddpkit.core.errors import UsageError


def map_tensors(value, function):
    """``value`` with ``function`` applied to each tensor in it: through tuples (named ones too), lists, dicts and
    dataclass instances, at any depth; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(item, function) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(item, function) for item in value)
    if isinstance(value, dict):
        return type(value)((key, map_tensors(item, function)) for key, item in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{field.name: map_tensors(getattr(value, field.name), function)
                                             for field in dataclasses.fields(value) if field.init})
    return value


def batch_shaped(value, rows: int) -> bool:
    """Whether every tensor in ``value`` has ``rows`` rows (its first dimension), and there is one at least."""
    found = []

    def look(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor.dim() > 0 and tensor.size(0) == rows)
        return tensor

    map_tensors(value, look)
    return bool(found) and all(found)


def gathered(output, *, sizes: list[int], rank: int, rows: int, with_gradients: bool, kept=()):
    """``output`` of this rank's share (``rows`` rows: its size in ``sizes``, or 1 for a stand-in that counts 0), its
    batch-shaped tensors gathered into the whole batch's on every rank (see the module). ``kept``: its tensors that are
    the batch's already (losses a split keeps, made the batch's: ``at_the_model.check_both_ways``), left as they are."""
    world_size = len(sizes)

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        if any(tensor is other for other in kept):
            return tensor
        if tensor.dim() > 0 and tensor.size(0) == rows:
            return Gather.apply(tensor, sizes, rank) if with_gradients else _gather(tensor, sizes)
        if with_gradients and tensor.requires_grad:
            shared.append(tensor)
            return ScaleGradient.apply(tensor, 1.0 / world_size)
        return tensor

    shared: list[torch.Tensor] = []
    output = map_tensors(output, gather)
    if shared and not the_same_on_every_rank(shared):
        raise UsageError("--loss-reduction coupled: the model returns a tensor that is not one row per sample and "
                         f"differs across the processes (shape {list(shared[0].shape)}: a loss computed inside the "
                         "model from its share of the batch?). Compute the loss outside the model, from its gathered "
                         "outputs, or use --loss-reduction mean or sum", said_elsewhere=rank != 0)
    return output


def the_same_on_every_rank(tensors: list[torch.Tensor], group=None) -> bool:
    """Whether each of ``tensors`` holds the same values on every rank of ``group`` (the default one where None: one
    all-reduce of their largest and smallest values; large ones are not compared, and taken to be the same)."""
    small = [tensor.detach().reshape(-1).double() for tensor in tensors if tensor.numel() <= 65536]
    if not small:
        return True
    values = torch.cat(small)
    extremes = torch.cat([values, -values])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(extremes[:values.numel()], -extremes[values.numel():]))


def _gather(tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The ranks' ``tensor``s, ``sizes[r]`` rows of rank r's, one after the other (all_gather wants equal shapes:
    each is padded to the largest share first)."""
    largest = max(sizes)
    padded = tensor.detach()
    if padded.size(0) < largest:
        padded = torch.cat([padded, padded.new_zeros((largest - padded.size(0), *padded.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])


class Gather(torch.autograd.Function):
    """``_gather`` forward; backward, this rank's own rows of the gradient (nothing sent)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
        ctx.start, ctx.size, ctx.rows = sum(sizes[:rank]), sizes[rank], tensor.size(0)
        ctx.set_materialize_grads(False)  # (an output the loss did not use stays without a gradient, as on one device)
        return _gather(tensor, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None, None
        if ctx.size == 0:  # a stand-in: its row is in no one's batch
            return grad.new_zeros((ctx.rows, *grad.shape[1:])), None, None
        return grad[ctx.start:ctx.start + ctx.size], None, None


class ScaleGradient(torch.autograd.Function):
    """The identity forward; its gradient times ``scale`` backward. (Its output shares the tensor's storage and version
    but is no view of it: FSDP warns of views among a sharded model's outputs, which in-place ops could cut off.)"""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.set_materialize_grads(False)  # (no gradient stays none: an output that the loss did not use)
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        return None if grad is None else grad * ctx.scale, None
