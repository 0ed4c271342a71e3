#!/usr/bin/env python3
"""The ResNet-50 ImageFolder trainer of the "Multi GPU training with Pytorch" tutorial, with ddpkit.

Run it on 2 processes (2 GPUs, or 2 CPU processes with gloo on a machine without GPUs):

    ddpkit run --nproc-per-node 2 examples/resnet50_imagefolder.py --data /data/imagenette/train

``--data`` is an ImageFolder root: one sub-folder of images per class. The model is rebuilt with one
output per class folder. ``--batch-size`` is per process: the global batch is batch size x number of
processes. Rank 0 saves the bare model's weights (no ``module.`` prefix) to
``CHECKPOINT_DIR/epoch_N.pt`` after every epoch; load them with ``torch.load(path, weights_only=True)``.

The tutorial's single-device script (its DataParallel version without the DataParallel line) is the
starting point; every line that differs from it carries a ``# ddpkit:`` comment.
"""

import argparse
from pathlib import Path

import torch
import torchvision

import ddpkit  # ddpkit: instead of torch.distributed, torch.multiprocessing, DDP and DistributedSampler


def load_data(args, rt):  # ddpkit: takes the flags and the runtime instead of num_gpus
    transforms = torchvision.transforms.Compose([
        torchvision.transforms.Resize(round(args.image_size * 256 / 224)),  # ddpkit: --image-size, 224 -> 256
        torchvision.transforms.CenterCrop(args.image_size),  # ddpkit: --image-size (default 224)
        torchvision.transforms.ToTensor(),
        torchvision.transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
    ])
    dataset = torchvision.datasets.ImageFolder(root=args.data, transform=transforms)  # ddpkit: --data

    # ddpkit: DistributedSampler + DataLoader (shuffled, per-process batch, workers, pin_memory on GPU)
    dataloader = ddpkit.train_loader(dataset, batch_size=args.batch_size, runtime=rt, seed=0)
    return dataloader, len(dataset.classes)  # ddpkit: (added) the number of classes, for the model


def save_model(epoch, model, checkpoint_dir):  # ddpkit: weights only, into --checkpoint-dir
    """Saves the model's weights after the given epoch."""
    file = Path(checkpoint_dir) / f'epoch_{epoch}.pt'  # ddpkit: atomic_save makes the folder
    # ddpkit: the bare model's CPU weights, written to a temporary file and renamed (never half-written)
    ddpkit.atomic_save(ddpkit.model_state_dict(model), file)
    return file


def run_training(args):  # ddpkit: the flags instead of num_gpus
    # ddpkit: rank, device and process group, destroyed however the block ends; the body is indented.
    with ddpkit.distributed(device=args.device) as rt:  # ddpkit
        dataloader, num_classes = load_data(args, rt)  # ddpkit: (the tutorial builds the loader later)
        torch.manual_seed(0)  # ddpkit: (added) reproducible runs; DDP copies rank 0's weights to all ranks
        # ddpkit: was resnet50(pretrained=False): --model, and one output per class folder (not 1,000)
        model = torchvision.models.get_model(args.model, weights=None, num_classes=num_classes)  # ddpkit
        model = ddpkit.prepare_model(model, rt)  # ddpkit: replaces model.cuda() (+ DataParallel/DDP)

        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        criterion = torch.nn.CrossEntropyLoss()  # ddpkit: no criterion.cuda(): the loss has no weights
        model.train()
        num_epochs = args.epochs  # ddpkit: --epochs (default 30)
        total_steps = len(dataloader) if args.steps is None else min(args.steps, len(dataloader))  # ddpkit: --steps
        for epoch in range(1, num_epochs + 1):  # ddpkit: + 1 (range(1, num_epochs) ran one epoch too few)
            ddpkit.print0(rt, f'\nEpoch {epoch}\n')  # ddpkit: global rank 0 only
            for step, (images, labels) in enumerate(dataloader, 1):  # ddpkit: batches arrive on rt.device
                optimizer.zero_grad()
                outputs = model(images)
                loss = criterion(outputs, labels)
                loss.backward()
                optimizer.step()
                if step % 10 == 0 or step == total_steps:  # ddpkit: (added) also log the last step
                    ddpkit.print0(rt, f'Epoch [{epoch} / {num_epochs}], Step [{step} / {total_steps}], '
                                      f'Loss: {loss.item():.4f}')  # ddpkit: global rank 0 only
                if step == total_steps:  # ddpkit: (added) --steps
                    break  # ddpkit: (added)
            if rt.is_main:  # ddpkit: one copy of the weights is enough; rank 0 writes it
                file = save_model(epoch, model, args.checkpoint_dir)  # ddpkit: no optimizer argument
                print(f'saved {file}', flush=True)  # ddpkit: (added)
        ddpkit.barrier(rt)  # ddpkit: nobody tears the group down while rank 0 is still writing


if __name__ == "__main__":
    parser = argparse.ArgumentParser()  # ddpkit: (added) flags for the values the tutorial hard-codes
    parser.add_argument('--data', required=True, help='ImageFolder root: one sub-folder of images per class')
    parser.add_argument('--model', default='resnet50', help='a torchvision classifier (default: resnet50)')
    parser.add_argument('--image-size', type=int, default=224, help='crop side (default: 224, resize 256)')
    parser.add_argument('--epochs', type=int, default=30)
    parser.add_argument('--batch-size', type=int, default=64, help='per process')  # ddpkit: per process
    parser.add_argument('--steps', type=int, default=None, help='at most this many steps per epoch')
    parser.add_argument('--checkpoint-dir', default=str(Path.cwd() / 'model_checkpoints'))
    parser.add_argument('--device', default='auto', choices=['auto', 'cpu', 'cuda'],  # ddpkit: new flag
                        help='auto: one GPU per process when there are enough, else CPU (gloo)')
    args = parser.parse_args()
    # ddpkit: no `num_gpus = torch.cuda.device_count()`: `ddpkit run --nproc-per-node N` starts the processes
    run_training(args)  # ddpkit: args instead of num_gpus
