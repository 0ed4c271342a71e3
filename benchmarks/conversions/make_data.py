"""Make small offline test data for the conversion benchmarks.

    python make_data.py --out DIR [--mnist-test 101] [--val-images 37]

Writes, under DIR:
  DIR/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte
      an MNIST-format copy of scikit-learn's 8x8 "digits" (1,797 images),
      upscaled to 20x20 and padded to 28x28 like MNIST; the test split has
      --mnist-test images (default 101: odd, so 2 processes cannot split it
      evenly), the rest is the train split.  torchvision.datasets.MNIST(DIR)
      reads it offline (and download=True finds it and skips downloading).
  DIR/imagefolder/{train,val}/class_K/*.jpg
      --classes classes (default 6) of small synthetic JPEGs (--size pixels):
      each class is a coloured shape on noise.  --train-per-class images per
      class for train, --val-images images in total for val (default 37: odd).
  DIR/flatfolder/{train,val}/class_K/*.png
      the same layout, each image of one colour (--flat-train and --flat-val
      images, default 37 each: odd): random crops, resizes and flips leave such
      an image as it is, so a run that draws them differently on each process
      still reads the same pixels (the ImageNet trainer's weights compared).
  DIR/chargpt/{train.bin,val.bin,meta.pkl}
      a char-level nanoGPT dataset (uint16 token ids, meta.pkl with vocab_size,
      stoi, itos) from a generated text (--chars characters, 90/10 split).
Finally it checks that torchvision's MNIST class loads the files offline.
"""
import argparse
import os
import pickle
import struct

import numpy as np
from PIL import Image, ImageDraw


def write_idx_images(path, images):
    n, h, w = images.shape
    with open(path, "wb") as f:
        f.write(struct.pack(">IIII", 0x00000803, n, h, w))
        f.write(images.astype(np.uint8).tobytes())


def write_idx_labels(path, labels):
    with open(path, "wb") as f:
        f.write(struct.pack(">II", 0x00000801, len(labels)))
        f.write(labels.astype(np.uint8).tobytes())


def make_mnist(root, n_test, seed):
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(digits.images))
    imgs = []
    for im in digits.images[order]:
        small = Image.fromarray((im * (255.0 / 16.0)).astype(np.uint8))
        big = np.asarray(small.resize((20, 20), Image.BILINEAR))
        canvas = np.zeros((28, 28), np.uint8)
        canvas[4:24, 4:24] = big
        imgs.append(canvas)
    imgs = np.stack(imgs)
    labels = digits.target[order]
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    splits = {"train": slice(n_test, None), "t10k": slice(0, n_test)}
    for name, sl in splits.items():
        write_idx_images(os.path.join(raw, f"{name}-images-idx3-ubyte"), imgs[sl])
        write_idx_labels(os.path.join(raw, f"{name}-labels-idx1-ubyte"), labels[sl])
    return len(imgs) - n_test, n_test


COLORS = [(220, 40, 40), (40, 180, 40), (40, 60, 220), (230, 200, 30), (200, 40, 200), (30, 200, 200),
          (240, 130, 20), (120, 120, 120), (140, 70, 20), (250, 250, 250)]


def draw_image(cls, size, rng):
    noise = rng.integers(0, 90, (size, size, 3), dtype=np.uint8)
    img = Image.fromarray(noise)
    d = ImageDraw.Draw(img)
    r = int(size * rng.uniform(0.25, 0.4))
    cx, cy = rng.integers(r, size - r, 2)
    box = [cx - r, cy - r, cx + r, cy + r]
    color = COLORS[cls % len(COLORS)]
    if cls % 3 == 0:
        d.ellipse(box, fill=color)
    elif cls % 3 == 1:
        d.rectangle(box, fill=color)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
    return img


