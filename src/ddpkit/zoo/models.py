"""The tutorials' two CNNs and torchvision's classifiers, by name; a model of the user's own as
``package.module:function``.

    >>> from ddpkit.zoo import build_model
    >>> build_model("net", in_channels=1, num_classes=10, image_size=28).fc1.in_features
    1600
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.core.errors import UsageError, first_line
from ddpkit.zoo import user_code


class Net(nn.Module):
    """The tutorials' MNIST CNN: two conv + BatchNorm blocks, two linear layers, log-probabilities out."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=3, stride=1)
        self.n1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, stride=1)
        self.n2 = nn.BatchNorm2d(64)
        side = ((image_size - 2) // 2 - 2) // 2
        if side < 1:
            raise UsageError(f"model net needs images of at least 10x10 pixels, got --image-size {image_size}")
        self.fc1 = nn.Linear(64 * side * side, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.n1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.n2(self.conv2(x))), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=-1)

    def pipeline_pieces(self) -> list[tuple[str, nn.Module]]:
        """``forward`` as steps, for cutting the model into pipeline stages (ddpkit.strategies.split)."""
        return [
            ("conv1", self.conv1), ("n1", self.n1), ("_relu1", nn.ReLU()), ("_pool1", nn.MaxPool2d(2)),
            ("conv2", self.conv2), ("n2", self.n2), ("_relu2", nn.ReLU()), ("_pool2", nn.MaxPool2d(2)),
            ("_flatten", nn.Flatten(1)), ("fc1", self.fc1), ("_relu3", nn.ReLU()), ("fc2", self.fc2),
            ("_log_softmax", nn.LogSoftmax(dim=-1)),
        ]


class ConvNet(nn.Module):
    """The tutorials' random-data model: one conv, one linear layer, no BatchNorm.

    The tutorial ends in a softmax and then applies CrossEntropyLoss (a second softmax inside the loss),
    which flattens the gradients; this version returns the logits, as CrossEntropyLoss expects.
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
        super().__init__()
        if image_size < 3:
            raise UsageError(f"model convnet needs images of at least 3x3 pixels, got --image-size {image_size}")
        self.conv2d = nn.Conv2d(in_channels, 16, 3)
        self.fc = nn.Linear((image_size - 2) * (image_size - 2) * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv2d(x).reshape(x.shape[0], -1))

    def pipeline_pieces(self) -> list[tuple[str, nn.Module]]:
        """``forward`` as steps, for cutting the model into pipeline stages (ddpkit.strategies.split)."""
        return [("conv2d", self.conv2d), ("_flatten", nn.Flatten(1)), ("fc", self.fc)]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    build: Callable[..., nn.Module]
    in_channels: int
    image_size: int  # the size the model was written for; torchvision models take what they are given


BUILTIN_MODELS = {
    "net": ModelSpec(Net, in_channels=1, image_size=28),
    "convnet": ModelSpec(ConvNet, in_channels=3, image_size=32),
}


def torchvision_classifiers() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def check_model_name(name: str) -> None:
    """Raise UsageError unless ``name`` is a built-in model, a torchvision classifier or a function's name."""
    if name in BUILTIN_MODELS or user_code.is_spec(name):
        return
    names = torchvision_classifiers()
    if name not in names:
        close = [n for n in names if n.startswith(name[:4])][:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UsageError(
            f"unknown model {name!r}{hint}; use net, convnet, a torchvision classifier such as resnet18 "
            "(`ddpkit train --list-models` prints them all), or your own as package.module:function"
        )


def model_input(name: str, data_kind: str, image_size: int | None) -> tuple[int, int]:
    """(channels, image size) the data must be produced in for this model."""
    spec = BUILTIN_MODELS.get(name)
    if spec is not None:
        return spec.in_channels, image_size or spec.image_size
    # torchvision classifiers take RGB; ImageNet-sized for image folders, small for the toy sets.
    return 3, image_size or (224 if data_kind == "folder" else 32)


# Classifiers whose training-mode output is a tuple with auxiliary heads: ddpkit trains the main head.
AUX_LOGIT_MODELS = ("googlenet", "inception_v3")


def build_model(name: str, *, in_channels: int, num_classes: int | None, image_size: int,
                arguments: dict | None = None) -> nn.Module:
    """The model ``name`` says; ``arguments``: the keyword arguments of a function of the user's own."""
    check_model_name(name)
    if user_code.is_spec(name):
        return user_code.build_model(name, arguments or {})
    if num_classes is None:
        raise UsageError(f"--model {name} needs the number of classes, which the data does not say: return "
                         "(train, validation, number of classes) from your --data function")
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name].build(in_channels=in_channels, num_classes=num_classes, image_size=image_size)
    import torchvision

    extra = {"aux_logits": False, "init_weights": True} if name in AUX_LOGIT_MODELS else {}
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **extra)
    check_input_size(model, name, in_channels, image_size)
    return model


def check_input_size(model: nn.Module, name: str, channels: int, image_size: int) -> None:
    """One forward pass of two blank images, so a size the model cannot take is a clear error, not a traceback."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(2, channels, image_size, image_size))
    except (RuntimeError, AssertionError, ValueError) as error:
        raise UsageError(
            f"model {name} cannot take {image_size}x{image_size} images ({first_line(error)}); "
            "set --image-size, e.g. 224"
        ) from None
    finally:
        model.train(was_training)


