"""Data for every rank: a world-size-independent, resumable sample order (``sampler``), loaders whose batches
arrive on the device (``loaders``), exact evaluation (``evaluation``), image files decoded on the CPU or the GPU
(``images``), packs of them for many machines (``shards``), and a folder of test JPEGs (``sample_images``).

    loader = ddpkit.train_loader(dataset, batch_size=32, runtime=rt, seed=0)
    for epoch in range(3):
        for images, labels in loader:        # a new order each epoch
            ...
"""

from ddpkit.data.evaluation import reduce_sums, wait_until_only_python_holds
from ddpkit.data.images import ImageData, image_folder
from ddpkit.data.loaders import DeviceLoader, check_equal_batches, default_workers, eval_loader, to_device, train_loader
from ddpkit.data.sampler import ResumableSampler, eval_indices
from ddpkit.data.shards import image_shards

__all__ = ["DeviceLoader", "ImageData", "ResumableSampler", "check_equal_batches", "default_workers", "eval_indices",
           "eval_loader", "image_folder", "image_shards", "reduce_sums", "to_device", "train_loader",
           "wait_until_only_python_holds"]
