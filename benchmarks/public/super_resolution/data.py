"""pytorch/examples super_resolution/data.py: BSDS300's train and test folders, centre-cropped to a multiple of the
upscale factor; the input shrunk by the factor, the target the crop itself.

Changes: no download (it needs the network): the images are read from ``dataset/BSDS300/images/{train,test}`` in
the current folder, where the benchmark writes small random images; and the crop size is a parameter (the
example's 256 is the default).
"""
from os.path import join

from torchvision.transforms import CenterCrop, Compose, Resize, ToTensor

from dataset import DatasetFromFolder


def bsd300_images(dest="dataset"):
    return join(dest, "BSDS300/images")


def calculate_valid_crop_size(crop_size, upscale_factor):
    return crop_size - (crop_size % upscale_factor)


def input_transform(crop_size, upscale_factor):
    return Compose([
        CenterCrop(crop_size),
        Resize(crop_size // upscale_factor),
        ToTensor(),
    ])


def target_transform(crop_size):
    return Compose([
        CenterCrop(crop_size),
        ToTensor(),
    ])


def get_training_set(upscale_factor, crop_size=256):
    train_dir = join(bsd300_images(), "train")
    crop_size = calculate_valid_crop_size(crop_size, upscale_factor)
    return DatasetFromFolder(train_dir,
                             input_transform=input_transform(crop_size, upscale_factor),
                             target_transform=target_transform(crop_size))


def get_test_set(upscale_factor, crop_size=256):
    test_dir = join(bsd300_images(), "test")
    crop_size = calculate_valid_crop_size(crop_size, upscale_factor)
    return DatasetFromFolder(test_dir,
                             input_transform=input_transform(crop_size, upscale_factor),
                             target_transform=target_transform(crop_size))
