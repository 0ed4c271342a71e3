"""A script written for one device, as its author would, that ``tests/test_unchanged.py`` runs under
``ddpkit run --unchanged`` on 1 and on 2 processes and compares. Nothing in it knows about ranks.

    python unchanged_script.py OUT mean     # BatchNorm, an uneven last batch, clipping, accumulation, an exact
                                            # evaluation, a GAN's two models and optimizers, batches of 1,
                                            # evaluations written in every way scripts write them
    python unchanged_script.py OUT sum      # losses summed over the batch (the VAE's), a batch cut by hand with the
                                            # loss inside the model (nanoGPT's), random_split and a drawn seed
    python unchanged_script.py OUT coupled  # a CLIP-style loss over in-batch negatives (--loss-reduction coupled)
    python unchanged_script.py OUT both     # all of the above: on one process, where every reduction splits alike
    python unchanged_script.py OUT outside  # a batch cut by hand, its loss computed outside the model (also in mean)
    python unchanged_script.py OUT coupled-inside  # a loss computed inside the model, with coupled

A third argument ``float64`` makes it compute in float64. It writes OUT/result.pt with torch.save (rank 0 alone under
--unchanged), OUT/log.csv (a line per epoch, appended) and a TensorBoard run in OUT/tb as a script's own side files
and an MLflow run in OUT/mlruns (rank 0's alone under --unchanged), prints a line per epoch, and writes OUT/draws-<pid>.json with the noise it drew
through os.open, which --unchanged leaves alone (every rank writes its own). Whole models too, as older tutorials save them: the classifier (OUT/whole.pt), a deep copy of it taken after its
first epoch (OUT/best.pt), the language model (OUT/lm.pt).

It names init_process_group and DistributedDataParallel in its comments and strings, never in its code: it is a
one-device script all the same.
"""

import copy
import json
import os
import pickle
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE")


def globals_named(pickled: bytes) -> list[str]:
    """Every global a pickle names (what ``torch.load(weights_only=True)`` must be allowed), read without loading it."""
    import pickletools

    found, memo, strings, last = set(), {}, [], None
    for op, arg, _ in pickletools.genops(pickled):
        if op.name in STRINGS:
            last = arg
            strings.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = last
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = last
        elif op.name in ("GET", "BINGET", "LONG_BINGET"):
            last = memo.get(arg)
            strings.append(last)
        elif op.name in ("GLOBAL", "STACK_GLOBAL"):
            found.add(arg.replace(" ", ".") if op.name == "GLOBAL" else f"{strings[-2]}.{strings[-1]}")
            last = None
        else:
            last = None
    return sorted(found)

out, reduction = sys.argv[1], sys.argv[2]
if sys.argv[3:] == ["float64"]:  # where float32's rounding, which training grows, would hide a difference of method
    torch.set_default_dtype(torch.float64)
data = torch.randn(45, 6)  # unseeded: the same on every rank, as ddpkit seeds every rank alike
labels = torch.randint(0, 3, (45,))
result = {}
# A seed the script draws: the same on every rank. Drawn first, whatever the mode: a library that draws from Python's
# stream (MLflow names its runs with it) would otherwise make it differ between the modes.
seed_drawn = random.randint(0, 10**6)


def classifier_with_batch_norm():
    """37 samples in batches of 8 (the last of 5, split 3 + 2), two micro-steps per step, clipped; then counted."""
    import mlflow
    from torch.utils.tensorboard import SummaryWriter

    board = SummaryWriter(os.path.join(out, "tb"))
    os.environ.setdefault("MLFLOW_TRACKING_URI", "file://" + os.path.join(out, "mlruns"))
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_experiment("unchanged")
    mlflow.start_run(run_name="classifier")  # (named: MLflow would draw a name from the script's random stream)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    loader = DataLoader(TensorDataset(data[:37], labels[:37]), batch_size=8, shuffle=True)
    result["len_loader"] = len(loader)
    for epoch in range(2):
        model.train()
        for step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y) / 2
            loss.backward()
            if step % 2 == 1 or step == len(loader) - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
                optimizer.step()
                optimizer.zero_grad()
        model.eval()
        correct = total = 0
        loss_sum = 0.0
        with torch.no_grad():
            for x, y in DataLoader(TensorDataset(data, labels), batch_size=7):
                output = model(x)
                loss_sum += F.cross_entropy(output, y, reduction="sum").item()
                correct += (output.argmax(1) == y).sum().item()
                total += len(y)
        result[f"eval_{epoch}"] = [correct, total, loss_sum]
        print(f"epoch {epoch}: {correct} of {total} right")
        with open(os.path.join(out, "log.csv"), "a") as log:
            log.write(f"{epoch},{correct},{loss_sum}\n")
        board.add_scalar("eval/loss", loss_sum, epoch)
        mlflow.log_metric("eval_loss", loss_sum, step=epoch)
        if epoch == 0:
            best = copy.deepcopy(model)  # a best-model copy, as many scripts keep one (an EMA copy is taken alike)
    model.train()  # (a pass that starts while every model is in eval mode reads whole batches: an evaluation)
    result["isinstance"] = isinstance(model, nn.Sequential)
    result["keys"] = list(model.state_dict())
    board.close()
    mlflow.end_run()
    with open(os.path.join(out, "log.csv")) as log:  # read back: this process's own file
        result["log lines"] = len(log.read().splitlines())
    with torch.no_grad():  # the copy evaluates on its own (a plain model; under --shard, sharded like the model)
        result["best_eval"] = F.cross_entropy(best(data), labels, reduction="sum").item()
    result["best_plain"] = [type(best).__name__, type(best[1]).__name__, len(best._forward_pre_hooks)]
    torch.save(model, os.path.join(out, "whole.pt"))
    torch.save({"model": best, "epoch": 0}, os.path.join(out, "best.pt"))
    return model


