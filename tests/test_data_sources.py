"""The data sets of the contract through their real loaders: MNIST's files, ImageFolder, torchvision models."""

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from ddpkit.app.cli import main
from ddpkit.zoo import load_data, parse_data_spec


def write_idx(path, array: np.ndarray) -> None:
    """MNIST's own file format: a magic number naming the type and rank, the sizes, then raw bytes."""
    header = struct.pack(">I", 0x0800 + array.ndim) + b"".join(struct.pack(">I", n) for n in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def fake_mnist(root, n_train=64, n_test=21):
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, (n,)))


def image_folder(root, classes=("a", "b", "c"), per_class=4):
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (24 + i, 20), (40 * k, 10 * i, 100)).save(root / name / f"{i}.png")


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_mnist_reads_the_real_file_format_through_torchvision(tmp_path):
    fake_mnist(tmp_path / "data")
    sets = load_data(parse_data_spec(f"mnist:{tmp_path / 'data'}"), channels=1, image_size=28)
    assert (len(sets.train), len(sets.val), sets.num_classes) == (64, 21, 10)
    image, label = sets.train[0]
    assert image.shape == (1, 28, 28) and 0 <= label < 10
    code = main(["train", "--data", f"mnist:{tmp_path / 'data'}", "--nproc-per-node", "1", "--epochs", "1",
                 "--batch-size", "16", "--output-dir", str(tmp_path / "out"), "--no-progress", "--workers", "0"])
    assert code == 0 and metrics(tmp_path / "out")[0]["val_count"] == 21


def test_image_folder_with_train_and_val_and_a_torchvision_model(tmp_path):
    image_folder(tmp_path / "imgs" / "train", per_class=6)
    image_folder(tmp_path / "imgs" / "val", per_class=3)
    code = main(["train", "--data", f"folder:{tmp_path / 'imgs'}", "--model", "resnet18", "--image-size", "32",
                 "--nproc-per-node", "1", "--epochs", "1", "--batch-size", "4", "--workers", "0",
                 "--output-dir", str(tmp_path / "out"), "--no-progress"])
    assert code == 0
    assert metrics(tmp_path / "out")[0]["val_count"] == 9
    import torchvision

    torchvision.models.resnet18(num_classes=3).load_state_dict(torch.load(tmp_path / "out" / "model.pt", weights_only=True))


def test_image_folder_without_a_split_is_split_90_10(tmp_path):
    image_folder(tmp_path / "flat", per_class=10)
    sets = load_data(parse_data_spec(f"folder:{tmp_path / 'flat'}"), channels=3, image_size=16)
    assert (len(sets.train), len(sets.val), sets.num_classes) == (27, 3, 3)
    assert sets.train[0][0].shape == (3, 16, 16)


def test_a_folder_without_class_folders_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = main(["train", "--data", f"folder:{tmp_path / 'empty'}", "--nproc-per-node", "1",
                 "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "expected one sub-folder of images per class" in err and err.count("\n") == 1


@pytest.mark.parametrize("model, channels", [("net", 1), ("convnet", 3), ("resnet18", 3)])
def test_digits_fit_every_model(model, channels):
    from ddpkit.zoo import model_input

    c, size = model_input(model, "digits", None)
    sets = load_data(parse_data_spec("digits"), channels=c, image_size=size)
    assert c == channels and sets.train[0][0].shape == (c, size, size)
    assert (len(sets.train), len(sets.val)) == (1438, 359)


def test_the_digits_are_scikit_learns_read_without_importing_it(monkeypatch):
    from sklearn.datasets import load_digits

    from ddpkit import zoo

    script = "import sys; from ddpkit import zoo; zoo.load_digits(1, 28); print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout == "False\n"
    expected = load_digits()
    images, labels = zoo.digits_arrays()
    assert np.array_equal(images, expected.images) and np.array_equal(labels, expected.target)
    # A scikit-learn that keeps the file elsewhere: its load_digits, the same arrays.
    monkeypatch.setattr(zoo.datasets, "DIGITS_FILE", ("no", "such", "digits.csv.gz"))
    images, labels = zoo.digits_arrays()
    assert np.array_equal(images, expected.images) and np.array_equal(labels, expected.target)


def test_train_and_test_folders_are_train_and_validation(tmp_path):
    image_folder(tmp_path / "imgs" / "train", per_class=5)
    image_folder(tmp_path / "imgs" / "test", per_class=2)
    sets = load_data(parse_data_spec(f"folder:{tmp_path / 'imgs'}"), channels=3, image_size=16)
    # Not a 2-class problem "train" vs "test": the 3 classes, with test/ as the validation part.
    assert (len(sets.train), len(sets.val), sets.num_classes) == (15, 6, 3)


def test_a_train_folder_alone_is_split(tmp_path):
    image_folder(tmp_path / "imgs" / "train", per_class=10)
    sets = load_data(parse_data_spec(f"folder:{tmp_path / 'imgs'}"), channels=3, image_size=16)
    assert (len(sets.train), len(sets.val), sets.num_classes) == (27, 3, 3)


def test_models_with_auxiliary_heads_train(tmp_path):
    code = main(["train", "--model", "googlenet", "--data", "synthetic:8", "--image-size", "32", "--epochs", "1",
                 "--batch-size", "4", "--nproc-per-node", "1", "--output-dir", str(tmp_path), "--no-progress"])
    assert code == 0


def test_an_image_size_the_model_cannot_take_is_a_clear_error(tmp_path, capsys):
    code = main(["train", "--model", "vit_b_16", "--data", "synthetic:8", "--epochs", "1", "--nproc-per-node", "1",
                 "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "model vit_b_16 cannot take 32x32 images" in err and "--image-size" in err
