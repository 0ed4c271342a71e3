"""PyTorch's "Training a Classifier" tutorial (CIFAR-10, pytorch.org/tutorials), data-parallel with ddpkit.

Written from the tutorial's behaviour: the same small network (two convolutions with pooling, three
linear layers), cross-entropy, SGD with momentum, batches of 4, a running-loss line every 2,000
mini-batches, "Finished Training", the weights saved to cifar_net.pth, then the accuracy over the test
images and per class. What ddpkit changed (each marked `ddpkit:`): the job replaces the device choice,
the loaders become this rank's share, the accuracies count every test image once over all ranks, and
rank 0 alone prints and saves.

    ddpkit run --nproc-per-node 2 examples/cifar10_tutorial.py
    ddpkit run --nproc-per-node 2 examples/cifar10_tutorial.py --cifar-dir ./data     # real CIFAR-10

Without ``--cifar-dir`` it trains on ddpkit's built-in digits (real scans, as 3x32x32 images, classes
"0" to "9"), so it runs without a network; with it, torchvision's CIFAR-10 (downloaded by rank 0 first).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import ddpkit
from ddpkit import zoo

CIFAR_CLASSES = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def datasets(cifar_dir, job):
    if cifar_dir is None:
        data = zoo.load_digits(channels=3, image_size=32)
        return data.train, data.val, tuple(str(digit) for digit in range(10))
    import torchvision
    import torchvision.transforms as transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    with ddpkit.main_process_first(job.runtime):  # ddpkit: rank 0 downloads, the others then read
        train_set = torchvision.datasets.CIFAR10(root=cifar_dir, train=True, download=True, transform=transform)
        test_set = torchvision.datasets.CIFAR10(root=cifar_dir, train=False, download=True, transform=transform)
    return train_set, test_set, CIFAR_CLASSES


def main():
    parser = argparse.ArgumentParser(description="PyTorch's CIFAR-10 tutorial, data-parallel with ddpkit")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="per process (default: 4, the tutorial's)")
    parser.add_argument("--print-every", type=int, default=2000, help="mini-batches per running-loss line")
    parser.add_argument("--cifar-dir", default=None, help="torchvision's CIFAR-10 there (default: ddpkit's digits)")
    parser.add_argument("--save", default="./cifar_net.pth")
    args = parser.parse_args()

    with ddpkit.Job("ddp", seed=0) as job:  # ddpkit: device, process group, the same initial weights everywhere
        train_set, test_set, classes = datasets(args.cifar_dir, job)
        # ddpkit: this rank's share; loader processes (the tutorial's num_workers=2) where the data is on disk
        trainloader = job.train_loader(train_set, args.batch_size)
        testloader = job.eval_loader(test_set, args.batch_size)  # ddpkit: each test image on exactly one rank
        net, optimizer = job.setup(Net(), optim.SGD, lr=0.001, momentum=0.9)  # ddpkit: wrapped in DDP
        criterion = nn.CrossEntropyLoss()

        for epoch in range(args.epochs):  # loop over the dataset multiple times
            running_loss = 0.0
            for i, (inputs, labels) in enumerate(trainloader):  # ddpkit: already on the job's device
                loss = criterion(net(inputs), labels)
                job.backward(loss)  # ddpkit: instead of loss.backward(); gradients averaged over the ranks
                job.step(optimizer)  # ddpkit: optimizer.step() and zero_grad()
                running_loss += loss.item()
                if i % args.print_every == args.print_every - 1:
                    job.print(f"[{epoch + 1}, {i + 1:5d}] loss: {running_loss / args.print_every:.3f}")  # rank 0's
                    running_loss = 0.0
        job.print("Finished Training")
        job.save_model(net, args.save)  # ddpkit: the bare model's state_dict, written by rank 0

        correct_pred = [0.0] * len(classes)
        total_pred = [0.0] * len(classes)
        model = ddpkit.unwrap(net)  # ddpkit: each rank evaluates its own share; no collective in the forward
        model.eval()
        with torch.no_grad():
            for images, labels in testloader:
                predictions = model(images).argmax(1)
                for label, prediction in zip(labels.tolist(), predictions.tolist()):
                    correct_pred[label] += label == prediction
                    total_pred[label] += 1
        # ddpkit: the counts of every rank added up, so each test image counts once
        counts = job.reduce_sums(correct_pred + total_pred)
        correct_pred, total_pred = counts[:len(classes)], counts[len(classes):]
        job.print(f"Accuracy of the network on the {int(sum(total_pred))} test images: "
                  f"{100 * sum(correct_pred) // sum(total_pred):.0f} %")
        for classname, correct, total in zip(classes, correct_pred, total_pred):
            job.print(f"Accuracy for class: {classname:5s} is {100 * correct / max(total, 1):.1f} %")


if __name__ == "__main__":
    main()
