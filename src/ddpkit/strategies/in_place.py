"""DDP on a model object that the script keeps holding (``ddpkit run --unchanged``): a ``Replica`` holds DDP's
reducer (bucketed all-reduces that overlap the backward pass) over the module's own parameters, as PyTorch's
composable ``replicate`` builds it, and the root call's hooks run DDP's forward halves around each training call. No
wrapper, and nothing of DDP's on the module: the script's ``model`` is still its own object of its own class, its
``state_dict()`` keys are unchanged.

    >>> replica = Replica(model, weight=lambda: 0.5)         # doctest: +SKIP

What differs from DDP's own averaging is the weight: rank r's gradient counts ``weight()`` (its share of the
batch, ``ddpkit.data.split_batches``), not 1 / world size, so that an uneven batch gives the gradient of the whole
batch. The weights of a batch sum to 1 over the ranks; a gradient accumulated over several backward passes therefore
keeps what earlier passes left in ``.grad`` (the same on every rank) as it is.

BatchNorm layers in training normalise over every rank's batch together (``sync_bn.OverAllRanks``): each layer keeps
its class, its synchronised forward its own attribute.

A copy of such a module is a plain one: ``copy.deepcopy``, ``pickle`` and ``torch.save(model)`` give the module's own
class (and BatchNorm's), holding its weights, without what ddpkit put on it (hooks and state: ``keep_plain``), as one
device would have it: an EMA or best-model copy trains and evaluates on its own, a saved file loads where ddpkit was
never imported, and its pickle names the globals that one device's names (``torch.load`` with ``weights_only`` and the
script's own ``safe_globals`` reads it).
"""

import contextlib
import dataclasses
import inspect
import types
import weakref
from collections.abc import Callable  # (no postponed annotations: DDP reads the hook's)

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel import distributed as ddp_code
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger
from ddpkit.strategies.sync_bn import forward_over_all_ranks

Weight = Callable[[], float]


