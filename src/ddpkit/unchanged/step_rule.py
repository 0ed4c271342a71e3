"""Split or gathered: which way a loader's training steps take, decided from what the script's first step does with
its batch (``ddpkit run --unchanged``).

Two ways give one device's step. **Gathered** (DataParallel's): every process holds the whole batch, each model call
computes this process's rows of it, and its outputs are gathered, with their gradients, into the whole batch's on
every process; the script's own code after the model (its loss, its printed numbers, its draws) then runs on the
whole batch everywhere, as on one device. That is exact whatever the code does, and costs every process the whole
batch's loading and the code after the model. **Split**: the loader hands each process its share, and the script's
code runs on shares; that is exact only where the code is a mean over rows that ddpkit accounts for.

Each training pass's first step (whole, as a pass's first batch is) is taken the gathered way and watched
(``StepWatch``, a ``TorchFunctionMode`` on the script's code alone: it is set aside while a model's call runs), while
the loader is not gathered already. The step is **proven split** when everything that the script computes from the
batch and from the models' outputs, outside the models, is

- **row-wise**: elementwise arithmetic and functions of rows against constants (a Python number, a tensor of the
  script's own with no row dimension), conversions and moves, indexing and reductions along other dimensions than the
  rows', ``cat``/``stack`` along another dimension; and the rows merged with the dimensions after them into blocks of
  rows (``logits.view(-1, classes)``: each row of the result in one of the batch's, on any share);
- **a mean that ddpkit accounts for** on the split way: a loss of ``torch.nn.functional`` with ``reduction="mean"``
  (``counted``: its value is then the whole batch's), or a plain ``.mean()`` over everything (its gradient is weighed
  by the share; its value is the share's, so the script must not read it), then sums and constant multiples of such;
- and the backward starts from a mean valued whole (a loss that holds a plain ``.mean()`` is the share's, and a loop
  reads its loss after the step, where no watch sees it, as often as in it).

Anything else is not proven, and the loader's steps take the gathered way from then on (said once, with the first
reason seen): a product of rows with each other (``z @ z.t()``), a sum over the batch, a division by a count the
script computed, a ``cat`` of rows, sorting, any read of the batch's size or of its values (``inputs.size(0)``,
``B, T, V = logits.shape``, ``(preds == labels).sum()``, ``.item()`` of a share's mean; ``logits.size(-1)`` and
``logits.shape[-1]`` are another dimension's: ``subscript_read``), a random draw (diffusion's noise and timesteps:
torch's, and those from Python's or NumPy's streams, ``random_streams``), a tensor that trains read outside a model
(a learned temperature), a function not in the lists here. Unknown is gathered: the lists prove, they never guess.
And a tensor of the batch's rows (the batch's own, or computed from them) that the step leaves in a list, a dict or a
deque that the script held before the step (bound to a name of its frames, or to an attribute of an object bound
there): a loop that collects its predictions and labels to compute an epoch's accuracy after the loop would collect
a share's (``kept_rows``).
"""

from __future__ import annotations

import collections
import dataclasses
import random
import sys
import types
import weakref
from collections.abc import Callable, Mapping

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode
from torch.utils import _pytree as pytree

from ddpkit.unchanged.bytecode import index_at, instructions
from ddpkit.unchanged.callers import innermost, package

