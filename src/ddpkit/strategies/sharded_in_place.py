"""FSDP2 on a model object that the script keeps holding (``ddpkit run --unchanged --shard``): PyTorch's
``fully_shard``, in place, as ``in_place.Replica`` is DDP on a module the script keeps. Each rank keeps 1/N of every
parameter, gradient and optimizer state; a block's parameters are all-gathered for its forward (and backward) and its
gradients reduce-scattered.

    >>> moved = shard_in_place(model, reshard_after_forward=True, weight=lambda: 0.5)   # doctest: +SKIP

What stays one device's:

- the object: its class is FSDP2's subclass of the script's, so ``isinstance`` holds, and its ``state_dict()`` keys;
- ``model.state_dict()``: whole plain tensors on rank 0, gathered there alone (every rank calls it, as every rank runs
  the script), on the CPU where the model is on a GPU, a parameter tied to another (GPT-2's head and embedding) one
  tensor under both keys, as one device's state dict shares it; on the other ranks stand-ins of one element each
  (``whole_on_rank_0``); ``model.load_state_dict(whole)`` keeps each rank's shard of rank 0's whole state dict;
- ``pickle`` and ``torch.save(model)`` give the script's own class with whole weights, nothing of FSDP's on it
  (``plain_copy``);
- copies kept beside it (an EMA's): ``copy.deepcopy(model)`` is sharded like it (``sharded_copy``), and so are the
  copies the script made before it was sharded (``copies_of``); an EMA's update that reads state dicts reads shards
  (``read_to_update``).

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
import dataclasses
import gc
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.core.errors import UsageError
from ddpkit.core.process_group import fingerprint
from ddpkit.strategies.base import is_shard, local_shard
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
    held = _holders(model)
    for with_children in (True, False):
        chosen: list[nn.Module] = []
        inside: set[int] = set()
        for module in holders:  # modules() is depth first: an outer block comes before what it holds
            if id(module) in inside or counts[type(module)] < 2 or bool(list(module.children())) != with_children:
                continue
            if any(held[key] != count for key, count in _holders(module).items()):
                continue  # it shares a parameter with a module outside it (a tied head): that stays with the root
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
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0)  # fully_shard keeps each rank's own slice of its own copy
    return _shard(module, next(module.parameters()).device.type, Sharding(reshard_after_forward, weight, whole))


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How a model was sharded, which its copies repeat (``copies_of``, ``sharded_copy``)."""

    reshard_after_forward: bool
    weight: Weight
    whole: Callable[[], bool]


