"""PyTorch's own MNIST example (github.com/pytorch/examples, mnist/main.py), data-parallel with ddpkit.

Written from that script's behaviour: the same network (two convolutions, dropout, two linear layers,
log-softmax), Adadelta with a StepLR decay every epoch, a "Train Epoch" line every --log-interval
batches, a "Test set" line each epoch, and --save-model. What ddpkit changed (each marked `ddpkit:`):
the job replaces the device choice and ``.to(device)`` calls, the loaders become this rank's share, the
test pass counts every sample once over all ranks, and rank 0 alone prints and saves.

    ddpkit run --nproc-per-node 2 examples/pytorch_examples_mnist.py --epochs 2
    python examples/pytorch_examples_mnist.py --epochs 2              # one process, the same script
    ddpkit run --nproc-per-node 2 examples/pytorch_examples_mnist.py --mnist-dir ./data   # real MNIST

Without ``--mnist-dir`` it trains on ddpkit's built-in digits (real scans, resized to 28x28), so it
runs without a network; with it, torchvision's MNIST (downloaded there by rank 0 first).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

import ddpkit
from ddpkit import zoo


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, job, model, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):  # ddpkit: batches arrive on the job's device
        loss = F.nll_loss(model(data), target)
        job.backward(loss)  # ddpkit: instead of loss.backward(); gradients are averaged over the ranks
        job.step(optimizer)  # ddpkit: optimizer.step() and zero_grad()
        if batch_idx % args.log_interval == 0:
            seen = batch_idx * args.batch_size * job.world_size  # ddpkit: samples of every rank
            total = len(train_loader) * args.batch_size * job.world_size
            job.print(f"Train Epoch: {epoch} [{seen}/{total} ({100.0 * batch_idx / len(train_loader):.0f}%)]"
                      f"\tLoss: {loss.item():.6f}")  # ddpkit: rank 0's loss, printed by rank 0
            if args.dry_run:
                break


def test(job, model, test_loader):
    # ddpkit: every test sample counted once over all ranks (the example's sum of nll_loss, then the mean)
    loss, accuracy, count = job.evaluate(model, test_loader, loss_fn=F.nll_loss)
    job.print(f"\nTest set: Average loss: {loss:.4f}, Accuracy: {round(accuracy * count)}/{count} "
              f"({100.0 * accuracy:.0f}%)\n")


def datasets(mnist_dir, job):
    if mnist_dir is None:
        data = zoo.load_digits(channels=1, image_size=28)
        return data.train, data.val
    from torchvision import datasets, transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    with ddpkit.main_process_first(job.runtime):  # ddpkit: rank 0 downloads, the others then read
        return (datasets.MNIST(mnist_dir, train=True, download=True, transform=transform),
                datasets.MNIST(mnist_dir, train=False, transform=transform))


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example, data-parallel with ddpkit")
    parser.add_argument("--batch-size", type=int, default=64, help="input batch size per process (default: 64)")
    parser.add_argument("--test-batch-size", type=int, default=1000, help="test batch size per process (default: 1000)")
    parser.add_argument("--epochs", type=int, default=14, help="number of epochs to train (default: 14)")
    parser.add_argument("--lr", type=float, default=1.0, help="learning rate (default: 1.0)")
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate step gamma (default: 0.7)")
    parser.add_argument("--strategy", default="ddp", help="ddpkit strategy: single, ddp, zero, fsdp (default: ddp)")
    parser.add_argument("--dry-run", action="store_true", help="quickly check a single pass")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default: 1)")
    parser.add_argument("--log-interval", type=int, default=10, help="batches between training status lines")
    parser.add_argument("--save-model", action="store_true", help="save the model as mnist_cnn.pt")
    parser.add_argument("--mnist-dir", default=None, help="torchvision's MNIST there (default: ddpkit's digits)")
    args = parser.parse_args()

    # ddpkit: the job picks the device, starts the process group and seeds every rank alike
    with ddpkit.Job(args.strategy, seed=args.seed) as job:
        train_set, test_set = datasets(args.mnist_dir, job)
        train_loader = job.train_loader(train_set, args.batch_size)  # ddpkit: this rank's share, reshuffled each epoch
        test_loader = job.eval_loader(test_set, args.test_batch_size)
        model, optimizer = job.setup(Net(), optim.Adadelta, lr=args.lr)  # ddpkit: wrapped for the strategy
        scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
        for epoch in range(1, args.epochs + 1):
            train(args, job, model, train_loader, optimizer, epoch)
            test(job, model, test_loader)
            scheduler.step()
        if args.save_model:
            job.save_model(model, "mnist_cnn.pt")  # ddpkit: the bare model's weights, written by rank 0


if __name__ == "__main__":
    main()
