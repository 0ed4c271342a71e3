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

The module and its layers keep their own classes (``replicate`` gives the module a subclass of its class, which only
adds methods that ddpkit has called by then: the class is put back). A copy of such a module is a plain one:
``copy.deepcopy``, ``pickle`` and ``torch.save(model)`` give the module's own class (and BatchNorm's), holding its
weights, without what ``replicate`` and ddpkit put on it (hooks and state: ``keep_plain``), as one device would have
it: an EMA or best-model copy trains and evaluates on its own, a saved file loads where ddpkit was never imported, and
its pickle names the globals that one device's names (``torch.load`` with ``weights_only`` and the script's own
``safe_globals`` reads it).
"""

import dataclasses
import types
import weakref
from collections.abc import Callable  # (no postponed annotations: DDP reads the hook's)

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate import replicate

from ddpkit.strategies.sync_bn import forward_over_all_ranks

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
    # replicate's class (DDP<Name>) only adds methods, the last of which ran just now; its hooks, which do DDP's work,
    # are the instance's. The module's own class again: what pickles it then names that class, as one device's does.
    module.__class__ = plain
    keep_plain(module, added_since(before, hooks_and_keys(module)))


def weighted_all_reduce(weight: Weight, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the sum over ranks of each rank's gradients times its ``weight()``."""
    buffer = bucket.buffer()
    buffer.mul_(weight())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda done: done.value()[0])


def batch_norm_over_all_ranks(module: nn.Module, weight: Weight, whole: Callable[[], bool], *,
                              scaled: bool = False) -> None:
    """Every BatchNorm layer of ``module`` normalises over all ranks' batches in training, in place (but while
    ``whole()``: every rank holds the whole batch); ``scaled``: the gradients reaching them are weighted already
    (``sync_bn.synced_batch_norm``). Each layer keeps its class: its ``forward`` is the instance's own, as a library's
    hooks set it (a pickle of the layer names its class alone)."""
    for layer in module.modules():
        if not isinstance(layer, nn.modules.batchnorm._BatchNorm):
            continue
        for key, value in (("share", weight), ("whole", whole), ("scaled", scaled),
                           ("forward", types.MethodType(forward_over_all_ranks, layer))):
            object.__setattr__(layer, key, value)
        keep_plain(layer, Added(keys=frozenset({"share", "whole", "scaled", "forward"})))


@dataclasses.dataclass(frozen=True)
class Added:
    """What was put on a module in place: attributes (``keys`` of its ``__dict__``) and hooks (``hooks``: the name of
    each hook dictionary, such as ``_forward_pre_hooks``, and the ids added to it)."""

    keys: frozenset = frozenset()
    hooks: tuple = ()


_added: weakref.WeakKeyDictionary[nn.Module, Added] = weakref.WeakKeyDictionary()


def keep_plain(module: nn.Module, added: Added) -> None:
    """Copies of ``module`` (``copy.deepcopy``, ``pickle``, ``torch.save``) without ``added``, what was put on it in
    place: its state for them (``__getstate__``, the instance's own, which both read) leaves it out."""
    before = _added.get(module, Added())
    _added[module] = Added(keys=before.keys | added.keys | {"__getstate__"}, hooks=before.hooks + added.hooks)
    if "__getstate__" not in vars(module):
        object.__setattr__(module, "__getstate__", types.MethodType(_plain_state, module))


def _plain_state(module: nn.Module) -> dict:
    return state_without(module, Added())


def state_without(module: nn.Module, added: Added) -> dict:
    """``module``'s state (a new dictionary), without what was ``added`` to it in place, nor what ``keep_plain``
    recorded."""
    state = dict(type(module).__getstate__(module))  # (the class's: the instance's own is this function's caller)
    for each in (_added.get(module, Added()), added):
        for key in each.keys:
            state.pop(key, None)
        for name, ids in each.hooks:
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
