"""What the gathered way costs a compute-bound contrastive step: ``ddpkit run --unchanged`` against hand-written DDP.

    .venv/bin/python benchmarks/unchanged_contrastive.py [--rounds 2] [--steps 30] [--json FILE]

The script (below, ``ONE``): SimCLR's NT-Xent over two noisy views of each sample, drawn by the loop, an MLP encoder
(4 layers, 1024 wide, 128 out) called once per view, a global batch of 512 from a TensorDataset. Its loss couples the
batch's rows, so ``--unchanged`` takes the gathered way: every process holds the whole batch and draws its noise,
computes its share of the encoder's rows, and the loss over the gathered embeddings.

The hand-written side (``DDP``) is what open_clip does: DDP around the encoder, each process 256 rows of the same
batches, its embeddings all-gathered with their gradients (``torch.distributed.nn.functional.all_gather``), the loss
over the whole batch's embeddings. Three runs a round, alternating the order: the script on one process
(``ddpkit run --unchanged --nproc-per-node 1``), under ``--unchanged`` on 2, and the hand-written one on 2 (``ddpkit
run``, which only launches it). Every process gets one thread (OMP_NUM_THREADS=1); the clock is the loop's own, over
its steps after the first two. Reported: each side's best time, the ratios to one process, and unchanged / DDP (goal:
at most 1.15).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unchanged_passes import options, reported, trained_ratios  # noqa: E402

COMMON = """
import sys, time
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

steps, width, batch = int(sys.argv[1]), 1024, 512


def encoder():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 128))


def nt_xent(a, b, temperature=0.2):
    z = F.normalize(torch.cat([a, b]), dim=1)
    similarity = (z @ z.t() / temperature).fill_diagonal_(float("-inf"))
    n = len(a)
    return F.cross_entropy(similarity, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]))


data = TensorDataset(torch.randn(steps * batch, 256, generator=torch.Generator().manual_seed(1)))
"""

ONE = COMMON + """
model = encoder()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x,) in enumerate(DataLoader(data, batch_size=batch, shuffle=True)):
    if step == 2:
        start = time.perf_counter()
    loss = nt_xent(model(x + 0.1 * torch.randn_like(x)), model(x + 0.1 * torch.randn_like(x)))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"trained in {time.perf_counter() - start:.3f} s, last loss {loss.item():.4f}")
"""

DDP = COMMON + """
import torch.distributed as dist
from torch.distributed.nn.functional import all_gather
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = DistributedDataParallel(encoder())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
shuffled = DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(2))
for step, (x,) in enumerate(shuffled):
    if step == 2:
        start = time.perf_counter()
    x = x.chunk(world)[rank]
    a = torch.cat(all_gather(model(x + 0.1 * torch.randn_like(x))))
    b = torch.cat(all_gather(model(x + 0.1 * torch.randn_like(x))))
    loss = nt_xent(a, b)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
if rank == 0:
    print(f"trained in {time.perf_counter() - start:.3f} s, last loss {loss.item():.4f}")
dist.destroy_process_group()
"""


def main() -> None:
    args = options(__doc__, steps=30)
    launch = [sys.executable, "-m", "ddpkit", "run"]
    with tempfile.TemporaryDirectory() as folder:
        one, ddp = Path(folder) / "one.py", Path(folder) / "ddp.py"
        one.write_text(ONE)
        ddp.write_text(DDP)
        steps = str(args.steps)
        sides = {"1 process": [*launch, "--unchanged", "--seed", "0", "--nproc-per-node", "1", str(one), steps],
                 "unchanged, 2": [*launch, "--unchanged", "--seed", "0", "--nproc-per-node", "2", str(one), steps],
                 "DDP, 2": [*launch, "--nproc-per-node", "2", str(ddp), steps]}
        result = trained_ratios(sides, args.rounds, folder, {"unchanged / 1 process": ("unchanged, 2", "1 process"),
                                                             "DDP / 1 process": ("DDP, 2", "1 process"),
                                                             "unchanged / DDP": ("unchanged, 2", "DDP, 2")})
    reported(result, args.json)


if __name__ == "__main__":
    main()