ROWS, LOSS, MEAN = "rows", "loss", "mean"  # kinds of tracked tensors: a batch's rows, a mean valued whole, a share's
BLOCKS = "rows*"  # and blocks of rows: "rows*K", K rows for each of the batch's, in order (a token's logits a row)
# Functions of one tensor's elements (and Tensor methods of the same names, in place or not).
ELEMENTWISE = frozenset("""abs absolute acos arccos acosh asin asinh atan atanh ceil clamp clamp_min clamp_max clip
cos cosh deg2rad digamma erf erfc erfinv exp exp2 expm1 fix floor frac lgamma log log10 log1p log2 logit nan_to_num
neg negative positive rad2deg reciprocal relu relu6 round rsqrt sigmoid sign sgn sin sinc sinh sqrt square tan tanh
trunc elu selu celu gelu silu mish softplus softsign hardtanh hardsigmoid hardswish leaky_relu logsigmoid tanhshrink
threshold float double half bfloat16 to cuda cpu contiguous detach clone type type_as
__neg__ __pos__ __abs__ __invert__ pow __pow__ __rpow__ float_power fill_ zero_ xlogy zeros_like ones_like full_like
empty_like logical_not isnan isinf isfinite""".split())
# Elementwise functions of two or more tensors (broadcast): row-wise where their rows are the same rows.
BINARY = frozenset("""add sub subtract mul multiply div divide true_divide floor_divide remainder fmod atan2 maximum
minimum fmax fmin hypot lerp addcmul addcdiv where masked_fill copysign logaddexp logaddexp2 __add__ __radd__ __iadd__
__sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__ __itruediv__ __div__ __rdiv__
__floordiv__ __mod__ eq ne lt le gt ge greater less greater_equal less_equal not_equal __eq__ __ne__ __lt__ __le__
__gt__ __ge__ logical_and logical_or logical_xor __and__ __or__ __xor__""".split())
# Functions along a dimension (``dim``, their second positional argument or keyword): row-wise along any but 0.
ALONG = {"softmax": 1, "log_softmax": 1, "normalize": 2, "sum": 1, "mean": 1, "amax": 1, "amin": 1, "logsumexp": 1,
         "cumsum": 1, "cumprod": 1, "norm": 2, "gather": 1, "squeeze": 1, "unsqueeze": 1, "flatten": 1,
         "cat": 1, "concat": 1, "concatenate": 1, "stack": 1, "prod": 1, "var": 1, "std": 1, "argmax": 1, "argmin": 1}
