"""Cutting a model into consecutive pieces: the ground both model parallel and pipeline parallel stand on.

    >>> from ddpkit.zoo import build_model
    >>> model = build_model("convnet", in_channels=3, num_classes=10, image_size=32)
    >>> [name for name, _ in pieces(model)]
    ['conv2d', '_flatten', 'fc']
    >>> [[name for name, _ in part] for part in balanced(pieces(model), 2)]
    [['conv2d', '_flatten'], ['fc']]

A model can be cut when its forward is its parts applied one after the other. ddpkit knows that of
``nn.Sequential``, of its own ``net`` and ``convnet``, and of the torchvision families in
``TORCHVISION_LAYOUTS``; any other model can say it by defining ``pipeline_pieces()``, returning
``[(name, module), ...]`` in forward order, where each name is the module's attribute path in the
model (``"layer3.0"``) or, for a parameterless step the forward does with a function, a new name
starting with ``_``. A child that is itself an ``nn.Sequential`` is opened into its children, so a
ResNet can be cut between two blocks of ``layer3``.

Each part becomes a ``Pieces`` module whose state_dict keys are the original model's (``layer3.0.conv1.weight``),
so the parts' state_dicts together are the model's state_dict, and ``model.pt`` stays loadable into
the bare model.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddpkit.core.errors import UsageError

# torchvision classifiers whose forward is these children in this order, with a flatten where named.
TORCHVISION_LAYOUTS = {
    "ResNet": ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "_flatten", "fc"),
    "VGG": ("features", "avgpool", "_flatten", "classifier"),
    "AlexNet": ("features", "avgpool", "_flatten", "classifier"),
    "MobileNetV3": ("features", "avgpool", "_flatten", "classifier"),
    "EfficientNet": ("features", "avgpool", "_flatten", "classifier"),
    "ConvNeXt": ("features", "avgpool", "classifier"),
    "RegNet": ("stem", "trunk_output", "avgpool", "_flatten", "fc"),
}


def pieces(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model as ``(name, module)`` steps in forward order; UsageError when ddpkit cannot tell them."""
    if hasattr(model, "pipeline_pieces"):
        steps = list(model.pipeline_pieces())
    elif isinstance(model, nn.Sequential):
        steps = list(model.named_children())
    elif type(model).__name__ in TORCHVISION_LAYOUTS:
        steps = [(name, nn.Flatten(1) if name == "_flatten" else model.get_submodule(name))
                 for name in TORCHVISION_LAYOUTS[type(model).__name__]]
    else:
        known = ", ".join(["nn.Sequential", "net", "convnet", *TORCHVISION_LAYOUTS])
        raise UsageError(
            f"cannot cut model {type(model).__name__} into stages: ddpkit does not know the order of its forward "
            f"(it knows {known}); define pipeline_pieces() on the model (see ddpkit.strategies.split)"
        )
    return _open_sequentials(steps)


