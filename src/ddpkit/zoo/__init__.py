"""Models and data sets by name: ``net`` and ``convnet`` (the tutorials' models) and torchvision's classifiers
(``models``); the ``digits``, synthetic, MNIST and image-folder data sets (``datasets``); and a model or data set
of the user's own, ``package.module:function`` (``user_code``).

    >>> from ddpkit.zoo import build_model, load_digits
    >>> len(load_digits(channels=1, image_size=8).val)
    359
"""

from ddpkit.zoo.datasets import (DATA_KINDS, IMAGE_KINDS, USER_DATA, Datasets, DataSpec, digits_arrays,
                                 example_batch, load_data, load_digits, load_for_model, load_images,
                                 load_mnist, load_synthetic, parse_data_spec)
from ddpkit.zoo.models import (BUILTIN_MODELS, ConvNet, Net, build_model, check_input_size, check_model_name,
                               model_input, torchvision_classifiers)

__all__ = ["BUILTIN_MODELS", "DATA_KINDS", "IMAGE_KINDS", "USER_DATA", "ConvNet", "DataSpec",
           "Datasets", "Net", "build_model", "check_input_size", "check_model_name", "digits_arrays", "example_batch",
           "load_data", "load_digits", "load_for_model", "load_images", "load_mnist",
           "load_synthetic", "model_input", "parse_data_spec", "torchvision_classifiers"]
