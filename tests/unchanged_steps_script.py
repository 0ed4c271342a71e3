"""Training steps whose split would not be one device's, which tests/test_unchanged.py runs under ``ddpkit run
--unchanged`` on 1 and 2 processes, in float64, with no flag: 2 processes must train and print as 1.

    python tests/unchanged_steps_script.py OUT [PART ...]

- **contrastive**: SimCLR's NT-Xent over two noisy views of each sample, the encoder called once per view, and a
  learned temperature read outside the model (every row's loss depends on every other row); the rows of each of the
  encoder's calls go into ``rows``' ``views``;
- **summed**: ``F.mse_loss(..., reduction="sum")`` plus a summed BCE, with SGD;
- **masked**: a tagger over padded sequences, its mean written by hand (``(loss * mask).sum() / mask.sum()``);
- **padding**: a GRU classifier that reads its last step over sequences that the loader's collate function pads to
  the batch's longest, its batches holding each sample's name too: a share padded to its own longest gave another last
  step (a split loader whose collate function does not collate by rows reads each batch whole and keeps its rows);
- **tokens**: the same tagger, its loss over every token not padded as a language model's loop writes it
  (``logits.view(-1, classes)`` against ``tags.view(-1)`` with ``ignore_index``: split, a counted mean over blocks of
  the batch's rows);
- **denoise**: a denoiser whose loop draws each batch's noise and noise levels (``torch.randn_like``, ``torch.rand``);
- **numbers**: the classic fine-tuning loop, printing its epoch's loss from ``loss.item() * inputs.size(0)`` and its
  accuracy from ``(preds == labels).sum()``;
- **buffers**: a model that keeps a running mean of its inputs in a buffer, written in its training forward, and
  centres them with it (as observation normalisers do), under a plain cross-entropy;
- **spectral**: an MLP whose layers are spectrally normalised: its power iteration writes each layer's buffers in its
  training forward, from the layer's weight alone, so a share's call writes what the whole batch's does (split; the
  training calls' rows go into ``rows``' ``spectral``);
- **keywords**: a model called with its tensors by keyword (``model(**batch)``), returning a dict, its epoch's
  accuracy counted from its logits: the rows of each of its calls go into OUT/result.pt's ``rows``, and whether its
  forward found a process group (``torch.distributed.is_initialized()``) into ``groups``;
- **auxiliary**: a model with a second head whose loss term is added only when the batch holds the rare class (two
  samples of 29): the other steps leave that head without a gradient, and SGD with momentum skips it, as on one
  device; then a call that raises, caught by the script;
- **later**: one loader over both epochs, a plain mean in the first, a summed penalty added in the second;
- **drawn**: one loader over both epochs, a plain mean in the first; in the second, the loop flips each batch when
  Python's ``random.random()`` says so and adds a noise level that it draws from NumPy (draws that no torch function
  makes);
- **inside**: losses a model computes inside its forward: two towers returning an in-batch contrastive loss (its
  rows' losses depend on each other: computed whole), then a tagger returning its mean over the tags that are not
  padding (``ignore_index``: split, counted); the rows of each training call go into ``rows``;
- **returned**: a model called by keyword with its labels, as transformers' models are, returning its loss over the
  labels that are not ignored and its logits, the script counting its accuracy from them (the gathered way, the
  model's calls cut all the same); then the same with ``num_items_in_batch`` given; then a binary classifier (one
  logit a row) in batches of 13, whose last batch of 3 leaves a share of one row (its logits one element);
- **loading**: a summed loss (the gathered way) over a loader that reads in a worker process and pads its sequences to
  each batch's longest (its first batch's all alike), the loop adding noise that it draws; each sample's read written
  down with its epoch, into ``rows``' ``reads`` (the reads of each epoch);
- **augmented**: a plain mean (the split way), then from the third epoch a summed term (the gathered way), over a
  loader whose persistent worker draws a number for each sample it reads (as a random augmentation does) and says it
  on stderr (the test reads each process's log), and which has a ``worker_init_fn`` (it is read whole when gathered);
- **across**: models that compute across their batch's rows inside their forward and return no loss: two towers
  returning the similarity of each row of one with each row of the other (the script's cross-entropy against the
  diagonal), then a model that centres and scales its hidden rows by their batch's mean and spread, written by hand;
  the rows of each of their calls go into ``rows``' ``similarity`` and ``centred``; and a model that draws noise in
  its forward, in evaluation too (as a VAE does), whose rows go into ``noisy`` (its weights, each process's draws, are
  not compared); and one whose BatchNorm keeps no running statistics (its rows into ``free``);
- **metrics** (where torchmetrics is installed): torchmetrics in training and in evaluation, a sum of the samples
  seen, a weighted mean of the loss, an accuracy and a concatenation of the scores; torchmetrics reads
  ``torch.distributed`` and syncs over any process group it finds, and this script started none.
- **regressor**: one output a row under a plain mean, in batches whose last leaves a share of one row;
- **collected**: predictions and labels collected over an epoch's steps, its accuracy computed after the loop;
- **penalty**: a WGAN's critic with a gradient penalty (WGAN-GP): the gradient of its outputs with respect to
  samples interpolated between real and generated ones (``torch.autograd.grad``, ``create_graph=True``), each row's
  norm held near 1, then the generator's step through the critic (last: ``--shard`` refuses it).

Each part trains 2 epochs over 29 samples in shuffled batches of 6 (the last one 5), prints one line per step and per
epoch, and writes OUT/result.pt: each part's weights (a flat dictionary of tensors). First, the script prints whether
it finds a process group: it started none.
"""

import importlib.util
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

# (byhand after cycled, whose loader's last pass was split: a gathered loader's last pass is held open until another
# begins, in case a wrapper fetched its last batch ahead, and a batch cut by hand meanwhile would be taken for its own.)
out, parts = sys.argv[1], sys.argv[2:] or [
    "contrastive", "summed", "masked", "tokens", "padding", "denoise", "numbers", "buffers", "spectral", "keywords",
    "auxiliary", "later", "drawn", "inside", "returned", "loading", "augmented", "across", "cycled", "byhand", "single",
    "listed", "hooked", "straight", "regressor", "collected"] + (
    ["metrics"] if importlib.util.find_spec("torchmetrics") else []) + [
    "penalty", "sparse", "taken", "scripted", "routed", "detected", "renormed", "again"]
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
result = {}
print(f"group 0: {torch.distributed.is_available() and torch.distributed.is_initialized()}")


