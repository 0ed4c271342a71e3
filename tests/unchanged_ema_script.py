"""A script written for one device that keeps averaged copies of its model's weights, as image classifiers, diffusion
models and much of LLM pre-training do, that ``tests/test_unchanged_sharded.py`` runs under ``ddpkit run --unchanged
--shard always`` on 2 processes and on 1, and compares. Nothing in it knows about ranks or sharding.

    python unchanged_ema_script.py OUT

- a small convolutional network with BatchNorm and residual blocks, Adam, its own shuffled DataLoader;
- ``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn``, built before training, updated after every
  step, its BatchNorm statistics recomputed at the end (``update_bn``) and evaluated;
- an EMA of the script's own, a ``copy.deepcopy`` taken after the first step, updated by a loop over
  ``zip(ema.parameters(), model.parameters())``;
- a timm model (``resnet10t``) with timm's ``ModelEmaV3``, which reads both models' ``state_dict()`` at every update,
  and a second one kept in float32.

In float64. It writes OUT/result.pt: every model's and copy's state dict at the end, the evaluations, and the class of
each copy's parameters.
"""

import copy
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn
from torch.utils.data import DataLoader, TensorDataset

out = sys.argv[1]
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=False)  # (BatchNorm follows)
        self.norm = nn.BatchNorm2d(width)

    def forward(self, x):
        return x + F.relu(self.norm(self.conv(x)))


class Net(nn.Module):
    def __init__(self, width: int = 6, classes: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


images, labels = torch.randn(36, 3, 8, 8), torch.randint(0, 4, (36,))
loader = DataLoader(TensorDataset(images, labels), batch_size=8, shuffle=True)  # 4 batches of 8, then 4
model = Net()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
own = None
for epoch in range(2):
    model.train()
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        averaged.update_parameters(model)
        if own is None:
            own = copy.deepcopy(model)
        else:
            with torch.no_grad():
                for mine, theirs in zip(own.parameters(), model.parameters()):
                    mine.mul_(0.7).add_(theirs, alpha=0.3)
update_bn(loader, averaged)
averaged.eval()
own.eval()
with torch.no_grad():
    evaluations = {name: F.cross_entropy(copied(images), labels, reduction="sum").item()
                   for name, copied in (("averaged", averaged), ("own", own))}
print(f"the EMA's loss {evaluations['averaged']:.6f}, the own copy's {evaluations['own']:.6f}")

import timm  # noqa: E402
from timm.utils import ModelEmaV3  # noqa: E402

net = timm.create_model("resnet10t", pretrained=False, num_classes=4)
net_optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.05)
ema = ModelEmaV3(net, decay=0.9)
ema32 = ModelEmaV3(net, decay=0.8, dtype=torch.float32)  # an EMA in another dtype than its model's
for step, (x, y) in enumerate(DataLoader(TensorDataset(images, labels), batch_size=12, shuffle=True)):
    net.train()
    loss = F.cross_entropy(net(x), y)
    net_optimizer.zero_grad()
    loss.backward()
    net_optimizer.step()
    ema.update(net, step=step + 2)
    ema32.update(net, step=step + 2)
ema.module.eval()
with torch.no_grad():
    evaluations["timm"] = F.cross_entropy(ema.module(images), labels, reduction="sum").item()
print(f"timm's EMA's loss {evaluations['timm']:.6f}")
torch.save({"weights": {"model": model.state_dict(), "averaged": averaged.state_dict(), "own": own.state_dict(),
                        "net": net.state_dict(), "ema": ema.module.state_dict(), "ema32": ema32.module.state_dict()},
            "evaluations": evaluations,
            "classes": {name: sorted({type(parameter).__name__ for parameter in copied.parameters()})
                        for name, copied in (("averaged", averaged), ("own", own), ("ema", ema.module),
                                             ("ema32", ema32.module))}},
           os.path.join(out, "result.pt"))
