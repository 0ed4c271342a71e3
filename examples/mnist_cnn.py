"""The MNIST CNN (with BatchNorm) of the "Distributed Training with DistributedDataParallel" tutorial, with ddpkit.

Run it on 2 processes (2 GPUs, or 2 CPU processes with gloo on a machine without GPUs):

    ddpkit run --nproc-per-node 2 examples/mnist_cnn.py --data-dir ./data

Without network access (MNIST cannot be downloaded), train on ddpkit's built-in digits instead:

    ddpkit run --nproc-per-node 2 examples/mnist_cnn.py --digits

``--batch-size`` is per process: the global batch is batch size x number of processes. Every line
that differs from the tutorial's single-device script carries a ``# ddpkit:`` comment.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets, transforms

import ddpkit  # ddpkit: instead of torch.distributed, DDP and DistributedSampler
import ddpkit.zoo  # ddpkit: only for --digits


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, stride=1)
        self.n1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, stride=1)
        self.n2 = nn.BatchNorm2d(64)
        self.fc1 = nn.Linear(1600, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = self.n1(x)
        x = F.relu_(x)
        x = F.max_pool2d(x, 2)
        x = self.conv2(x)
        x = self.n2(x)
        x = F.relu_(x)
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu_(x)
        x = self.fc2(x)
        x = F.log_softmax(x, dim=-1)
        return x


def get_mnist_dataset(train=True, data_dir='./data'):  # ddpkit: returns the data set; ddpkit makes the loader
    transform = transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize((0.1307,), (0.3081,))
    ])
    return datasets.MNIST(data_dir, train=train, download=True, transform=transform)  # ddpkit: (see above)


def train(model, optimizer, train_loader, device):
    for X, target in train_loader:
        X = X.to(device)
        target = target.to(device)
        optimizer.zero_grad()
        pred = model(X)
        loss = F.nll_loss(pred, target)
        loss.backward()
        optimizer.step()
    return loss.item()  # ddpkit: (added) for the log line on rank 0


@torch.no_grad()
def test(model, test_loader, device, rt):  # ddpkit: (added) the tutorial has no evaluation
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for X, target in test_loader:
        X, target = X.to(device), target.to(device)
        pred = model(X)
        loss_sum += F.nll_loss(pred, target, reduction='sum').item()
        correct += (pred.argmax(dim=1) == target).sum().item()
        count += len(target)
    model.train()
    # ddpkit: each rank saw its own share of the test set; add the sums of all ranks
    return ddpkit.reduce_sums([loss_sum, correct, count], rt)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()  # ddpkit: (added) flags for the values the tutorial hard-codes
    parser.add_argument('--data-dir', default='./data', help='where MNIST is (or is downloaded to)')
    parser.add_argument('--digits', action='store_true',
                        help="ddpkit's built-in digits (no download), resized to 28x28, instead of MNIST")
    parser.add_argument('--epochs', type=int, default=5)
    parser.add_argument('--batch-size', type=int, default=64, help='per process')
    parser.add_argument('--lr', type=float, default=0.01)
    parser.add_argument('--device', default='auto', choices=['auto', 'cpu', 'cuda'],  # ddpkit: new flag
                        help='auto: one GPU per process when there are enough, else CPU (gloo)')
    args = parser.parse_args()

    # ddpkit: replaces `cuda = True`; rank, device and process group, destroyed however the block ends.
    with ddpkit.distributed(device=args.device) as rt:  # ddpkit
        device = rt.device  # ddpkit: this rank's own GPU (or the CPU)
        torch.manual_seed(0)  # ddpkit: (added) reproducible runs; DDP copies rank 0's weights to all ranks
        model = ddpkit.prepare_model(Net(), rt)  # ddpkit: Net().to(device) wrapped in DDP
        if args.digits:  # ddpkit: (added) --digits: no download
            sets = ddpkit.zoo.load_digits(channels=1, image_size=28)
            train_set, test_set = sets.train, sets.val
        else:
            with ddpkit.main_process_first(rt):  # ddpkit: rank 0 downloads, the others then read the files
                train_set = get_mnist_dataset(train=True, data_dir=args.data_dir)
                test_set = get_mnist_dataset(train=False, data_dir=args.data_dir)
        # ddpkit: replaces DataLoader(..., shuffle=True): each rank gets its share, reshuffled every epoch
        train_loader = ddpkit.train_loader(train_set, batch_size=args.batch_size, runtime=rt)
        test_loader = ddpkit.eval_loader(test_set, batch_size=256, runtime=rt)  # ddpkit
        optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)  # ddpkit: --lr (default 0.01)

        model.train()
        for epoch in range(args.epochs):  # ddpkit: --epochs (default 5)
            last_loss = train(model, optimizer, train_loader, device)  # ddpkit: (added) keep the loss
            ddpkit.print0(rt, f'epoch {epoch}: last batch loss {last_loss:.4f}')  # ddpkit: rank 0 prints
        ddpkit.broadcast_buffers(ddpkit.unwrap(model), rt)  # ddpkit: (added) every rank tests rank 0's BatchNorm stats
        loss_sum, correct, count = test(ddpkit.unwrap(model), test_loader, device, rt)  # ddpkit: bare model
        ddpkit.print0(rt, f'test: loss {loss_sum / count:.4f}, accuracy {correct / count:.2%} '  # ddpkit
                          f'({int(correct)}/{int(count)} samples)')