def step(optimizer, loss, name=None):
    """A training step, as every part takes it; its loss printed under ``name``."""
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if name is not None:
        print(f"{name}: loss {loss.item():.12f}")


def loader(*tensors):
    return DataLoader(TensorDataset(*tensors), batch_size=6, shuffle=True)


class Counted(nn.Linear):
    """A linear layer that writes down the rows of each call (not a hook of the script's: a model holding one is
    computed whole, ``hooked``)."""

    def __init__(self, inputs: int, outputs: int, rows: list):
        super().__init__(inputs, outputs)
        self.rows = rows

    def forward(self, batch):
        self.rows.append(len(batch))
        return super().forward(batch)


def contrastive():
    x = torch.randn(29, 8)
    rows = []
    encoder = nn.Sequential(Counted(8, 16, rows), nn.ReLU(), nn.Linear(16, 4))
    log_temperature = nn.Parameter(torch.tensor(-1.0))
    optimizer = torch.optim.Adam([*encoder.parameters(), log_temperature], lr=1e-2)
    for epoch in range(2):
        for (batch,) in loader(x):
            a = F.normalize(encoder(batch + 0.1 * torch.randn_like(batch)), dim=1)
            b = F.normalize(encoder(batch + 0.1 * torch.randn_like(batch)), dim=1)
            z = torch.cat([a, b])
            similarity = z @ z.t() / log_temperature.exp()
            similarity = similarity.masked_fill(torch.eye(len(z), dtype=torch.bool), float("-inf"))
            n = len(batch)
            positives = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
            loss = F.cross_entropy(similarity, positives)
            step(optimizer, loss, f"contrastive {epoch}")
    result.setdefault("rows", {})["views"] = torch.tensor(rows)
    return {**encoder.state_dict(), "temperature": log_temperature.detach()}


def summed():
    x, y, z = torch.randn(29, 8), torch.randn(29, 2), torch.randint(0, 2, (29, 1)).double()
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for epoch in range(2):
        for batch, target, flag in loader(x, y, z):
            output = model(batch)
            loss = F.mse_loss(output[:, :2], target, reduction="sum") + F.binary_cross_entropy_with_logits(
                output[:, 2:], flag, reduction="sum")
            step(optimizer, loss, f"summed {epoch}")
    return model.state_dict()


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(11, 8)
        self.rnn = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 5)

    def forward(self, tokens):
        return self.head(self.rnn(self.embedding(tokens))[0])


def masked():
    lengths = torch.randint(1, 7, (29,))
    mask = (torch.arange(6)[None, :] < lengths[:, None]).double()
    tokens, tags = torch.randint(1, 11, (29, 6)) * mask.long(), torch.randint(0, 5, (29, 6))
    model = Tagger()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(2):
        for batch, target, kept in loader(tokens, tags, mask):
            logits = model(batch)
            loss = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
            loss = (loss * kept).sum() / kept.sum()
            step(optimizer, loss, f"masked {epoch}")
    return model.state_dict()


class LastStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(11, 8, padding_idx=0)
        self.rnn = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.rnn(self.embedding(tokens))[0][:, -1])


def padding():
    lengths = torch.randint(1, 9, (29,))
    texts = [(torch.randint(1, 11, (int(length),)), label, f"text {index}")
             for index, (length, label) in enumerate(zip(lengths, torch.randint(0, 3, (29,))))]

    def collate(rows):
        return (torch.nn.utils.rnn.pad_sequence([row[0] for row in rows], batch_first=True),
                torch.stack([row[1] for row in rows]), [row[2] for row in rows])

    model = LastStep()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for epoch in range(2):
        for tokens, labels, _ in DataLoader(texts, batch_size=6, shuffle=True, collate_fn=collate):
            step(optimizer, F.cross_entropy(model(tokens), labels), f"padding {epoch}")
    return model.state_dict()


def tokens():
    lengths = torch.randint(1, 7, (29,))
    padded = torch.arange(6)[None, :] >= lengths[:, None]
    words, tags = torch.randint(1, 11, (29, 6)).masked_fill(padded, 0), torch.randint(0, 5, (29, 6))
    model = Tagger()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(2):
        for batch, target in loader(words, tags.masked_fill(padded, -100)):
            logits = model(batch)
            step(optimizer, F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=-100),
                 f"tokens {epoch}")
    return model.state_dict()


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(9, 32), nn.SiLU(), nn.Linear(32, 8))

    def forward(self, noisy, level):
        return self.net(torch.cat([noisy, level[:, None]], dim=1))


def denoise():
    x = torch.randn(29, 8)
    model = Denoiser()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(2):
        for (batch,) in loader(x):
            noise = torch.randn_like(batch)
            level = torch.rand(len(batch))
            noisy = (1 - level[:, None]).sqrt() * batch + level[:, None].sqrt() * noise
            loss = F.mse_loss(model(noisy, level), noise)
            step(optimizer, loss, f"denoise {epoch}")
    return model.state_dict()


def numbers():
    x, y = torch.randn(29, 8), torch.randint(0, 3, (29,))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        running_loss, running_corrects = 0.0, 0
        for inputs, labels in loader(x, y):
            optimizer.zero_grad()
            outputs = model(inputs)
            _, preds = torch.max(outputs, 1)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item() * inputs.size(0)
            running_corrects += torch.sum(preds == labels.data)
        print(f"numbers {epoch}: loss {running_loss / 29:.12f} acc {running_corrects.double() / 29:.12f}")
    return model.state_dict()


class Centred(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))
        self.net = nn.Linear(8, 3)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.net(x - self.mean)


