"""The user's own model and data for ``ddpkit train``: ``--model package.module:function`` and ``--data
package.module:function``, imported from the current folder or the environment.

    $ cat my_project.py
    def model(width=64):                 # returns an nn.Module that maps a batch of inputs to class scores
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(width), torch.nn.ReLU(), ...)
    def data(n=1024):                    # returns (train, validation) data sets of (input, class) pairs,
        ...                              # or (train, validation, number of classes)
    $ ddpkit train --model my_project:model --model-arg width=128 --data my_project:data --data-arg n=4096

A ``KEY=VALUE``'s value is read as JSON where it can be (``3``, ``0.5``, ``true``, ``[1, 2]``, ``"x"``),
else as a string. Every mistake the launcher can see (the module or the function cannot be found, the
arguments do not fit its signature) is one line before any process starts; a function that returns the
wrong thing is one line from rank 0 (exit status 2).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.nn as nn

from ddpkit.core.errors import UsageError, first_line

SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:function


def is_spec(text: str) -> bool:
    """Whether ``text`` names a function as ``package.module:function``."""
    return SPEC.match(text) is not None


def parse_arguments(pairs: Sequence[str], flag: str) -> dict[str, Any]:
    """``["width=128", "name=x"]`` -> ``{"width": 128, "name": "x"}`` (``flag`` names them in errors)."""
    arguments: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"{flag} takes KEY=VALUE with KEY a Python name, got {pair!r}")
        try:
            arguments[key] = json.loads(text)
        except ValueError:  # not JSON: the text itself
            arguments[key] = text
    return arguments


def _signature(function: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):  # some callables written in C have none: the call itself will check
        return None


def find_function(spec: str, flag: str, arguments: Mapping[str, Any], arguments_flag: str) -> Callable:
    """The function ``spec`` names, imported, with ``arguments`` checked against its signature."""
    module_name, _, name = spec.partition(":")
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)  # as `python -m` would: the user's modules beside where they run ddpkit
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"{flag} {spec}: cannot import {module_name} ({first_line(error)}); run ddpkit from the "
                         "folder that holds it, or install it in this environment") from None
    except SyntaxError as error:
        raise UsageError(f"{flag} {spec}: {error.filename}, line {error.lineno}: {error.msg}") from None
    function = getattr(module, name, None)
    if function is None:
        found = sorted(key for key, value in vars(module).items() if callable(value) and not key.startswith("_")
                       and getattr(value, "__module__", None) == module.__name__)  # its own, not what it imported
        raise UsageError(f"{flag} {spec}: {module_name} ({module.__file__}) has no {name!r}"
                         + (f"; it has {', '.join(found[:8])}" if found else ""))
    if not callable(function):
        raise UsageError(f"{flag} {spec}: {name} is a {type(function).__name__}, not a function")
    signature = _signature(function)
    if signature is not None:
        try:
            signature.bind(**arguments)
        except TypeError as error:
            raise UsageError(f"{flag} {spec}{signature}: {error}; check {arguments_flag}") from None
    return function


def build_model(spec: str, arguments: Mapping[str, Any]) -> nn.Module:
    """``spec``'s function called with ``arguments``; its result must be an ``nn.Module``."""
    model = find_function(spec, "--model", arguments, "--model-arg")(**arguments)
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _is_dataset(value: Any) -> bool:
    return hasattr(value, "__len__") and hasattr(value, "__getitem__")


def _classes_of(dataset: Any) -> int | None:
    """``len(dataset.classes)`` (torchvision's data sets have it), looking through Subsets."""
    while dataset is not None:
        classes = getattr(dataset, "classes", None)
        if classes is not None:
            return len(classes)
        dataset = getattr(dataset, "dataset", None)
    return None


def load_data(spec: str, arguments: Mapping[str, Any]) -> tuple[Any, Any, int | None]:
    """``spec``'s function called with ``arguments``: (train set, validation set, number of classes or None
    where the data does not say; a model of the user's own does not need it)."""
    returned = find_function(spec, "--data", arguments, "--data-arg")(**arguments)
    shape = "(train, validation) data sets, or (train, validation, number of classes)"
    if not (isinstance(returned, (tuple, list)) and len(returned) in (2, 3)):
        raise UsageError(f"--data {spec} returned a {type(returned).__name__}; return {shape}")
    train, val = returned[0], returned[1]
    for which, dataset in (("train", train), ("validation", val)):
        if not _is_dataset(dataset):
            raise UsageError(f"--data {spec}: its {which} set is a {type(dataset).__name__}, not a data set with len() "
                             "and indexing (a torch.utils.data.Dataset such as TensorDataset or ImageFolder)")
        if len(dataset) == 0:
            raise UsageError(f"--data {spec}: its {which} set is empty")
    num_classes = returned[2] if len(returned) == 3 else _classes_of(train)
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)
                                    or num_classes < 1):
        raise UsageError(f"--data {spec}: the number of classes must be a whole number above 0, got {num_classes!r}")
    sample = train[0]
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise UsageError(f"--data {spec}: a sample of its train set is a {type(sample).__name__}; each must be an "
                         "(input, class) pair")
    return train, val, num_classes
