"""FSDP2 on a model object that the script keeps holding (``ddpkit run --unchanged --shard``): PyTorch's
``fully_shard``, in place, as ``in_place.Replica`` is DDP on a module the script keeps. Each rank keeps 1/N of every
parameter, gradient and optimizer state; a block's parameters are all-gathered for its forward (and backward) and its
gradients reduce-scattered.

    >>> moved = shard_in_place(model, reshard_after_forward=True, weight=lambda: 0.5)   # doctest: +SKIP

What stays one device's:

- the object: its class is FSDP2's subclass of the script's, so ``isinstance`` holds, and its ``state_dict()`` keys;
- ``model.state_dict()``: whole plain tensors, gathered (every rank calls it, as every rank runs the script), on the
  CPU where the model is on a GPU, a parameter tied to another (GPT-2's head and embedding) one tensor under both
  keys, as one device's state dict shares it; ``model.load_state_dict(whole)`` keeps each rank's shard of a whole
  state dict;
- copies: ``copy.deepcopy``, ``pickle`` and ``torch.save(model)`` give the script's own class with whole weights,
  nothing of FSDP's on it (``plain_copy``).

Which blocks (``repeated_blocks``): the outermost submodules whose class occurs at least twice among the modules
with parameters, and which have children (a transformer's layers, a ResNet's residual blocks); where none has
children, the repeated layers themselves (an MLP's ``Linear`` layers). Containers (``Sequential``, ``ModuleList``,
``ModuleDict``) are never blocks: they hold them. Each is sharded first, then the root, which
takes the rest (embeddings, heads), as torchtitan applies ``fully_shard``. A model without repeated parts is one
block, the root.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.core.errors import UsageError
from ddpkit.strategies.base import is_shard
from ddpkit.strategies.fsdp import fsdp2, is_fsdp2
from ddpkit.strategies.in_place import (Added, Weight, added_since, batch_norm_over_all_ranks, hooks_and_keys,
                                        state_without)

# Each sharded module's attributes and hooks before ``fully_shard``, which adds more at the first forward too.
_before_sharding: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
_state = threading.local()  # .copying: inside a plain copy; .alone: one rank pickles (rank 0's torch.save to a path)
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)  # hold blocks, are none: ResNet's layer1 holds 2


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` to shard one at a time, before its root (the rule in the module's text)."""
    holders = [module for module in model.modules()
               if module is not model and _has_parameters(module) and not isinstance(module, CONTAINERS)]
    counts = collections.Counter(type(module) for module in holders)
    for with_children in (True, False):
        chosen: list[nn.Module] = []
        inside: set[int] = set()
        for module in holders:  # modules() is depth first: an outer block comes before what it holds
            if id(module) in inside or counts[type(module)] < 2 or bool(list(module.children())) != with_children:
                continue
            chosen.append(module)
            inside.update(id(part) for part in module.modules())
        if chosen:
            return chosen
    return []


def shard_in_place(module: nn.Module, *, reshard_after_forward: bool, weight: Weight,
                   whole: Callable[[], bool] = lambda: False) -> dict[nn.Parameter, nn.Parameter]:
    """Shard ``module`` over every rank (on every rank alike, at the same point of the script), its repeated blocks
    first, then its root; ``reshard_after_forward=False`` keeps the gathered parameters from forward to backward
    (ZeRO-2's layout: gradients and optimizer state sharded, parameters whole during a step). Its parameters and
    buffers are rank 0's from here on. Returns each old parameter's sharded replacement, for the optimizers that
    hold the old ones. BatchNorm normalises over all ranks' batches, as under ``in_place.Replica``."""
    fully_shard = fsdp2().fully_shard
    device = next(module.parameters()).device
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0)  # fully_shard keeps each rank's own slice of its own copy
    batch_norm_over_all_ranks(module, weight, whole, scaled=True)  # (the models' outputs carry the weights)
    names = {name: parameter for name, parameter in module.named_parameters()}
    before = {part: hooks_and_keys(part) for part in module.modules()}
    plain = {part: type(part) for part in module.modules()}
    mesh = _mesh(device.type)
    # FSDP2 shards no scalar (CLIP's temperature): it stays whole on every rank, its gradient averaged here.
    scalars = {parameter for parameter in module.parameters() if parameter.dim() == 0}
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
               **({"ignored_params": scalars} if scalars else {})}
    for block in repeated_blocks(module):
        fully_shard(block, **options)
    fully_shard(module, **options)
    for scalar in scalars:
        if scalar.requires_grad:
            scalar.register_hook(_averaged)
    for part, found in before.items():
        _before_sharding[part] = found
        if type(part) is not plain[part]:
            _copies_plain(part, plain[part])
    for part in module.modules():
        if any(is_shard(parameter) for parameter in part._parameters.values()):
            part._register_state_dict_hook(_whole_state)
            part._register_load_state_dict_pre_hook(_sharded_state, with_module=True)
    moved = dict(module.named_parameters())
    return {old: moved[name] for name, old in names.items() if moved.get(name) is not old and name in moved}