class Factors(nn.Module):
    def __init__(self):
        super().__init__()
        self.users, self.items = nn.Embedding(9, 4, max_norm=1.0), nn.Embedding(7, 4, max_norm=1.0)

    def forward(self, users, items):
        return (self.users(users) * self.items(items)).sum(1) * 5


def buffers():
    x, y = torch.randn(29, 8) + 2, torch.randint(0, 3, (29,))
    model = Centred()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for inputs, labels in loader(x, y):
            loss = F.cross_entropy(model(inputs), labels)
            step(optimizer, loss, f"buffers {epoch}")
    return model.state_dict()


class Normalised(nn.Module):
    """Two spectrally normalised layers (``torch.nn.utils.parametrizations.spectral_norm``), the rows of each training
    call written down."""

    def __init__(self, rows: list):
        super().__init__()
        self.rows = rows
        self.first = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 16))
        self.second = nn.utils.parametrizations.spectral_norm(nn.Linear(16, 3))

    def forward(self, x):
        if self.training:
            self.rows.append(len(x))
        return self.second(torch.tanh(self.first(x)))


def spectral():
    x, y = torch.randn(29, 8), torch.randint(0, 3, (29,))
    rows = []
    model = Normalised(rows)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for inputs, labels in loader(x, y):
            step(optimizer, F.cross_entropy(model(inputs), labels), f"spectral {epoch}")
    result.setdefault("rows", {})["spectral"] = torch.tensor(rows)
    return model.state_dict()


def renormed():
    """Embeddings kept in the unit ball by ``nn.Embedding(max_norm=1.0)``, whose forward renormalises the rows that
    its batch looks up, in place, outside autograd: the model's parameters written in a training call, computed whole
    (before: each process renormalised its share's rows alone, 1.5 from one process after 3 epochs of a small
    recommender). Under ``--shard always``, refused in one line: a shard would not keep what the forward writes."""
    users, items, ratings = torch.randint(0, 9, (29,)), torch.randint(0, 7, (29,)), torch.rand(29) * 5
    factors = Factors()
    optimizer = torch.optim.SGD(factors.parameters(), lr=0.5)
    for epoch in range(2):
        for u, i, r in loader(users, items, ratings):
            step(optimizer, F.mse_loss(factors(u, i), r), f"renormed {epoch}")
    return factors.state_dict()


class ByKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 3)
        self.rows, self.groups = [], []

    def forward(self, inputs, scale):
        if self.training:
            self.rows.append(len(inputs))
            self.groups.append(torch.distributed.is_available() and torch.distributed.is_initialized())
        return {"logits": self.net(inputs) * scale}


def keywords():
    x, y = torch.randn(29, 8), torch.randint(0, 3, (29,))
    model = ByKeyword()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        right = 0
        for inputs, labels in loader(x, y):
            batch = {"inputs": inputs, "scale": torch.ones(len(inputs), 1)}
            logits = model(**batch)["logits"]
            step(optimizer, F.cross_entropy(logits, labels))
            right += int((logits.argmax(1) == labels).sum())
        print(f"keywords {epoch}: {right} right")
    result.setdefault("rows", {}).update(keywords=torch.tensor(model.rows), groups=torch.tensor(model.groups))
    return model.state_dict()


class WithAuxiliary(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.head, self.auxiliary = nn.Linear(8, 16), nn.Linear(16, 3), nn.Linear(16, 1)

    def forward(self, x):
        hidden = torch.tanh(self.trunk(x))
        return self.head(hidden), self.auxiliary(hidden)


class Routed(nn.Module):
    """Two experts, each row routed to one by the sign of its first feature; an expert that no row reaches is not
    called (a branch on its data: ``branches``)."""

    def __init__(self):
        super().__init__()
        self.trunk, self.experts = nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 3), nn.Linear(8, 3)])

    def forward(self, x):
        hidden, out = torch.tanh(self.trunk(x)), torch.zeros(len(x), 3)
        for index, expert in enumerate(self.experts):
            rows = (x[:, 0] > 0) == bool(index)
            if rows.any():
                out = out.index_put((rows,), expert(hidden[rows]))
        return out


def auxiliary():
    x, y = torch.randn(29, 8), torch.randint(0, 2, (29,))
    y[[3, 17]] = 2  # the rare class
    model = WithAuxiliary()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        for inputs, labels in loader(x, y):
            logits, extra = model(inputs)
            loss = F.cross_entropy(logits, labels)
            rare = labels == 2
            if rare.any():
                loss = loss + F.binary_cross_entropy_with_logits(extra[:, 0], rare.double())
            step(optimizer, loss, f"auxiliary {epoch}")
    try:  # a call that raises (a wrong shape), caught: the script goes on, with no DDP forward left going on
        model(torch.randn(2, 7))
    except RuntimeError as error:
        active = torch.nn.parallel.DistributedDataParallel._active_ddp_module
        print(f"auxiliary 1: {type(error).__name__} caught, a DDP forward left going on: {active is not None}")
    return model.state_dict()


def drawn():
    import random

    import numpy

    x, y = torch.randn(29, 4, 2), torch.randint(0, 3, (29,))
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = loader(x, y)
    for epoch in range(2):
        for inputs, labels in train:
            if epoch == 1:
                inputs = inputs.flip(-1) if random.random() < 0.5 else inputs
                inputs = inputs * (1 + numpy.random.normal(0, 0.5))
            step(optimizer, F.cross_entropy(model(inputs), labels), f"drawn {epoch}")
    return model.state_dict()


def later():
    x, y = torch.randn(29, 8), torch.randn(29, 2)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train = loader(x, y)
    for epoch in range(2):
        for inputs, targets in train:
            output = model(inputs)
            loss = F.mse_loss(output, targets)
            if epoch == 1:
                loss = loss + 0.01 * (output ** 2).sum()
            step(optimizer, loss, f"later {epoch}")
    return model.state_dict()


class TwoTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(8, 4), nn.Linear(8, 4)
        self.rows = []

    def forward(self, x, y):
        if self.training:
            self.rows.append(len(x))
        similarity = F.normalize(self.left(x), dim=1) @ F.normalize(self.right(y), dim=1).t() / 0.1
        labels = torch.arange(len(x))
        return (F.cross_entropy(similarity, labels) + F.cross_entropy(similarity.t(), labels)) / 2


