"""What deciding a training step's way costs (``ddpkit.unchanged``): the script's side of one step (the loss, its
backward and the optimizer's step) with the watch on (``step_rule``), against the same step without it; and a loss
that a model returns computed both ways (``at_the_model.AtTheModel.check_losses``), against one training step of that
model. In one process (a group of one, over gloo).

    python benchmarks/step_rule_cost.py [--steps 200]

The watch is on for one step per loader (its first training step), so this is the whole cost of the decision, paid
once per loader; the model's own forward runs with the watch set aside, and is not counted here either way. A loss a
model returns is computed both ways once per model, at its first training call.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.unchanged.at_the_model import AtTheModel
from ddpkit.unchanged.batches import Batch
from ddpkit.unchanged.step_rule import StepWatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    watch_cost(args.steps)
    check_cost(max(args.steps // 10, 5))


class TokenModel(nn.Module):
    """A 2-layer transformer over tokens that returns its mean loss over the tokens not ignored, as transformers'
    models do given their labels."""

    def __init__(self, vocabulary: int = 512, width: int = 128):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens, labels):
        logits = self.head(self.layers(self.embedding(tokens)))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100), "logits": logits}


def check_cost(rounds: int) -> None:
    """The both-ways computation of a returned loss against one training step (forward, backward, AdamW)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = TokenModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 512, (32, 64))
    labels = tokens.masked_fill(torch.rand(32, 64) < 0.2, -100)
    at_the_model = AtTheModel(rank=0, world_size=1, batch=Batch(world_size=1), current_call=lambda: None)

    def step() -> float:
        start = time.perf_counter()
        loss = model(tokens, labels)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    def both_ways() -> float:
        at_the_model.losses_kept.pop(model, None)
        start = time.perf_counter()
        at_the_model.check_losses(model, (tokens, labels), {})
        return time.perf_counter() - start

    for _ in range(3):
        step(), both_ways()
    stepped = sorted(step() for _ in range(rounds))[rounds // 2]
    checked = sorted(both_ways() for _ in range(rounds))[rounds // 2]
    kept = model not in at_the_model.couples_rows
    print(f"a returned loss computed both ways (a 2-layer transformer of width 128, 32 x 64 tokens), median of "
          f"{rounds}: {checked * 1e3:.1f} ms, against {stepped * 1e3:.1f} ms for one training step: "
          f"{checked / stepped:.2f} steps, once per model; kept by a split: {kept}")
    dist.destroy_process_group()


def watch_cost(steps: int) -> None:
    """The script's side of a step with the watch on and off."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))

    def step(watched: bool) -> tuple[float, str | None]:
        watch = StepWatch() if watched else None
        if watch is not None:
            watch.begin((x, y))
            watch.pause()
        output = model(x)  # (the model's call: set aside, as ddpkit's hooks set it aside)
        start = time.perf_counter()
        if watch is not None:
            watch.outputs(output, training=True)
            watch.resume()
        loss = F.cross_entropy(output, y.to(output.device)) + 0.1 * F.mse_loss(output[:, :1], x[:, :1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print_value = loss.item()
        verdict = watch.end() if watch is not None else None
        return time.perf_counter() - start, verdict if print_value == print_value else "nan"

    for _ in range(20):
        step(False), step(True)
    plain = sorted(step(False)[0] for _ in range(steps))[steps // 2]
    results = [step(True) for _ in range(steps)]
    watched = sorted(seconds for seconds, _ in results)[steps // 2]
    verdicts = {verdict for _, verdict in results}
    print(f"the script's side of a step (loss, backward, optimizer step), median of {steps}: "
          f"{plain * 1e6:.0f} us plain, {watched * 1e6:.0f} us watched: {watched / plain:.2f}x, "
          f"{(watched - plain) * 1e6:.0f} us once per loader; verdicts {verdicts} (None: proven split)")


if __name__ == "__main__":
    main()
