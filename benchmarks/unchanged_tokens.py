"""What a language model's loop costs under ``ddpkit run --unchanged`` when its loss views the logits as one row a
token: split (the rule's blocks of rows) against the same loop on the gathered way, and against one process.

    .venv/bin/python benchmarks/unchanged_tokens.py [--rounds 2] [--steps 24] [--json FILE]

The script (below, ``LOOP``): a one-layer causal transformer (width 128, 4 heads) over sequences of 64 tokens from a
vocabulary of 4,000, batches of 32 from a TensorDataset, AdamW; its loss
``F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))``, as nanoGPT's and transformers' loops write
it. The step rule proves it split: the view merges each row's tokens into rows of its own, and the cross-entropy is a
counted mean over them (docs/unchanged.md, "Split or gathered"). Its twin (``READS``) also prints the batch's size at
each step, which takes the gathered way: every process holds the whole batch, and the logits (32 × 64 × 4,000 floats,
33 MB) are gathered with their gradients. Runs a round, alternating the order: the loop on one process, and each twin
on 2 (``ddpkit run --unchanged --nproc-per-node N``); every process one thread; the loop's own clock over its steps
after the first two. Reported: each side's best, and the ratios.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unchanged_passes import options, reported, trained_ratios  # noqa: E402

LOOP = """
import sys, time
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

steps, vocabulary, length, batch = int(sys.argv[1]), 4000, 64, 32
reads = len(sys.argv) > 2


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, 128)
        self.position = nn.Parameter(torch.zeros(length, 128))
        self.block = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
        self.head = nn.Linear(128, vocabulary)

    def forward(self, tokens):
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.size(1))
        return self.head(self.block(self.embedding(tokens) + self.position, src_mask=causal, is_causal=True))


torch.manual_seed(0)
text = torch.randint(0, vocabulary, (steps * batch, length + 1), generator=torch.Generator().manual_seed(1))
model = LM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, (x, y) in enumerate(DataLoader(TensorDataset(text[:, :-1], text[:, 1:]), batch_size=batch, shuffle=True)):
    if step == 2:
        start = time.perf_counter()
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if reads:
        print(f"step {step}: {x.size(0)} sequences")
print(f"trained in {time.perf_counter() - start:.3f} s, last loss {loss.item():.4f}")
"""


def main() -> None:
    args = options(__doc__, steps=24)
    launch = [sys.executable, "-m", "ddpkit", "run", "--unchanged", "--seed", "0", "--nproc-per-node"]
    with tempfile.TemporaryDirectory() as folder:
        loop = Path(folder) / "loop.py"
        loop.write_text(LOOP)
        steps = str(args.steps)
        sides = {"1 process": [*launch, "1", str(loop), steps],
                 "split, 2": [*launch, "2", str(loop), steps],
                 "gathered, 2": [*launch, "2", str(loop), steps, "reads"]}
        result = trained_ratios(sides, args.rounds, folder, {"split / 1 process": ("split, 2", "1 process"),
                                                             "gathered / 1 process": ("gathered, 2", "1 process"),
                                                             "split / gathered": ("split, 2", "gathered, 2")})
    reported(result, args.json)


if __name__ == "__main__":
    main()
