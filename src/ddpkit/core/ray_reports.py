"""Metrics to Ray Train from a rank under Ray, without importing Ray anywhere else.

    from ddpkit.core import ray_reports
    ray_reports.report({"val_loss": 0.25, "val_count": 359})    # a no-op outside Ray

``Job.evaluate`` and ``ddpkit train``'s epochs call it on every rank (Ray asks every worker to report alike). In a
Ray Train worker (a ``Job`` in one's own ``TorchTrainer``) it is ``ray.train.report``; in a rank that ``ddpkit run
--launcher ray`` started from a worker (``ddpkit.launch.on_ray``) it is a JSON line through a pipe to that worker,
which reports it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping

from ddpkit.core import env as env_mod
from ddpkit.core.logs import logger

REPORTS_ENV = "DDPKIT_RAY_REPORTS"  # in a rank a Ray worker started: the pipe its reports go through to that worker


def report(metrics: Mapping[str, float]) -> None:
    """Hand ``metrics`` to Ray Train (``ray.train.report``) when this process is a rank under Ray; else nothing.

    In a Ray Train worker itself (a Job in one's own ``TorchTrainer``): ``ray.train.report`` here. In a rank that
    ``--launcher ray`` started from a worker: one JSON line through the pipe to that worker, which reports it. Every
    rank calls it the same number of times (``Job.evaluate`` and the trainer's epochs are collective), as Ray asks."""
    relay = os.environ.get(REPORTS_ENV)
    metrics = {name: value for name, value in metrics.items() if isinstance(value, (int, float, str))}  # Ray's kinds
    if relay is not None:
        line = json.dumps(metrics) + "\n"
        try:
            os.write(int(relay), line.encode())
        except (OSError, ValueError) as error:  # the worker is gone (it ends this rank too), or a stray variable
            logger.debug(f"cannot hand metrics to the Ray worker through {REPORTS_ENV}={relay}: {error}")
        return
    if in_ray_train_worker():
        import ray.train

        ray.train.report(metrics)


def in_ray_train_worker() -> bool:
    """Whether this process runs Ray Train's training function (without importing Ray where it is not loaded)."""
    if not env_mod.is_ray_worker(os.environ) or "ray.train" not in sys.modules:
        return False
    import ray.train

    try:
        ray.train.get_context()
    except RuntimeError:  # a Ray process, but not Train's worker (the driver, a task)
        return False
    return True
