"""Which modules are the script's models, and what each becomes at its first training call (``ddpkit run --unchanged``):
a DDP replica (``strategies.in_place.Replica``), or sharded in place where ``--shard`` says (``layouts``,
``strategies.sharded_in_place``), its optimizers re-pointed (``optimizers``). A module with nothing to train, a part
of a model found already, and the script's own DDP or FSDP (then --unchanged stands aside) are not models.

Each model object also gets what one device's script may need of it on N processes: its ``save_pretrained`` ends
when rank 0 has written (``saved_then_read``), and a ``num_items_in_batch`` given to its call is the whole batch's
(a pre-hook of its own, ``at_the_model.AtTheModel.keywords_and_items``). Both are the object's, left out of its
copies (``in_place.keep_plain``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger
from ddpkit.strategies import distributed_already
from ddpkit.strategies.in_place import Added, Replica, added_since, hooks_and_keys, keep_plain, sparse_layers
from ddpkit.unchanged import layouts
from ddpkit.unchanged.batches import Batch
from ddpkit.unchanged.optimizers import not_elementwise, steps_each_element


class Adoption:
    """The models found, and how each was made distributed."""

    def __init__(self, *, rank: int, world_size: int, batch: Batch, shard: str = "never", optimizers=None,
                 wait_for_rank_0: Callable[[], None] = lambda: None, stand_aside: Callable[[], None] = lambda: None,
                 items_hook: Callable | None = None, find_unused: bool = False):
        self.rank = rank
        self.world_size = world_size
        self.batch = batch
        self.shard = shard  # ``layouts.SHARDING``: where each model's training state lives
        self.optimizers = optimizers  # ``optimizers.Optimizers``, recorded where models may be sharded
        self.wait_for_rank_0 = wait_for_rank_0  # a barrier: after a library's save, which rank 0 alone writes
        self.stand_aside = stand_aside  # takes out every hook of --unchanged's
        self.items_hook = items_hook  # each model's pre-hook: keyword tensors cut, a count of items given to its call
        self.found: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.passed: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # called at the top, not models (no parameters)
        self.sharded: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.sharded_before: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # sharded before their first call
        self.replicas: weakref.WeakKeyDictionary[nn.Module, Replica] = weakref.WeakKeyDictionary()
        self.find_unused = find_unused  # DDP looks for unused parameters at every step (``Replica``)

    def adopt(self, module: nn.Module) -> bool:
        """Make ``module`` a replica, if it is a model; False for one that is not (nothing to train, or the script's
        own DDP or FSDP, which stands aside)."""
        if not is_trainable(module) or isinstance(module, parametrize.ParametrizationList):
            # (Nothing to train; or torch's own part of a parametrized layer, which torch calls as it registers a
            # parametrization, spectral_norm's or weight_norm's: a part of the model that holds the layer.)
            self.passed.add(module)
            return False
        if isinstance(module, torch.jit.ScriptModule):
            self.passed.add(module)
            if self.world_size > 1 and self.rank == 0:
                logger.warning(f"--unchanged: {getattr(module, 'original_name', class_name(module))} is a TorchScript "
                               "module (torch.jit.script or trace), which takes no hooks of a module's own: it is left "
                               "as it is, and every process computes each of its steps whole, as one device does "
                               "(exact, and no faster)")
            return False
        if self.part_of_a_model(module):
            self.passed.add(module)  # a part of a model found already, called on its own: that model's replica
            return False
        if self.world_size > 1 and self.shard != "never" and _sharded_ahead(module):
            # Sharded before its first call: on its way to the device (``move``), or as a copy of a model (an EMA's).
            self.sharded.add(module)
            self.sharded_before.add(module)
        elif any(distributed_already(part) for part in module.modules()):
            if self.rank == 0:
                logger.warning("--unchanged stood aside: the script wraps its model in DDP or FSDP itself, and runs as "
                               "under ddpkit run (its loaders, files, saves and losses its own from here on)")
            self.stand_aside()
            return False
        elif self.world_size > 1 and (layout := self.layout(module)) != "replica":
            from ddpkit.strategies.sharded_in_place import copies_of, shard_in_place

            moved = shard_in_place(module, reshard_after_forward=layout == "full", weight=self.batch.current_weight,
                                   whole=self.batch.is_whole)
            moved.update(copies_of(module, not_these=self.found))  # (an EMA's copy, taken before: sharded alike)
            self.optimizers.repoint(moved, class_name(module))
            self.sharded.add(module)
        elif self.world_size > 1:  # one process has nothing to average: its models run as they are
            self.replicas[module] = Replica(module, weight=self.batch.current_weight, whole=self.batch.is_whole,
                                            find_unused=self.find_unused)
        if self.world_size > 1:
            saved_then_read(module, self.wait_for_rank_0)
            if self.items_hook is not None:
                before = hooks_and_keys(module)
                module.register_forward_pre_hook(self.items_hook, with_kwargs=True)
                keep_plain(module, added_since(before, hooks_and_keys(module)))
        self.found.add(module)
        logger.debug(f"--unchanged: {class_name(module)} is a model; its gradients are averaged over the ranks")
        return True

    def part_of_a_model(self, module: nn.Module) -> bool:
        """Whether ``module`` holds a parameter of a model found already (it is a part of one)."""
        owned = {id(parameter) for model in self.found for parameter in model.parameters()}
        return any(id(parameter) in owned for parameter in module.parameters())

    def move(self, module: nn.Module, device: torch.device) -> bool:
        """The script moves ``module`` to ``device`` (``model.to(device)``, ``model.cuda()``): where it is a model
        that ``--shard`` shards there (``always``, or ``auto`` where a replica would not fit, its parameters counted
        as arriving), it is sharded on the way (``sharded_in_place.shard_on_the_way``), so that the device receives
        its shards alone, and its first call finds it sharded. False where it moves as it is: on one process, to
        the CPU, a module with nothing to train, one not whole on the CPU, a model found already or a part of one,
        one sharded or distributed already, or one that ``auto`` keeps as a replica."""
        from ddpkit.strategies.fsdp import is_fsdp2

        if (self.world_size == 1 or self.shard == "never" or device.type != "cuda" or module in self.found
                or module in self.passed or not is_trainable(module) or _sharded_ahead(module)
                or type(module).__name__ == "OptimizedModule"  # (torch.compile's wrapper: sharded at its first call)
                or any(parameter.device.type != "cpu" for parameter in module.parameters())
                or any(is_fsdp2(part) or distributed_already(part) for part in module.modules())):
            return False
        if self.part_of_a_model(module):
            return False
        layout = self.layout(module, arriving=device)
        if layout == "replica":
            return False
        from ddpkit.strategies.sharded_in_place import copies_of, shard_on_the_way

        moved = shard_on_the_way(module, device, reshard_after_forward=layout == "full",
                                 weight=self.batch.current_weight, whole=self.batch.is_whole)
        moved.update(copies_of(module, not_these=self.found))
        self.optimizers.repoint(moved, class_name(module))
        return True

    def layout(self, module: nn.Module, arriving: torch.device | None = None) -> str:
        """Where ``module``'s training state lives (``layouts``), said in one line where it is sharded or ``auto``
        weighed it; ``arriving``: the device the script is moving it to, its parameters not there yet. Every rank
        decides alike: ``auto`` reads the least free memory of any rank."""
        name = class_name(module)
        if self.shard == "never":
            return "replica"
        stepped_by = self.optimizers.holding(module.parameters())
        odd = next((optimizer for optimizer in stepped_by if not steps_each_element(optimizer)), None)
        sparse = next(iter(sparse_layers(module)), None)
        renormed = next((layer for layer in module.modules() if isinstance(layer, (nn.Embedding, nn.EmbeddingBag))
                         and layer.max_norm is not None), None)  # (its forward writes its weight, in place)
        device = arriving or next(module.parameters()).device
        if self.shard == "always":
            if odd is not None:
                raise UsageError(not_elementwise(odd, name), said_elsewhere=self.rank != 0)
            if sparse is not None:
                raise UsageError(f"--unchanged --shard: {name} holds an {type(sparse).__name__} with sparse=True, "
                                 "and a shard's gradients are dense: run with --shard never (each process a whole "
                                 "replica)", said_elsewhere=self.rank != 0)
            if renormed is not None:
                raise UsageError(f"--unchanged --shard: {name} holds an {type(renormed).__name__} with max_norm, whose "
                                 "forward writes its weight in place, and a shard does not keep what is written into "
                                 "the weights it gathers: run with --shard never (each process a whole replica, "
                                 "exact)", said_elsewhere=self.rank != 0)
            layout, why = "full", "--shard always"
        else:
            memory = layouts.device_memory(device)
            if memory is None:
                return "replica"  # the CPU: ``auto`` keeps the replica
            free, total = layouts.least_of_all_ranks(memory, device)
            estimate = layouts.estimate(module.parameters(), stepped_by, arriving=arriving is not None)
            layout, why = layouts.choose(estimate, world_size=self.world_size, free=free, total=total)
            why = f"--shard auto: {why}"
            if layout != "replica" and sparse is not None:
                layout, why = "replica", (f"{why}; but its {type(sparse).__name__} has sparse gradients, which a "
                                          "shard cannot hold: it may run out of memory")
            elif layout != "replica" and renormed is not None:
                layout, why = "replica", (f"{why}; but its {type(renormed).__name__} writes its weight in its forward "
                                          "(max_norm), which a shard would not keep: it may run out of memory")
            elif layout != "replica" and odd is not None:
                layout, why = "replica", (f"{why}; but {type(odd).__name__} steps it, and over a shard its step would "
                                          "not be one device's: it may run out of memory")
        if arriving is not None:
            if layout == "replica":
                return layout  # (said at its first call, which weighs it again)
            why = f"{why}; on its way to {arriving}"
        if self.rank == 0:
            logger.info(f"--unchanged: {name} {layouts.SAID[layout].format(n=self.world_size)} ({why})")
        return layout


def _sharded_ahead(module: nn.Module) -> bool:
    """Whether ddpkit sharded ``module`` before its first call (on its way to the device, or as a model's copy)."""
    import sys

    sharded = sys.modules.get("ddpkit.strategies.sharded_in_place")
    return sharded is not None and sharded.sharded_ahead(module)


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


def is_trainable(module: nn.Module) -> bool:
    return any(parameter.requires_grad for parameter in module.parameters())


def class_name(module: nn.Module) -> str:
    """The script's name for ``module``'s class (not a class of torch.distributed's or ddpkit's put on it)."""
    return next(kind.__name__ for kind in type(module).__mro__
                if not kind.__module__.startswith(("torch.distributed", "ddpkit.")))
