"""The DDP demo of the "distributed training" tutorial, as a torchrun-style script: one training step of a linear
model on every rank, then the process group torn down. It uses nothing of ddpkit:

    ddpkit run --nproc-per-node 2 examples/ddp_demo.py
    torchrun --nproc-per-node 2 examples/ddp_demo.py

Every rank prints its own line (``rank 1 of 2 done``): ``ddpkit run`` shows rank 0's output as it comes, and the
other ranks' lines as well, those that say the same but for their numbers collapsed into one with a count. Lines
that differ from the tutorial's script carry a ``# changed:`` comment.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class SimpleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 1)

    def forward(self, x):
        return self.fc(x)


def train(rank, world_size):
    on_gpu = torch.cuda.device_count() >= world_size  # changed: gloo on the CPU where there are not enough GPUs
    device = torch.device("cuda", rank % max(1, torch.cuda.device_count())) if on_gpu else torch.device("cpu")
    # changed: the launcher's variables (MASTER_ADDR, MASTER_PORT) instead of tcp://127.0.0.1:29500
    dist.init_process_group(backend="nccl" if on_gpu else "gloo", rank=rank, world_size=world_size)
    model = SimpleModel().to(device)
    ddp_model = DDP(model, device_ids=[device.index] if on_gpu else None)
    criterion = nn.MSELoss().to(device)
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
    inputs = torch.randn(64, 10).to(device)
    targets = torch.randn(64, 1).to(device)
    outputs = ddp_model(inputs)
    loss = criterion(outputs, targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    dist.destroy_process_group()
    print(f"rank {rank} of {world_size} done")  # changed: (added) what each rank says at its end


if __name__ == "__main__":
    # changed: rank and world size from torchrun's variables, instead of mp.spawn(train, nprocs=4)
    train(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
