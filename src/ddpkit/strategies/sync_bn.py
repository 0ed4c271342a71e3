"""Synchronised BatchNorm: batch statistics over the *global* batch, on GPU and on CPU.

With plain BatchNorm under DDP each process normalises with the mean and variance of its own
per-process batch, so 2 processes x batch 32 do not train like 1 process x batch 64. SyncBatchNorm
all-reduces the statistics. PyTorch's ``nn.SyncBatchNorm`` refuses CPU tensors, so on CPU (gloo)
ddpkit swaps in ``CPUSyncBatchNorm``, which all-reduces the per-channel sums with
``torch.distributed.nn.functional.all_reduce`` (differentiable: the backward pass all-reduces too).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn

from ddpkit.core.process_group import Runtime


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Differentiable sum over ranks (its backward all-reduces the gradient)."""
    with warnings.catch_warnings():
        # Deprecated in favour of a private module; this public one is still the autograd-aware all-reduce.
        warnings.simplefilter("ignore", FutureWarning)
        return dist_fn.all_reduce(tensor)


class _WeightedSum(torch.autograd.Function):
    """The sum over ranks of ``tensor``; backward, the sum over ranks of each rank's gradient times its ``weight``,
    divided by this rank's weight (which its gradient's all-reduce multiplies back: ``strategies.in_place``). The
    ranks' statistics then receive the gradient of the weighted sum of their losses, as on one process."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad * ctx.weight
        dist.all_reduce(total)
        return (total / ctx.weight if ctx.weight else torch.zeros_like(total)), None


class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the union of every rank's batch; works with any backend, gloo included."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(input)
        return synced_batch_norm(self, input)


def synced_batch_norm(bn: nn.modules.batchnorm._BatchNorm, input: torch.Tensor,
                      weight: float | None = None) -> torch.Tensor:
    """``bn`` (any BatchNorm layer, in training) applied with the statistics of every rank's batch together; its
    running statistics updated with them, as one process's BatchNorm would over the whole batch.

    ``weight``: this rank's share of the loss when the ranks' shares differ (``ddpkit run --unchanged``; None: equal
    shares, as under DDP). The gradients that reach the statistics are then summed weighted, and a rank of weight 0
    (a stand-in sample, ``ddpkit.data.split_batches``) adds nothing to the statistics.
    """
    reduce = _all_reduce if weight is None else (lambda tensor: _WeightedSum.apply(tensor, weight))
    counted = 1.0 if weight is None or weight > 0 else 0.0
    # Statistics in float32 at least, even under bf16/fp16 autocast: low precision cannot even count the samples.
    out_dtype = input.dtype
    input = input.to(torch.promote_types(input.dtype, torch.float32))
    channels = input.size(1)
    dims = [0, *range(2, input.dim())]
    shape = [1, channels] + [1] * (input.dim() - 2)
    local_count = input.numel() // channels
    # Two passes, as single-process BatchNorm does: the global mean first, then the sum of squared
    # deviations from it. (E[x^2] - E[x]^2 in one pass loses digits when the mean dwarfs the spread.)
    sums = reduce(torch.cat([input.sum(dims), input.new_full((1,), float(local_count))]) * counted)
    count = sums[-1]
    mean = sums[:channels] / count
    centered = input - mean.view(shape)
    var = reduce((centered * centered).sum(dims) * counted) / count
    if bn.track_running_stats:
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            momentum = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
            unbiased = var * count / (count - 1).clamp(min=1)
            bn.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            bn.running_var.mul_(1 - momentum).add_(unbiased.detach(), alpha=momentum)
    out = centered * torch.rsqrt(var.view(shape) + bn.eps)
    if bn.affine:
        out = out * bn.weight.view(shape) + bn.bias.view(shape)
    return out.to(out_dtype)


def _to_cpu_sync(module: nn.Module) -> nn.Module:
    converted = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, CPUSyncBatchNorm):
        converted = CPUSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        converted.load_state_dict(module.state_dict())
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, _to_cpu_sync(child))
    return converted


def convert_sync_batchnorm(model: nn.Module, runtime: Runtime) -> nn.Module:
    """Replace every BatchNorm layer with a synchronised one for this runtime's device."""
    if runtime.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _to_cpu_sync(model)

