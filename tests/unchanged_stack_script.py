"""A one-device script on the stack that people train with, which tests/test_unchanged.py runs on 1 and 2 processes
under ``ddpkit run --unchanged``, cold (no warm rank): ``torch.compile`` (inductor, generating and compiling C++ on the
CPU), a matplotlib figure saved, and, where transformers is installed, a model saved with ``save_pretrained`` and read
back with ``from_pretrained`` from the same folder. It knows nothing of processes.

    python tests/unchanged_stack_script.py OUT [--eager]

writes OUT/result.json: the compiled model's weights (float64), the figure's size, and what was read back; and
OUT/result.pt: the weights as tensors. ``--eager``: the model not compiled (one device's reference, without ddpkit:
its batches are in order, so that any process count reads the same).
"""

import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

out = sys.argv[1]
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
x, y = torch.randn(60, 8), torch.randn(60, 1)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
compiled = model if "--eager" in sys.argv else torch.compile(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for epoch in range(2):
    for xb, yb in DataLoader(TensorDataset(x, y), batch_size=12):
        loss = F.mse_loss(compiled(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
result = {"weights": {key: value.tolist() for key, value in model.state_dict().items()}}

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

plt.plot(losses)
plt.savefig(os.path.join(out, "losses.png"))
with open(os.path.join(out, "losses.png"), "rb") as figure:  # read back: what this process wrote
    result["figure"] = len(figure.read())

try:
    import transformers
except ImportError:
    transformers = None
if transformers is not None:
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    lm = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 50, (16, 8))
    lm_optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    for (batch,) in DataLoader(TensorDataset(tokens), batch_size=8):
        lm(input_ids=batch, labels=batch).loss.backward()
        lm_optimizer.step()
        lm_optimizer.zero_grad()
    lm.save_pretrained(os.path.join(out, "lm"))
    again = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(out, "lm"))
    result["read back"] = sorted(os.listdir(os.path.join(out, "lm")))
    result["the same"] = all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), lm.state_dict().values()))

with open(os.path.join(out, "result.json"), "w") as file:
    json.dump(result, file)
torch.save({"weights": {"compiled": model.state_dict()}}, os.path.join(out, "result.pt"))