# The models sharded (each root, with how), and the copies of them sharded alike (an EMA's, an AveragedModel's).
_roots: weakref.WeakKeyDictionary[nn.Module, Sharding] = weakref.WeakKeyDictionary()
_copies: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _shard(module: nn.Module, device_type: str, sharding: Sharding) -> dict[nn.Parameter, nn.Parameter]:
    """``fully_shard`` on ``module``'s blocks, then on its root, and what ddpkit puts beside it (see
    ``shard_in_place``); its parameters may be on the meta device (a copy's, materialised after)."""
    fully_shard = fsdp2().fully_shard
    batch_norm_over_all_ranks(module, sharding.weight, sharding.whole, scaled=True)  # (the outputs carry the weights)
    names = {name: parameter for name, parameter in module.named_parameters()}
    before = {part: hooks_and_keys(part) for part in module.modules()}
    plain = {part: type(part) for part in module.modules()}
    mesh = _mesh(device_type)
    # FSDP2 shards no scalar (CLIP's temperature): it stays whole on every rank, its gradient averaged here.
    scalars = {parameter for parameter in module.parameters() if parameter.dim() == 0}
    options = {"mesh": mesh, "reshard_after_forward": sharding.reshard_after_forward,
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
        if part._parameters or part._buffers:
            part._register_state_dict_hook(_whole_state)
        if any(is_shard(parameter) for parameter in part._parameters.values()):
            part._register_load_state_dict_pre_hook(_sharded_state, with_module=True)
    _roots[module] = sharding
    moved = dict(module.named_parameters())
    return {old: moved[name] for name, old in names.items() if moved.get(name) is not old and name in moved}


def sharded_ahead(module: nn.Module) -> bool:
    """Whether ddpkit sharded ``module`` as a whole model or a copy of one (``shard_in_place``, ``shard_on_the_way``,
    ``copies_of``, ``sharded_copy``)."""
    return module in _copies or module in _roots


def copies_of(model: nn.Module, *, not_these=()) -> dict[nn.Parameter, nn.Parameter]:
    """Shard alike, where ``model`` was just sharded, the copies of it that the script made before (an EMA's
    ``copy.deepcopy(model)``, an ``AveragedModel``'s, timm's ``ModelEmaV3``'s, taken before its first step): every
    module of its class (before sharding) whose parameters and buffers have its names, shapes and device, sharing
    none of them, not itself a model (``not_these``); its dtype may differ (an EMA kept in float32 of a bfloat16
    model), each copy sharded in its own. Found once, among the objects Python tracks. Each copy's
    blocks are gathered for a forward and freed after it, whatever the model's layout (a copy is evaluated, not
    trained). Returns each old parameter's replacement, for the optimizers that hold them."""
    kind = getattr(type(model), "_plain", type(model))
    layout = _layout(model)
    own = {id(tensor) for tensor in [*model.parameters(), *model.buffers()]}
    source = _roots[model]
    moved: dict[nn.Parameter, nn.Parameter] = {}
    objects = gc.get_objects()
    twins = [found for found in objects if type(found) is kind and found is not model and found not in not_these
             and not any(is_fsdp2(part) for part in found.modules()) and _layout(found) == layout
             and not any(id(tensor) in own for tensor in [*found.parameters(), *found.buffers()])]
    if (refused := averaged_with_buffers(objects, twins)) is not None:
        raise UsageError(refused, said_elsewhere=dist.get_rank() != 0)
    for twin in in_rank_zeros_order(twins):
        moved.update(shard_in_place(twin, reshard_after_forward=True, weight=source.weight, whole=source.whole))
        _copies.add(twin)
    return moved


def in_rank_zeros_order(copies: list[nn.Module]) -> list[nn.Module]:
    """``copies`` (of one model, found among the objects Python tracks) in the order of their counterparts on rank 0,
    so that each is sharded (its values broadcast from rank 0's) with its own counterpart. The order Python tracks
    them in is not the same on every rank: where collections ran at other times, an EMA kept in float32 came before
    the one in float64 on one rank and after it on another, and their broadcasts did not pair ("Received data size
    doesn't match expected size"; tests/test_unchanged_sharded.py). Each copy is told by its values, the same on every
    rank at this point (copies made on every rank alike): rank 0's marks are broadcast, and each rank takes for each
    the copy of its own nearest to it, among those of its dtype. Copies equal in every value are interchangeable."""
    if len(copies) < 2 or dist.get_world_size() == 1:
        return copies
    device = next(copies[0].parameters()).device
    marks = torch.stack([_mark(copy_) for copy_ in copies]).to(device)
    theirs = marks.clone()
    dist.broadcast(theirs, src=0)
    left, ordered = list(range(len(copies))), []
    for mark in theirs:
        nearest = min((index for index in left if marks[index, 0] == mark[0]),
                      key=lambda index: float((marks[index, 1:] - mark[1:]).abs().sum()), default=None)
        if nearest is None:  # (no copy of that dtype here: the copies found differ across ranks)
            raise RuntimeError("--unchanged --shard: the copies of a model found on this rank differ from rank 0's")
        left.remove(nearest)
        ordered.append(copies[nearest])
    return ordered


def _mark(module: nn.Module) -> torch.Tensor:
    """Five numbers of ``module``'s values, on the CPU: its dtype's size, then its parameters' and buffers'
    ``fingerprint``."""
    size = torch.tensor([float(next(module.parameters()).element_size())], dtype=torch.float64)
    return torch.cat([size, fingerprint([*module.parameters(), *module.buffers()])])


def averaged_with_buffers(objects, copies: list[nn.Module]) -> str | None:
    """The one line that refuses an ``AveragedModel(model, use_buffers=True)`` among ``objects`` over one of
    ``copies``, before training: its update averages the buffers in the same step as the parameters, and sharded its
    parameters are shards and its buffers whole tensors, which one of PyTorch's ``foreach`` steps cannot take
    together; else None."""
    from torch.optim.swa_utils import AveragedModel

    held = {id(copy) for copy in copies}
    # (By the object's type, not isinstance: that reads ``__class__`` of every object on the heap, and a deprecated
    # one warns when read, torch.distributed's ``reduce_op`` among them.)
    if any(issubclass(type(found), AveragedModel) and found.use_buffers and id(found.module) in held
           for found in objects):
        return ("--unchanged --shard: AveragedModel(..., use_buffers=True) averages the model's buffers in one step "
                "with its parameters, which are shards under --shard (its buffers whole): average the parameters "
                "alone (use_buffers=False, then torch.optim.swa_utils.update_bn for BatchNorm's statistics), or run "
                "with --shard never")
    return None


def _layout(module: nn.Module) -> list:
    """Each parameter's and buffer's name, shape and device type (a shard's whole shape)."""
    return [(name, tuple(tensor.shape), tensor.device.type)
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]]


