"""What a model that returns its loss costs on the gathered way under ``ddpkit run --unchanged``: a transformers loop
that counts its samples and its accuracy (so its steps take the gathered way), its model given its labels (so it
returns its loss with its logits).

    .venv/bin/python benchmarks/unchanged_returned.py [--rounds 2]

The loop: a BERT of 2 layers, width 128, from a config (``BertForSequenceClassification``), 256 sequences of 32 to 63
tokens padded per batch, batches of 32, 2 epochs, AdamW, ``out = model(**batch)``, ``out.loss.backward()``,
``seen += batch["input_ids"].size(0)`` and the accuracy from ``out.logits``. Reported: its training time (the loop's
own clock) on 1 process and on 2, R rounds. To compare a change, run it again with an older checkout's ``src`` on
``PYTHONPATH`` (docs/benchmarks.md says which).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

LOOP = """
import time
import torch
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification

torch.manual_seed(0)
lengths, labels = torch.randint(32, 64, (256,)), torch.randint(0, 2, (256,))
data = [{"input_ids": torch.randint(2, 42, (int(n),)), "labels": label} for n, label in zip(lengths, labels)]


def padded(samples):
    width = max(len(sample["input_ids"]) for sample in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, :len(sample["input_ids"])] = sample["input_ids"]
        mask[row, :len(sample["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.stack([s["labels"] for s in samples])}


model = BertForSequenceClassification(BertConfig(vocab_size=42, hidden_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, intermediate_size=512,
                                                 max_position_embeddings=128))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
start = time.perf_counter()
for epoch in range(2):
    seen, right = 0, 0
    for batch in DataLoader(data, batch_size=32, shuffle=True, collate_fn=padded):
        out = model(**batch)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        seen += batch["input_ids"].size(0)
        right += int((out.logits.argmax(-1) == batch["labels"]).sum())
    print(f"epoch {epoch}: accuracy {right / seen:.4f}")
print(f"trained in {time.perf_counter() - start:.3f} s")
"""


def trained(script: str, nproc: int) -> float:
    """The loop's training time under ``ddpkit run --unchanged`` on ``nproc`` processes."""
    done = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--unchanged", "--seed", "0", "--nproc-per-node",
                           str(nproc), script], capture_output=True, text=True, timeout=600)
    found = re.search(r"trained in ([0-9.]+) s", done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"the loop failed on {nproc} processes:\n{done.stdout}\n{done.stderr}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "loop.py")
        with open(script, "w") as file:
            file.write(LOOP)
        for round_ in range(args.rounds):
            one, two = trained(script, 1), trained(script, 2)
            print(f"round {round_ + 1}: 1 process {one:.2f} s, 2 processes {two:.2f} s ({two / one:.2f} of one)")


if __name__ == "__main__":
    main()
