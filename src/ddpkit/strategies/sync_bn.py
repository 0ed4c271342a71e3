"""Synchronised BatchNorm: batch statistics over the *global* batch, on GPU and on CPU.

With plain BatchNorm under DDP each process normalises with the mean and variance of its own
per-process batch, so 2 processes x batch 32 do not train like 1 process x batch 64. SyncBatchNorm
all-reduces the statistics. PyTorch's ``nn.SyncBatchNorm`` refuses CPU tensors, so on CPU (gloo)
ddpkit swaps in ``CPUSyncBatchNorm``, whose ``synced_batch_norm`` all-reduces each layer's per-channel sums once
forward and once backward, in about the time of PyTorch's own BatchNorm on the CPU (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.core.process_group import Runtime


class OverAllRanks:
    """Mixed in before a BatchNorm class: in training on several ranks, the statistics of every rank's batch together
    (``synced_batch_norm``); ``share``, where set, gives this rank's share of the loss (None: equal shares), and
    ``whole``, where set, whether every rank holds the whole batch now (its own statistics are then the batch's)."""

    share: Callable[[], float] | None = None
    whole: Callable[[], bool] | None = None
    scaled: bool = False  # the gradient reaching it is scaled by N times its share already (a sharded model's)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return forward_over_all_ranks(self, input)


def forward_over_all_ranks(bn: nn.modules.batchnorm._BatchNorm, input: torch.Tensor) -> torch.Tensor:
    """``bn``'s forward (a BatchNorm layer with ``OverAllRanks``' attributes, as a mixin or its own): over every rank's
    batch in training on several ranks, else its class's own."""
    if bn.training and dist.is_initialized() and dist.get_world_size() > 1 and not (bn.whole and bn.whole()):
        bn._check_input_dim(input)
        return synced_batch_norm(bn, input, weight=None if bn.share is None else bn.share(), scaled=bn.scaled)
    if isinstance(bn, OverAllRanks):
        return super(OverAllRanks, bn).forward(input)
    return type(bn).forward(bn, input)


class CPUSyncBatchNorm(OverAllRanks, nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the union of every rank's batch; works with any backend, gloo included."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


_groups: dict = {}  # the default group -> a group of the same ranks for BatchNorm's statistics


def _statistics_group():
    """A process group of its own for the statistics, made at the first synchronised layer (every rank reaches it
    together): on the default group, a layer's all-reduce in backward would wait behind DDP's gradient buckets, which
    go out on it meanwhile, and the backward pass would stall until they are through."""
    default = dist.group.WORLD
    if default not in _groups:
        _groups.clear()  # a group from an earlier default group (one torn down) is gone with it
        _groups[default] = dist.new_group(backend=dist.get_backend())
    return _groups[default]


def synced_batch_norm(bn: nn.modules.batchnorm._BatchNorm, input: torch.Tensor,
                      weight: float | None = None, scaled: bool = False) -> torch.Tensor:
    """``bn`` (any BatchNorm layer, in training) applied with the statistics of every rank's batch together; its
    running statistics updated with them, as one process's BatchNorm would over the whole batch.

    ``weight``: this rank's share of the loss when the ranks' shares differ (``ddpkit run --unchanged``; None: equal
    shares, as under DDP). The gradients that reach the statistics are then summed weighted, and a rank of weight 0
    (a stand-in sample, ``ddpkit.data.split_batches``) adds nothing to the statistics. ``scaled``: the gradient that
    reaches the layer is this rank's share's times N times its weight already (a sharded model's outputs, whose
    gradients FSDP averages: ``ddpkit.unchanged.models``), so the ranks' sums add up as they are.
    """
    return _OverRanks.apply(input, bn.weight if bn.affine else None, bn.bias if bn.affine else None, bn, weight,
                            scaled)


SQUARED_AT_ONCE = 1 << 20  # elements a part, on the CPU (4 MiB in float32)


class _OverRanks(torch.autograd.Function):
    """BatchNorm over all ranks' batches: one all-reduce of the sums and centred sums of squares forward, the rows
    then normalised in place of their centred copy; backward, the per-channel sums of the gradient (PyTorch's own
    BatchNorm backward gives them, as the weight's and bias's gradients) all-reduced once, then the input's gradient
    in two passes."""

    @staticmethod
    def forward(ctx, input, weight, bias, bn, share, scaled):
        ctx.in_dtype, ctx.share, ctx.scaled, ctx.eps = input.dtype, share, scaled, bn.eps
        # Statistics in float32 at least, even under bf16/fp16 autocast: low precision cannot even count the samples.
        x = input.to(torch.promote_types(input.dtype, torch.float32))
        channels, dims = x.size(1), [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        counted = 1.0 if share is None or share > 0 else 0.0
        # Two passes over this rank's rows, as PyTorch's own BatchNorm makes on the CPU: its mean, then the squares of
        # the rows centred on it (in a tensor that then becomes the output). Sums of squares of the raw values,
        # accumulated in float64 (an earlier version), cost three times as long on the CPU, for less precision where
        # the mean dwarfs the spread. The ranks' counts, sums and centred sums of squares are then put together in
        # float64, in one all-reduce: sum of squares about the whole batch's mean = M2 + n * mean^2 summed, less
        # count * mean^2, where each rank's own term holds the precision of its centred sum.
        rows = x.numel() // channels
        local_mean = x.sum(dims) / max(rows, 1)
        centred = x - local_mean.view(shape)
        # On the CPU, a few rows at a time: a product of the whole tensor is a fresh allocation as large as it, whose
        # pages the kernel maps in one by one (eight times the time here), and each part's sum in float64 keeps the
        # digits that one float32 sum over the whole batch loses. On a GPU, one sum.
        squares = torch.zeros(channels, dtype=torch.float64, device=x.device)
        rows_at_once = len(x) if x.device.type != "cpu" else SQUARED_AT_ONCE // max(x.numel() // max(len(x), 1), 1)
        for part in centred.split(max(rows_at_once, 1)):
            squares += (part * part).sum(dims).to(torch.float64)
        local_mean64 = local_mean.to(torch.float64)
        sums = torch.cat([local_mean64 * rows, squares + rows * local_mean64 * local_mean64,
                          torch.full((1,), float(rows), dtype=torch.float64, device=x.device)])
        sums = sums * counted
        dist.all_reduce(sums, group=_statistics_group())
        count = sums[-1].item()
        if count <= 1:  # (one value a channel over the whole batch: torch's BatchNorm refuses it, as on one device,
            if bn.track_running_stats:  # having counted the batch first)
                bn.num_batches_tracked.add_(1)
            raise ValueError("Expected more than 1 value per channel when training, got input size "
                             f"{torch.Size([1, *x.shape[1:]])}")
        mean = sums[:channels] / count
        var = (sums[channels:2 * channels] / count - mean * mean).clamp(min=0)
        if bn.track_running_stats:
            with torch.no_grad():
                bn.num_batches_tracked.add_(1)
                momentum = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
                bn.running_mean.mul_(1 - momentum).add_(mean.to(bn.running_mean.dtype), alpha=momentum)
                unbiased = var * count / max(count - 1, 1)
                bn.running_var.mul_(1 - momentum).add_(unbiased.to(bn.running_var.dtype), alpha=momentum)
        invstd = torch.rsqrt(var + bn.eps)
        # (x - mean) * invstd * weight + bias, as (x - local mean) * scale + offset, in place on the centred rows.
        scale = invstd if weight is None else invstd * weight.to(torch.float64)
        offset = (local_mean64 - mean) * scale + (0.0 if bias is None else bias.to(torch.float64))
        output = centred.mul_(scale.to(x.dtype).view(shape)).add_(offset.to(x.dtype).view(shape))
        mean, invstd = mean.to(x.dtype), invstd.to(x.dtype)
        ctx.count = count
        ctx.save_for_backward(x, weight, mean, invstd)
        return output.to(input.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, invstd = ctx.saved_tensors
        grad = grad.to(x.dtype)
        # This rank's sum of grad * normalised input and sum of grad, per channel: the weight's and bias's gradients.
        _, sum_g_xhat, sum_g = torch.ops.aten.native_batch_norm_backward(
            grad, x, weight, None, None, mean, invstd, True, ctx.eps, [False, True, True])
        sums = torch.cat([sum_g, sum_g_xhat]).to(torch.float64)
        # Each rank's gradient counts its share of the loss (DDP's all-reduce multiplies it back in): sum the ranks'
        # weighted, divide by this rank's weight. A stand-in (weight 0) takes part with zeros.
        share = 1.0 if ctx.share is None else ctx.share
        if ctx.scaled:  # every rank's gradient is in the same units already (N times its share's weight)
            dist.all_reduce(sums, group=_statistics_group())
            sums = sums if share else torch.zeros_like(sums)
        else:
            sums = sums * share
            dist.all_reduce(sums, group=_statistics_group())
            sums = sums / share if share else torch.zeros_like(sums)
        channels = x.size(1)
        shape = [1, channels] + [1] * (x.dim() - 2)
        scale = invstd if weight is None else weight.to(x.dtype) * invstd
        mean_g = (sums[:channels] / ctx.count).to(x.dtype)
        mean_g_xhat = (sums[channels:] / ctx.count).to(x.dtype)
        # grad_input = scale * (grad - mean_g - xhat * mean_g_xhat), with xhat = (x - mean) * invstd, in two passes.
        slope = scale * invstd * mean_g_xhat
        offset = scale * mean_g - slope * mean
        grad_input = torch.addcmul(-offset.view(shape), grad, scale.view(shape))
        grad_input.addcmul_(x, slope.view(shape), value=-1)
        return (grad_input.to(ctx.in_dtype), sum_g_xhat if ctx.needs_input_grad[1] else None,
                sum_g if ctx.needs_input_grad[2] else None, None, None, None)


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