class PaddedTagger(Tagger):
    def __init__(self):
        super().__init__()
        self.rows = []

    def forward(self, tokens, tags):
        if self.training:
            self.rows.append(len(tokens))
        return F.cross_entropy(super().forward(tokens).transpose(1, 2), tags, ignore_index=-100)


def inside():
    x, y = torch.randn(29, 8), torch.randn(29, 8)
    towers = TwoTowers()
    optimizer = torch.optim.SGD(towers.parameters(), lr=0.1)
    for epoch in range(2):
        for left, right in loader(x, y):
            step(optimizer, towers(left, right), f"inside {epoch}")
    lengths = torch.randint(1, 7, (29,))
    tokens = torch.randint(1, 11, (29, 6))
    tags = torch.randint(0, 5, (29, 6)).masked_fill(torch.arange(6)[None, :] >= lengths[:, None], -100)
    tagger = PaddedTagger()
    optimizer = torch.optim.Adam(tagger.parameters(), lr=1e-2)
    for epoch in range(2):
        for batch, target in loader(tokens, tags):
            step(optimizer, tagger(batch, target), f"inside {epoch}")
    result.setdefault("rows", {}).update(towers=torch.tensor(towers.rows), tagger=torch.tensor(tagger.rows))
    return {**{f"towers.{k}": v for k, v in towers.state_dict().items()}, **tagger.state_dict()}


