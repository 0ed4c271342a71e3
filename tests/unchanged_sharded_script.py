"""A script written for one device, as its author would, that ``tests/test_unchanged_sharded.py`` runs under ``ddpkit run
--unchanged --shard always`` on 2 processes and on 1, and compares. Nothing in it knows about ranks or sharding.

    python unchanged_sharded_script.py OUT mlp [WIDTH DEPTH] [EPOCHS]   # residual MLP blocks, Adam, its own DataLoader,
                                                              # accumulation, clipping, a scheduler, an evaluation;
                                                              # saves its model and optimizer state dicts and epoch
                                                              # after every epoch (OUT/checkpoint.pt), and resumes
                                                              # from that file where it finds one
    python unchanged_sharded_script.py OUT resnet                       # torchvision's ResNet-18, BatchNorm, SGD, momentum

It computes in float64 (``DTYPE=float32`` in its environment: float32). It writes OUT/result.pt (the model's state
dict at the end, the losses it printed, its evaluation), OUT/whole.pt (the model itself, in a dict) and OUT/copy.pt (the
state dict of a ``copy.deepcopy`` taken after the first epoch).
"""

import copy
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

out, kind = sys.argv[1], sys.argv[2]
torch.set_default_dtype(getattr(torch, os.environ.get("DTYPE", "float64")))
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int, depth: int, classes: int = 5):
        super().__init__()
        self.embed = nn.Linear(12, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp(width: int, depth: int, epochs: int):
    data, labels = torch.randn(53, 12), torch.randint(0, 5, (53,))
    model = Net(width, depth)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    start = 0
    path = os.path.join(out, "checkpoint.pt")
    if os.path.exists(path):  # the script's own resume
        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start = checkpoint["epoch"] + 1
        print(f"resumed at epoch {start}")
    loader = DataLoader(TensorDataset(data, labels), batch_size=8, shuffle=True)  # 6 batches of 8, then 5 (split 3 + 2)
    losses = []
    for epoch in range(start, epochs):
        model.train()
        for step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y) / 2
            loss.backward()
            losses.append(loss.item())
            if step % 2 == 1 or step == len(loader) - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
        scheduler.step()
        if epoch == start:
            torch.save(copy.deepcopy(model).state_dict(), os.path.join(out, "copy.pt"))
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch}, path)
        print(f"epoch {epoch}: loss {sum(losses[-7:]) / 7:.6f}")
    finish(model, losses, data, labels, Net)


def resnet():
    import torchvision

    data, labels = torch.randn(19, 3, 32, 32), torch.randint(0, 10, (19,))
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for epoch in range(1):
        model.train()
        for x, y in DataLoader(TensorDataset(data, labels), batch_size=8):  # 8, 8, then 3 (split 2 + 1)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        torch.save(copy.deepcopy(model).state_dict(), os.path.join(out, "copy.pt"))
    finish(model, losses, data, labels, torchvision.models.ResNet)


def finish(model, losses, data, labels, kind):
    model.eval()
    with torch.no_grad():
        output = model(data)
    evaluation = [(output.argmax(1) == labels).sum().item(), F.cross_entropy(output, labels).item()]
    print(f"evaluation: {evaluation[0]} right, loss {evaluation[1]:.6f}")
    torch.save({"state": model.state_dict(), "losses": losses, "evaluation": evaluation,
                "isinstance": isinstance(model, kind)},
               os.path.join(out, "result.pt"))
    torch.save({"model": model, "steps": len(losses)}, os.path.join(out, "whole.pt"))  # the whole model, in a dict


if kind == "mlp":
    numbers = [int(word) for word in sys.argv[3:]]
    width, depth, epochs = (numbers + [32, 3, 2][len(numbers):])[:3]
    mlp(width, depth, epochs)
else:
    resnet()
