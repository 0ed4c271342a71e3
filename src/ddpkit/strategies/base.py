"""What every strategy provides: the ``Strategy`` protocol, whose method bodies are the common answers.

A strategy is one small object (a frozen dataclass holding its own settings) that owns everything that
differs between ways of distributing a model: which settings fit which world, how the model (and, for
ZeRO, the optimizer) is wrapped, how gradient synchronisation is skipped on accumulation micro-steps,
which module evaluation runs, and how the whole model and optimizer state is gathered and loaded.
Code outside ``ddpkit.strategies`` asks the object; it never branches on a strategy's name or on a
wrapper's type.

Adding a strategy: one file in this folder with a frozen dataclass that subclasses ``Strategy`` and
overrides what differs from the defaults here, and one line in ``STRATEGIES`` in ``__init__.py``.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
import torch.nn as nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel

from ddpkit.core.process_group import Runtime


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a DataParallel / DistributedDataParallel wrapper (DDP's of one process too) or
    ``torch.compile``'s (or the model itself).

    Under FSDP the model is its own (sharded) self; under pipeline parallel, this rank's stage.
    """
    while True:
        if isinstance(model, (nn.DataParallel, DistributedDataParallel)) or getattr(model, "is_pipeline", False) \
                or getattr(model, "calls_module_directly", False):
            model = model.module
        elif is_compiled(model):
            model = model._orig_mod  # noqa: SLF001 - torch.compile's one way to the module it compiled
        else:
            return model


class BareStateDict:
    """For a wrapper that holds the user's model as ``self.module`` (DDP, DataParallel): its ``state_dict()`` is the
    bare model's, without the ``module.`` prefix, as a script that saves ``model.state_dict()`` expects (and loads
    before wrapping); ``load_state_dict`` takes either (a checkpoint saved from a plain DDP model has the prefix)."""

    def state_dict(self, *args, **kwargs):
        """The bare model's ``state_dict()``."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load into the bare model a state with its keys, or with every key prefixed ``module.``."""
        if state_dict and all(key.startswith(WRAPPED_PREFIX) for key in state_dict):
            bare = collections.OrderedDict(state_dict)
            if hasattr(state_dict, "_metadata"):
                bare._metadata = state_dict._metadata  # noqa: SLF001 - the versions a state_dict carries
            consume_prefix_in_state_dict_if_present(bare, WRAPPED_PREFIX)
            state_dict = bare
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


WRAPPED_PREFIX = "module."


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is ``torch.compile``'s wrapper (an OptimizedModule) around another module."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing can be compiled yet
    return dynamo is not None and isinstance(model, dynamo.OptimizedModule)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (a DDP or FSDP module, say), or ``model`` itself."""
    return model._orig_mod if is_compiled(model) else model  # noqa: SLF001


def is_shard(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one rank's shard of a larger one (FSDP's parameters are DTensors)."""
    return hasattr(tensor, "to_local")


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a shard's local tensor (a view of it), any other tensor itself."""
    return tensor.to_local() if is_shard(tensor) else tensor


def local_bytes(tensor: torch.Tensor) -> int:
    return local_shard(tensor).numel() * tensor.element_size()


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameters, their gradients (counted at the parameters' size whether allocated at this moment or not,
    so the number does not depend on when it is read) and the optimizer's tensors, as this rank holds them."""
    total = sum(local_bytes(p) * (2 if p.requires_grad else 1) for p in model.parameters())
    if optimizer is not None:
        total += sum(local_bytes(value) for per_parameter in optimizer.state.values()
                     for value in per_parameter.values() if isinstance(value, torch.Tensor))
    return total


