"""A script that reads as one device's, but distributes itself at run time: its helper module (the test writes it
beside: ``helper.wrap``) wraps the model in DDP, or, with ``--own-group``, the script starts a process group of its own
behind a condition and wraps the model itself. ``ddpkit run --unchanged`` finds that out at the model's first call, or
at the script's ``init_process_group``, and stands aside, every hook of its own taken out and the launcher's variables
given back, and the script runs on as under ``ddpkit run``. Each rank writes OUT/rank<N>.json through ``open``: what it
found of ddpkit's after standing aside (nothing), and then the script saves its model on every rank.

    python tests/unchanged_aside_script.py OUT [--own-group]
"""

import builtins
import io
import json
import os
import sys

import torch
import torch.distributed
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as module_hooks
from torch.utils.data import DataLoader, TensorDataset

import helper

out = sys.argv[1]
rank_before = os.environ.get("RANK")  # None under --unchanged: a one-device process has no launcher's variables
torch.manual_seed(0)
if "--own-group" in sys.argv:
    torch.distributed.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(nn.Linear(4, 3))
else:
    model = helper.wrap(nn.Linear(4, 3))
loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,))), batch_size=4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
sizes = []
for epoch in range(2):
    for x, y in loader:
        sizes.append(len(x))
        loss = F.cross_entropy(model(x), y, ignore_index=2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
found = {
    "batch sizes": sizes,
    "torch.save": torch.save.__module__,
    "open": builtins.open is io.open and getattr(builtins.open, "__module__", None) in ("io", "_io"),
    "iterate": DataLoader.__iter__.__module__,
    "batch sampler": type(loader.batch_sampler).__module__,
    "cross_entropy": F.cross_entropy.__module__,
    "global hooks": len(module_hooks._global_forward_pre_hooks) + len(module_hooks._global_forward_hooks),
    "RANK": [rank_before, os.environ.get("RANK")],
    "init_process_group": torch.distributed.init_process_group.__code__.co_filename.startswith(
        os.path.dirname(torch.__file__)),  # torch's own
}
rank = torch.distributed.get_rank()
with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
    json.dump(found, file)
torch.save(model.module.state_dict(), os.path.join(out, f"model{rank}.pt"))
