"""The script's models, found as it calls them (``ddpkit run --unchanged``), through PyTorch's global module hooks
(``register_module_forward_pre_hook`` and ``register_module_forward_hook``).

A module called from the script's own code (not from inside another module's forward), in training mode with
gradients on, that has parameters to train, is a model: at that first call, on every rank alike, it becomes a DDP
replica in place (``strategies.in_place``): its parameters and buffers rank 0's, its gradients all-reduced during
backward, weighted by this rank's share of the batch. A loss module (no parameters) is left alone.

Where no DataLoader splits the batches (the script cuts them by hand: nanoGPT's ``get_batch``; or a model trained on
a whole graph or data set at once), the model's first call runs whole on every rank (a hook cannot reach that call's
inputs), from the shared random streams: the same gradient as one device's, at N times the work. What it returns
decides the rest:

- its loss (a tensor of one element, as nanoGPT's model returns): the batches are split where they enter the model,
  as DataParallel scatters them, each positional tensor argument cut along its first dimension; the loss it returns
  is valued as the whole batch's (its gradient stays the share's), so that the script prints one process's number;
- no loss (the script computes it outside, from targets that no one split): every call stays whole on every rank,
  exact and no faster, said once. A batch cut at the model would meet its targets whole, and a graph's rows are no
  batch to cut.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules import module as module_hooks
from torch.utils import _pytree as pytree

from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger
from ddpkit.data.split_batches import Share, rows_of_share, share_of, share_sizes
from ddpkit.strategies import distributed_already
from ddpkit.strategies.in_place import Added, added_since, hooks_and_keys, keep_plain, replicate_in_place
from ddpkit.unchanged import layouts
from ddpkit.unchanged.batches import Batch
from ddpkit.unchanged.divided import KEYWORDS_SEEN, Call, Evaluations
from ddpkit.unchanged.gathered import ScaleGradient, gathered
from ddpkit.unchanged.optimizers import not_elementwise, steps_each_element
from ddpkit.unchanged.randomness import Streams

NOT_SPLIT = ("--unchanged: this model's batches come from no DataLoader; it returned its loss at its first call, so "
             "they are split where they enter it, but it returns none now, and a loss computed outside it would meet "
             "targets that were not split: return the loss from every call, or give the script a DataLoader over a "
             "map-style data set, or run it without --unchanged")


class Models:
    """The global hooks, the models they found, and what each root call of one does."""

    def __init__(self, *, rank: int, world_size: int, batch: Batch, streams: Streams,
                 witness: Callable[..., None], shard: str = "never", optimizers=None,
                 wait_for_rank_0: Callable[[], None] = lambda: None, stand_aside: Callable[[], None] = lambda: None):
        self.rank = rank
        self.stand_aside = stand_aside  # takes out every hook of --unchanged's, these included
        self.wait_for_rank_0 = wait_for_rank_0  # a barrier: after a library's save, which rank 0 alone writes
        self.shard = shard  # ``layouts.SHARDING``: where each model's training state lives
        self.optimizers = optimizers  # ``optimizers.Optimizers``, recorded where models may be sharded
        self.sharded: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.witness = witness  # told of each call of a model: in training or not (``Loaders.witness``)
        self.world_size = world_size
        self.batch = batch
        self.streams = streams
        self.found: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.passed: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # called at the top, not models (no parameters)
        self.depth = 0
        self.off = False
        self._calls: list[Call] = []  # the open root call
        self.whole: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models computed whole on every rank
        self.evaluations = Evaluations(rank=rank, world_size=world_size)

    def install(self) -> None:
        # torch warns a script that compiles a module that global hooks fire once more around the compiled module:
        # they are these, and they act at the outer call alone (``depth``).
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        self._handles = [module_hooks.register_module_forward_pre_hook(self.before)]
        if KEYWORDS_SEEN:
            self._handles.append(module_hooks.register_module_forward_hook(self.after, always_call=True,
                                                                           with_kwargs=True))
        else:
            self._handles.append(module_hooks.register_module_forward_hook(
                lambda module, args, output: self.after(module, args, {}, output), always_call=True))

    def uninstall(self) -> None:
        self.off = True
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def before(self, module: nn.Module, args: tuple):
        self.depth += 1
        if self.depth != 1 or self.off:
            return None
        if not (module.training and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()):
            return self.evaluating(module, args)
        first = False
        if module not in self.found:
            if module in self.passed or not self.adopt(module):
                return None
            first = True
        self.witness(training=True)
        from_loader = self.batch.loader_passes > 0 and not self.batch.coupled
        # (One process: nothing to split. A model whose first call returned no loss: every call whole, below.)
        split = self.world_size > 1 and not from_loader and not first and module not in self.whole
        share, whole_args = None, args
        if split:
            args, share = self.split(args)
            self.streams.enter_forward()  # each rank's rows draw their own dropout, as rows of one batch do
        elif not from_loader:
            self.batch.set_whole()  # the same computation on every rank, from the shared streams: one device's
        self._calls.append(Call(module, whole_args, share=share,
                                learning=first and not self.batch.loader_passes and not self.batch.coupled))
        if module in self.sharded:
            if first:
                from ddpkit.strategies.fsdp import fsdp2

                # fully_shard's pre-forward hook (it gathers the root's parameters) was added during this call: run it.
                args, _ = fsdp2().fully_shard.state(module)._pre_forward(module, args, {})
            # What leaves through its inputs (to a model that made them: a GAN's generator) is unweighted again.
            factor = self.sharded_weight()
            return _scaled_gradients(args, 1.0 / factor if factor else 0.0)
        if first and self.world_size > 1:
            from torch.distributed._composable.replicate import replicate

            # replicate's own pre-forward hook was added during this call: run it for this call.
            replicate.state(module).forward_pre_hook(module, args, {})
        return args if split else None

    def evaluating(self, module: nn.Module, args: tuple):
        """A model called without training: its loader's pass learns it is an evaluation, and a whole batch is
        divided across the ranks where the model allows (``divided``)."""
        if module not in self.found and (module in self.passed or not _trainable(module)):
            return None
        self.witness(training=False)
        divided = self.evaluations.divide(module, args) if self.batch.loader_passes and self.batch.whole else None
        self._calls.append(Call(module, args, evaluating=True, share=None if divided is None else divided[1]))
        return None if divided is None else divided[0]

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output):
        self.depth -= 1
        if self.depth != 0 or not self._calls or self._calls[-1].module is not module:
            return None
        call = self._calls.pop()
        if call.evaluating:
            return self.evaluations.finish(call, kwargs, output)
        share = call.share
        split = share is not None
        if split:
            self.streams.leave_forward()
        elif call.learning and self.world_size > 1 and not _returns_a_loss(output):
            self.computed_whole(module)
        scale = self.batch.output_scale()
        if module in self.sharded:
            scale *= self.sharded_weight()
        if call.items_counted and _returns_a_loss(output):
            weight = self.batch.current_weight()  # (a sum's part: its gradient counts whole, DDP weighs it by share)
            output, split = self.whole_batch_losses(output, summed=True, scale=1.0 / weight if weight else 0.0), True
        elif split and self.batch.coupled:
            output = gathered(output, sizes=share_sizes(share.samples, world_size=self.world_size), rank=self.rank,
                              rows=len(share.indices), with_gradients=True)
        elif split:
            output = self.whole_batch_losses(output)
        if scale == 1.0:
            return output if split else None
        return _scaled_gradients(output, scale)

    def sharded_weight(self) -> float:
        """What the gradient of a sharded model's call is multiplied by, inside it: FSDP averages the ranks'
        gradients (the sum over N), so each rank's counts its batch's weight times N. (A replica's weight is applied
        as DDP reduces its gradients: ``in_place.weighted_all_reduce``; FSDP has no such hook on every torch.) The
        gradient leaving the call through its inputs is divided by it again (``before``)."""
        return self.world_size * self.batch.current_weight()

    def computed_whole(self, module: nn.Module) -> None:
        """``module``'s inputs come from no split DataLoader and its first call returned no loss (the script computes
        it outside, from targets that were not split): every rank computes each of its calls whole, from the shared
        streams, as one device would. Exact, and no faster: said once."""
        self.whole.add(module)
        if self.rank == 0:
            logger.warning(f"--unchanged: {_class_name(module)} gets inputs that no DataLoader split (a batch cut by "
                           "hand, a whole graph or data set) and its loss is computed outside it: every process "
                           "computes each of its steps whole, as one device does (exact, and no faster). A DataLoader "
                           "over a map-style data set would split its batches")

    def whole_batch_losses(self, output, *, summed: bool | None = None, scale: float = 1.0):
        """``output`` of a model that got this rank's share of a batch, its losses (tensors of one element that
        require grad) valued as the whole batch's: what the script prints is then one process's number. Their
        gradient stays this rank's own (times ``scale``). ``summed``: each rank's loss is a part of a sum (else
        the batch's reduction says). A model that returns no loss is refused (its loss would meet targets that were
        not split)."""
        leaves, spec = pytree.tree_flatten(output)
        losses = [index for index, leaf in enumerate(leaves) if _is_a_loss(leaf)]
        if not losses:
            raise UsageError(NOT_SPLIT, said_elsewhere=self.rank != 0)  # every rank meets it: rank 0 says it
        weight = 1.0 if (self.batch.summed if summed is None else summed) else self.batch.weight
        values = torch.stack([leaves[index].detach().reshape(()).to(torch.float64) * weight for index in losses])
        dist.all_reduce(values)
        for index, value in zip(losses, values):
            leaf = leaves[index] if scale == 1.0 else ScaleGradient.apply(leaves[index], scale)
            leaves[index] = leaf + (value.to(leaf.dtype).reshape(leaf.shape) - leaf).detach()
        return pytree.tree_unflatten(leaves, spec)

    def items_of_the_batch(self, module: nn.Module, args: tuple, kwargs: dict):
        """A model's pre-hook: a split batch's count of items given to its call (``num_items_in_batch``, as
        transformers' models take it), counted by the script from its share, becomes the whole batch's (summed over
        the ranks), so that the loss it returns is its share's part of one device's sum (``after``)."""
        items = kwargs.get("num_items_in_batch")
        call = self._calls[-1] if self._calls else None
        if (items is None or call is None or call.module is not module or call.evaluating or self.batch.whole
                or self.batch.coupled or self.batch.summed):
            return None
        device = items.device if isinstance(items, torch.Tensor) else next(module.parameters()).device
        total = torch.as_tensor(items, dtype=torch.float64, device=device) * float(self.batch.current_weight() > 0)
        dist.all_reduce(total)
        call.items_counted = True
        items = total.to(items.dtype) if isinstance(items, torch.Tensor) else type(items)(total.item())
        return args, {**kwargs, "num_items_in_batch": items}

    def adopt(self, module: nn.Module) -> bool:
        """Make ``module`` a replica, if it is a model; False for one that is not (nothing to train, or the script's
        own DDP or FSDP, which stands aside)."""
        if not _trainable(module):
            self.passed.add(module)
            return False
        owned = {id(parameter) for model in self.found for parameter in model.parameters()}
        if any(id(parameter) in owned for parameter in module.parameters()):
            self.passed.add(module)  # a part of a model found already, called on its own: that model's replica
            return False
        if any(distributed_already(part) for part in module.modules()):
            if self.rank == 0:
                logger.warning("--unchanged stood aside: the script wraps its model in DDP or FSDP itself, and runs as "
                               "under ddpkit run (its loaders, files, saves and losses its own from here on)")
            self.stand_aside()
            return False
        layout = self.layout(module) if self.world_size > 1 else "replica"
        if layout != "replica":
            from ddpkit.strategies.sharded_in_place import shard_in_place

            moved = shard_in_place(module, reshard_after_forward=layout == "full", weight=self.batch.current_weight,
                                   whole=self.batch.is_whole)
            self.optimizers.repoint(moved, _class_name(module))
            self.sharded.add(module)
        elif self.world_size > 1:  # one process has nothing to average: its models run as they are
            replicate_in_place(module, weight=self.batch.current_weight, whole=self.batch.is_whole)
        if self.world_size > 1:
            saved_then_read(module, self.wait_for_rank_0)
            before = hooks_and_keys(module)
            module.register_forward_pre_hook(self.items_of_the_batch, with_kwargs=True)
            keep_plain(module, added_since(before, hooks_and_keys(module)))
        self.found.add(module)
        logger.debug(f"--unchanged: {_class_name(module)} is a model; its gradients are averaged over the ranks")
        return True

    def layout(self, module: nn.Module) -> str:
        """Where ``module``'s training state lives (``layouts``), said in one line where it is sharded or ``auto``
        weighed it. Every rank decides alike: ``auto`` reads the least free memory of any rank."""
        name = _class_name(module)
        if self.shard == "never":
            return "replica"
        stepped_by = self.optimizers.holding(module.parameters())
        odd = next((optimizer for optimizer in stepped_by if not steps_each_element(optimizer)), None)
        if self.shard == "always":
            if odd is not None:
                raise UsageError(not_elementwise(odd, name), said_elsewhere=self.rank != 0)
            layout, why = "full", "--shard always"
        else:
            memory = layouts.device_memory(next(module.parameters()).device)
            if memory is None:
                return "replica"  # the CPU: ``auto`` keeps the replica
            free, total = layouts.least_of_all_ranks(memory, next(module.parameters()).device)
            estimate = layouts.estimate(module.parameters(), stepped_by)
            layout, why = layouts.choose(estimate, world_size=self.world_size, free=free, total=total)
            why = f"--shard auto: {why}"
            if layout != "replica" and odd is not None:
                layout, why = "replica", (f"{why}; but {type(odd).__name__} steps it, and over a shard its step would "
                                          "not be one device's: it may run out of memory")
        if self.rank == 0:
            logger.info(f"--unchanged: {name} {layouts.SAID[layout].format(n=self.world_size)} ({why})")
        return layout

    def split(self, args: tuple) -> tuple[tuple, Share]:
        """This rank's share of the batch in ``args``: each tensor argument cut along its first dimension. (With a
        loss that couples the batch, each rank's gradient then weighs 1, or 0 for a stand-in: ``gathered``.)"""
        sizes = {arg.shape[0] for arg in args if isinstance(arg, torch.Tensor) and arg.dim() > 0}
        if len(sizes) != 1:
            raise UsageError(NOT_SPLIT if not sizes else
                             f"--unchanged: the model's tensor arguments do not share a batch size (first dimensions "
                             f"{sorted(sizes)}), so they cannot be split across the processes: give the script a "
                             "DataLoader, or run it without --unchanged", said_elsewhere=self.rank != 0)
        share = share_of(range(sizes.pop()), self.rank, self.world_size)
        self.batch.set(float(share.weight > 0) if self.batch.coupled else share.weight)
        return rows_of_share(args, share), share


def saved_then_read(module: nn.Module, wait_for_rank_0: Callable[[], None]) -> None:
    """A model with a ``save_pretrained`` method (transformers, diffusers, PEFT, the Hub's mixin): the libraries
    write on rank 0 alone where a process group is up, and the script may read the folder back next
    (``from_pretrained``), as one device does: every rank waits there until rank 0 has written. (An attribute of the
    script's model object, left out of its copies: ``in_place.keep_plain``.)"""
    method = getattr(module, "save_pretrained", None)
    if not callable(method) or "save_pretrained" in vars(module):
        return

    @functools.wraps(method)
    def save_pretrained(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:
            wait_for_rank_0()

    object.__setattr__(module, "save_pretrained", save_pretrained)
    keep_plain(module, Added(keys=frozenset({"save_pretrained"})))


def _scaled_gradients(tree, scale: float):
    """``tree``'s tensors that require grad, their gradient multiplied by ``scale`` in backward."""
    if scale == 1.0:
        return tree
    return pytree.tree_map_only(torch.Tensor, lambda t: ScaleGradient.apply(t, scale) if t.requires_grad else t, tree)


def _trainable(module: nn.Module) -> bool:
    return any(parameter.requires_grad for parameter in module.parameters())


def _is_a_loss(leaf) -> bool:
    """A loss among a model's outputs: a tensor of one element that requires grad (nanoGPT's model returns one)."""
    return isinstance(leaf, torch.Tensor) and leaf.numel() == 1 and leaf.requires_grad


def _returns_a_loss(output) -> bool:
    return any(_is_a_loss(leaf) for leaf in pytree.tree_leaves(output))


def _class_name(module: nn.Module) -> str:
    """The script's name for ``module``'s class (not ``replicate``'s subclass of it, ``DDPNet``)."""
    return next(kind.__name__ for kind in type(module).__mro__
                if not kind.__module__.startswith(("torch.distributed", "ddpkit.")))