def make_imagefolder(root, classes, train_per_class, val_total, size, seed):
    rng = np.random.default_rng(seed + 1)
    counts = {"train": [train_per_class] * classes,
              "val": [val_total // classes + (1 if k < val_total % classes else 0) for k in range(classes)]}
    for split, per_class in counts.items():
        for k, n in enumerate(per_class):
            d = os.path.join(root, "imagefolder", split, f"class_{k}")
            os.makedirs(d, exist_ok=True)
            for i in range(n):
                draw_image(k, size, rng).save(os.path.join(d, f"{i:04d}.jpg"), quality=90)
    return sum(counts["train"]), sum(counts["val"])


def make_flatfolder(root, classes, n_train, n_val, size, seed):
    """Images of one colour each: a shade of the class's colour, so that the classes can be told apart."""
    rng = np.random.default_rng(seed + 3)
    for split, n in (("train", n_train), ("val", n_val)):
        for i in range(n):
            k = i % classes
            shade = rng.uniform(0.5, 1.0)
            color = tuple(int(c * shade) for c in COLORS[k % len(COLORS)])
            d = os.path.join(root, "flatfolder", split, f"class_{k}")
            os.makedirs(d, exist_ok=True)
            Image.new("RGB", (size, size), color).save(os.path.join(d, f"{i:04d}.png"))
    return n_train, n_val


WORDS = ("the king queen lord lady night day sword crown love death heart blood fair foul sweet "
         "speak hear see come go stay fly rise fall bright dark old young true false my thy thou "
         "art shall will not never ever now then here there").split()


def make_chars(root, n_chars, seed):
    rng = np.random.default_rng(seed + 2)
    lines = []
    total = 0
    names = ["KING", "QUEEN", "HAMLET", "ROMEO", "JULIET", "LEAR"]
    while total < n_chars:
        speaker = names[rng.integers(len(names))]
        n_words = int(rng.integers(4, 14))
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), n_words)]
        sent = " ".join(words).capitalize() + rng.choice([".", "!", "?", ","])
        block = f"{speaker}:\n{sent}\n\n"
        lines.append(block)
        total += len(block)
    data = "".join(lines)[:n_chars]
    chars = sorted(set(data))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    ids = np.array([stoi[c] for c in data], dtype=np.uint16)
    n = len(ids)
    out = os.path.join(root, "chargpt")
    os.makedirs(out, exist_ok=True)
    ids[: int(n * 0.9)].tofile(os.path.join(out, "train.bin"))
    ids[int(n * 0.9):].tofile(os.path.join(out, "val.bin"))
    with open(os.path.join(out, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return len(chars), int(n * 0.9), n - int(n * 0.9)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data", help="output directory (default: data)")
    p.add_argument("--mnist-test", type=int, default=101, help="size of the MNIST test split (default 101)")
    p.add_argument("--classes", type=int, default=6)
    p.add_argument("--train-per-class", type=int, default=20)
    p.add_argument("--val-images", type=int, default=37, help="total val images (default 37)")
    p.add_argument("--size", type=int, default=72, help="JPEG side in pixels (default 72)")
    p.add_argument("--flat-train", type=int, default=37, help="one-colour train images (default 37)")
    p.add_argument("--flat-val", type=int, default=37, help="one-colour val images (default 37)")
    p.add_argument("--chars", type=int, default=200_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true",
                   help="skip the final check (torchvision reads the MNIST copy), and importing torch for it")
    a = p.parse_args()

    n_tr, n_te = make_mnist(a.out, a.mnist_test, a.seed)
    print(f"MNIST-format digits: {n_tr} train / {n_te} test -> {a.out}/MNIST/raw")
    n_tr, n_va = make_imagefolder(a.out, a.classes, a.train_per_class, a.val_images, a.size, a.seed)
    print(f"ImageFolder: {a.classes} classes, {n_tr} train / {n_va} val -> {a.out}/imagefolder")
    n_tr, n_va = make_flatfolder(a.out, a.classes, a.flat_train, a.flat_val, a.size, a.seed)
    print(f"ImageFolder of one-colour images: {n_tr} train / {n_va} val -> {a.out}/flatfolder")
    v, n_tr, n_va = make_chars(a.out, a.chars, a.seed)
    print(f"char dataset: vocab {v}, {n_tr} train / {n_va} val tokens -> {a.out}/chargpt")

    if a.no_check:
        return
    # check that torchvision reads the MNIST copy offline
    from torchvision import datasets, transforms
    for train in (True, False):
        ds = datasets.MNIST(a.out, train=train, download=False, transform=transforms.ToTensor())
        x, y = ds[0]
        assert x.shape == (1, 28, 28) and 0 <= y <= 9, (x.shape, y)
        print(f"torchvision MNIST(train={train}) loads offline: {len(ds)} samples, x {tuple(x.shape)}, y {y}")
    ds = datasets.MNIST(a.out, train=False, download=True)  # as the vae example calls it: must not hit the net
    print(f"MNIST(download=True) finds the files and skips downloading: {len(ds)} samples")


if __name__ == "__main__":
    main()
