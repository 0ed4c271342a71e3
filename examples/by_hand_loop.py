"""library_loop.py's training written with torch.distributed alone: the comparison docs/library.md counts.

The same model, data, optimizer and features as ``examples/library_loop.py`` (ddp or fsdp, bf16/fp16
autocast, gradient accumulation, exact evaluation, checkpoints and resume), with nothing from ddpkit but
the data set. Each feature's lines are marked ``# [feature]``; docs/library.md counts them against
ddpkit's. It resumes at an epoch's start, as the tutorials do: a mid-epoch resume (the sampler's
position, every rank's RNG) would take more lines again.

    ddpkit run --nproc-per-node 2 examples/by_hand_loop.py --strategy fsdp --amp bf16 --accumulate 2
    torchrun --nproc-per-node 2 examples/by_hand_loop.py --resume runs/by-hand/checkpoint.pt
"""

import argparse
import contextlib
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddpkit import zoo  # the data set and model only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--amp", default="off", choices=["off", "bf16", "fp16"])
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16, help="per process and micro-step")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume", default=None, help="a checkpoint file")
    parser.add_argument("--out", default="runs/by-hand")
    args = parser.parse_args()

    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # [start]
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # [start]
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")  # [start]
    if device.type == "cuda":  # [start]
        torch.cuda.set_device(device)  # [start]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # [start] for a plain `python by_hand_loop.py`
    os.environ.setdefault("MASTER_PORT", "29511")  # [start]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)  # [start]
    try:  # [start]
        torch.manual_seed(0)  # [start] the same initial weights on every rank
        data = zoo.load_digits(channels=3, image_size=32)
        model = zoo.ConvNet(in_channels=3, num_classes=data.num_classes, image_size=32).to(device)  # [model]
        if args.strategy == "fsdp":  # [fsdp]
            for layer in model.children():  # [fsdp]
                if any(True for _ in layer.parameters()):  # [fsdp]
                    fully_shard(layer)  # [fsdp]
            fully_shard(model)  # [fsdp]
        else:  # [model]
            model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)  # [model]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)  # [amp]
        scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # [amp]
        sampler = DistributedSampler(data.train, world_size, rank, shuffle=True, seed=0, drop_last=True)  # [data]
        loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler, drop_last=True)  # [data]
        # Every validation sample on exactly one rank (DistributedSampler would pad with duplicates).
        val_part = Subset(data.val, range(rank, len(data.val), world_size))  # [eval]
        val_loader = DataLoader(val_part, batch_size=64)  # [eval]

        first_epoch = 0  # [checkpoint]
        if args.resume:  # [checkpoint]
            saved = torch.load(args.resume, map_location="cpu", weights_only=True)  # [checkpoint]
            set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"],  # [checkpoint]
                           options=StateDictOptions(full_state_dict=True))  # [checkpoint]
            scaler.load_state_dict(saved["scaler"])  # [checkpoint]
            first_epoch = saved["epoch"] + 1  # [checkpoint]

        for epoch in range(first_epoch, args.epochs):  # [checkpoint]
            model.train()  # [eval] evaluation left it in eval mode
            sampler.set_epoch(epoch)  # [data]
            steps = len(loader) // args.accumulate * args.accumulate  # [accumulate] whole optimizer steps only
            for index, (images, labels) in enumerate(loader):
                if index == steps:  # [accumulate]
                    break  # [accumulate]
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)  # [data]
                last = (index + 1) % args.accumulate == 0  # [accumulate]
                if args.strategy == "fsdp":  # [accumulate]
                    model.set_requires_gradient_sync(last)  # [accumulate]
                skip_sync = model.no_sync() if args.strategy == "ddp" and not last else contextlib.nullcontext()  # [accumulate]
                with skip_sync:  # [accumulate]
                    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):  # [amp]
                        loss = F.cross_entropy(model(images), labels)
                    scaler.scale(loss / args.accumulate).backward()  # [amp] [accumulate]
                if last:  # [accumulate]
                    scaler.step(optimizer)  # [amp]
                    scaler.update()  # [amp]
                    optimizer.zero_grad()  # [accumulate] only after the step

            # Exact evaluation: each rank its own samples; under DDP the bare module (DDP's forward would
            # broadcast buffers and hang when the ranks' batch counts differ); under FSDP every forward is a
            # collective, so a rank out of batches runs empty ones until the rank with the most is done.
            evaluated = model if args.strategy == "fsdp" else model.module  # [eval]
            evaluated.eval()  # [eval]
            sums = torch.zeros(3, dtype=torch.float64, device=device)  # [eval] loss, correct, count
            batches = torch.tensor([len(val_loader)], device=device)  # [eval]
            dist.all_reduce(batches, op=dist.ReduceOp.MAX)  # [eval]
            empty = (torch.zeros((0, *data.val[0][0].shape)), torch.zeros(0, dtype=torch.long))  # [eval]
            with torch.no_grad():  # [eval]
                batch_iter = iter(val_loader)  # [eval]
                for _ in range(int(batches.item()) if args.strategy == "fsdp" else len(val_loader)):  # [eval]
                    images, labels = next(batch_iter, empty)  # [eval]
                    images, labels = images.to(device), labels.to(device)  # [eval]
                    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):  # [eval] [amp]
                        logits = evaluated(images)  # [eval]
                    sums[0] += F.cross_entropy(logits.float(), labels, reduction="sum")  # [eval]
                    sums[1] += (logits.argmax(1) == labels).sum()  # [eval]
                    sums[2] += labels.numel()  # [eval]
            dist.all_reduce(sums)  # [eval]
            if rank == 0:  # [print]
                print(f"epoch {epoch + 1}: val_loss {sums[0] / sums[2]:.4f} val_acc {sums[1] / sums[2]:.2%} "  # [print]
                      f"({int(sums[2])} samples)", flush=True)  # [print]

            model_state, optimizer_state = get_state_dict(  # [checkpoint] a collective under FSDP
                model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # [checkpoint]
            if rank == 0:  # [checkpoint]
                os.makedirs(args.out, exist_ok=True)  # [checkpoint]
                path = os.path.join(args.out, "checkpoint.pt")  # [checkpoint]
                torch.save({"model": model_state, "optimizer": optimizer_state, "scaler": scaler.state_dict(),  # [checkpoint]
                            "epoch": epoch}, path + ".tmp")  # [checkpoint]
                os.replace(path + ".tmp", path)  # [checkpoint] never half a file under the real name
            dist.barrier()  # [checkpoint] nobody goes on (or exits) before it is written

        model_state, _ = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # [save]
        if rank == 0:  # [save]
            torch.save(model_state, os.path.join(args.out, "model.pt"))  # [save]
        dist.barrier()  # [save]
    finally:  # [start]
        dist.destroy_process_group()  # [start]


if __name__ == "__main__":
    main()
    # An FSDP model and gloo's work in flight sit in reference cycles: free them now, not while the
    # interpreter shuts down, where tearing them down can abort the process (SIGABRT, pytorch#190489).
    gc.collect()  # [start]