class Returns(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.rows = []

    def forward(self, inputs, labels, num_items_in_batch=None):
        if self.training:
            self.rows.append(len(inputs))
        logits = self.net(inputs)
        if num_items_in_batch is None:
            return {"loss": F.cross_entropy(logits, labels, ignore_index=-100), "logits": logits}
        return {"loss": F.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch, "logits": logits}


class Binary(Returns):
    def __init__(self):
        super().__init__()
        self.net[-1] = nn.Linear(16, 1)

    def forward(self, inputs, labels):
        if self.training:
            self.rows.append(len(inputs))
        logits = self.net(inputs)
        return {"loss": F.binary_cross_entropy_with_logits(logits[:, 0], labels), "logits": logits}


def returned():
    x, y = torch.randn(29, 8), torch.randint(0, 3, (29,))
    y[::4] = -100
    weights = {}
    for counted in (False, True):
        model = Returns()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(2):
            right = 0
            for inputs, labels in loader(x, y):
                batch = {"inputs": inputs, "labels": labels}
                if counted:
                    batch["num_items_in_batch"] = (labels != -100).sum()
                out = model(**batch)
                step(optimizer, out["loss"], f"returned {epoch}")
                right += int((out["logits"].argmax(1) == labels).sum())
            print(f"returned {epoch}: {right} right")
        result.setdefault("rows", {})[f"returned{int(counted)}"] = torch.tensor(model.rows)
        weights.update({f"{int(counted)}.{key}": value for key, value in model.state_dict().items()})
    model = Binary()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        right = 0
        for inputs, labels in DataLoader(TensorDataset(x, (y > 0).double()), batch_size=13, shuffle=True):
            out = model(inputs=inputs, labels=labels)
            step(optimizer, out["loss"], f"returned {epoch}")
            right += int(((out["logits"][:, 0] > 0) == (labels > 0.5)).sum())
        print(f"returned {epoch}: {right} right")
    result["rows"]["binary"] = torch.tensor(model.rows)
    return {**weights, **{f"binary.{key}": value for key, value in model.state_dict().items()}}


class Recorded(torch.utils.data.Dataset):
    """Samples whose every read, in whatever process, is written down with the epoch it was read in."""

    def __init__(self, *tensors):
        self.tensors, self.epoch = tensors, 0

    def __len__(self):
        return len(self.tensors[0])

    def __getitem__(self, index):
        with open(os.path.join(out, "reads.txt"), "a") as reads:
            reads.write(f"{self.epoch}\n")
        return tuple(tensor[index] for tensor in self.tensors)


def padded(rows):
    """Sequences padded to the batch's longest, as a collate function for text does."""
    sequences = torch.nn.utils.rnn.pad_sequence([row[0] for row in rows], batch_first=True)
    return sequences, torch.stack([row[1] for row in rows])


def loading():
    lengths = [3] * 6 + [index % 4 + 1 for index in range(6, 29)]  # (the first batch's all alike: it shows no padding)
    data = Recorded([torch.randn(length, 4) for length in lengths], torch.randn(29, 2))
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = DataLoader(data, batch_size=6, num_workers=1, collate_fn=padded)
    for epoch in range(2):
        data.epoch = epoch
        for inputs, targets in batches:
            loss = F.mse_loss(model(inputs + 0.1 * torch.randn_like(inputs)).sum(1), targets, reduction="sum")
            step(optimizer, loss, f"loading {epoch}")
    with open(os.path.join(out, "reads.txt")) as reads:
        read = reads.read().split()
    result.setdefault("rows", {})["reads"] = torch.tensor([read.count("0"), read.count("1")])
    return model.state_dict()


class Drawn(TensorDataset):
    """Samples and a number drawn for each read (as a random augmentation draws), said on stderr by the process that
    reads it (a loader's worker)."""

    def __getitem__(self, index):
        drawn = torch.rand(())
        print(f"drawn {drawn:.9f}", file=sys.stderr, flush=True)
        return super().__getitem__(index)


def augmented():
    x, y = torch.randn(29, 8), torch.randn(29, 2)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = DataLoader(Drawn(x, y), batch_size=6, shuffle=True, num_workers=1, persistent_workers=True,
                         worker_init_fn=lambda worker: None)
    for epoch in range(4):
        print(f"augmented: epoch {epoch}", file=sys.stderr, flush=True)
        for inputs, targets in batches:
            loss = F.mse_loss(model(inputs), targets)
            if epoch >= 2:  # (a summed term from the third epoch: the gathered way)
                loss = loss + 1e-3 * model(inputs).sum()
            step(optimizer, loss, f"augmented {epoch}")
    return model.state_dict()


class Similarity(TwoTowers):
    def forward(self, x, y):
        self.rows.append(len(x))
        return F.normalize(self.left(x), dim=1) @ F.normalize(self.right(y), dim=1).t() / 0.1


class BatchCentred(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(8, 16), nn.Linear(16, 2)
        self.rows = []

    def forward(self, x):
        self.rows.append(len(x))
        hidden = self.first(x)
        return self.last(torch.tanh((hidden - hidden.mean(0)) / (hidden.std(0) + 1e-5)))


class Noisy(BatchCentred):
    def forward(self, x):
        self.rows.append(len(x))
        return self.last(torch.tanh(self.first(x + 0.1 * torch.randn_like(x))))


class Free(BatchCentred):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(16, track_running_stats=False)

    def forward(self, x):
        self.rows.append(len(x))
        return self.last(torch.tanh(self.norm(self.first(x))))


def across():
    x, y, z = torch.randn(29, 8), torch.randn(29, 8), torch.randn(29, 2)
    towers, centred, noisy, free = Similarity(), BatchCentred(), Noisy(), Free()
    optimizer = torch.optim.SGD([*towers.parameters(), *centred.parameters()], lr=0.1)
    for epoch in range(2):
        for left, right in loader(x, y):
            logits = towers(left, right)
            step(optimizer, F.cross_entropy(logits, torch.arange(len(logits))), f"across {epoch}")
    for epoch in range(2):
        for inputs, targets in loader(x, z):
            step(optimizer, F.mse_loss(centred(inputs), targets), f"across {epoch}")
    optimizer = torch.optim.SGD(noisy.parameters(), lr=0.1)
    for epoch in range(2):
        for inputs, targets in loader(x, z):
            step(optimizer, F.mse_loss(noisy(inputs), targets))
    torch.manual_seed(1)  # (its draws were each process's own: the parts after it start from a seed again)
    optimizer = torch.optim.SGD(free.parameters(), lr=0.1)
    for epoch in range(2):
        for inputs, targets in loader(x, z):
            step(optimizer, F.mse_loss(free(inputs), targets))
    result.setdefault("rows", {}).update(similarity=torch.tensor(towers.rows), centred=torch.tensor(centred.rows),
                                         noisy=torch.tensor(noisy.rows), free=torch.tensor(free.rows))
    return {**{f"towers.{k}": v for k, v in towers.state_dict().items()}, **centred.state_dict(),
            **{f"free.{k}": v for k, v in free.state_dict().items()}}


def cycled():
    """A loader read through ``itertools.cycle``, which keeps its first pass's batches (here, each process's shares)
    and hands them out again, in their order, once the pass has ended (before: refused in one line at the first)."""
    import itertools

    x, y = torch.randn(29, 8), torch.randn(29, 1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = itertools.cycle(loader(x, y))
    for number in range(10):
        inputs, targets = next(batches)
        step(optimizer, F.mse_loss(model(inputs), targets), f"cycled {number // 5}")
    return model.state_dict()


def single():
    """BatchNorm in training on a batch of one sample (7 samples in batches of 6): torch refuses it on one device
    (a ValueError, which the script catches), and so it does split across the processes, where one of them holds a
    stand-in (before: ddpkit's BatchNorm over every process trained on it)."""
    x, y = torch.randn(7, 8), torch.randint(0, 3, (7,))
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for inputs, labels in loader(x, y):
            try:
                step(optimizer, F.cross_entropy(model(inputs), labels))
            except ValueError as error:
                print(f"single {epoch}: {error}")
    return model.state_dict()


def listed():
    """A loader that hands out lists of samples (``collate_fn`` keeps them), the model called on each sample, the loss
    divided by ``len(batch)``: a batch of one row cannot be cut across the processes, and the model is computed whole
    (before: said to compute across the rows of its batch, which it does not)."""
    samples = TensorDataset(torch.randn(7, 8), torch.randint(0, 3, (7,)))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for batch in DataLoader(samples, batch_size=4, shuffle=True, collate_fn=lambda batch: batch):
            loss = sum(F.cross_entropy(model(inputs[None]), label[None]) for inputs, label in batch) / len(batch)
            step(optimizer, loss)
        print(f"listed {epoch}: loss {loss.item():.12f} of {len(batch)}")
    return model.state_dict()


class Kept:
    """A hook of the script's own, as a class: it keeps the output of the layer it is on."""

    def __call__(self, layer, inputs, output):
        self.output = output


class KeepsItsOwn(nn.Module):
    """A mixture of two experts that keeps its hidden rows on itself, and appends its load-balancing loss to a list
    of its own, for the loop."""

    def __init__(self):
        super().__init__()
        self.gate, self.experts = nn.Linear(8, 2), nn.ModuleList([nn.Linear(8, 3), nn.Linear(8, 3)])
        self.hidden, self.balances = None, []

    def forward(self, inputs):
        self.hidden = self.gate(inputs).softmax(1)
        load = self.hidden.mean(0)
        self.balances.append(2 * (load * load).sum())
        return sum(self.hidden[:, index:index + 1] * expert(inputs) for index, expert in enumerate(self.experts))


def hooked():
    """A penalty on a hidden layer's activations, which forward hooks of the script's own keep (a function, and an
    object of a class); a model that keeps its hidden rows and its balancing loss on itself, which the loop adds: a
    call cut at the model would give them a share's rows (before: 1.1e-2 and 6.2e-3 from one process, silently, the
    printed loss each process's own). Both computed whole on every process, said once each, the list's first entry
    taken back where the first call, tried on a share, is made again whole. The loop skips each epoch's first batch
    before any model sees it (before: read as a batch that a wrapper fetched ahead, and said so)."""
    x, y = torch.randn(29, 8), torch.randint(0, 3, (29,))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    kept, hidden, mixture = Kept(), {}, KeepsItsOwn()
    model[1].register_forward_hook(lambda layer, inputs, output: hidden.update(tanh=output))
    model[3].register_forward_hook(kept)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(mixture.parameters(), lr=0.1)]
    for epoch in range(2):
        for index, (inputs, labels) in enumerate(loader(x, y)):
            if index == 0:
                continue
            loss = F.cross_entropy(model(inputs), labels)
            step(optimizers[0], loss + hidden["tanh"].pow(2).sum() / 20 + kept.output.sum() / 50, f"hooked {epoch}")
            loss = F.cross_entropy(mixture(inputs), labels) + mixture.hidden[:, 0].sum() / 30 + sum(mixture.balances)
            mixture.balances.clear()
            step(optimizers[1], loss)
    return {**model.state_dict(), **{f"mixture.{k}": v for k, v in mixture.state_dict().items()}}


class Rounded(torch.autograd.Function):
    """A straight-through estimator: rounded forward, the gradient passed through."""

    @staticmethod
    def forward(ctx, values):
        return torch.round(values)

    @staticmethod
    def backward(ctx, gradient):
        return gradient


def straight():
    """A loss that adds a ``.mean()`` written by hand (the rounding's error), printed at each epoch's end, after the
    last step, where no watch sees the read: its value on split batches would be a share's (before: the printed
    loss each process's own, the weights exact). Gathered from its first step."""
    x, y = torch.randn(29, 8), torch.randint(0, 3, (29,))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for inputs, labels in loader(x, y):
            outputs = model(inputs)
            rounded = Rounded.apply(outputs * 4) / 4
            loss = F.cross_entropy(rounded, labels) + 0.1 * (rounded - outputs).pow(2).mean()
            step(optimizer, loss)
        print(f"straight {epoch}: loss {loss.item():.12f}")
    return model.state_dict()


def regressor():
    """One output a row and a plain mean (the split way), in batches of 9, whose last of 2 leaves each process a share
    of one row, then of 13, whose last of 3 leaves shares of 2 and 1: a share's output of one row is one element, and
    not a loss (before: taken for one, the two processes' outputs were averaged into each, 1.3e-2 off; with shares
    of 2 and 1 rows, one process waited in a collective that the other never reached). Then, in batches of 9 again,
    its one output a row squeezed (``model(x).squeeze()``) into a binary logit: the gathered way, as on a share of one
    row ``squeeze()`` would take the rows away (before: split, and a share's logit of no dimension met a target of one
    row, a ValueError on that process). Each epoch's last loss printed: its short batch's."""
    x = torch.randn(29, 4)
    y = x.sum(1, keepdim=True)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch, size in enumerate((9, 13, 9)):
        for inputs, targets in DataLoader(TensorDataset(x, y), batch_size=size, shuffle=True):
            if epoch < 2:
                loss = F.mse_loss(model(inputs), targets)
            else:
                loss = F.binary_cross_entropy_with_logits(model(inputs).squeeze(), (targets.squeeze(1) > 0).double())
            step(optimizer, loss)
        print(f"regressor {epoch}: loss {loss.item():.12f}")
    return model.state_dict()


def collected():
    """A loop that collects each step's predictions and labels in lists made before the loop, and computes its epoch's
    accuracy from them after it, the steps themselves a plain mean: the gathered way (before: split, each process
    collected the first batch and its shares of the others, and printed "4 of 18 right" where one process printed
    "7 of 29 right")."""
    x, y = torch.randn(29, 8), torch.randint(0, 3, (29,))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        predictions, labels = [], []
        for inputs, targets in loader(x, y):
            logits = model(inputs)
            step(optimizer, F.cross_entropy(logits, targets))
            predictions.append(logits.detach().argmax(1))
            labels.append(targets)
        predictions, labels = torch.cat(predictions), torch.cat(labels)
        print(f"collected {epoch}: {int((predictions == labels).sum())} of {len(labels)} right")
    return model.state_dict()


class Tokens(nn.Module):
    """A next-token model over batches that the loop cuts by hand, returning its logits and its loss."""

    def __init__(self):
        super().__init__()
        self.rows = []
        self.embedding, self.head = nn.Embedding(11, 8), Counted(8, 11, self.rows)

    def forward(self, idx, targets):
        logits = self.head(torch.tanh(self.embedding(idx)))
        return logits, F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))