# Losses whose mean ddpkit accounts for on a split batch (``counted``); ``reduction="none"`` gives rows.
LOSSES = frozenset({"cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                    "binary_cross_entropy", "binary_cross_entropy_with_logits"})
DRAWS = frozenset("""rand randn randint randperm rand_like randn_like randint_like normal bernoulli multinomial poisson
normal_ uniform_ bernoulli_ random_ exponential_ geometric_ cauchy_ log_normal_ dropout dropout1d dropout2d
dropout3d alpha_dropout feature_alpha_dropout""".split())
# A tensor's properties that are not its values: their reads tell nothing of the batch's rows (``data`` is the tensor
# itself; ``shape`` is the batch's size, and ``T``, ``mT``, ``H``, ``mH`` turn its rows into columns).
NOT_NEUTRAL_PROPERTIES = frozenset({"shape", "T", "mT", "H", "mH", "real", "imag"})
# Methods that tell nothing of the values (hooks that libraries put on outputs, the memory's layout).
NEUTRAL_METHODS = frozenset({"register_hook", "retain_grad", "register_post_accumulate_grad_hook", "data_ptr",
                             "untyped_storage", "storage_offset", "stride", "is_contiguous", "element_size",
                             "get_device", "dim", "ndimension", "is_floating_point", "is_complex", "__hash__",
                             "requires_grad_", "record_stream", "_is_view", "is_shared", "is_pinned"})
READS_OF_A_MEAN = frozenset({"item", "__float__", "__format__", "__repr__", "__str__", "tolist", "numpy", "cpu",
                             "__int__", "__bool__", "__index__"})


class Unproven(Exception):
    """What the step did that is not proven exact on the split way (the message: the first such thing)."""


class Watch(TorchFunctionMode):
    """A torch function mode that ddpkit enters (``resume``) and leaves (``pause``) around parts of the script's code,
    and leaves only where it is torch's innermost mode (a mode that the script entered above it, and has not left,
    stays above it: ``pause`` then says False, and this one stays on)."""

    def __init__(self):
        super().__init__()
        self.on = False

    def resume(self) -> None:
        if not self.on:
            self.__enter__()
            self.on = True

    def pause(self) -> bool:
        if not self.on:
            return True
        if _get_current_function_mode() is not self:
            return False
        self.__exit__(None, None, None)
        self.on = False
        return True


class StepWatch(Watch):
    """Follows the tensors of one training step through the script's code (see the module): ``begin`` with the
    batch handed out, ``outputs`` of each model call (``pause``/``resume`` around it), ``end`` for the verdict."""

    def __init__(self, fewest_rows: int | None = None):
        super().__init__()
        # The rows of the smallest share that the loader's batches can give (None: not known): under 2, a share's
        # rows may be one, which a squeeze of every dimension of size 1 takes away.
        self.fewest_rows = fewest_rows
        self.keepers: dict[int, tuple[str, object]] = {}  # where the script could keep rows beyond the step (``begin``)
        self.streams: list[tuple[str, Callable[[], object]]] = []  # random streams the watch cannot see drawn from
        self.states: list = []  # their states where the script's code last resumed (``resume``)
        self.kinds: dict[int, tuple[weakref.ref, str]] = {}
        self.reason: str | None = None  # the first thing not proven
        self.backward = False  # a backward from a mean that ddpkit accounts for was seen
        self.trained = False  # a model was called to train while watching
        self.evaluated = False  # a model was called without training while watching
        self.rows = 0

    # -- the window -------------------------------------------------------------------------------------------------

    def begin(self, batch, frame: types.FrameType | None = None) -> None:
        """A batch handed out: its tensors whose first dimension is the batch's (the most common one) are its rows. A
        batch whose tensors cannot be found (a container of a kind not read here) proves nothing. ``frame``: where the
        batch is handed out, whose script frames' containers are looked into at the step's end (``kept_rows``)."""
        handed_out = containers_in(batch)  # (the batch itself, whatever holds it already, is no keeper)
        streams = random_stream_kinds()
        held = bound_in(frame, (*KEEPERS, *streams))
        self.keepers = {key: kept for key, kept in held.items()
                        if isinstance(kept[1], KEEPERS) and key not in handed_out}
        self.streams = random_streams([kept for kept in held.values() if isinstance(kept[1], streams)])
        tensors = [tensor for tensor in tensors_in(batch) if tensor.dim() > 0]
        sizes = [tensor.size(0) for tensor in tensors]
        if sizes:
            self.rows = max(set(sizes), key=sizes.count)
            for tensor in tensors:
                if tensor.size(0) == self.rows:
                    self.mark(tensor, ROWS)
        else:
            self.unproven(f"its batch holds no tensor that could be followed (a {type(batch).__name__})")
        self.resume()

    def resume(self) -> None:
        if not self.on:  # (what a model's call draws is the model's: the script's code draws from here)
            self.states = [_comparable(read()) for _, read in self.streams]
        super().resume()

    def pause(self) -> bool:
        """Out of torch's function modes while a model runs (its code is not the script's loop; a compiled model sees
        no mode of ours). False where another mode was pushed above ours: the step is then not proven. Where a random
        stream other than torch's moved since the script's code resumed, the script drew from it (a Beta draw for
        mixup from NumPy, a flip decided by ``random.random()``): on split batches each process would draw from a
        stream of its own, so the step is not proven."""
        if self.on and self.reason is None:
            for (name, read), state in zip(self.streams, self.states):
                if _comparable(read()) != state:
                    self.unproven(f"it draws at random outside the model ({name})")
                    break
        if super().pause():
            return True
        self.unproven("another torch function mode was entered during the step")
        return False

    def outputs(self, output, *, training: bool) -> None:
        """A model's call returned ``output``: its tensors with the batch's rows are rows, a loss it returned (one
        element, requiring grad) a mean valued whole (``at_the_model.whole_batch_losses`` makes it so). Read out of the
        mode: a call computed again, whole, from inside its own hook (``at_the_model.cut_as_tried``) has resumed it
        already, and these reads are ddpkit's, not the script's."""
        self.pause()
        self.trained = self.trained or training
        self.evaluated = self.evaluated or not training
        found = tensors_in(output)
        for leaf in found:
            if leaf.dim() > 0 and leaf.size(0) == self.rows:
                self.mark(leaf, ROWS)
            elif leaf.numel() == 1 and leaf.requires_grad:
                self.mark(leaf, LOSS)
        if not found and output is not None:
            self.unproven(f"a model returned no tensor that could be followed (a {type(output).__name__})")

    def end(self) -> str | None:
        """The verdict once the step is over: None where it is proven split, else what was not proven."""
        self.pause()
        if self.reason is None and not self.backward:
            self.unproven("no backward from a mean of the batch was seen")
        if self.reason is None:
            kept = self.kept_rows()
            if kept is not None:
                self.unproven(f"it keeps the batch's rows beyond the step, in {kept}")
        self.keepers.clear()
        self.kinds.clear()
        self.streams, self.states = [], []
        return self.reason

    def kept_rows(self) -> str | None:
        """Where the step left a tensor of the batch's rows in a container that the script held before it (``begin``):
        the last items of a list or a deque (appended), the last values of a dict, each looked into as ``tensors_in``
        does. On split batches that container would collect a share's rows, and what the script computes from it
        after the loop (an epoch's accuracy over the predictions collected) would be the share's. Containers made in
        the step (the batch moved to the device, ``{k: v.to(device) for ...}``) are the step's own, and not looked
        into."""
        for name, keeper in self.keepers.values():
            items = reversed(keeper.values()) if isinstance(keeper, dict) else reversed(keeper)
            for _, item in zip(range(KEEPER_ITEMS_READ), items):
                if any(_factor(self.kind(tensor)) for tensor in tensors_in(item)):
                    return f"{name}, a {type(keeper).__name__}"
        return None

    # -- what each function does to the kinds ----------------------------------------------------------------------

    def mark(self, tensor: torch.Tensor, kind: str) -> None:
        key = id(tensor)
        self.kinds[key] = (weakref.ref(tensor, lambda _: self.kinds.pop(key, None)), kind)

    def kind(self, value) -> str | None:
        held = self.kinds.get(id(value)) if isinstance(value, torch.Tensor) else None
        return held[1] if held is not None and held[0]() is value else None

    def unproven(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.reason is None:
            try:
                kind = self.follow(func, args, kwargs, result)
            except Unproven as why:
                self.unproven(str(why))
            except Exception as error:  # (a call whose arguments the rules do not read: not proven, and said so)
                self.unproven(f"{getattr(func, '__name__', func)} was called in a way the rules do not read "
                              f"({type(error).__name__}: {error})")
            else:
                if kind is not None:
                    for leaf in pytree.tree_leaves(result):
                        if isinstance(leaf, torch.Tensor):
                            self.mark(leaf, kind)
        return result

    def follow(self, func, args: tuple, kwargs: dict, result) -> str | None:
        """The kind of ``result`` (None: untracked), or ``Unproven``."""
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property of a tensor: func is the property's getter
            name = getattr(getattr(func, "__self__", None), "__name__", "")
            if name == "data":
                return self.kind(args[0])
            if name not in NOT_NEUTRAL_PROPERTIES:
                return None
            if name == "shape" and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
                index = subscript_read()
                if index is not None and index % args[0].dim() != 0:
                    return None  # (``logits.shape[-1]``: the size of another dimension than the rows', as ``size``)
        if name in NEUTRAL_METHODS:
            return None
        if name in DRAWS:
            raise Unproven(f"it draws at random outside the model ({name})")
        leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        kinds = [self.kind(leaf) for leaf in leaves]
        tracked = [kind for kind in kinds if kind is not None]
        if not tracked:
            return None
        if any(kind is None and leaf.requires_grad for leaf, kind in zip(leaves, kinds)):
            raise Unproven(f"a tensor that trains is used outside the model, with the batch's ({name})")
        if name in ("backward", "grad"):
            if MEAN in tracked:  # (its gradient would be one device's, but the loop may read its value after the step)
                raise Unproven("its backward starts from a mean that its share computes (.mean() of the batch's "
                               "rows), whose value the loop may read after the step")
            if set(tracked) <= {LOSS}:
                self.backward = True
                return None
            raise Unproven("its backward starts from something other than a mean over the batch")
        if any(_factor(kind) for kind in tracked):
            if LOSS in tracked or MEAN in tracked:
                raise Unproven(f"it combines the batch's rows with a mean ({name})")
            return self.of_rows(name, args, kwargs, leaves, kinds, result)
        return self.of_means(name, tracked, leaves, kinds)

    def of_rows(self, name, args, kwargs, leaves, kinds, result) -> str:
        factors = {_factor(kind) for kind in kinds} - {None}
        if len(factors) > 1:
            raise Unproven(f"it computes {name} of the batch's rows with blocks of its rows")
        factor = factors.pop()
        if name in LOSSES:
            reduction = kwargs.get("reduction", "mean")
            if kwargs.get("size_average") is not None or kwargs.get("reduce") is not None:
                raise Unproven(f"{name} with the legacy size_average or reduce")
            if reduction == "mean":
                return LOSS
            if reduction == "none":
                return self.rows_of(result, name, factor)
            raise Unproven(f"{name} with reduction={reduction!r} (a sum over the batch)")
        if name == "mean" and _dim(args, kwargs, 1) is None:
            return MEAN
        # Other tensors used with rows: constants that do not reach across rows (no dimension of their own matched
        # to the rows', or one of size 1).
        rows_rank = max(leaf.dim() for leaf, kind in zip(leaves, kinds) if _factor(kind))
        for leaf, kind in zip(leaves, kinds):
            if kind is None and leaf.dim() == rows_rank and leaf.size(0) != 1:
                raise Unproven(f"{name} of the batch's rows with a tensor of as many dimensions")
        in_place = name[:-1] if name.endswith("_") and not name.startswith("_") else name
        if in_place in ELEMENTWISE or in_place in BINARY:
            return self.rows_of(result, name, factor)
        if name in ALONG:
            dim = _dim(args, kwargs, ALONG[name])
            if dim is None and name == "squeeze" and (self.fewest_rows is None or self.fewest_rows < 2):
                raise Unproven("it squeezes every dimension of size 1 (squeeze), the rows' too on a share of one row")
            if dim is None and name in ("normalize", "squeeze"):
                return self.rows_of(result, name, factor)  # (normalize: along dimension 1; squeeze: rows_of checks)
            if dim is not None and 0 not in _dims(dim if isinstance(dim, (tuple, list)) else [dim], _rank(args)):
                return self.rows_of(result, name, factor)
            if name == "sum":
                raise Unproven("it sums over the batch")
        if name in ("flatten", "ravel", "view", "reshape") and _merges_rows(name, args, kwargs):
            # The rows merged with the dimensions after them, in order (``logits.view(-1, vocabulary)``,
            # ``labels.view(-1)``): each row of the result lies in one row of the batch where their number is a
            # multiple of the batch's, as on any share (a row's elements are as many on every share).
            size = result.size(0) if isinstance(result, torch.Tensor) and result.dim() > 0 else 0
            if size and size % self.rows == 0:
                return self.rows_of(result, name, size // self.rows)
        if name in ("flip", "roll"):  # (along the dimensions given; roll with none rolls the flattened tensor)
            dims = kwargs.get("dims", args[1:] if name == "flip" else args[2] if len(args) > 2 else None)
            dims = [dim for part in (dims if isinstance(dims, (tuple, list)) else [dims])
                    for dim in (part if isinstance(part, (tuple, list)) else [part])]
            if dims and None not in dims and 0 not in _dims(dims, args[0].dim()):
                return self.rows_of(result, name, factor)
        if name == "__getitem__" and _keeps_rows(args[1]):
            return self.rows_of(result, name, factor)
        if name in ("transpose", "swapaxes", "swapdims") and 0 not in _dims(
                [*args[1:3], *(kwargs.get(key) for key in ("dim0", "dim1", "axis0", "axis1"))], args[0].dim()):
            return self.rows_of(result, name, factor)
        if name in ("size", "shape", "__len__", "numel", "nelement") or name in READS_OF_A_MEAN:
            if name == "size" and len(args) > 1 and args[1] not in (0, -args[0].dim()):
                return None  # the size of another dimension than the rows'
            raise Unproven(f"it reads the batch's {'size' if name != 'item' else 'values'} ({name})")
        raise Unproven(f"it computes {name} over the batch's rows")

    def rows_of(self, result, name: str, factor: int = 1) -> str:
        """The kind of ``result``, of ``factor`` rows for each of the batch's (ROWS, or BLOCKS), where its tensors have
        them; else not proven."""
        tensors = [leaf for leaf in pytree.tree_leaves(result) if isinstance(leaf, torch.Tensor)]
        if tensors and all(tensor.dim() > 0 and tensor.size(0) == self.rows * factor for tensor in tensors):
            return ROWS if factor == 1 else f"{BLOCKS}{factor}"
        raise Unproven(f"{name} leaves the batch's rows")

    def of_means(self, name, tracked, leaves, kinds) -> str | None:
        if name in READS_OF_A_MEAN:
            if MEAN in tracked:
                raise Unproven(f"it reads a mean that its share computed ({name})")
            return None
        if name in ("add", "sub", "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__neg__",
                    "neg", "detach", "clone", "to", "float", "double", "half", "bfloat16", "cuda", "contiguous",
                    "add_", "sub_"):
            return MEAN if MEAN in tracked else LOSS
        if name in ("mul", "div", "__mul__", "__rmul__", "__imul__", "__truediv__", "__itruediv__", "mul_", "div_",
                    "true_divide") and len(tracked) == 1:
            others = [leaf for leaf, kind in zip(leaves, kinds) if kind is None]
            if name in ("div", "__truediv__", "__itruediv__", "div_", "true_divide") and kinds[0] is None:
                raise Unproven(f"it divides by a mean of the batch ({name})")
            if all(other.numel() == 1 for other in others):
                return MEAN if MEAN in tracked else LOSS
        raise Unproven(f"it computes {name} of a mean over the batch")


KEEPERS = (list, dict, collections.deque)  # what a loop collects its steps' tensors in
KEEPER_ITEMS_READ = 4  # of each, the items a step could have added last
KEPT_ATTRIBUTES_READ = 256  # an object bound in the script with more attributes is not looked into


def bound_in(frame: types.FrameType | None, kinds: tuple[type, ...]) -> dict[int, tuple[str, object]]:
    """The objects of ``kinds`` that the script's frames hold, from ``frame`` outwards past torch's, ddpkit's and
    Python's standard library's code: bound to a name there, or to an attribute of an object bound there (a trainer's
    ``self.outputs``), by id, with that name. Read from ``f_locals`` (a module's frame: its globals), never written."""
    found: dict[int, tuple[str, object]] = {}
    while frame is not None:
        if package(frame) not in sys.stdlib_module_names and package(frame) not in ("torch", "ddpkit"):
            for name, value in list(frame.f_locals.items()):
                if isinstance(value, kinds):
                    found.setdefault(id(value), (name, value))
                    continue
                if isinstance(value, (types.ModuleType, type, types.FunctionType, torch.Tensor, *KEEPERS)):
                    continue
                attributes = _attributes(value)
                if len(attributes) > KEPT_ATTRIBUTES_READ:
                    continue
                for attribute, held in list(attributes.items()):
                    if isinstance(held, kinds):
                        found.setdefault(id(held), (f"{name}.{attribute}", held))
        frame = frame.f_back
    return found


def random_stream_kinds() -> tuple[type, ...]:
    """The kinds of random stream objects that a script may hold and draw from without a torch function: Python's
    ``random.Random``, and NumPy's ``Generator`` and ``RandomState`` where NumPy is imported."""
    numpy = sys.modules.get("numpy")
    return (random.Random,) if numpy is None else (random.Random, numpy.random.Generator, numpy.random.RandomState)


def random_streams(held: list[tuple[str, object]]) -> list[tuple[str, Callable[[], object]]]:
    """The random streams other than torch's that the script's code can draw from, each with a way to read its state:
    Python's ``random`` and NumPy's global ones (where NumPy is imported), and those ``held`` by the script's frames
    (``bound_in``, with their names). torch's draws are calls that the watch sees (``DRAWS``); these are not."""
    streams: list[tuple[str, Callable[[], object]]] = [("Python's random", random.getstate)]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        streams.append(("NumPy's random", numpy.random.get_state))
    for name, stream in held:
        if isinstance(stream, random.SystemRandom):  # (the system's entropy: no state, and one device's is not
            continue  # repeatable either)
        read = stream.getstate if isinstance(stream, random.Random) else stream.get_state \
            if isinstance(stream, numpy.random.RandomState) else (lambda stream=stream: stream.bit_generator.state)
        streams.append((f"{name}, a {type(stream).__name__}", read))
    return streams


def _comparable(state):
    """A random stream's state as a value that ``==`` compares (NumPy's hold arrays)."""
    if isinstance(state, Mapping):
        return tuple((key, _comparable(value)) for key, value in sorted(state.items()))
    if isinstance(state, (list, tuple)):
        return tuple(_comparable(value) for value in state)
    tobytes = getattr(state, "tobytes", None)
    return tobytes() if callable(tobytes) else state


def containers_in(value, depth: int = 0) -> set[int]:
    """The ids of ``value`` and of the containers inside it, as ``tensors_in`` walks them."""
    items = None if depth > 8 else _items(value)
    return set() if items is None else {id(value)}.union(*(containers_in(item, depth + 1) for item in items))


def _attributes(value) -> dict:
    """``value``'s instance attributes, read past any ``__getattr__`` of its class; none where it has no ``__dict__``
    (``__slots__``, a built-in's instance)."""
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except (AttributeError, TypeError):  # no __dict__ to read: it keeps nothing there
        return {}
    return attributes if isinstance(attributes, dict) else {}


def tensors_in(value, depth: int = 0) -> list[torch.Tensor]:
    # (Not pytree's leaves, which miss a UserDict such as BatchEncoding; not ``gathered.map_tensors``, which rebuilds
    # each container and reads dicts only, as the gather must.)
    """The tensors in ``value``: itself, or inside mappings of any kind (a dict, transformers' ``BatchEncoding`` and
    ``ModelOutput``), lists, tuples and dataclasses, at any depth."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = None if depth > 8 else _items(value)
    return [] if items is None else [tensor for item in items for tensor in tensors_in(item, depth + 1)]


def _items(value) -> list | None:
    """What a container that ``tensors_in`` walks holds (a mapping's values, a list's or tuple's items, a dataclass's
    fields); None for anything else."""
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, field.name) for field in dataclasses.fields(value)]
    return None


def _rank(args: tuple) -> int:
    first = args[0] if args else None
    if isinstance(first, (list, tuple)) and first:
        first = first[0]
    return first.dim() if isinstance(first, torch.Tensor) else 0


def _dim(args: tuple, kwargs: dict, position: int):
    for key in ("dim", "axis", "start_dim"):
        if key in kwargs:
            return kwargs[key]
    value = args[position] if len(args) > position else None
    return value if isinstance(value, (int, tuple, list)) and not isinstance(value, bool) else None


def _dims(values, rank: int) -> set[int]:
    return {value % rank for value in values if isinstance(value, int)} if rank else set()


def subscript_read() -> int | None:
    """The number with which the script's code subscripts the attribute it is reading now (``logits.shape[-1]``), read
    from its instructions after that read; None where it does anything else with it (unpacks it, keeps it, subscripts
    it with a name or a slice). Its frame is the innermost that is neither torch's, ddpkit's nor Python's own."""
    frame = innermost(sys._getframe(1), ("torch", "ddpkit"))
    if frame is None:
        return None
    listed, at = instructions(frame.f_code), index_at(frame.f_code, frame.f_lasti)
    if at is None or at + 2 >= len(listed) or not listed[at].opname.startswith("LOAD_ATTR"):
        return None
    number, subscript = listed[at + 1], listed[at + 2]
    if number.opname not in ("LOAD_CONST", "LOAD_SMALL_INT") or type(number.argval) is not int:
        return None
    if subscript.opname == "BINARY_SUBSCR" or subscript.opname == "BINARY_OP" and subscript.argrepr == "[]":
        return number.argval
    return None


def _factor(kind: str | None) -> int | None:
    """The rows that a tensor of ``kind`` holds for each of the batch's: 1 for ROWS, K for BLOCKS; None for others."""
    if kind == ROWS:
        return 1
    return int(kind[len(BLOCKS):]) if kind is not None and kind.startswith(BLOCKS) else None


def _merges_rows(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a ``flatten``, ``ravel``, ``view`` or ``reshape`` call merges the rows with the dimensions after them
    (from dimension 0: ``flatten()``, ``flatten(0, k)``) or asks for a first dimension of whatever size the rest leaves
    (``view(-1, ...)``, the other sizes given as numbers): on any share its result is the share's part of the batch's
    result. A shape with the batch's size in it (``view(4, -1)``) would cut a share's rows otherwise."""
    if name in ("flatten", "ravel"):
        start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
        return isinstance(start, int) and start % max(args[0].dim(), 1) == 0
    shape = kwargs.get("shape", kwargs.get("size"))
    if shape is None:
        shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    return bool(shape) and shape[0] == -1 and all(isinstance(size, int) and not isinstance(size, bool)
                                                  for size in shape)


def _keeps_rows(index) -> bool:
    """Whether indexing with ``index`` keeps every row in order (a full slice first, or an Ellipsis before the rest)."""
    first = index[0] if isinstance(index, tuple) and index else index
    if first is Ellipsis:
        return not isinstance(index, tuple) or all(part is None or isinstance(part, (slice, int))
                                                   for part in index[1:])
    return isinstance(first, slice) and first == slice(None) and isinstance(index, tuple)
