"""DataParallel or DistributedDataParallel, on the same small convolutional network and random images.

    python examples/random_data_convnet.py --strategy dp                       # one process driving every GPU
    ddpkit run --nproc-per-node 2 examples/random_data_convnet.py              # DDP: a process per GPU (or CPU share)

The question the DDP tutorials start from, answered with one script: with ``dp`` a single process copies the model
onto each GPU at every step, cuts the batch between them and gathers the outputs and gradients back on the first GPU;
with ``ddp`` (the default) each process holds its own replica and its own share of the data, and the gradients are
averaged while the backward pass runs. The ``Job`` is the only line that differs. ``--batch-size`` is what one process
reads per step: DataParallel splits it across its GPUs, DDP's global batch is it times the number of processes
(printed at the start). DataParallel needs CUDA; DDP runs on the CPU too, over gloo.

The images are noise, the red channel a little brighter in those of one class and darker in the other's, so the
loss has something to fall towards. Each epoch ends with its mean loss over every sample, summed over the processes.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ddpkit


def noise_images(count: int, size: int = 32) -> TensorDataset:
    """``count`` images of noise, the red channel of those labelled 1 a little brighter and of those labelled 0 a
    little darker; the same on every process."""
    generator = torch.Generator().manual_seed(1234)
    images = torch.randn(count, 3, size, size, generator=generator)
    labels = torch.randint(0, 2, (count,), generator=generator)
    images[:, 0] += (labels.float() * 2 - 1).view(-1, 1, 1) * 0.5
    return TensorDataset(images, labels)


class SmallConvNet(nn.Module):
    """One convolution, pooled over the image, then a linear read-out of two logits."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.features = nn.Conv2d(3, channels, kernel_size=3, padding=1)
        self.head = nn.Linear(channels, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pooled = F.relu(self.features(images)).mean(dim=(2, 3))
        return self.head(pooled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=["ddp", "dp"], default="ddp", help="how to use several devices (ddp)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples one process reads per step (32)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=256, help="size of the random data set (256)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: a GPU per process where there are enough, else the CPU")
    args = parser.parse_args()

    job = ddpkit.Job(args.strategy, device=args.device)
    torch.manual_seed(0)  # the model's first weights: the same on every process
    model = SmallConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = DataLoader(noise_images(args.samples), batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = job.prepare(model, optimizer, loader)
    if job.is_main:
        print(f"{args.strategy}: {job.world_size} process(es), a global batch of {args.batch_size * job.world_size}")
    for epoch in range(args.epochs):
        total, seen = 0.0, 0
        for step, (images, labels) in enumerate(loader):
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, seen = total + loss.item() * len(labels), seen + len(labels)
            if job.is_main:
                print(f"epoch {epoch} step {step}: loss {loss.item():.4f} (this process's share)")
        total, seen = job.sum(total, seen)
        if job.is_main:
            print(f"epoch {epoch}: mean loss {total / seen:.4f} over {int(seen)} samples")


if __name__ == "__main__":
    main()