class InBatch(nn.Module):
    """Two towers returning their in-batch contrastive loss: each row's loss depends on every other row."""

    def __init__(self):
        super().__init__()
        self.rows = []
        self.query, self.document = Counted(8, 4, self.rows), nn.Linear(8, 4)

    def forward(self, queries, documents):
        similarity = F.normalize(self.query(queries), dim=1) @ F.normalize(self.document(documents), dim=1).T
        return F.cross_entropy(similarity / 0.1, torch.arange(len(queries)))


def byhand():
    """Batches that the loop cuts by hand from one sequence (nanoGPT's ``get_batch``: no DataLoader), given to the
    model by keyword alone (``model(idx=x, targets=y)``), then its targets alone by keyword (``model(x, targets=y)``,
    as transformers' models take their labels). Its first call, whole, shows it returns its loss, which is computed
    both ways (the whole batch, then this process's share, in evaluation): a mean over its rows. Its later calls are
    cut at the model, keywords and all (before: the first refused, saying that the model returned no loss;
    the second crashed on targets that were not cut); their rows go into ``rows``' ``byhand``. Then another such model
    whose logits the loop reads from its second step on, every other step (a count of right predictions against the
    batch's targets, printed): its logits on each share are gathered, as the loop's code loads them again (before: a
    crash on shapes that did not match); its rows into ``read``. Last, two towers returning an in-batch contrastive loss, which the check shows not
    to be a mean over rows: computed whole (before: split, silently 1.1e-1 from one process); rows into ``towers``."""
    text = torch.randint(0, 11, (200,))
    model = Tokens()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for keyword in (True, False):
        for _ in range(5):
            starts = torch.randint(len(text) - 7, (6,))
            x = torch.stack([text[start:start + 6] for start in starts])
            y = torch.stack([text[start + 1:start + 7] for start in starts])
            _, loss = model(idx=x, targets=y) if keyword else model(x, targets=y)
            step(optimizer, loss, f"byhand {int(keyword)}")
    reader = Tokens()
    reading = torch.optim.SGD(reader.parameters(), lr=0.5)
    for count in range(5):
        starts = torch.randint(len(text) - 7, (6,))
        x = torch.stack([text[start:start + 6] for start in starts])
        y = torch.stack([text[start + 1:start + 7] for start in starts])
        logits, loss = reader(x, y)
        step(reading, loss)
        if count % 2:
            print(f"byhand 2: {int((logits.argmax(-1) == y).sum())} right")
    towers, samples = InBatch(), torch.randn(40, 8)
    pairing = torch.optim.SGD(towers.parameters(), lr=0.1)
    for _ in range(5):
        chosen = torch.randperm(40)[:6]
        step(pairing, towers(samples[chosen], samples[chosen] + 0.1 * torch.randn(6, 8)), "byhand 3")
    result.setdefault("rows", {}).update(byhand=torch.tensor(model.rows), read=torch.tensor(reader.rows),
                                         inbatch=torch.tensor(towers.rows))
    return {**model.state_dict(), **{f"reader.{key}": value for key, value in reader.state_dict().items()},
            **{f"towers.{key}": value for key, value in towers.state_dict().items()}}


