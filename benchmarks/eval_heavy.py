"""A one-device script whose evaluation is most of its work, as written for one device (``benchmarks/unchanged_eval.py``
runs it under ``ddpkit run --unchanged`` on 1 and on 2 processes).

    python eval_heavy.py [--samples N] [--evals E]

A small convolutional network trains 4 steps on random 32-pixel images, then evaluates the test set E times
(``model.eval()``, ``torch.no_grad()``, batches of 128), timing each evaluation with its own clock. It prints one JSON
line per evaluation: its wall time, and the count, correct and summed loss it found.
"""

import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=2048)
parser.add_argument("--evals", type=int, default=3)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                      nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
train = TensorDataset(torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,)))
test = TensorDataset(torch.randn(args.samples, 3, 32, 32), torch.randint(0, 10, (args.samples,)))

model.train()
for x, y in DataLoader(train, batch_size=64, shuffle=True):
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()

for evaluation in range(args.evals):
    model.eval()
    count = correct = 0
    loss_sum = 0.0
    start = time.perf_counter()
    with torch.no_grad():
        for x, y in DataLoader(test, batch_size=128):
            output = model(x)
            loss_sum += F.cross_entropy(output, y, reduction="sum").item()
            correct += (output.argmax(1) == y).sum().item()
            count += len(y)
    print(json.dumps({"evaluation": evaluation, "seconds": time.perf_counter() - start, "count": count,
                      "correct": correct, "loss_sum": loss_sum}), flush=True)
