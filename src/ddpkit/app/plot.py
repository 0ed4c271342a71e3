"""``ddpkit plot OUTPUT_DIR``: a run's ``metrics.jsonl`` drawn per epoch to a PNG: losses, validation
accuracy, images per second, and each rank's own step time where recorded (matplotlib, ``ddpkit[bench]``)."""

from __future__ import annotations

import os

from ddpkit.watch import status
from ddpkit.core.errors import UsageError

PLOT_FILE = "metrics.png"


def draw(output_dir: str, path: str | None = None) -> str:
    """Draw the run in ``output_dir`` to ``path`` (default ``OUTPUT_DIR/metrics.png``); returns the path."""
    if not os.path.isfile(os.path.join(output_dir, status.METRICS_FILE)):
        raise UsageError(f"{output_dir} holds no {status.METRICS_FILE}: give the --output-dir of a `ddpkit train` run "
                         "that finished an epoch")
    records = status.read_metrics(output_dir)
    if not records:
        raise UsageError(f"{os.path.join(output_dir, status.METRICS_FILE)} holds no whole record: no epoch has "
                         "finished yet")
    try:
        import matplotlib
    except ImportError:
        raise UsageError("ddpkit plot needs matplotlib: pip install matplotlib (or 'ddpkit[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [record["epoch"] + 1 for record in records]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    losses, accuracy, speed, ranks = axes.flat
    for key in ("train_loss", "val_loss"):
        losses.plot(epochs, [record.get(key) for record in records], marker="o", label=key)
    losses.set(title="loss", ylabel="loss")
    losses.legend()
    accuracy.plot(epochs, [100 * record.get("val_acc", 0) for record in records], marker="o", color="tab:green")
    accuracy.set(title="validation accuracy", ylabel="%")
    speed.plot(epochs, [record.get("images_per_sec") for record in records], marker="o", color="tab:purple")
    speed.set(title="images per second (all ranks)", ylabel="images/s", xlabel="epoch")
    per_rank = [record.get("rank_step_time_s") or [] for record in records]
    for rank in range(max(map(len, per_rank), default=0)):
        ranks.plot(epochs, [times[rank] if rank < len(times) else None for times in per_rank], marker="o",
                   label=f"rank {rank}")
    if any(per_rank):
        ranks.legend(fontsize="small")
    ranks.set(title="each rank's own step time", ylabel="s", xlabel="epoch")
    from matplotlib.ticker import MaxNLocator

    for axis in axes.flat:
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    figure.suptitle(os.path.abspath(output_dir))
    figure.tight_layout()
    path = path or os.path.join(output_dir, PLOT_FILE)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
