"""The tutorials' model-parallel demo (fc1 on one device, fc2 on another) inside DDP, with ddpkit.

Run it on 2 processes, each holding the model cut over 2 devices:

    ddpkit run --nproc-per-node 2 examples/model_parallel_ddp.py --steps 5

The devices here are the CPU twice (gloo), so it runs anywhere; with 4 GPUs, process r would take
``["cuda:2r", "cuda:2r+1"]`` (not yet run on GPUs: see docs/examples.md).

The tutorials wrote the split by hand (``.to('cuda:0')`` in ``__init__``, ``x.to('cuda:1')`` in
``forward``) and passed ``device_ids=[rank]`` to DDP, which DDP refuses for a model on two devices.
Here ``ddpkit.model_parallel`` cuts the model and moves the activations, and DDP gets
``device_ids=None``. Every line that differs from the tutorial carries a ``# ddpkit:`` comment.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpkit  # ddpkit

parser = argparse.ArgumentParser()  # ddpkit: the tutorial ran one step with fixed settings
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()


# ddpkit: the two layers as a sequence; model_parallel puts each on its device (no .to() in __init__)
class ModelParallelModel(nn.Sequential):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10)
        self.fc2 = nn.Linear(10, 1)


def main():
    with ddpkit.distributed(device="cpu") as rt:  # ddpkit: the group; no hard-coded nccl or port
        devices = ["cpu", "cpu"]  # ddpkit: the tutorial's 'cuda:0' and 'cuda:1'
        torch.manual_seed(0)  # ddpkit: the same initial weights on every rank
        model = ddpkit.model_parallel(ModelParallelModel(), devices)  # ddpkit: fc1 on devices[0], fc2 on [1]
        ddp_model = DDP(model)  # ddpkit: device_ids=None for a model on several devices
        criterion = nn.MSELoss()
        optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
        torch.manual_seed(1 + rt.rank)  # ddpkit: each rank its own batch, as each GPU would get
        for step in range(args.steps):  # ddpkit: a few steps instead of one
            inputs = torch.randn(64, 10).to(devices[0])
            targets = torch.randn(64, 1).to(devices[1])
            outputs = ddp_model(inputs)
            loss = criterion(outputs, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ddpkit.print0(rt, f"step {step}: loss {loss.item():.4f} (rank 0's batch)")  # ddpkit
        # ddpkit: every rank holds the same weights after DDP's averaged steps
        mine = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
        every = [torch.empty_like(mine) for _ in range(rt.world_size)]
        dist.all_gather(every, mine)
        same = all(torch.equal(every[0], other) for other in every)
        ddpkit.print0(rt, f"fc1 on {model.fc1.weight.device}, fc2 on {model.fc2.weight.device}; "
                          f"replicas identical: {same}")


if __name__ == "__main__":
    main()
