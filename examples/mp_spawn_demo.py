"""The torch.multiprocessing.spawn DDP demo of the "multi-GPU training" tutorial, with ddpkit.

No launcher: the script starts its own processes, as in the tutorial. On a machine without GPUs
(or with fewer GPUs than processes) they run on the CPU with gloo:

    python examples/mp_spawn_demo.py --nproc 2

Every line that differs from the tutorial's script carries a ``# ddpkit:`` comment.
"""

import argparse

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim

import ddpkit  # ddpkit: instead of `from torch.nn.parallel import DistributedDataParallel as DDP`
from ddpkit.core.process_group import free_port  # ddpkit: instead of the hard-coded MASTER_PORT


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def example(rank, world_size, port, args):  # ddpkit: also gets the port and the flags
    # ddpkit: replaces dist.init_process_group("nccl", rank=rank, world_size=world_size); picks
    # nccl + this rank's GPU, or gloo + CPU, and destroys the group however the block ends
    environment = ddpkit.from_spawn(rank, world_size, master_port=port)
    with ddpkit.distributed(environment=environment, backend=args.backend, device=args.device) as rt:
        # create local model
        # ddpkit: the tutorial's ToyModel (from its torchrun demo) instead of nn.Linear(10, 10).to(rank);
        # no .to(rank): prepare_model moves it to rt.device
        model = ToyModel()  # ddpkit
        # construct DDP model
        ddp_model = ddpkit.prepare_model(model, rt)  # ddpkit: model.to(rank) + DDP(device_ids=[rank])
        # define loss function and optimizer
        loss_fn = nn.MSELoss()
        optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
        for step in range(args.steps):  # ddpkit: (added) the tutorial takes one step; --steps repeats it
            optimizer.zero_grad()  # ddpkit: (added) needed once there is more than one step
            # forward pass
            outputs = ddp_model(torch.randn(20, 10).to(rt.device))  # ddpkit: rt.device instead of rank
            labels = torch.randn(20, 5).to(rt.device)  # ddpkit: rt.device instead of rank; 5 outputs
            # backward pass
            loss = loss_fn(outputs, labels)  # ddpkit: (added) keep the loss for the log line
            loss.backward()  # ddpkit: was loss_fn(outputs, labels).backward()
            # update parameters
            optimizer.step()
            ddpkit.print0(rt, f"step {step}: loss {loss.item():.4f} (rank 0's batch)")  # ddpkit: rank 0 only
        # ddpkit: (added, to the end of the function) each rank drew its own random batch, yet DDP averaged
        # the gradients: every replica must hold the same parameters.
        params = torch.cat([p.detach().flatten() for p in ddp_model.parameters()])
        gathered = [torch.empty_like(params) for _ in range(world_size)]
        dist.all_gather(gathered, params)
        same = all(torch.equal(other, params) for other in gathered)
        ddpkit.print0(rt, f"{world_size} processes via {rt.env.launcher}, backend {rt.backend}, "
                          f"device {rt.device.type}: parameters identical on every rank: {same}")


def main(args):  # ddpkit: gets the flags
    world_size = args.nproc  # ddpkit: --nproc; the tutorial: world_size = 2
    port = free_port()  # ddpkit: a port that is free now, not a fixed 10086 that may be taken
    mp.spawn(example,
             args=(world_size, port, args),  # ddpkit: + port and flags
             nprocs=world_size,
             join=True)


if __name__ == "__main__":
    # ddpkit: no os.environ["MASTER_ADDR"] / ["MASTER_PORT"]: the port goes to each process instead
    parser = argparse.ArgumentParser()  # ddpkit: (added) flags
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn (default: 2)")
    parser.add_argument("--steps", type=int, default=1, help="training steps (default: 1, as in the tutorial)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],  # ddpkit: new flag
                        help="auto: nccl when each process has its own GPU, else gloo")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],  # ddpkit: new flag
                        help="auto: one GPU per process when there are enough, else CPU")
    main(parser.parse_args())  # ddpkit: passes the flags
