"""What a checkpoint holds, in any layout ddpkit reads: its own (``FORMAT``), the tutorials'
``{"model_state_dict", "optimizer_state_dict", "epoch"}`` and a plain state_dict, with or without DDP's
``module.`` prefix; the checks that a model and an optimizer fit it; every rank's RNG states.

Everything ddpkit writes is plain tensors, numbers, strings, lists and dicts, so that
``torch.load(..., weights_only=True)`` reads it.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from ddpkit.core.errors import CheckpointError, UsageError
from ddpkit.strategies import strategy_of, unwrap


FORMAT = "ddpkit-checkpoint/1"


# Keys of a ddpkit checkpoint.
KEY_FORMAT = "format"
KEY_MODEL = "model"
KEY_OPTIMIZER = "optimizer"
KEY_SCHEDULER = "scheduler"
KEY_SCALER = "scaler"
KEY_PROGRESS = "progress"  # epoch, step, samples, global_step, world_size, global_batch
KEY_RANKS = "ranks"  # one dict per rank: "rng" and whatever the caller passed as rank_state
KEY_CONFIG = "config"
KEY_VERSIONS = "versions"
KEY_EXTRA = "extra"
KEY_CHECKSUMS = "checksums"  # sharded: CRC-32 of each file in the folder
KEY_SHARDED = "sharded"  # set on reading a sharded checkpoint: its folder
# The tutorials' keys.
TUTORIAL_MODEL = "model_state_dict"
TUTORIAL_OPTIMIZER = "optimizer_state_dict"
TUTORIAL_EPOCH = "epoch"


@dataclasses.dataclass
class Contents:
    """A checkpoint of any supported layout, read into ddpkit's terms."""

    model: dict[str, torch.Tensor]
    optimizer: dict | None = None
    scheduler: dict | None = None
    scaler: dict | None = None
    progress: dict | None = None  # None: weights only, training starts at epoch 0
    ranks: list[dict] = dataclasses.field(default_factory=list)
    config: dict | None = None
    versions: dict | None = None
    extra: dict | None = None
    layout: str = "ddpkit"
    sharded: Path | None = None  # a sharded checkpoint's folder: ``model`` holds shapes only (meta tensors)

    @property
    def from_ddpkit(self) -> bool:
        """Written by ddpkit (full or sharded): it holds the data position and every rank's RNG states."""
        return self.layout.startswith("ddpkit")


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def read_contents(obj: Any, source: str | os.PathLike = "checkpoint") -> Contents:
    """Recognise a ddpkit checkpoint, the tutorials' dict layouts, or a plain state_dict."""
    if isinstance(obj, dict) and obj.get(KEY_FORMAT) == FORMAT:
        folder = obj.get(KEY_SHARDED)
        return Contents(
            model=obj[KEY_MODEL], optimizer=obj.get(KEY_OPTIMIZER), scheduler=obj.get(KEY_SCHEDULER),
            scaler=obj.get(KEY_SCALER), progress=obj.get(KEY_PROGRESS), ranks=list(obj.get(KEY_RANKS) or []),
            config=obj.get(KEY_CONFIG), versions=obj.get(KEY_VERSIONS), extra=obj.get(KEY_EXTRA),
            layout="ddpkit, sharded" if folder else "ddpkit", sharded=Path(folder) if folder else None,
        )
    if isinstance(obj, dict) and _is_state_dict(obj.get(TUTORIAL_MODEL)):
        # The tutorials save after finishing epoch N: training continues with epoch N+1.
        epoch = obj.get(TUTORIAL_EPOCH)
        progress = {"epoch": int(epoch) + 1, "step": 0, "samples": 0} if isinstance(epoch, int) else None
        return Contents(model=strip_prefix(obj[TUTORIAL_MODEL]), optimizer=obj.get(TUTORIAL_OPTIMIZER),
                        progress=progress, layout="tutorial")
    if isinstance(obj, dict) and _is_state_dict(obj.get(KEY_MODEL)):
        return Contents(model=strip_prefix(obj[KEY_MODEL]), optimizer=obj.get(KEY_OPTIMIZER), layout="model+optimizer")
    if _is_state_dict(obj):
        return Contents(model=strip_prefix(obj), layout="state_dict")
    raise CheckpointError(
        f"{source} is not a checkpoint ddpkit can read: expected a state_dict, a dict with "
        f"'{TUTORIAL_MODEL}' (and '{TUTORIAL_OPTIMIZER}', '{TUTORIAL_EPOCH}'), or a ddpkit checkpoint"
    )


def strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop DDP's / DataParallel's ``module.`` prefix (saved from the wrapper instead of the model)."""
    state = dict(state)
    consume_prefix_in_state_dict_if_present(state, "module.")
    return state


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def check_model_state(model: nn.Module, state: dict[str, torch.Tensor], source: str | os.PathLike = "checkpoint") -> None:
    """Raise one ``CheckpointError`` naming missing keys, unexpected keys and shape mismatches."""
    expected = unwrap(model).state_dict()
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    shapes = [
        f"{key} {list(state[key].shape)} vs {list(value.shape)}"
        for key, value in expected.items()
        if key in state and state[key].shape != value.shape
    ]
    if not (missing or unexpected or shapes):
        return
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s): {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s): {_listing(unexpected)}")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es), checkpoint vs model: {_listing(shapes, 3)}")
    raise CheckpointError(f"{source} is for another model: {'; '.join(problems)}")


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], source: str | os.PathLike = "checkpoint") -> None:
    """Load into the bare model (before wrapping, or through DDP/DP), refusing any mismatch up front."""
    state = strip_prefix(state)
    check_model_state(model, state, source)
    unwrap(model).load_state_dict(state)


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The bare model's weights on the CPU: no ``module.`` prefix, loadable with ``weights_only=True``.

    One process's own copy: under FSDP or a pipeline no process has the whole model, and
    ``ddpkit.full_model_state`` (a collective every rank calls) gathers it instead.
    """
    if strategy_of(model).shards_model:
        raise UsageError("model_state_dict holds one process's copy, and under FSDP or a pipeline no process holds "
                         "the whole model; call ddpkit.full_model_state(model, runtime) on every rank instead")
    return {key: value.detach().cpu() for key, value in unwrap(model).state_dict().items()}


def check_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict, source: str | os.PathLike = "checkpoint") -> None:
    """One ``CheckpointError`` when a saved optimizer state cannot drive ``optimizer`` (another kind, other params)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not groups:
        raise CheckpointError(f"{source}: its optimizer state has no param_groups")
    saved_counts = [len(group.get("params", [])) for group in groups]
    counts = [len(group["params"]) for group in optimizer.param_groups]
    if saved_counts != counts:
        raise CheckpointError(f"{source}: its optimizer state covers {saved_counts} parameters per group, this "
                              f"model's optimizer {counts}")
    # A setting this optimizer does not know marks another kind (SGD's momentum in an Adam, say); settings
    # only the new one has are filled in by PyTorch for states saved by older versions.
    foreign = sorted(set(groups[0]) - set(optimizer.param_groups[0]) - {"params", "initial_lr"})
    if foreign:
        raise CheckpointError(
            f"{source}: its optimizer state is for another optimizer than {type(optimizer).__name__} (it has "
            f"{', '.join(foreign)}); resume with the `optimizer` that wrote it"
        )


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's random number generator states, in types ``weights_only`` loading accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _python_rng()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def _python_rng() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    if "numpy" in state:
        import numpy as np

        numpy_state = state["numpy"]
        np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype("uint32"), numpy_state["pos"],
                             numpy_state["has_gauss"], numpy_state["cached_gaussian"]))


def versions() -> dict[str, str]:
    from ddpkit.core.version import __version__

    # str(): torch.__version__ is a TorchVersion, which weights_only loading would refuse.
    found = {"ddpkit": str(__version__), "torch": str(torch.__version__), "python": platform.python_version()}
    if torch.version.cuda:
        found["cuda"] = str(torch.version.cuda)
    return found
