"""A one-device script that breaks DDP's own rules, which tests/test_unchanged.py runs under ``ddpkit run
--unchanged`` on 1 and 2 processes, in float64: 2 processes must train and print as 1.

    python tests/unchanged_rules_script.py OUT [PART ...]

- **heads**: a trunk and two heads, the even steps through one and the odd steps through the other (a parameter
  unused in a step: Adam leaves the other head as one device leaves it, its gradient None);
- **reentrant**: a block run through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``;
- **unfrozen**: a backbone frozen for the first epoch (``requires_grad_(False)``), then trained;
- **frozen**: a layer trained for the first epoch, then frozen;
- **later** (named alone): both heads at every step but the fourth, which uses one: under ``--find-unused-parameters``
  as on one process, and without it refused in one line;
- **stream**: batches of an ``IterableDataset`` that shuffles itself with torch's global generator, through a
  DataLoader with 2 workers, each yielding every other sample; its last batch short;
- **self-split** (named alone): a stream that gives each process its own samples, reading the group's rank: left
  as it is;
- **printed**: an ``nn.MSELoss`` and a ``F.binary_cross_entropy_with_logits`` whose ``loss.item()`` the script
  prints, and a model with BatchNorm that returns its own mean loss written by hand.

It writes OUT/result.pt after each part: each part's weights, each step's printed loss, and the rows of each call of
its model (where the model is a ``Backbone``).
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info

out, parts = sys.argv[1], sys.argv[2:] or ["heads", "reentrant", "unfrozen", "frozen", "stream", "printed"]
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
inputs, targets = torch.randn(29, 8), torch.randn(29, 2)
data = TensorDataset(inputs, targets)  # batches of 6: the last one 5, cut 3 + 2 on two processes


class Stream(IterableDataset):
    """The data set's samples in an order drawn at each pass, each loader worker yielding every other one."""

    def __iter__(self):
        order = torch.randperm(len(inputs)).tolist()
        worker = get_worker_info()
        for index in order if worker is None else order[worker.id::worker.num_workers]:
            yield inputs[index], targets[index]


class SelfSplit(IterableDataset):
    def __iter__(self):
        # (as WebDataset's split_by_node reads them; the launcher's RANK is not in a --unchanged script's environment)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        for index in range(rank, len(inputs), world):
            yield inputs[index], targets[index]


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.a, self.b = nn.Linear(16, 2), nn.Linear(16, 2)

    def forward(self, x, step):
        return (self.a if step % 2 == 0 else self.b)(self.trunk(x))


class Later(Heads):
    def forward(self, x, step):
        features = self.trunk(x)
        return self.a(features) + (self.b(features) if step != 3 else 0)


class Reentrant(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(8, 16), nn.Linear(16, 2)
        self.middle = nn.Sequential(nn.Linear(16, 16), nn.Tanh())

    def forward(self, x, step):
        return self.last(checkpoint(self.middle, torch.tanh(self.first(x)), use_reentrant=True))


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        # (No bias before BatchNorm: its gradient would be 0 but for rounding, which Adam's step makes lr-sized.)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16),
                                      nn.Tanh())
        self.head = nn.Linear(16, 2)

    def forward(self, x, step):
        rows.append(len(x))  # what each call computes: under --unchanged, its process's share
        return self.head(self.backbone(x))


class OwnLoss(nn.Module):
    """Returns its mean squared error, written by hand (its BatchNorm's running statistics in its state)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x, y):
        return ((self.net(x) - y) ** 2).mean()


def trained(model, loss_of, epochs=3, before_epoch=lambda model, epoch: None, loader=None):
    """``model`` trained with Adam by ``loss_of(model, x, y, step)``; the printed losses."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    printed, step = [], 0
    for epoch in range(epochs):
        before_epoch(model, epoch)
        for x, y in loader if loader is not None else DataLoader(data, batch_size=6, shuffle=True):
            loss = loss_of(model, x, y, step)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            printed.append(loss.item())
            step += 1
    print(f"{type(model).__name__}: last loss {printed[-1]:.6f}")
    return model, printed


def mse(model, x, y, step):
    return F.mse_loss(model(x, step), y)


def unfreeze_after_the_first(model, epoch):
    model.backbone.requires_grad_(epoch > 0)


def freeze_after_the_first(model, epoch):
    model.backbone[2].requires_grad_(epoch == 0)


result = {"weights": {}, "printed": {}, "rows": {}}
rows = []
runs = {
    "heads": lambda: trained(Heads(), mse),
    "later": lambda: trained(Later(), mse),
    "reentrant": lambda: trained(Reentrant(), mse),
    "unfrozen": lambda: trained(Backbone(), mse, before_epoch=unfreeze_after_the_first),
    "frozen": lambda: trained(Backbone(), mse, before_epoch=freeze_after_the_first),
    "stream": lambda: trained(Backbone(), mse, loader=DataLoader(Stream(), batch_size=6, num_workers=2)),
    "self-split": lambda: trained(Backbone(), mse, loader=DataLoader(SelfSplit(), batch_size=6)),
    "printed": lambda: trained(Backbone(), lambda model, x, y, step: nn.MSELoss()(model(x, step), y)),
    "logits": lambda: trained(Backbone(), lambda m, x, y, step: F.binary_cross_entropy_with_logits(m(x, step),
                                                                                                (y > 0).double())),
    "own loss": lambda: trained(OwnLoss(), lambda model, x, y, step: model(x, y)),
}
for part in parts:
    for name in ([part] if part != "printed" else ["printed", "logits", "own loss"]):
        torch.manual_seed(1)
        rows.clear()
        model, printed = runs[name]()
        result["rows"][name] = list(rows)
        result["weights"][name] = {key: value.detach().clone() for key, value in model.state_dict().items()}
        result["printed"][name] = printed
        torch.save(result, os.path.join(out, "result.pt"))  # after each part: what a run that fails later trained