class Replica:
    """DDP's reducer on a module the script keeps holding: DistributedDataParallel over the module's own parameters
    (as PyTorch's composable ``replicate`` builds it), its forward's two halves called from the root call's hooks
    (``before``, ``after``: ``ddpkit.unchanged.models``), the module untouched by it.

    DDP's own rules are met for the script, from what its steps show (docs/unchanged.md, "DDP's rules"). The reducer's
    first step is a probe: DDP's static graph, whose first iteration reduces every gradient at the end of the backward
    pass, whatever the graph (unused parameters, reentrant activation checkpointing). The graph of that step's calls
    decides the reducer for the steps after it, the same on every rank (what any rank's graph needs): a graph through
    reentrant checkpointing keeps the static graph; one that leaves trainable parameters unreached gets
    ``find_unused_parameters`` (their gradients left as one device leaves them); any other, neither (nothing to pay
    where nothing goes unused). A change of which parameters require a gradient (a backbone unfrozen, a layer frozen)
    starts a probe again, over the parameters that train now."""

    def __init__(self, module: nn.Module, *, weight: Weight, whole: Callable[[], bool] = lambda: False,
                 find_unused: bool = False):
        with torch.no_grad():
            for buffer in module.buffers():
                dist.broadcast(buffer, src=0)  # the parameters DDP broadcasts itself, when it is built
        batch_norm_over_all_ranks(module, weight, whole)
        self.name = type(module).__name__
        self.weight = weight
        self.parameters = list(module.parameters())
        # (Layers whose gradients are sparse: DDP expects one from a parameter's own layer, ``reduced_over``.)
        self.sparse = sparse_layers(module)
        self.find_unused = find_unused  # look for unused parameters at every step, whatever the probe showed
        self.ddp: DistributedDataParallel | None = None
        self.trains: tuple[bool, ...] = ()  # which parameters required a gradient when ``ddp`` was built
        self.mode = ""  # how ``ddp`` was built: ``MODES``
        self.needed = -1  # during a probe: the index in ``MODES`` of what its calls' graphs need so far
        # Trained on whole batches cut at the model (``ddpkit.unchanged``'s gathered way): a step may leave outputs
        # unused (a loss term that some batches have), which DDP meets only when it looks for unused parameters.
        self.outputs_may_go_unused = False
        # Its first step's forward read its tensors' values (a branch on its data: ``ddpkit.unchanged.branches``): a
        # later step may leave parameters unused that this one used.
        self.reads_its_data = False
        # Then, a backward's parameters that an unused output left without a gradient (DDP zero-fills those it
        # reduces; one device leaves them None), and those that got one: ``untouched_again``.
        self.untouched: set[int] = set()
        self.received: set[int] = set()
        self.reduced = False  # the reducer's last backward pass reduced its last bucket
        self.retired: DistributedDataParallel | None = None  # the one before ``ddp``, kept a while (``build``)

    def before(self, args: tuple, *, begin: bool = True, unused: bool = False) -> None:
        """A training call begins (gradients on, the module in training mode). ``begin``: DDP's forward with it (else
        ``begin`` is called once the forward showed it is one: DDP is built here all the same, as it broadcasts).
        ``unused``: the call's outputs are gathered from a whole batch (the same on every rank), and a step may leave
        some of them unused: DDP looks for unused parameters from then on (built again once, where it did not)."""
        trains = self.trainable()
        if self.retired is not None and self.reduced:
            self.retired = None  # (the new reducer reduced a backward: the graph of the step before is done)
        if unused and not self.outputs_may_go_unused:
            self.outputs_may_go_unused = True
            self.follow_gradients()
            if self.ddp is not None and self.needed < 0 and self.mode == "plain":
                self.build(trains, "unused parameters", synced=True)
        self.untouched_again()
        if self.ddp is not None and self.trains != trains:
            self.ddp = None  # a probe again, over the parameters that train now
        elif self.needed >= 0 and self.reduced:  # the probe's step is over: the reducer it showed is needed
            mode, self.needed = MODES[max(self.needed, int(self.outputs_may_go_unused))], -1
            if mode != self.mode:
                self.build(trains, mode, synced=True)
        if self.ddp is None:
            if not any(trains):
                return  # nothing trains now: nothing to average
            self.build(trains, "static graph", synced=bool(self.mode))  # (rank 0's since the first was built)
            self.needed = 0
        if begin:
            self.begin(args)

    def begin(self, args: tuple = ()) -> None:
        """DDP's forward begins (its reducer prepared for a backward pass)."""
        if self.ddp is None:
            return
        DistributedDataParallel._active_ddp_module = self.ddp  # (what torch.compile's DDP optimizer reads)
        try:
            self.ddp._pre_forward(*args)
        except RuntimeError as error:
            if "Expected to have finished reduction in the prior iteration" not in str(error):
                raise
            raise UsageError(f"--unchanged: {self.name} left parameters without a gradient in its last step, and "
                             "used them all at its first, so DDP did not look for unused ones and that step's "
                             "gradients were not averaged: run with --find-unused-parameters (DDP's "
                             "find_unused_parameters at every step)", said_elsewhere=dist.get_rank() != 0) from None

    def after(self, output):
        """The call's ``output``, as DDP's forward returns it."""
        self.unwound()
        if self.ddp is None:
            return output
        if self.needed >= 0:
            self.needed = max(self.needed, MODES.index(self.needs(output)))
        return self.ddp._post_forward(output)

    @staticmethod
    def unwound() -> None:
        """The call is over, or raised: no DDP forward goes on (as DDP's own forward clears it, in a ``finally``)."""
        DistributedDataParallel._active_ddp_module = None

    def follow_gradients(self) -> None:
        """Note, for each parameter, whether a backward gave it a gradient or left it as it was: where a step left a
        parameter without one, DDP's reducer writes it zeros all the same, which ``untouched_again`` takes back before
        the next forward or optimizer step. (Each parameter's own post-accumulate hook, which PyTorch calls before
        DDP's reducer writes, and which a copy of the parameter does not carry; one optimizer step pre-hook.)"""
        for parameter in self.parameters:
            parameter.register_post_accumulate_grad_hook(self._accumulated)
        _UNTOUCHED.add(self)
        if not _STEP_HOOK:
            _STEP_HOOK.append(register_optimizer_step_pre_hook(_untouched_again_everywhere))

    def _accumulated(self, parameter: torch.Tensor) -> None:
        (self.received if parameter.grad is not None else self.untouched).add(id(parameter))

    def untouched_again(self) -> None:
        """The parameters that the last backward passes left without a gradient, and that none gave one to, without
        one again (as on one device: an optimizer skips them)."""
        if not self.untouched:
            self.received.clear()
            return
        for parameter in self.parameters:
            if id(parameter) in self.untouched and id(parameter) not in self.received:
                parameter.grad = None
        self.untouched.clear()
        self.received.clear()

    def trainable(self) -> tuple[bool, ...]:
        return tuple(parameter.requires_grad for parameter in self.parameters)

    def build(self, trains: tuple[bool, ...], mode: str, *, synced: bool = False) -> None:
        """DDP over the parameters, as ``mode`` (``MODES``) says; ``synced``: they are rank 0's already (DDP need not
        broadcast them again, where its release can be told so)."""
        logger.debug(f"--unchanged: {self.name}'s DDP built over {sum(trains)} trainable parameters ({mode})")
        # The reducer before it goes, its hooks with it; but one whose outputs pass through DDP's own autograd
        # function (a static graph's first iteration, or unused parameters looked for), which holds it weakly, is
        # kept until the new one has reduced: a graph that the step made through it may still run backward (a
        # gradient taken with create_graph=True, before the model's next call in the same step).
        self.retired = self.ddp if self.mode in ("static graph", "unused parameters") else None
        self.ddp = None
        with _not_broadcast(synced and not INIT_SYNC):
            spare = mode == "unused parameters" and not self.find_unused  # (ddpkit's decision, not the flag's)
            self.ddp = DistributedDataParallel(reduced_over(self.parameters, self.sparse, spare=spare),
                                               static_graph=mode == "static graph",
                                               find_unused_parameters=mode == "unused parameters",
                                               **({"init_sync": False} if synced and INIT_SYNC else {}))
        self.ddp.register_comm_hook(self, Replica.reduce)
        self.trains, self.mode, self.reduced = trains, mode, False

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's communication hook: ``weighted_all_reduce``, the last bucket of a backward pass noted."""
        if bucket.is_last():
            self.reduced = True
        return weighted_all_reduce(self.weight, bucket)

    def needs(self, output) -> str:
        """What ``output``'s graph needs of DDP on every rank (``MODES``): the most that any rank's needs."""
        reached, reentrant = graph_of(output)
        unused = self.find_unused or self.outputs_may_go_unused or self.reads_its_data or any(
            train and id(parameter) not in reached for train, parameter in zip(self.trains, self.parameters))
        mode = 2 if reentrant else 1 if unused else 0
        decided = torch.tensor([mode], device=self.parameters[0].device)
        dist.all_reduce(decided, op=dist.ReduceOp.MAX)
        return MODES[int(decided.item())]