class Detector(nn.Module):
    """Returns its losses in a dict, its box loss only where its batch holds a positive: a loss that its data decides
    whether to compute, inside its forward."""

    def __init__(self):
        super().__init__()
        self.body, self.classes, self.boxes = nn.Linear(8, 16), nn.Linear(16, 2), nn.Linear(16, 4)

    def forward(self, x, labels, boxes):
        hidden = torch.tanh(self.body(x))
        classes, placed = self.classes(hidden), self.boxes(hidden)
        losses = {"classes": F.cross_entropy(classes, labels)}
        positive = labels > 0
        if positive.any():
            losses["boxes"] = F.smooth_l1_loss(placed[positive], boxes[positive])
        return losses


def routed():
    """Experts that a router skips where no row reaches them, on split batches (its loader in order: the first batch
    routes rows to both experts in each process's share, the second to the second expert in one share only, the third
    to none, whose step leaves that expert without a gradient on one device too). Before, the second step stopped the
    run (exit status 2, naming --find-unused-parameters): DDP was built plain after a first step that used every
    parameter; now its first step's forward shows that it reads its data, and DDP looks for unused parameters."""
    x, y = torch.randn(29, 8), torch.randint(0, 3, (29,))
    x[:, 0] = -x[:, 0].abs()
    x[[0, 3, 5, 8, 20], 0] *= -1  # (rows routed to the second expert)
    model = Routed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        for inputs, labels in DataLoader(TensorDataset(x, y), batch_size=6):
            step(optimizer, F.cross_entropy(model(inputs), labels))
    return model.state_dict()


def detected():
    """A detector whose box loss, computed inside its forward, only the batches with a positive have, its loader in
    order: the first batch holds none, the second one in one process's share only. Its first step's forward, which
    does not enter the ``if`` on its data, shows the loss that the ``if``'s block calls, and it is computed whole, its
    batches whole (before: the second step's shares computed that loss on one process only, and the run failed on
    collectives that no longer paired up, "Is there a distributed collective mismatch"; on NCCL, a hang)."""
    x, labels, boxes = torch.randn(29, 8), torch.zeros(29, dtype=torch.long), torch.randn(29, 4)
    labels[[8, 15, 16, 20]] = 1
    detector = Detector()
    optimizer = torch.optim.SGD(detector.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        for inputs, targets, placed in DataLoader(TensorDataset(x, labels, boxes), batch_size=6):
            step(optimizer, sum(detector(inputs, targets, placed).values()))
    return detector.state_dict()


def penalty():
    real_samples = torch.randn(29, 8) + 1
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    critic = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    generator_steps = torch.optim.Adam(generator.parameters(), lr=1e-3)
    critic_steps = torch.optim.Adam(critic.parameters(), lr=1e-3)
    for epoch in range(2):
        for (real,) in loader(real_samples):
            fake = generator(torch.randn(real.size(0), 4)).detach()
            alpha = torch.rand(real.size(0), 1)
            mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            grads = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)[0]
            held = ((grads.norm(2, dim=1) - 1) ** 2).mean()
            step(critic_steps, critic(fake).mean() - critic(real).mean() + 10 * held, f"penalty {epoch}")
            step(generator_steps, -critic(generator(torch.randn(real.size(0), 4))).mean())
    return {**{f"generator.{k}": v for k, v in generator.state_dict().items()},
            **{f"critic.{k}": v for k, v in critic.state_dict().items()}}


class Ratings(nn.Module):
    """Matrix factorisation over sparse embeddings (``sparse=True``: their gradients are sparse tensors)."""

    def __init__(self):
        super().__init__()
        self.users, self.items = nn.Embedding(11, 4, sparse=True), nn.Embedding(7, 4, sparse=True)
        self.bias = nn.Linear(8, 1)

    def forward(self, users, items):
        return self.bias(torch.cat([self.users(users), self.items(items)], 1)).squeeze(1)


def sparse():
    users, items, ratings = torch.randint(0, 11, (29,)), torch.randint(0, 7, (29,)), torch.rand(29) * 5
    model = Ratings()
    embeddings = torch.optim.SparseAdam([model.users.weight, model.items.weight], lr=0.05)
    dense = torch.optim.SGD(model.bias.parameters(), lr=0.05)
    for epoch in range(2):
        for who, what, rated in loader(users, items, ratings):
            loss = F.mse_loss(model(who, what), rated)
            dense.zero_grad()
            step(embeddings, loss, f"sparse {epoch}")
            dense.step()
    return model.state_dict()