def sharded_copy(module: nn.Module, memo: dict) -> nn.Module:
    """A copy of the sharded model ``module`` sharded alike (``copy.deepcopy``): the script's classes built without
    their tensors (on the meta device), sharded with the model's mesh and placements, each rank's shards then copied
    from the model's own, the buffers whole. Nothing is gathered: each rank adds its shards' bytes alone."""
    sharding = _roots[module]
    for tensor in [*module.parameters(), *module.buffers()]:
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    _state.copying = True
    try:
        copied = _one_plain(module, None, memo)
    finally:
        _state.copying = False
    for original, part in zip(module.modules(), copied.modules()):
        _strip(part, _added_by_sharding(original))
    device = next(module.parameters()).device
    _shard(copied, device.type, dataclasses.replace(sharding, reshard_after_forward=True))
    copied.to_empty(device=device)
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip([*copied.named_parameters(), *copied.named_buffers()],
                                          [*module.named_parameters(), *module.named_buffers()]):
            local_shard(mine).copy_(local_shard(theirs))
    _copies.add(copied)
    return copied


READ_DIRECTLY = ("--unchanged --shard: the script used a sharded parameter directly (`model.fc.weight`, or with a "
                 "tensor kept beside the model: an EMA on another device): between steps each "
                 "process holds its shard of it, a DTensor. Read model.state_dict() (whole), or run with --shard never")


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


def _holders(module: nn.Module) -> collections.Counter:
    """How many times each parameter (by id) is held inside ``module``, by each module holding it."""
    return collections.Counter(id(parameter) for _, part in module.named_modules(remove_duplicate=False)
                               for parameter in part._parameters.values() if parameter is not None)


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


_meshes: dict[str, object] = {}


def _mesh(device_type: str):
    """One device mesh over every rank of the default group, per device type."""
    if device_type not in _meshes:
        from torch.distributed.device_mesh import init_device_mesh

        _meshes[device_type] = init_device_mesh(device_type, (dist.get_world_size(),))
    return _meshes[device_type]


def whole_on_rank_0(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole and plain on rank 0 where it is a shard (every rank calls it: the shards are gathered to rank
    0 alone); on the other ranks zeros of its shape and dtype that hold one element (``stand_in``): a whole state
    dict then costs rank 0 alone (FSDP's own full state dicts with ``rank0_only``), and the others can still read it.
    Any other tensor is itself. A GPU's comes back on the CPU, one tensor at a time (as FSDP's full state dicts with
    ``cpu_offload``): a model sharded because it does not fit one device would not fit there whole either."""
    if not is_shard(tensor):
        return tensor
    cut = _rows_of_dim_0(tensor)
    if cut is None:  # (not FSDP2's layout on ddpkit's mesh)
        gathered, rank = tensor.full_tensor(), dist.get_rank()
    else:
        group, rank, rows = cut
        local = tensor.to_local()
        padded = local.new_zeros((rows, *tensor.shape[1:]))
        padded[:local.shape[0]] = local
        gathered = local.new_empty((rows * dist.get_world_size(group), *tensor.shape[1:])) if rank == 0 else None
        dist.gather(padded, list(gathered.split(rows)) if rank == 0 else None, dst=dist.get_global_rank(group, 0),
                    group=group)
        gathered = gathered[:tensor.shape[0]] if rank == 0 else None
    if rank != 0:
        return stand_in(tensor)
    return gathered.cpu() if gathered.device.type != "cpu" else gathered


def _rows_of_dim_0(tensor: torch.Tensor):
    """For a shard laid out as FSDP2 lays them on ddpkit's mesh (dim 0 cut as torch.chunk cuts it, over one mesh
    dimension): its group, this rank in it, and the rows of every rank's shard padded alike (the last ranks' shards
    have fewer); None for any other layout."""
    from torch.distributed.tensor import Shard

    if tensor.device_mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),):
        return None
    group = tensor.device_mesh.get_group()
    return group, dist.get_rank(group), -(-tensor.shape[0] // dist.get_world_size(group))


def stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """What a rank other than 0 holds for ``tensor`` in a whole state dict: zeros of its shape and dtype on the CPU,
    one element expanded (every stride 0): a read gives zeros, a write is refused by PyTorch, a copy
    (``copy.deepcopy``) holds one element too, and loading it takes rank 0's values (``from_rank_0``). Only rank 0's
    values are the model's, and only rank 0's console, files and saves are the job's."""
    return torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)


