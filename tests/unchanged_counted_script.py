"""A one-device script whose losses are means over counted items, which tests/test_unchanged.py runs under
``ddpkit run --unchanged`` on 1 and 2 processes, in float64: each share of a batch holds its own count, and 2
processes must still train and print as 1.

    python tests/unchanged_counted_script.py OUT

- **lm** (where transformers is installed): a GPT-2 built from a config, sequences of different lengths padded by a
  collator that puts -100 in the labels at the padding, ``loss = model(**batch).loss``, AdamW with a linear warm-up,
  gradient clipping, then saved with ``save_pretrained`` (its head tied to its embedding: one tensor, written once);
  and the same model given ``num_items_in_batch``, counted from the batch, as transformers' own
  loops do;
- **outside**: a small language model of the script's own on the same batches, its loss ``F.cross_entropy(...,
  ignore_index=-100)`` in the script;
- **weighted**: a classifier with a class-weighted ``nn.CrossEntropyLoss(weight=w)``.

It writes OUT/result.pt: each model's weights and each step's printed loss, whether the LM's state dict holds its tied
head and embedding as one tensor, and the keys ``save_pretrained`` wrote.
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

out = sys.argv[1]
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
VOCAB = 40
lengths = torch.randint(3, 13, (30,))
sequences = [torch.randint(1, VOCAB, (int(length),)) for length in lengths]


def padded(batch):
    """The collator: inputs padded with 0, labels with -100 where there is no token."""
    width = max(len(sequence) for sequence in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, sequence in enumerate(batch):
        ids[row, :len(sequence)] = sequence
        labels[row, :len(sequence)] = sequence
        mask[row, :len(sequence)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def trained(model, step, epochs=2, lr=1e-2):
    """``model`` trained by ``step(model, batch) -> loss`` over the padded batches: AdamW, a linear warm-up of 4 steps,
    gradients clipped at 1; the printed losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    warm_up = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda at: min(1.0, (at + 1) / 4))
    printed = []
    for _ in range(epochs):
        for batch in DataLoader(sequences, batch_size=8, shuffle=True, collate_fn=padded):
            loss = step(model, batch)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            warm_up.step()
            printed.append(loss.item())
    return printed


class SmallLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embedding(ids))))


def outside(model, batch):
    logits = model(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


result = {"weights": {}, "printed": {}}
torch.manual_seed(1)
model = SmallLanguageModel()
result["printed"]["outside"] = trained(model, outside)
result["weights"]["outside"] = model.state_dict()

torch.manual_seed(2)
features = torch.randn(45, 6)
classes = torch.cat([torch.zeros(30, dtype=torch.long), torch.ones(10, dtype=torch.long), torch.full((5,), 2)])
classifier = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
criterion = nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0]))
optimizer = torch.optim.SGD(classifier.parameters(), lr=0.5)
result["printed"]["weighted"] = []
for _ in range(3):
    for x, y in DataLoader(list(zip(features, classes)), batch_size=10, shuffle=True):
        loss = criterion(classifier(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        result["printed"]["weighted"].append(loss.item())
result["weights"]["weighted"] = classifier.state_dict()

try:
    import transformers
except ImportError:
    transformers = None
if transformers is not None:
    def language_model():
        torch.manual_seed(3)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    def counted_items(model, batch):
        items = (batch["labels"][:, 1:] != -100).sum()
        return model(**batch, num_items_in_batch=items).loss

    lm = language_model()
    result["printed"]["lm"] = trained(lm, lambda model, batch: model(**batch).loss, lr=3e-3)
    result["weights"]["lm"] = lm.state_dict()
    # GPT-2 ties its head to its embedding: one tensor under both keys, and save_pretrained writes it once.
    result["tied"] = result["weights"]["lm"]["lm_head.weight"].data_ptr() == \
        result["weights"]["lm"]["transformer.wte.weight"].data_ptr()
    lm.save_pretrained(os.path.join(out, "lm"))
    from safetensors import safe_open

    with safe_open(os.path.join(out, "lm", "model.safetensors"), framework="pt") as saved:
        result["saved"] = sorted(saved.keys())
    lm = language_model()
    result["printed"]["items"] = trained(lm, counted_items, lr=3e-3)
    result["weights"]["items"] = lm.state_dict()

torch.save(result, os.path.join(out, "result.pt"))
