"""DDP on a model object that the script keeps holding (``ddpkit run --unchanged``): PyTorch's composable
``replicate``, whose hooks run DDP's reducer (bucketed all-reduces that overlap the backward pass) on the module
itself. No wrapper: the script's ``model`` is still its own object, its ``state_dict()`` keys are unchanged, and
``isinstance(model, ItsClass)`` holds (``replicate`` gives it a subclass of its class, in place).

    >>> replicate_in_place(model, weight=lambda: 0.5)         # doctest: +SKIP

What differs from DDP's own averaging is the weight: rank r's gradient counts ``weight()`` (its share of the
batch, ``ddpkit.data.split_batches``), not 1 / world size, so that an uneven batch gives the gradient of the whole
batch. The weights of a batch sum to 1 over the ranks; a gradient accumulated over several backward passes therefore
keeps what earlier passes left in ``.grad`` (the same on every rank) as it is.

BatchNorm layers in training normalise over every rank's batch together (``sync_bn.OverAllRanks``), their
class also swapped for a subclass in place, so the module's structure and keys stay as they were.

A copy of such a module is a plain one: ``copy.deepcopy``, ``pickle`` and ``torch.save(model)`` give the module's own
class (and BatchNorm's), holding its weights, without what ``replicate`` and ddpkit put on it (their classes, hooks
and state), as one device would have it: an EMA or best-model copy trains and evaluates on its own, and a saved file
loads where ddpkit was never imported.
"""

import copy
import dataclasses
from collections.abc import Callable  # (no postponed annotations: DDP reads the hook's)

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate import replicate

from ddpkit.strategies.sync_bn import OverAllRanks

Weight = Callable[[], float]


def replicate_in_place(module: nn.Module, *, weight: Weight, whole: Callable[[], bool] = lambda: False) -> None:
    """Make ``module`` (on every rank, at the same point of the script) a DDP replica of rank 0's, whose gradients
    are summed over the ranks, rank r's weighted by ``weight()``. Its buffers are rank 0's from here on too.
    ``whole()``: every rank holds the whole batch now, and its BatchNorm layers normalise over it alone."""
    with torch.no_grad():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)  # the parameters DDP broadcasts itself, when it starts
    batch_norm_over_all_ranks(module, weight, whole)
    plain, before = type(module), hooks_and_keys(module)
    # No device_ids: DDP then leaves the inputs where the script put them, as the module alone would.
    replicate(module)
    module.register_comm_hook(weight, weighted_all_reduce)
    # replicate's class, this module's own: its copies are of the plain class.
    copied_plain(type(module), plain, added_since(before, hooks_and_keys(module)))


def weighted_all_reduce(weight: Weight, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the sum over ranks of each rank's gradients times its ``weight()``."""
    buffer = bucket.buffer()
    buffer.mul_(weight())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda done: done.value()[0])


_synced_classes: dict[type, type] = {}


def batch_norm_over_all_ranks(module: nn.Module, weight: Weight, whole: Callable[[], bool], *,
                              scaled: bool = False) -> None:
    """Every BatchNorm layer of ``module`` normalises over all ranks' batches in training, in place (but while
    ``whole()``: every rank holds the whole batch); ``scaled``: the gradients reaching them are weighted already
    (``sync_bn.synced_batch_norm``)."""
    for layer in module.modules():
        kind = type(layer)
        if not isinstance(layer, nn.modules.batchnorm._BatchNorm):
            continue
        if not issubclass(kind, OverAllRanks):
            if kind not in _synced_classes:
                _synced_classes[kind] = type(kind.__name__, (OverAllRanks, kind), {"__module__": kind.__module__})
                copied_plain(_synced_classes[kind], kind, Added(keys=frozenset({"share", "whole", "scaled"})))
            layer.__class__ = _synced_classes[kind]
        layer.share, layer.whole, layer.scaled = weight, whole, scaled


@dataclasses.dataclass(frozen=True)
class Added:
    """What was put on a module in place: attributes (``keys`` of its ``__dict__``) and hooks (``hooks``: the name of
    each hook dictionary, such as ``_forward_pre_hooks``, and the ids added to it)."""

    keys: frozenset = frozenset()
    hooks: tuple = ()


def copied_plain(cls: type, plain: type, added: Added) -> None:
    """Make every copy of an instance of ``cls`` (a class put on a module in place) an instance of ``plain``, without
    ``added``: for ``copy.deepcopy``, ``pickle`` and ``torch.save``, whose file then names ``plain`` alone."""

    def __reduce_ex__(module: nn.Module, protocol: int):
        # object.__new__ pickles by name (copyreg's __newobj__ would insist on the instance's own class).
        return object.__new__, (plain,), state_without(module, added)

    def __deepcopy__(module: nn.Module, memo: dict) -> nn.Module:
        new, arguments, state = __reduce_ex__(module, 4)
        copied = new(*arguments)
        memo[id(module)] = copied
        copied.__setstate__(copy.deepcopy(state, memo))
        return copied

    cls.__reduce_ex__ = __reduce_ex__
    cls.__deepcopy__ = __deepcopy__


def state_without(module: nn.Module, added: Added) -> dict:
    """``module``'s state (a new dictionary), without what was ``added`` to it in place."""
    state = dict(module.__getstate__())
    for key in added.keys:
        state.pop(key, None)
    for name, ids in added.hooks:
        if name in state:
            state[name] = type(state[name])((hook, value) for hook, value in state[name].items() if hook not in ids)
    return state


def hooks_and_keys(module: nn.Module) -> dict:
    """The keys of ``module.__dict__``, each dictionary's own keys beside it (hooks and their flags)."""
    return {key: set(value) if isinstance(value, dict) else None for key, value in vars(module).items()}


def added_since(before: dict, after: dict) -> Added:
    keys = frozenset(key for key in after if key not in before)
    hooks = tuple((key, frozenset(after[key] - before[key])) for key in after
                  if key in before and before[key] is not None and after[key] is not None and after[key] - before[key])
    return Added(keys=keys, hooks=hooks)