def _open_sequentials(steps: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    opened = []
    for name, module in steps:
        if type(module) is nn.Sequential and len(module) > 0:
            opened.extend(_open_sequentials([(f"{name}.{child}", sub) for child, sub in module.named_children()]))
        else:
            opened.append((name, module))
    return opened


def parameter_count(part: list[tuple[str, nn.Module]]) -> int:
    return sum(p.numel() for _, module in part for p in module.parameters())


def balanced(steps: list[tuple[str, nn.Module]], parts: int) -> list[list[tuple[str, nn.Module]]]:
    """``parts`` consecutive runs of ``steps``, each with weights, the largest run as small as possible.

    Cuts fall only just before a piece with weights: a parameterless step (ReLU, pooling, flatten) stays
    with the piece before it, which also sends the smaller, pooled activation to the next stage.
    """
    if parts < 1:
        raise UsageError(f"a model is cut into at least 1 part, got {parts}")
    # Units: a piece with weights and the parameterless steps after it (leading ones join the first).
    starts = [i for i, step in enumerate(steps) if parameter_count([step]) > 0][1:]
    if len(starts) + 1 < parts:
        raise UsageError(f"the model has {len(starts) + 1} pieces with weights, too few for {parts} stages "
                         f"(its pieces: {_listing([name for name, _ in steps])})")
    bounds = [0, *starts, len(steps)]
    weights = [parameter_count(steps[a:b]) for a, b in zip(bounds, bounds[1:])]
    groups = _linear_partition(weights, parts)
    cuts = [bounds[sum(groups[:k])] for k in range(1, parts)]
    edges = [0, *cuts, len(steps)]
    return [steps[a:b] for a, b in zip(edges, edges[1:])]


def _linear_partition(weights: list[int], parts: int) -> list[int]:
    """How many consecutive weights go into each of ``parts`` groups (each at least one) so that the
    heaviest group is as light as possible: the textbook dynamic programme, O(parts x n^2)."""
    n = len(weights)
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    inf = float("inf")
    # best[k][i]: the lightest possible heaviest group for the first i weights in k groups.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], choice[k][i] = cost, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        sizes.append(i - choice[k][i])
        i = choice[k][i]
    return sizes[::-1]


def _listing(names: list[str], limit: int = 12) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def at_names(steps: list[tuple[str, nn.Module]], names: list[str]) -> list[list[tuple[str, nn.Module]]]:
    """Cut before each named piece (``layer3`` means the first piece inside it, ``layer3.0``)."""
    order = [name for name, _ in steps]
    cuts = []
    for name in names:
        found = [i for i, step in enumerate(order) if step == name or step.startswith(name + ".")]
        if not found:
            raise UsageError(f"`split_at` {name}: no such piece; the model's pieces are {_listing(order)}")
        if found[0] == 0:
            raise UsageError(f"`split_at` {name}: that is the model's first piece; a cut there leaves an empty stage")
        cuts.append(found[0])
    if cuts != sorted(set(cuts)):
        raise UsageError(f"`split_at` {','.join(names)}: the names must be distinct and in forward order")
    bounds = [0, *cuts, len(steps)]
    return [steps[a:b] for a, b in zip(bounds, bounds[1:])]


def cut(model: nn.Module, parts: int, split_at: list[str] | None = None) -> list[list[tuple[str, nn.Module]]]:
    """The model's pieces in ``parts`` runs: at ``split_at`` names when given, else balanced by parameters."""
    steps = pieces(model)
    if split_at:
        if len(split_at) != parts - 1:
            raise UsageError(f"`split_at` names {len(split_at)} cut(s), which makes {len(split_at) + 1} stages, "
                             f"but there are {parts}; name {parts - 1}")
        runs = at_names(steps, split_at)
        for index, run in enumerate(runs):
            if parameter_count(run) == 0:  # nothing to train there: its optimizer would have no parameters
                raise UsageError(f"`split_at` {','.join(split_at)}: stage {index + 1} ({_listing([n for n, _ in run], 4)}) "
                                 "holds no weights; move the cut to a layer with weights")
        return runs
    return balanced(steps, parts)


class Pieces(nn.Module):
    """Some consecutive pieces of a model, run in order, each on its own device.

    The pieces sit under their original attribute paths, so ``state_dict()`` has the model's own keys.
    Activations move to the next piece's device in the forward (and gradients back in the backward).
    """

    def __init__(self, steps: list[tuple[str, nn.Module]], devices: list[torch.device] | None = None):
        super().__init__()
        devices = devices or [None] * len(steps)
        self._steps: list[tuple[nn.Module, torch.device | None]] = []
        for (name, module), device in zip(steps, devices):
            *parents, leaf = name.split(".")
            holder: nn.Module = self
            for parent in parents:
                if not hasattr(holder, parent):
                    # A Sequential opened into pieces: keep its name so the keys stay "layer3.0...".
                    holder.add_module(parent, nn.Sequential())
                holder = getattr(holder, parent)
            holder.add_module(leaf, module.to(device) if device is not None else module)
            self._steps.append((module, device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module, device in self._steps:
            if device is not None and x.device != device:
                x = x.to(device)
            x = module(x)
        return x


def model_parallel(model: nn.Module, devices: list[torch.device | str], split_at: list[str] | None = None) -> Pieces:
    """The model cut into ``len(devices)`` parts, part k on ``devices[k]``, in one process.

        >>> from ddpkit.zoo import build_model
        >>> model = build_model("net", in_channels=1, num_classes=10, image_size=28)
        >>> split = model_parallel(model, ["cpu", "cpu"])
        >>> split(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])

    Wrap the result in DDP with ``device_ids=None`` to run one such model per process.
    """
    if not devices:
        raise UsageError("model parallel needs at least one device")
    devices = [torch.device(device) for device in devices]
    parts = cut(model, len(devices), split_at)
    steps = [step for part in parts for step in part]
    placed = [device for part, device in zip(parts, devices) for _ in part]
    return Pieces(steps, placed)