class Rows(nn.Sequential):
    """Keeps the number of rows of each call without gradients: how much of an evaluation this process computed."""

    def forward(self, x):
        if not torch.is_grad_enabled():
            self.rows = getattr(self, "rows", 0) + len(x)
        return super().forward(x)


def evaluations():
    """A model trained between evaluations written in every way scripts write them: each must count every sample
    once, as on one device (``result["evaluations"]``: count, correct, summed loss per evaluation). The rows this
    process computed in them: OUT/rows-<pid>.json, every process's own (os.open)."""
    model = Rows(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_set, test_set = TensorDataset(data[:30], labels[:30]), TensorDataset(data[30:], labels[30:])
    train_loader = DataLoader(train_set, batch_size=6, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=4)
    found = result["evaluations"] = {}

    def step(x, y, train):  # a trainer's step function: gradients switched per batch, the model left in train mode
        with torch.set_grad_enabled(train):
            logits = model(x)
            loss = F.cross_entropy(logits, y, reduction="sum")
        return loss, (logits.argmax(1) == y).sum().item(), len(y)

    def count(name, loader, forward):
        totals = [0, 0, 0.0]
        for index, (x, y) in enumerate(loader):
            loss, correct, samples = forward(index, x, y)
            totals = [totals[0] + samples, totals[1] + correct, totals[2] + loss.item()]
        found[name] = totals

    def eval_mode_after_the_start(index, x, y):
        if index == 0:
            model.eval()  # placed inside the loop, gradients left on
        return step(x, y, True)

    def inference(index, x, y):
        with torch.inference_mode():
            return step(x, y, True)

    count("before training", test_loader, lambda index, x, y: step(x, y, False))
    for epoch in range(2):
        model.train()
        for index, (x, y) in enumerate(train_loader):
            if index == 2:  # an evaluation inside the training loop, then this batch trains
                count(f"inside the loop {epoch}", test_loader, lambda index, x, y: step(x, y, False))
            loss, _, _ = step(x, y, True)
            optimizer.zero_grad()
            (loss / len(y)).backward()
            optimizer.step()
        count(f"gradients off in the step {epoch}", test_loader, lambda index, x, y: step(x, y, False))
        count(f"inference mode {epoch}", test_loader, inference)
        count(f"the train set's own data {epoch}", DataLoader(train_set, batch_size=8),
              lambda index, x, y: step(x, y, False))
        count(f"eval mode inside the loop {epoch}", test_loader, eval_mode_after_the_start)
    rows_file = os.open(os.path.join(out, f"rows-{os.getpid()}.json"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(rows_file, json.dumps(model.rows).encode())
    os.close(rows_file)
    return model


def gan():
    """Two models, two optimizers; the generator's noise drawn per sample, as DCGAN draws it."""
    generator, critic = nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 1))
    g_optimizer = torch.optim.Adam(generator.parameters(), lr=1e-3)
    c_optimizer = torch.optim.Adam(critic.parameters(), lr=1e-3)
    draws = []
    for real, _ in DataLoader(TensorDataset(data, labels), batch_size=16, shuffle=True):
        noise = torch.randn(real.size(0), 4)
        draws.append(noise[0, 0].item())
        fake = generator(noise)
        c_optimizer.zero_grad()
        c_loss = F.softplus(-critic(real)).mean() + F.softplus(critic(fake.detach())).mean()
        c_loss.backward()
        c_optimizer.step()
        g_optimizer.zero_grad()
        F.softplus(-critic(fake)).mean().backward()
        g_optimizer.step()
    draws_file = os.open(os.path.join(out, f"draws-{os.getpid()}.json"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(draws_file, json.dumps(draws).encode())
    os.close(draws_file)
    return generator


def batches_of_one():
    """Batches smaller than the world: one sample each."""
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(TensorDataset(data[:5], labels[:5]), batch_size=1):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


class SummedAutoencoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encode, self.decode = nn.Linear(6, 2), nn.Linear(2, 6)

    def forward(self, x):
        return torch.sigmoid(self.decode(torch.tanh(self.encode(x))))


class TinyLanguageModel(nn.Module):
    """Returns its loss, as nanoGPT's GPT does, here summed over the batch."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 5), nn.Linear(5, 10)

    def forward(self, tokens, targets):
        logits = self.head(self.embed(tokens))
        return logits, F.cross_entropy(logits.view(-1, 10), targets.view(-1), reduction="sum")


def summed_losses():
    train, _ = random_split(TensorDataset(torch.rand(45, 6)), [37, 8])
    model = SummedAutoencoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=2e-3)  # (Adam would not see a gradient N times too small)
    order = torch.Generator().manual_seed(3)  # the script's own generator: the order does not depend on what ran before
    for epoch in range(2):
        for (x,) in DataLoader(train, batch_size=8, shuffle=True, generator=order):
            optimizer.zero_grad()
            F.binary_cross_entropy(model(x), x, reduction="sum").backward()
            optimizer.step()
    return model


def cut_by_hand():
    tokens = torch.randint(0, 10, (200,))
    model = TinyLanguageModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        starts = torch.randint(0, len(tokens) - 5, (7,))  # the shared stream: the same batch on every rank
        x = torch.stack([tokens[i:i + 4] for i in starts])
        y = torch.stack([tokens[i + 1:i + 5] for i in starts])
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    pickled = pickle.dumps(model)
    copied = pickle.loads(pickled)
    result["pickled"] = [type(copied).__name__, torch.equal(copied.head.weight, model.state_dict()["head.weight"])]
    result["pickled globals"] = globals_named(pickled)
    torch.save(model, os.path.join(out, "lm.pt"))
    return model


def counted_inside_a_training_pass():
    """A pass that trains, then only evaluates a batch: --unchanged says once that the count is the share's."""
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for index, (x, y) in enumerate(DataLoader(TensorDataset(data, labels), batch_size=9)):
        if index == 2:
            with torch.no_grad():
                result["counted inside a training pass"] = len(model(x))
            continue
        optimizer.zero_grad()
        F.cross_entropy(model(x), y, reduction="sum").backward()  # (the mode of summed losses)
        optimizer.step()
    return model


class Towers(nn.Module):
    """CLIP's shape: two encoders, their embeddings normalised, and the temperature returned with them."""

    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
        self.text = nn.Embedding(3, 4)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x, tokens):
        return F.normalize(self.image(x), dim=1), F.normalize(self.text(tokens), dim=1), self.logit_scale.exp()


def clip_style():
    """Each sample's pair against every other pair of its batch: the targets are made from the batch's size."""
    torch.manual_seed(11)  # the script's own seeding: the same towers whatever ran before
    model = Towers()
    # (SGD: Adam divides by the root of each gradient's square, so a component near 0 that float64 rounds otherwise
    # moves by the learning rate; with Adam the runs here end 5e-9 apart, with SGD 1e-15.)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    order = torch.Generator().manual_seed(5)
    for epoch in range(2):
        for x, y in DataLoader(TensorDataset(data[:37], labels[:37]), batch_size=8, shuffle=True, generator=order):
            image, text, scale = model(x, y)
            logits = scale * image @ text.T
            targets = torch.arange(len(logits))
            loss = (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model


def loss_outside():
    """Batches cut by hand, the loss computed outside the model, dropout: every process computes it whole."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for start in range(0, 45, 9):
        optimizer.zero_grad()
        F.cross_entropy(model(data[start:start + 9]), labels[start:start + 9]).backward()
        optimizer.step()
    return model


models = {}
# One device: no DistributedDataParallel / init_process_group branches here ("init_process_group" is just a word).
if reduction == "outside":
    models["outside"] = loss_outside()
if reduction in ("mean", "both"):
    models.update(classifier=classifier_with_batch_norm(), gan=gan(), ones=batches_of_one(), evaluated=evaluations(),
                  outside=loss_outside())
if reduction in ("sum", "both"):
    result["seed_drawn"] = seed_drawn
    torch.manual_seed(seed_drawn)  # the script's own seeding applies as on one device
    models.update(autoencoder=summed_losses(), by_hand=cut_by_hand(), counted=counted_inside_a_training_pass())
if reduction in ("coupled", "both"):
    models["clip"] = clip_style()
if reduction == "coupled-inside":  # a loss computed inside the model from its share: refused with coupled
    models["by_hand"] = cut_by_hand()
result["weights"] = {name: {key: value.tolist() for key, value in model.state_dict().items()}
                     for name, model in models.items()}
torch.save(result, os.path.join(out, "result.pt"))
