"""The script's optimizers, where its models are sharded (``ddpkit run --unchanged --shard``).

A script builds its optimizer from its model's parameters, before the model's first call, which is where ddpkit
shards the model and replaces those parameters with sharded ones (``strategies.sharded_in_place``). Every optimizer
is recorded as it is built (``torch.optim.Optimizer.__init__`` is wrapped: PyTorch has no hook for it), so that its
parameter groups can be pointed at the sharded parameters then (``repoint``): a scheduler holding it keeps working.
State it holds already (an optimizer loaded from a checkpoint before training, or one that stepped) is sharded with
the parameters; state that is not shaped as its parameter (a factored second moment) cannot be, and is refused.

Every optimizer's ``state_dict()`` and ``load_state_dict()`` speak one device's format: its sharded state gathered
whole into plain tensors on rank 0 (every rank calls it, as every rank runs the script; the others hold stand-ins:
``sharded_in_place.whole_on_rank_0``), and rank 0's whole state loaded as each rank's shard of it.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch

from ddpkit.core.errors import UsageError
from ddpkit.strategies.base import is_shard
from ddpkit.strategies.sharded_in_place import from_rank_0, sharded_like, whole_on_rank_0


# torch.optim's optimizers whose step updates each element from that element's own gradient and state: a shard's
# step is then the whole step's. (LBFGS takes dot products over all parameters; Muon or Shampoo work on whole
# matrices: each shard's step would differ from one device's.)
ELEMENTWISE = ("SGD", "Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")


def steps_each_element(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step is one of ``ELEMENTWISE``'s own (not a subclass's own step)."""
    step = inspect.unwrap(type(optimizer).step)  # (Optimizer wraps each class's step for its profiler and hooks)
    return (getattr(step, "__module__", "") or "").startswith("torch.optim") and \
        step.__qualname__.split(".")[0] in ELEMENTWISE


def not_elementwise(optimizer: torch.optim.Optimizer, model_name: str) -> str:
    return (f"--unchanged --shard: {type(optimizer).__name__} steps {model_name}'s parameters, and it is not one of "
            f"torch.optim's optimizers that update each element on its own ({', '.join(ELEMENTWISE)}): over a shard "
            "its step would not be one device's. Run with --shard never (each process a whole replica)")


class Optimizers:
    """Every optimizer the script builds (weakly held)."""

    def __init__(self, *, rank: int):
        self.rank = rank
        self.built: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._undo: list = []

    def install(self) -> None:
        original = torch.optim.Optimizer.__init__
        built = self.built

        @functools.wraps(original)
        def __init__(optimizer, *args, **kwargs):
            original(optimizer, *args, **kwargs)
            if optimizer not in built:
                built.add(optimizer)
                optimizer.register_state_dict_post_hook(_whole_state)
                optimizer.register_load_state_dict_pre_hook(_sharded_state)

        torch.optim.Optimizer.__init__ = __init__
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        handle = register_optimizer_step_pre_hook(self.check_step)
        self._undo = [handle.remove, lambda: setattr(torch.optim.Optimizer, "__init__", original)]

    def uninstall(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []

    def check_step(self, optimizer: torch.optim.Optimizer, *_) -> None:
        """Before each step: an optimizer that holds sharded parameters must step each element on its own (one built
        after the model was sharded is met here first)."""
        if optimizer in self.checked:
            return
        self.checked.add(optimizer)
        if not steps_each_element(optimizer) and any(
                is_shard(parameter) for group in optimizer.param_groups for parameter in group["params"]):
            raise UsageError(not_elementwise(optimizer, "a sharded model"), said_elsewhere=self.rank != 0)

    def holding(self, parameters) -> list[torch.optim.Optimizer]:
        """The optimizers that hold any of ``parameters``."""
        ids = {id(parameter) for parameter in parameters}
        return [optimizer for optimizer in list(self.built)
                if any(id(parameter) in ids for group in optimizer.param_groups for parameter in group["params"])]

    def repoint(self, moved: dict[torch.Tensor, torch.Tensor], model_name: str) -> None:
        """Point every optimizer at the sharded parameters that replace the ones it holds (``moved``), its state
        for them sharded alike."""
        for optimizer in self.holding(moved):
            for old, state in list(optimizer.state.items()):
                if old in moved:
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != old.shape:
                            raise UsageError(
                                f"--unchanged --shard: {type(optimizer).__name__} holds state {key!r} for a parameter "
                                f"of {model_name} shaped {tuple(value.shape)}, not as the parameter "
                                f"{tuple(old.shape)}, so it cannot be sharded with it: build the optimizer after the "
                                "model's first call, or run with --shard never", said_elsewhere=self.rank != 0)
            for old in [parameter for parameter in optimizer.state if parameter in moved]:
                state = optimizer.state.pop(old)
                optimizer.state[moved[old]] = {key: sharded_like(value, moved[old]) if _shaped_as(value, old) else value
                                               for key, value in state.items()}
            for group in optimizer.param_groups:
                group["params"] = [moved.get(parameter, parameter) for parameter in group["params"]]


def _shaped_as(value, parameter: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == parameter.shape


def _whole_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """An optimizer's state dict with its sharded state gathered whole on rank 0 (new inner dicts: the optimizer's
    own state stays as it is)."""
    if not any(is_shard(value) for state in state_dict["state"].values() for value in state.values()):
        return state_dict
    return {**state_dict, "state": {index: {key: whole_on_rank_0(value) for key, value in state.items()}
                                    for index, state in state_dict["state"].items()}}


def _sharded_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A whole (one device's) optimizer state dict, each tensor for a sharded parameter this rank's shard of rank 0's."""
    parameters = {index: parameter
                  for saved, group in zip(state_dict["param_groups"], optimizer.param_groups)
                  for index, parameter in zip(saved["params"], group["params"])}
    if not any(is_shard(parameter) for parameter in parameters.values()):
        return state_dict
    state = {}
    for index, values in state_dict["state"].items():
        parameter = parameters.get(index)
        sharded = parameter is not None and is_shard(parameter)
        state[index] = {key: from_rank_0(value, parameter)
                        if sharded and _shaped_as(value, parameter) and not is_shard(value) else value
                        for key, value in values.items()}
    return {**state_dict, "state": state}
