"""A full training loop on ddpkit's library: mixed precision, accumulation, exact evaluation, checkpoints
and resume. The strategy, precision and accumulation are each one argument; no other line changes.

    ddpkit run --nproc-per-node 2 examples/library_loop.py --strategy fsdp --amp bf16 --accumulate 2
    ddpkit run --nproc-per-node 2 examples/library_loop.py --strategy zero --resume runs/lib/checkpoints
    python examples/library_loop.py --strategy single --batch-size 64        # one process, the same run

It trains ddpkit's ``convnet`` on the built-in digits, evaluates every epoch, checkpoints every
``--checkpoint-every`` optimizer steps and at each epoch's end, and writes ``OUT/model.pt``.
"""

import argparse
import os

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp", choices=["single", "ddp", "zero", "fsdp"])
    parser.add_argument("--amp", default="off", choices=["off", "bf16", "fp16"])
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16, help="per process and micro-step")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--keep-checkpoints", type=int, default=3)
    parser.add_argument("--resume", default=None, help="a checkpoint file or folder")
    parser.add_argument("--out", default="runs/library-loop")
    args = parser.parse_args()

    with ddpkit.Job(args.strategy, amp=args.amp, accumulate=args.accumulate, seed=0) as job:  # [start]
        data = zoo.load_digits(channels=3, image_size=32)
        model, optimizer = job.setup(zoo.ConvNet(in_channels=3, num_classes=data.num_classes, image_size=32),  # [model]
                                     torch.optim.SGD, lr=0.01, momentum=0.9)  # [model]
        loader = job.train_loader(data.train, args.batch_size)  # [data]
        val_loader = job.eval_loader(data.val, 64)  # [eval]
        ckpt = job.checkpointer(os.path.join(args.out, "checkpoints"), model=model, optimizer=optimizer, loader=loader,  # [checkpoint]
                                keep=args.keep_checkpoints)  # [checkpoint]
        ckpt.resume(args.resume)  # [checkpoint] weights, optimizer, scaler, data position, RNG, step; None: fresh
        for epoch in range(loader.epoch, args.epochs):  # [checkpoint] from where it stopped
            for images, labels in loader:
                with job.autocast():  # [amp]
                    loss = F.cross_entropy(model(images), labels)
                job.backward(loss)  # [model]
                if job.step(optimizer) and job.global_step % args.checkpoint_every == 0:  # [model] [checkpoint]
                    ckpt.save()  # [checkpoint]
            val_loss, val_acc, count = job.evaluate(model, val_loader)  # [eval]
            job.print(f"epoch {epoch + 1}: val_loss {val_loss:.4f} val_acc {val_acc:.2%} ({count} samples)")  # [print]
            ckpt.save()  # [checkpoint]
        ckpt.wait()  # [checkpoint]
        job.save_model(model, os.path.join(args.out, "model.pt"))  # [save]

if __name__ == "__main__":
    main()