def sharded_like(value: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``value``, a whole tensor shaped as the sharded ``parameter``, placed as it is, cut from
    this rank's own ``value`` (the same on every rank)."""
    from torch.distributed.tensor import distribute_tensor

    value = value.detach().to(parameter.device)
    if "src_data_rank" in inspect.signature(distribute_tensor).parameters:  # each rank cuts its own: no scatter
        return distribute_tensor(value, parameter.device_mesh, parameter.placements, src_data_rank=None)
    return distribute_tensor(value, parameter.device_mesh, parameter.placements)


def from_rank_0(value: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """This rank's shard of rank 0's ``value``, a whole tensor shaped as the sharded ``parameter``, placed as it is:
    scattered from rank 0, so that the other ranks' ``value`` may be a whole state dict's stand-in (``stand_in``) or
    anything of its shape. Every rank calls it."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(_rows_from_rank_0(value, parameter), parameter.device_mesh, parameter.placements,
                              run_check=False, shape=parameter.shape, stride=parameter.stride())


def _rows_from_rank_0(value: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of rank 0's whole ``value`` for the sharded ``parameter``, on its device: rank 0's
    rows of dim 0 scattered (each rank receives its shard alone, padded as torch.chunk cuts); only rank 0's ``value``
    is read."""
    from torch.distributed.tensor import distribute_tensor

    cut = _rows_of_dim_0(parameter)
    if cut is None:  # (not FSDP2's layout on ddpkit's mesh)
        value = value.detach().to(device=parameter.device, dtype=parameter.dtype)
        return distribute_tensor(value, parameter.device_mesh, parameter.placements, src_data_rank=0).to_local()
    group, rank, rows = cut
    local = parameter.to_local()
    mine = local.new_empty((rows, *parameter.shape[1:]))
    chunks = None
    if rank == 0:
        padded = local.new_zeros((rows * dist.get_world_size(group), *parameter.shape[1:]))
        padded[:parameter.shape[0]].copy_(value.detach())
        chunks = list(padded.split(rows))
    dist.scatter(mine, chunks, src=dist.get_global_rank(group, 0), group=group)
    return mine[:local.shape[0]]


def shard_on_the_way(module: nn.Module, device: torch.device, *, reshard_after_forward: bool, weight: Weight,
                     whole: Callable[[], bool] = lambda: False) -> dict[nn.Parameter, nn.Parameter]:
    """Shard ``module``, whole on the CPU, as the script moves it to ``device`` (``model.to(device)``): its tensors
    are put on the meta device (their values kept aside), it is sharded there as ``shard_in_place`` shards, and each
    rank's shards are then made on ``device`` and filled with rank 0's rows (scattered): a rank's device holds no
    more of a parameter than its shard (rank 0's, each parameter whole while it scatters it, one at a time), the
    buffers whole. Ties stay ties. Returns each old parameter's replacement."""
    values: dict[str, torch.Tensor] = {}
    names: dict[str, nn.Parameter] = {}
    metas: dict[int, torch.Tensor] = {}
    for prefix, part in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(part, kind).items():
                if tensor is None:
                    continue
                key = f"{prefix}.{name}" if prefix else name
                values[key] = tensor.detach()
                if kind == "_parameters":
                    names[key] = tensor
                if id(tensor) not in metas:
                    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                    metas[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if kind == "_parameters" else empty
                getattr(part, kind)[name] = metas[id(tensor)]
    _shard(module, device.type, Sharding(reshard_after_forward, weight, whole))
    module.to_empty(device=device)
    with torch.no_grad():
        for key, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if is_shard(tensor):
                tensor.to_local().copy_(_rows_from_rank_0(values[key], tensor))
            else:
                tensor.copy_(values[key])
                dist.broadcast(tensor, src=0)
    moved = dict(module.named_parameters(remove_duplicate=False))
    return {old: moved[name] for name, old in names.items() if name in moved and moved[name] is not old}


def _whole_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:  # noqa: ARG001
    """A state dict hook: this module's sharded parameters, whole on rank 0 (``whole_on_rank_0``: every rank calls
    ``state_dict()``). A parameter that several modules hold (tied) is gathered once for the dictionary being built,
    and each of its keys gets a view of that one tensor, as one device's state dict shares a tied parameter's storage
    (``save_pretrained`` then writes it once, and ``torch.save`` keeps the tie).

    Where an EMA's update reads the state dict (``read_to_update``), its values are this rank's shards instead, and its
    other tensors (buffers, scalars) DTensors replicated over the ranks, views of the module's own: the update writes
    into its copy's shards and reads the model's, shard by shard, nothing gathered."""
    built = _built_for(state_dict)
    for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
        key = prefix + name
        if key not in state_dict or tensor is None:
            continue
        if built.to_update:
            if not is_shard(state_dict[key]):
                state_dict[key] = _replicated(state_dict[key])
            continue
        if not is_shard(state_dict[key]):
            continue
        held = built.gathered.get(id(tensor))
        gathered = held() if held is not None else None
        if gathered is None:
            state_dict[key] = whole_on_rank_0(state_dict[key])
            built.gathered[id(tensor)] = weakref.ref(state_dict[key])
        else:
            state_dict[key] = gathered.detach()


@dataclasses.dataclass
class _Built:
    """A state dict being built: read to update a copy in place (its values shards), and the whole tensors gathered
    for it (weakly: the dictionary holds them), by the id of each parameter."""

    to_update: bool
    gathered: dict = dataclasses.field(default_factory=dict)


_built: dict[int, _Built] = {}  # by the id of each dictionary being built, dropped with it


def _built_for(state_dict: dict) -> _Built:
    key = id(state_dict)
    if key not in _built:
        _built[key] = _Built(to_update=read_to_update())
        weakref.finalize(state_dict, _built.pop, key, None)
    return _built[key]


_MODULE_CODE = (nn.modules.module.__file__, __file__)


def read_to_update() -> bool:
    """Whether the state dict being built is read by an EMA's update, which writes into its copy's values in place
    (timm's ``ModelEma``, ``ModelEmaV2`` and ``ModelEmaV3``, YOLOv5's ``ModelEMA``): gradients off, and the code that
    called ``state_dict()`` a method of an object that holds a sharded copy of a model (``copies_of``,
    ``sharded_copy``). Such an update reads its copy's state dict and the model's together."""
    if torch.is_grad_enabled() or not _copies:
        return False
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in _MODULE_CODE:
        frame = frame.f_back
    holder = frame.f_locals.get("self") if frame is not None else None
    if holder is None:
        return False
    held = list(vars(holder).values()) if hasattr(holder, "__dict__") else []
    if isinstance(holder, nn.Module):
        held += list(holder._modules.values())
    return any(isinstance(value, nn.Module) and value in _copies for value in held)


def _replicated(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (whole on every rank) as a DTensor replicated over the ranks, a view of it."""
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(tensor, _mesh(tensor.device.type), [Replicate()], run_check=False)


def _sharded_state(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """A load_state_dict pre-hook: a whole tensor for a sharded parameter becomes this rank's shard of rank 0's
    (``from_rank_0``: the other ranks may hold a whole state dict's stand-ins)."""
    for name, parameter in module._parameters.items():
        key = prefix + name
        value = state_dict.get(key)
        if (is_shard(parameter) and isinstance(value, torch.Tensor) and not is_shard(value)
                and value.shape == parameter.shape):
            state_dict[key] = from_rank_0(value, parameter)


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
        if self in _roots:  # a model's copy (an EMA's): sharded alike
            return sharded_copy(self, memo)
        return plain_copy(self, memo)  # (a block of one, copied alone)


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
    if isinstance(obj, torch.Tensor):
        return whole_on_rank_0(obj) if is_shard(obj) else obj  # (an EMA's update's state dict, kept and saved)
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
