"""ddpkit's version, in the core: a checkpoint records it, and the core imports nothing above itself (the package's
``ddpkit.__version__`` re-exports it). Also the torch it runs on: pyproject's floor is torch 2.4, and the few
features that need a newer one ask here.

    >>> torch_at_least("2.4")
    True
"""

from __future__ import annotations

import re

__version__ = "0.1.0"


def torch_at_least(version: str) -> bool:
    """Whether the installed torch is ``version`` (e.g. ``"2.7"``) or newer; a local tag (``+cu121``) and a
    pre-release of that version count as that version, as a nightly build has the feature."""
    import torch

    installed = tuple(int(part) for part in re.findall(r"\d+", str(torch.__version__).split("+")[0])[:3])
    return installed >= tuple(int(part) for part in version.split("."))


def require_torch(version: str, feature: str) -> None:
    """A UsageError (one line, exit 2) when ``feature`` needs a newer torch than the one installed."""
    if not torch_at_least(version):
        import torch

        from ddpkit.core.errors import UsageError

        raise UsageError(f"{feature} needs torch>={version} (this is torch {torch.__version__}); "
                         f"upgrade it: pip install -U 'torch>={version}'")
