"""Data for every rank: a world-size-independent, resumable sample order (``sampler``), loaders whose batches
arrive on the device (``loaders``), and exact evaluation (``evaluation``).

    loader = ddpkit.train_loader(dataset, batch_size=32, runtime=rt, seed=0)
    for epoch in range(3):
        for images, labels in loader:        # a new order each epoch
            ...
"""

from ddpkit.data.evaluation import reduce_sums, wait_until_only_python_holds
from ddpkit.data.loaders import DeviceLoader, check_equal_batches, default_workers, eval_loader, to_device, train_loader
from ddpkit.data.sampler import ResumableSampler, eval_indices

__all__ = ["DeviceLoader", "ResumableSampler", "check_equal_batches", "default_workers", "eval_indices", "eval_loader",
           "reduce_sums", "to_device", "train_loader", "wait_until_only_python_holds"]