def sparse_layers(module: nn.Module) -> list[nn.Module]:
    """``module``'s layers whose gradients are sparse: an ``Embedding`` or ``EmbeddingBag`` with ``sparse=True``."""
    return [layer for layer in module.modules() if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.sparse]


def reduced_over(parameters: list[nn.Parameter], sparse: list[nn.Module], *, spare: bool = False) -> nn.Module:
    """What a ``Replica``'s DDP is built over: ``parameters`` in a ``ParameterList``, but for those of the ``sparse``
    layers (an ``Embedding`` or ``EmbeddingBag`` with ``sparse=True``), held by their own layer, from which DDP learns
    that their gradients are sparse (built over a list alone, it reads a sparse gradient as dense, and fails).
    ``spare``: one more parameter of one element, of ddpkit's, that no step uses (DDP looks for unused parameters,
    where ddpkit decided that a step may leave some: it then finds one at every step, and does not warn, at a step
    that used all of the model's, that the user should turn off a flag they never set)."""
    in_layers = {id(layer.weight) for layer in sparse}
    holder = nn.Module()
    if spare:
        holder.spare = nn.Parameter(torch.zeros(1, device=parameters[0].device))
    holder.dense = nn.ParameterList([parameter for parameter in parameters if id(parameter) not in in_layers])
    for index, layer in enumerate(sparse):
        holder.add_module(f"sparse{index}", layer)  # (a reference: the layer itself is not changed)
    return holder


MODES = ("plain", "unused parameters", "static graph")
INIT_SYNC = "init_sync" in inspect.signature(DistributedDataParallel).parameters  # (torch 2.5 and later)


@contextlib.contextmanager
def _not_broadcast(skipped: bool):
    """Before torch 2.5 (no ``init_sync=False``), DDP built again over parameters that are rank 0's already (its
    mode changed) broadcasts them all the same, in place: each parameter's version moves on, and a graph that saved
    it before (a gradient penalty's, made with ``create_graph=True``, differentiated after the model's next call)
    fails in its backward, where one device's would not. Where ``skipped``, torch's ``_sync_module_states``, as the
    DDP module calls it, does nothing for the time of that one build (a private function of torch's, put back)."""
    if not skipped:
        yield
        return
    original = ddp_code._sync_module_states
    ddp_code._sync_module_states = lambda **_: None
    try:
        yield
    finally:
        ddp_code._sync_module_states = original


_UNTOUCHED: weakref.WeakSet = weakref.WeakSet()  # replicas that follow which parameters a backward left untouched
_STEP_HOOK: list = []  # the optimizer step pre-hook that takes their zeros back, once registered


def _untouched_again_everywhere(optimizer, args, kwargs) -> None:
    for replica in list(_UNTOUCHED):
        replica.untouched_again()


def graph_of(output) -> tuple[set[int], bool]:
    """The ids of the leaf tensors that ``output``'s autograd graph reaches, and whether it runs through reentrant
    activation checkpointing (whose forward ran without a graph: its parameters are reached in its backward only)."""
    tensors = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
    nodes = [tensor.grad_fn for tensor in tensors if tensor.grad_fn is not None]
    leaves = {id(tensor) for tensor in tensors if tensor.is_leaf}
    seen, reentrant = set(nodes), False
    while nodes:
        node = nodes.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        reentrant = reentrant or type(node).__name__ == "CheckpointFunctionBackward"
        for following, _ in node.next_functions:
            if following is not None and following not in seen:
                seen.add(following)
                nodes.append(following)
    return leaves, reentrant


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