class Strategy(Protocol):
    """What differs between ways of running a model on several processes (single, dp, ddp, zero, fsdp, pipeline,
    model-parallel): checking the run's settings, wrapping the model and optimizer, skipping gradient sync on
    accumulation steps, what to evaluate, saving and loading the whole state. One file per strategy in
    ``ddpkit/strategies/``, registered in ``STRATEGIES``; ``create(name, **settings)`` makes one."""

    name: ClassVar[str]
    # Every rank starts a process group, even a job of one process (DDP, FSDP and pipelines need one).
    needs_group: ClassVar[bool] = True
    # One process per node by nature (single, dp): a launcher's "auto" process count means 1.
    one_process: ClassVar[bool] = False
    # No process holds the whole model (FSDP, pipelines): full_model_state is a collective.
    shards_model: ClassVar[bool] = False
    # Evaluation forwards are collectives: every rank must run as many as the rank with the most batches.
    eval_lockstep: ClassVar[bool] = False
    # Every rank holds the whole model, the same weights after each step (ddp, zero): ``ddpkit.watch.replicas``
    # compares them. Not where ranks hold different parts (fsdp, pipelines) or there is one process.
    replicated: ClassVar[bool] = False
    # Whether checkpoints are sharded by default: every rank writes its own part and none gathers the whole (fsdp, zero).
    sharded_checkpoints: ClassVar[bool] = False
    # Whether it can write sharded checkpoints at all (torch.distributed.checkpoint's layout of its state).
    can_shard_checkpoints: ClassVar[bool] = True
    # Each rank keeps only its share of the optimizer state (zero, fsdp).
    shards_optimizer: ClassVar[bool] = False
    # The registered strategy that is this one with ZeRO's sharded optimizer (ddp's is "zero"), or None.
    with_zero: ClassVar[str | None] = None
    # Wrapping gives every rank rank 0's weights (DDP's constructor does): no broadcast needed before it.
    syncs_weights: ClassVar[bool] = False
    # Runs as one of `ddpkit run|train --replica-groups R`'s groups (data parallel across them through torchft).
    in_replica_groups: ClassVar[bool] = False

    def check(self, *, world_size: int, cuda_count: int, batch_size: int | None = None,
              build_model: Callable[[], nn.Module] | None = None) -> None:
        """Raise UsageError when this strategy cannot run on ``world_size`` processes (the numbers in it).

        ``batch_size``: per process; ``build_model``: makes the model, for strategies that must inspect it."""

    def check_training(self, *, accumulate: int, amp: str) -> None:
        """Raise UsageError for training settings this strategy cannot honour."""

    def devices_per_process(self, cuda_count: int) -> int:
        """How many devices one process drives (DataParallel: every visible GPU), so a step of ``batch_size`` per
        device takes ``batch_size * devices_per_process`` samples in each process."""
        return 1

    def data_part(self, rank: int, world_size: int) -> tuple[int, int]:
        """(index, count): the data is split ``count`` ways and this rank takes part ``index``."""
        return rank, world_size

    def wrap(self, model: nn.Module, runtime: Runtime, *, example: torch.Tensor | None = None) -> nn.Module:
        """The module to train. ``example``: one batch of inputs on the CPU (pipelines need its shape)."""
        ...

    def make_optimizer(self, optimizer_class: type, model: nn.Module, **settings) -> torch.optim.Optimizer:
        """``optimizer_class(model.parameters(), **settings)``, as this strategy needs it (ZeRO shards it)."""
        return optimizer_class(model.parameters(), **settings)

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                        names: dict[int, str]) -> torch.optim.Optimizer:
        """The script's own ``optimizer``, made before wrapping, driving the wrapped ``model``: itself when wrapping
        kept the parameters (the same tensors: single, dp, ddp), else pointed at the new ones by name (FSDP's
        sharded parameters). ``names``: the bare model's parameter names by ``id`` of each, before wrapping."""
        rebind_parameters(optimizer, unwrap(model), names)
        return optimizer

    def set_gradient_sync(self, model: nn.Module, enabled: bool, *, first_backward: bool) -> None:
        """Whether the next forward and backward reduce gradients (off on accumulation micro-steps).

        The default has nothing to skip: one process, or DataParallel, whose replicas meet in the backward."""

    def forward_backward(self, model: nn.Module, inputs, targets, loss_fn: Callable, backward: Callable,
                         autocast: Callable[[], Any]) -> torch.Tensor | None:
        """One micro-step: the loss (None where this rank computes none), with its gradients computed."""
        with autocast():
            loss = loss_fn(model(inputs), targets)
        backward(loss)
        return loss

    def mark_waits(self, model: nn.Module) -> None:
        """Hooks on the wrapped model that mark, for ``ddpkit.core.progress``, where this rank waits for the others
        inside its forward and backward. The default marks none: a wait counts in the phase it happens in."""

    def eval_module(self, model: nn.Module) -> nn.Module:
        """What runs the validation forwards. The default, the bare replica: ranks may hold different numbers
        of validation batches, so no collective may run inside (DDP's forward broadcasts buffers)."""
        return unwrap(model)

    def sync_buffers(self, model: nn.Module, runtime: Runtime) -> None:
        """Give every replica the buffers (BatchNorm statistics) that model.pt will hold: rank 0's.
        The default: one copy of the model, nothing to align."""

    def full_model_state(self, model: nn.Module, runtime: Runtime) -> dict[str, torch.Tensor] | None:
        """The bare model's state_dict on rank 0, None elsewhere; every rank calls it. The tensors may be
        the model's own: ``snapshot`` them before the model changes. The default: rank 0's replica."""
        return unwrap(model).state_dict() if runtime.is_main else None

    def full_optimizer_state(self, model: nn.Module, optimizer, runtime: Runtime) -> dict | None:
        """The optimizer's whole state on rank 0, None elsewhere; every rank calls it."""
        return optimizer.state_dict() if runtime.is_main else None

    def load_optimizer_state(self, model: nn.Module, optimizer, saved: dict, names: list[str],
                             check: Callable[[Any, dict], None]) -> None:
        """Load a saved optimizer state of either layout (numbered or named: ``state``) into ``optimizer``.

        ``names``: the bare model's parameter names in order; ``check(optimizer, state)`` raises a clear
        error when the state cannot drive this optimizer."""
        from ddpkit.strategies import state

        numbered = state.named_to_numbered(saved, names) if state.is_named(saved) else saved
        check(optimizer, numbered)
        optimizer.load_state_dict(numbered)  # moves the state to the parameters' device

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load the bare model's whole state_dict (every rank has it) into the wrapped ``model``."""
        unwrap(model).load_state_dict(state)

    def sharded_state(self, model: nn.Module, optimizer) -> dict:
        """The model's and optimizer's state as a sharded checkpoint (torch.distributed.checkpoint) saves and
        loads it: ``{"model": ..., "optimizer": ...}``, each rank's own part (a shard of a sharded tensor,
        whole tensors where every rank holds the same), the optimizer's state keyed by parameter name."""
        return dcp_state(unwrap(model), optimizer)

    def load_sharded_state(self, model: nn.Module, optimizer, read: Callable[[dict], None]) -> None:
        """Load a sharded checkpoint into the wrapped ``model`` and ``optimizer`` (None: the model only):
        ``read(state)`` fills ``sharded_state``'s layout in place, each rank reading its own part."""
        load_dcp_state(unwrap(model), optimizer, read)

    def train_state_bytes(self, model: nn.Module, optimizer) -> int:
        """Bytes of parameters, gradients and optimizer state this rank holds."""
        return held_bytes(model, optimizer)