def taken():
    """Gradients that the script takes itself and sets by hand: ``torch.autograd.grad`` with respect to the weights,
    and per-sample gradients by torch.func (DP-SGD's clipping), each set as ``p.grad`` before the optimizer's step."""
    from torch.func import functional_call, grad, vmap

    x, y = torch.randn(29, 8), torch.randint(0, 3, (29,))
    by_hand, per_sample, read = (nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)) for _ in range(3))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (by_hand, per_sample, read)]

    def sample_loss(weights, inputs, label):
        return F.cross_entropy(functional_call(per_sample, weights, (inputs[None],)), label[None])

    for epoch in range(2):
        for inputs, labels in loader(x, y):
            loss = F.cross_entropy(by_hand(inputs), labels)
            for parameter, gradient in zip(by_hand.parameters(), torch.autograd.grad(loss, by_hand.parameters())):
                parameter.grad = gradient
            optimizers[0].step()
            print(f"taken {epoch}: loss {loss.item():.12f}")
            weights = {name: parameter.detach() for name, parameter in per_sample.named_parameters()}
            each = vmap(grad(sample_loss), in_dims=(None, 0, 0))(weights, inputs, labels)
            norms = torch.stack([value.flatten(1).norm(dim=1) for value in each.values()]).norm(dim=0)
            clipped = (1.0 / norms).clamp(max=1.0)
            for name, parameter in per_sample.named_parameters():
                parameter.grad = (each[name] * clipped.view(-1, *[1] * (each[name].dim() - 1))).sum(0) / len(inputs)
            optimizers[1].step()
            print(f"taken {epoch}: norms {norms.sum().item():.12f}")
            # The gradient's norm read first (its graph kept: at the first step, through DDP's static graph, which
            # reduces there), then a second call before one backward of both (before: a crash in DDP's backward).
            loss = F.cross_entropy(read(inputs), labels)
            norm = torch.cat([gradient.flatten() for gradient in torch.autograd.grad(
                loss, list(read.parameters()), retain_graph=True)]).norm()
            step(optimizers[2], loss + F.cross_entropy(read(inputs * 1.1), labels) / (1 + norm.detach()))
    return {**{f"by_hand.{k}": v for k, v in by_hand.state_dict().items()},
            **{f"per_sample.{k}": v for k, v in per_sample.state_dict().items()},
            **{f"read.{k}": v for k, v in read.state_dict().items()}}


def scripted():
    """A TorchScript model, trained as it is (it takes no hooks of a module's own); a model of lazy modules, whose
    parameters a dry run makes (before: DDP refused them, uninitialized, at that call), and one without; layers parametrized by
    weight_norm and spectral_norm (before: torch's own part of them taken for the model)."""
    x, y = torch.randn(29, 8), torch.randint(0, 3, (29,))
    model = torch.jit.script(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)))
    lazy = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.LazyLinear(3))
    lazy(torch.zeros(2, 8))
    # Layers parametrized by torch (which calls each parametrization as it registers it, from its own code).
    normed = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 16)), nn.Tanh(),
                           nn.utils.parametrizations.spectral_norm(nn.Linear(16, 3)))
    optimizers = [torch.optim.SGD(each.parameters(), lr=0.1) for each in (model, lazy, normed)]
    for epoch in range(2):
        for inputs, labels in loader(x, y):
            step(optimizers[0], F.cross_entropy(model(inputs), labels), f"scripted {epoch}")
            step(optimizers[1], F.cross_entropy(lazy(inputs), labels))
            step(optimizers[2], F.cross_entropy(normed(inputs), labels))
    # Lazy modules without a dry run, on a loader of their own: made at the pass's first step, whose batch is whole on
    # every process, their optimizer after it (before: that batch, which no adopted model took, was read as one
    # fetched ahead by a wrapper, and said so).
    made, made_optimizer = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.LazyLinear(3)), None
    for epoch in range(2):
        for inputs, labels in loader(x, y):
            loss = F.cross_entropy(made(inputs), labels)
            made_optimizer = made_optimizer or torch.optim.SGD(made.parameters(), lr=0.1)
            step(made_optimizer, loss)
    return {**model.state_dict(), **{f"lazy.{k}": v for k, v in lazy.state_dict().items()},
            **{f"normed.{k}": v for k, v in normed.state_dict().items()},
            **{f"made.{k}": v for k, v in made.state_dict().items()}}


def metrics():
    import torchmetrics

    x, y = torch.randn(29, 8), torch.randint(0, 3, (29,))
    held_out = DataLoader(TensorDataset(torch.randn(13, 8), torch.randint(0, 3, (13,))), batch_size=5)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen, mean_loss = torchmetrics.SumMetric(), torchmetrics.MeanMetric()
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    scores, tested = torchmetrics.CatMetric(), torchmetrics.SumMetric()
    for epoch in range(2):
        model.train()
        for inputs, labels in loader(x, y):
            logits = model(inputs)
            loss = F.cross_entropy(logits, labels)
            step(optimizer, loss)
            seen.update(torch.ones(len(inputs)))
            mean_loss.update(loss.detach(), weight=len(inputs))
            accuracy.update(logits.detach(), labels)
        print(f"metrics {epoch}: seen {seen.compute():.0f} loss {mean_loss.compute():.12f} "
              f"acc {accuracy.compute():.12f}")
        model.eval()
        with torch.no_grad():
            for inputs, _ in held_out:
                scores.update(model(inputs).softmax(1)[:, 0])
                tested.update(len(inputs))
        scored = scores.compute()
        print(f"metrics {epoch}: tested {tested.compute():.0f} scores {len(scored)} sum {scored.sum():.12f}")
    return model.state_dict()


def again():
    """Two losses of one call, each differentiated on its own (``backward(retain_graph=True)``, then another), then
    one optimizer step: one device's gradient is their sum, which DDP cannot average (it reduces one backward pass per
    call: before, the first step silently kept the second pass's gradients each process's own, and the next failed
    in DDP's backward, "marked as ready twice"). Refused in one line at the first step on several processes."""
    x = torch.randn(12, 8)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 11))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, in loader(x):
        optimizer.zero_grad()
        outputs = model(inputs)
        outputs[:, :3].pow(2).mean().backward(retain_graph=True)
        F.mse_loss(outputs[:, 3:], inputs).backward()
        optimizer.step()
    return model.state_dict()


for part in parts:
    result[part] = globals()[part]()
    torch.save(result, os.path.join(out, "result.pt"))
