"""What reading a gathered loader's batches costs under ``ddpkit run --unchanged``: a loop bound by its loader.

    .venv/bin/python benchmarks/unchanged_reading.py [--rounds 2] [--json FILE]
    PYTHONPATH=OTHER/src .venv/bin/python benchmarks/unchanged_reading.py ...   # another commit's ddpkit

The script (below): 384 JPEG images of 500 × 375 pixels in a folder, read by a Dataset of its own with PIL and the
ImageNet trainer's training transforms (``RandomResizedCrop(224)``, a flip, ``ToTensor``, ``Normalize``), 2 loader
workers, batches of 64, a small model (a 4 × 4 average pool and one linear layer), 2 epochs; its meter reads
``images.size(0)``, so the step takes the gathered way. Its loop times its second epoch (from its first batch's
arrival to its last step's end), when each process reads its share of each batch and the collated shares are gathered
(docs/unchanged.md, "Whole batches, read once"); before that, every process read every batch whole. Runs: the script
on one process and on 2 under ``--unchanged`` (OMP_NUM_THREADS=1), alternating, R rounds. Reported: each side's best
second epoch, and 2 processes / 1 (at best 0.5: half of each batch a process; 1 or more where each reads all).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unchanged_passes import alternated  # noqa: E402

SCRIPT = """
import sys, time
from pathlib import Path
import torch, torch.nn as nn, torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms


class Folder(Dataset):
    def __init__(self, root):
        self.files = sorted(Path(root).glob("*.jpg"))
        self.transform = transforms.Compose([
            transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
            transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        return self.transform(Image.open(self.files[index]).convert("RGB")), index % 10


torch.manual_seed(0)
model = nn.Sequential(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(3 * 56 * 56, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(Folder(sys.argv[1]), batch_size=64, shuffle=True, num_workers=2)
for epoch in range(2):
    seen, start = 0, None
    for images, labels in loader:
        start = start or time.perf_counter()
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += images.size(0)
    took = time.perf_counter() - start
print(f"second epoch in {took:.3f} s, {seen} images")
"""


def images(folder: Path, count: int = 384) -> Path:
    from PIL import Image

    out = folder / "images"
    out.mkdir()
    for index in range(count):
        Image.effect_noise((500, 375), 40 + index % 50).convert("RGB").save(out / f"{index:04}.jpg", quality=90)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "reading.py"
        script.write_text(SCRIPT)
        data = images(Path(folder))
        launch = [sys.executable, "-m", "ddpkit", "run", "--unchanged", "--seed", "0", "--nproc-per-node"]
        sides = {"1 process": [*launch, "1", str(script), str(data)],
                 "2 processes": [*launch, "2", str(script), str(data)]}
        found = alternated(sides, args.rounds, folder,
                           lambda wall, out: float(re.findall(r"second epoch in (\S+) s", out)[-1]))
    import ddpkit

    result = {"command": " ".join(sys.argv), "cores": os.cpu_count(), "ddpkit": str(Path(ddpkit.__file__).parent),
              "second epoch s": found, "2 / 1": min(found["2 processes"]) / min(found["1 process"])}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