READ_DIRECTLY = ("--unchanged --shard: the script used a sharded parameter directly (`model.fc.weight`, an EMA "
                 "copy updated from model.parameters()): between steps each process holds its shard of it, a DTensor. "
                 "Read model.state_dict() (whole), or run with --shard never")


def read_directly(error: BaseException) -> str | None:
    """The one line that explains ``error``, where a model was sharded in this process and the error is a DTensor's
    (the script met a shard where it wanted a whole tensor); else None."""
    said = str(error)
    if _before_sharding and any(sign in said for sign in ("DTensor", "sharded dimension", "redistribute",
                                                           "sharding strategy")):
        return READ_DIRECTLY
    return None


def _averaged(gradient: torch.Tensor) -> torch.Tensor:
    """A whole parameter's gradient, averaged over the ranks as FSDP averages the sharded ones'."""
    gradient = gradient.clone()
    dist.all_reduce(gradient)
    return gradient / dist.get_world_size()


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


_meshes: dict[str, object] = {}


def _mesh(device_type: str):
    """One device mesh over every rank of the default group, per device type."""
    if device_type not in _meshes:
        from torch.distributed.device_mesh import init_device_mesh

        _meshes[device_type] = init_device_mesh(device_type, (dist.get_world_size(),))
    return _meshes[device_type]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, whole and plain where it is a shard (gathered: every rank calls it), else itself. A GPU's comes back
    on the CPU, one tensor at a time (as FSDP's own full state dicts with ``cpu_offload``): a model sharded because it
    does not fit one device would not fit there whole either."""
    if not is_shard(tensor):
        return tensor
    gathered = tensor.full_tensor()
    return gathered.cpu() if gathered.device.type != "cpu" else gathered


def sharded_like(value: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``value``, a whole tensor shaped as the sharded ``parameter``, placed as it is."""
    from torch.distributed.tensor import distribute_tensor

    value = value.detach().to(parameter.device)
    if "src_data_rank" in inspect.signature(distribute_tensor).parameters:  # each rank cuts its own: no scatter
        return distribute_tensor(value, parameter.device_mesh, parameter.placements, src_data_rank=None)
    return distribute_tensor(value, parameter.device_mesh, parameter.placements)


def _whole_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:  # noqa: ARG001
    """A state dict hook: this module's sharded parameters, whole (every rank calls ``state_dict()``). A parameter
    that several modules hold (tied) is gathered once for the dictionary being built, and each of its keys gets a view
    of that one tensor, as one device's state dict shares a tied parameter's storage (``save_pretrained`` then writes
    it once, and ``torch.save`` keeps the tie)."""
    gathered = _gathered_for(state_dict)
    for name, parameter in module._parameters.items():
        key = prefix + name
        if key in state_dict and is_shard(state_dict[key]):
            held = gathered.get(id(parameter))
            tensor = held() if held is not None else None
            if tensor is None:
                state_dict[key] = whole(state_dict[key])
                gathered[id(parameter)] = weakref.ref(state_dict[key])
            else:
                state_dict[key] = tensor.detach()


# The whole tensors gathered for each state dict being built (weakly: the dictionary holds them), by the id of its
# dictionary, dropped with it.
_gathered: dict[int, dict[int, weakref.ref]] = {}


def _gathered_for(state_dict: dict) -> dict[int, weakref.ref]:
    key = id(state_dict)
    if key not in _gathered:
        _gathered[key] = {}
        weakref.finalize(state_dict, _gathered.pop, key, None)
    return _gathered[key]


def _sharded_state(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """A load_state_dict pre-hook: a whole tensor for a sharded parameter becomes this rank's shard of it."""
    for name, parameter in module._parameters.items():
        key = prefix + name
        value = state_dict.get(key)
        if (is_shard(parameter) and isinstance(value, torch.Tensor) and not is_shard(value)
                and value.shape == parameter.shape):
            state_dict[key] = sharded_like(value, parameter)


# Copies: the script's classes, whole weights, nothing of FSDP's.

_plain_classes: dict[type, type] = {}


def _copies_plain(module: nn.Module, plain: type) -> None:
    """Copies of ``module`` (FSDP2's class for the script's ``plain`` one) are plain: a class of ddpkit's below
    FSDP2's, which only adds how it copies and pickles (``_PicklesPlain``)."""
    sharded = type(module)
    if sharded not in _plain_classes:
        _plain_classes[sharded] = type(sharded.__name__, (_PicklesPlain, sharded),
                                       {"__module__": sharded.__module__, "_plain": plain, "_sharded": sharded})
    module.__class__ = _plain_classes[sharded]


class _PicklesPlain:
    """Copied and pickled as the script's own class, with whole weights and nothing of FSDP's: a pickle names the
    globals that one device's names. For that, ``__class__`` reads as the plain class once, right after
    ``__reduce_ex__`` (where pickle checks it against the class it is told to build); else it is the real one."""

    _plain: type
    _sharded: type

    def __new__(cls, *args, **kwargs):  # (FSDP2's own: indexing a container builds the plain class)
        return cls._sharded.__new__(cls._sharded, *args, **kwargs)

    @property
    def __class__(self):
        if getattr(_state, "pickling", None) is self:
            _state.pickling = None
            return self._plain
        return type(self)

    @__class__.setter
    def __class__(self, kind: type) -> None:
        object.__dict__["__class__"].__set__(self, kind)

    def __reduce_ex__(self, protocol: int):
        if getattr(_state, "alone", False) and not getattr(_state, "copying", False):
            raise UsageError("--unchanged --shard: torch.save of an object that holds a sharded model inside something "
                             "other than a module, dict, list or tuple: save model.state_dict(), or the model itself")
        copied = plain_copy(self)
        reduced = copied.__reduce_ex__(protocol)  # copyreg's: the plain class, built by name
        if protocol >= 2:
            _state.pickling = self
        return reduced

    def __deepcopy__(self, memo: dict) -> nn.Module:
        if getattr(_state, "copying", False):
            return _one_plain(self, self._plain, memo)
        return plain_copy(self, memo)


def plain_copy(module: nn.Module, memo: dict | None = None) -> nn.Module:
    """A copy of ``module`` as one device would hold it: the script's classes, whole weights, none of FSDP's hooks
    or state. Gathers every sharded block: every rank calls it."""
    memo = {} if memo is None else memo
    with _unsharded(module):
        _state.copying = True
        try:
            copied = copy.deepcopy(module, memo) if not is_fsdp2(module) else _one_plain(module, None, memo)
        finally:
            _state.copying = False
    for original, part in zip(module.modules(), copied.modules()):
        _strip(part, _added_by_sharding(original))
    return copied


def _one_plain(module: nn.Module, plain: type | None, memo: dict) -> nn.Module:
    """A copy of a module that ``fully_shard`` made a block, of its class before, without what sharding added."""
    plain = plain or next(kind for kind in type(module).__mro__
                          if not _is_fsdp_class(kind) and kind is not _PicklesPlain)
    copied = object.__new__(plain)
    memo[id(module)] = copied
    copied.__setstate__(copy.deepcopy(state_without(module, _added_by_sharding(module)), memo))
    return copied


def _added_by_sharding(module: nn.Module) -> Added:
    """What ``fully_shard`` and ddpkit put on ``module`` since it was sharded: attributes, and hooks of theirs (not
    those the script added since)."""
    if module not in _before_sharding:
        return Added()
    now = hooks_and_keys(module)
    added = added_since(_before_sharding[module], now)
    return Added(keys=added.keys, hooks=tuple(
        (name, frozenset(key for key in ids if _ours(getattr(module, name)[key]))) for name, ids in added.hooks))


def _ours(hook) -> bool:
    function = getattr(hook, "func", hook)  # functools.partial: a hook given its module
    return (getattr(function, "__module__", None) or "").startswith(("torch.distributed", "ddpkit"))


def _strip(module: nn.Module, added: Added) -> None:
    for key in added.keys:
        module.__dict__.pop(key, None)
    for name, ids in added.hooks:
        hooks = getattr(module, name, None)
        if isinstance(hooks, dict):
            for hook in ids:
                hooks.pop(hook, None)


def _is_fsdp_class(kind: type) -> bool:
    return issubclass(kind, fsdp2().FSDPModule)


@contextlib.contextmanager
def _unsharded(module: nn.Module) -> Iterator[None]:
    """Every sharded block of ``module`` gathered whole (its parameters plain tensors) inside the block."""
    blocks = [part for part in module.modules() if is_fsdp2(part)]
    for block in blocks:
        block.unshard()
    try:
        yield
    finally:
        for block in blocks:
            block.reshard()


@contextlib.contextmanager
def saved_alone() -> Iterator[None]:
    """One rank pickles (rank 0's ``torch.save`` to a path): a sharded model met there cannot gather."""
    _state.alone = True
    try:
        yield
    finally:
        _state.alone = False


def plain_for_saving(obj):
    """``obj`` with every module in it that holds a sharded block (itself, or in a dict, list or tuple) replaced by its
    plain copy: every rank calls it, before one rank saves."""
    if isinstance(obj, nn.Module):
        return plain_copy(obj) if any(is_fsdp2(part) for part in obj.modules()) else obj
    if isinstance(obj, dict):
        copied = copy.copy(obj)  # its own kind: an OrderedDict, a defaultdict
        copied.update((key, plain_for_saving(value)) for key, value in obj.items())
        return copied
    if isinstance(obj, list):
        return [plain_for_saving(value) for value in obj]
    if isinstance(obj, tuple):
        values = [plain_for_saving(value) for value in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)  # a named tuple, or a tuple
    return obj