def rebind_parameters(optimizer: torch.optim.Optimizer, model: nn.Module, names: dict[int, str]) -> None:
    """Point ``optimizer``'s parameter groups at ``model``'s parameters of the same names, in place (its settings,
    a scheduler's ``initial_lr`` and the object itself stay), where wrapping replaced the tensors."""
    from ddpkit.core.errors import UsageError

    current = dict(model.named_parameters())
    if all(id(current.get(names.get(id(p), ""))) == id(p) for group in optimizer.param_groups for p in group["params"]):
        return  # wrapping kept every tensor
    if optimizer.state:
        raise UsageError("the optimizer has state already (it stepped, or a state was loaded): hand it to "
                         "`prepare` before its first step, and load its saved state afterwards")
    for group in optimizer.param_groups:
        missing = [names.get(id(p), "(not a parameter of the model)") for p in group["params"]
                   if names.get(id(p)) not in current]
        if missing:
            raise UsageError(f"the optimizer holds parameters the wrapped model does not ({', '.join(missing[:3])}); "
                             "give `prepare` the model together with the optimizer made over its parameters")
        group["params"] = [current[names[id(p)]] for p in group["params"]]


def state_dicts():
    """torch.distributed.checkpoint's state_dict helpers, imported on use (they pull in FSDP: 0.6 s)."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _dcp_options():
    return state_dicts().StateDictOptions(flatten_optimizer_state_dict=True)


def dcp_state(model: nn.Module, optimizer) -> dict:
    """``{"model", "optimizer"}`` state dicts of torch.distributed.checkpoint for ``model`` (bare, or FSDP's)
    and ``optimizer`` (None: the model only), the optimizer's flattened to one key per parameter and value."""
    sd = state_dicts()
    if optimizer is None:
        return {"model": sd.get_model_state_dict(model, options=_dcp_options())}
    model_state, optimizer_state = sd.get_state_dict(model, optimizer, options=_dcp_options())
    return {"model": model_state, "optimizer": optimizer_state}


def load_dcp_state(model: nn.Module, optimizer, read: Callable[[dict], None]) -> None:
    """Fill ``dcp_state``'s layout with ``read`` and load it into ``model`` and ``optimizer``."""
    state = dcp_state(model, optimizer)
    read(state)
    sd = state_dicts()
    if optimizer is None:
        sd.set_model_state_dict(model, state["model"], options=_dcp_options())
    else:
        sd.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                          options=_dcp_options())
