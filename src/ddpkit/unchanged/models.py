"""The script's models, found as it calls them (``ddpkit run --unchanged``), through PyTorch's global module hooks
(``register_module_forward_pre_hook`` and ``register_module_forward_hook``).

A module called from the script's own code (not from inside another module's forward), in training mode with
gradients on, that has parameters to train, is a model: at that first call, on every rank alike, it becomes a DDP
replica in place (``strategies.in_place``): its parameters and buffers rank 0's, its gradients all-reduced during
backward, weighted by this rank's share of the batch. A loss module (no parameters) is left alone.

Where no DataLoader splits the batches (the script cuts them by hand: nanoGPT's ``get_batch``), they are split where
they enter the model, as DataParallel scatters them: each positional tensor argument cut along its first dimension.
The model must then return its loss (a tensor of one element): computed outside from the model's outputs, a loss
would meet targets that were not split, and that is refused in one line. The loss it returns is valued as the whole
batch's (its gradient stays the share's), so that the script prints one process's number. The first such call runs on
the whole batch on every rank (a hook cannot reach that call's inputs), which gives the same gradient, once, at N
times the work.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules import module as module_hooks
from torch.utils import _pytree as pytree

from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger
from ddpkit.data.split_batches import share_of
from ddpkit.strategies.fsdp import is_fsdp2
from ddpkit.strategies.in_place import replicate_in_place
from ddpkit.unchanged.batches import Batch
from ddpkit.unchanged.randomness import Streams

NOT_SPLIT = ("--unchanged: this script feeds its model batches that no DataLoader split (cut by hand, or from an "
             "IterableDataset or a loader without a batch size) and computes its loss outside the model, where its "
             "targets are not split: give it a DataLoader over a map-style data set, or return the loss from the "
             "model's forward (as nanoGPT does), or run it without --unchanged")


class _ScaleGradient(torch.autograd.Function):
    """The identity forward; its gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class Models:
    """The global hooks, the models they found, and what each root call of one does."""

    def __init__(self, *, rank: int, world_size: int, batch: Batch, streams: Streams):
        self.rank = rank
        self.world_size = world_size
        self.batch = batch
        self.streams = streams
        self.found: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.passed: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # called at the top, not models (no parameters)
        self.depth = 0
        self.off = False
        self._calls: list[tuple[nn.Module, bool]] = []  # the open root call: its module, split here or not

    def install(self) -> None:
        module_hooks.register_module_forward_pre_hook(self.before)
        module_hooks.register_module_forward_hook(self.after, always_call=True)

    def all_evaluating(self) -> bool:
        """Whether every model found so far is in eval mode (a loader's pass then reads whole batches)."""
        models = list(self.found)
        return bool(models) and not any(model.training for model in models)

    def before(self, module: nn.Module, args: tuple):
        self.depth += 1
        if self.depth != 1 or self.off or not (module.training and torch.is_grad_enabled()):
            return None
        first = False
        if module not in self.found:
            if module in self.passed or not self.adopt(module):
                return None
            first = True
        from_loader = self.batch.loader_passes > 0
        split = self.world_size > 1 and not from_loader and not first  # (one process: nothing to split)
        if split:
            args = self.split(args)
        elif not from_loader:
            self.batch.set_whole()
        self.streams.enter_forward()
        self._calls.append((module, split))
        if first and self.world_size > 1:
            from torch.distributed._composable.replicate import replicate

            # replicate's own pre-forward hook was added during this call: run it for this call.
            replicate.state(module).forward_pre_hook(module, args, {})
        return args if split else None

    def after(self, module: nn.Module, args: tuple, output):
        self.depth -= 1
        if self.depth != 0 or not self._calls or self._calls[-1][0] is not module:
            return None
        _, split = self._calls.pop()
        self.streams.leave_forward()
        if split:
            output = self.whole_batch_losses(output)
        scale = self.batch.output_scale()
        if scale == 1.0:
            return output if split else None
        return pytree.tree_map_only(torch.Tensor, lambda t: _ScaleGradient.apply(t, scale) if t.requires_grad else t,
                                    output)

    def whole_batch_losses(self, output):
        """``output`` of a model that got this rank's share of a batch, its losses (tensors of one element that
        require grad) valued as the whole batch's: what the script prints is then one process's number. Their
        gradient stays this rank's own. A model that returns no loss is refused (its loss would meet targets that
        were not split)."""
        leaves, spec = pytree.tree_flatten(output)
        losses = [index for index, leaf in enumerate(leaves)
                  if isinstance(leaf, torch.Tensor) and leaf.numel() == 1 and leaf.requires_grad]
        if not losses:
            raise UsageError(NOT_SPLIT, said_elsewhere=self.rank != 0)  # every rank meets it: rank 0 says it
        weight = 1.0 if self.batch.summed else self.batch.weight
        values = torch.stack([leaves[index].detach().reshape(()).float() * weight for index in losses])
        dist.all_reduce(values)
        for index, value in zip(losses, values):
            leaf = leaves[index]
            leaves[index] = leaf + (value.to(leaf.dtype).reshape(leaf.shape) - leaf).detach()
        return pytree.tree_unflatten(leaves, spec)

    def adopt(self, module: nn.Module) -> bool:
        """Make ``module`` a replica, if it is a model; False for one that is not (nothing to train, or the script's
        own DDP or FSDP, which stands aside)."""
        if not any(parameter.requires_grad for parameter in module.parameters()):
            self.passed.add(module)
            return False
        if any(_distributed_already(part) for part in module.modules()):
            self.off = True
            logger.warning("--unchanged stood aside: the script wraps its model in DDP or FSDP itself, and runs as "
                           "under ddpkit run")
            return False
        owned = {id(parameter) for model in self.found for parameter in model.parameters()}
        if any(id(parameter) in owned for parameter in module.parameters()):
            self.passed.add(module)  # a part of a model found already, called on its own: that model's replica
            return False
        if self.world_size > 1:  # one process has nothing to average: its models run as they are
            replicate_in_place(module, weight=self.batch.current_weight)
        self.found.add(module)
        logger.debug(f"--unchanged: {type(module).__name__} is a model; its gradients are averaged over the ranks")
        return True

    def split(self, args: tuple) -> tuple:
        """This rank's share of the batch in ``args``: each tensor argument cut along its first dimension."""
        sizes = {arg.shape[0] for arg in args if isinstance(arg, torch.Tensor) and arg.dim() > 0}
        if len(sizes) != 1:
            raise UsageError(NOT_SPLIT if not sizes else
                             f"--unchanged: the model's tensor arguments do not share a batch size (first dimensions "
                             f"{sorted(sizes)}), so they cannot be split across the processes: give the script a "
                             "DataLoader, or run it without --unchanged", said_elsewhere=self.rank != 0)
        share = share_of(range(sizes.pop()), self.rank, self.world_size)
        self.batch.set(share.weight)
        rows = slice(share.indices[0], share.indices[-1] + 1)
        return tuple(arg[rows] if isinstance(arg, torch.Tensor) and arg.dim() > 0 else arg for arg in args)


def _distributed_already(module: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return True
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel) or is_fsdp2(module)
