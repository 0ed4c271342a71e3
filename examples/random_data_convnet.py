"""The random-data conv demo of the DDP quick-start tutorial, data-parallel with ddpkit.

Run it on 2 processes (2 GPUs, or 2 CPU processes with gloo on a machine without GPUs):

    ddpkit run --nproc-per-node 2 examples/random_data_convnet.py --batch-size 32 --epochs 5

``--batch-size`` is per process: the global batch is batch size x number of processes. Every line
that differs from the tutorial's single-device script carries a ``# ddpkit:`` comment.
"""

import argparse

import torch
import torch.nn as nn
from torch.optim import SGD
from torch.utils.data import Dataset

import ddpkit  # ddpkit: replaces DataLoader, DistributedSampler, DDP and init_process_group imports

parser = argparse.ArgumentParser()
# ddpkit: no --gpu_id / CUDA_VISIBLE_DEVICES: the launcher gives each process its own device
parser.add_argument('--batch-size', type=int, default=32, help='per process')  # ddpkit: per process now
parser.add_argument('--epochs', type=int, default=5)
parser.add_argument('--dataset-size', type=int, default=128)
parser.add_argument('--num-classes', type=int, default=10)
parser.add_argument('--device', default='auto', choices=['auto', 'cpu', 'cuda'],  # ddpkit: new flag
                    help='auto: one GPU per process when there are enough, else CPU (gloo)')
config = parser.parse_args()


# Define dataset sample
class RandomDataset(Dataset):
    def __init__(self, dataset_size, image_size=32):
        images = torch.randn(dataset_size, 3, image_size, image_size)
        labels = torch.zeros(dataset_size, dtype=int)
        self.data = list(zip(images, labels))

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return len(self.data)


# Define the model (as in the tutorial: the softmax before CrossEntropyLoss caps how low the loss goes)
class Model(nn.Module):
    def __init__(self, num_classes):
        super(Model, self).__init__()
        self.conv2d = nn.Conv2d(3, 16, 3)
        self.fc = nn.Linear(30 * 30 * 16, num_classes)
        self.softmax = nn.Softmax(dim=1)

    def forward(self, x):
        batch_size = x.shape[0]
        x = self.conv2d(x)
        x = x.reshape(batch_size, -1)
        x = self.fc(x)
        out = self.softmax(x)
        return out


# ddpkit: the job in a function: its DDP model and process-group objects are freed when it returns,
# not while the interpreter shuts down (where freeing them can abort the process).
def main():
    # ddpkit: rank, device and process group, destroyed however the block ends; the block is indented.
    with ddpkit.distributed(device=config.device) as rt:  # ddpkit
        # Instantiate models, datasets, loaders, and optimizers
        torch.manual_seed(0)  # ddpkit: every rank must generate the same random data set
        model = Model(config.num_classes)
        dataset = RandomDataset(config.dataset_size)
        # ddpkit: DistributedSampler + DataLoader; set_epoch and moving batches to rt.device are done for you
        loader = ddpkit.train_loader(dataset, batch_size=config.batch_size, runtime=rt, seed=0, in_memory=True)
        loss_func = nn.CrossEntropyLoss()
        model = ddpkit.prepare_model(model, rt)  # ddpkit: to this rank's device, wrapped in DDP
        optimizer = SGD(model.parameters(), lr=0.1, momentum=0.9)

        # Start training
        for epoch in range(config.epochs):
            for step, (images, labels) in enumerate(loader):  # ddpkit: batches arrive on rt.device
                preds = model(images)
                loss = loss_func(preds, labels)
                optimizer.zero_grad()
                loss.backward()  # (DDP all-reduces the gradients during this call)
                optimizer.step()
                ddpkit.print0(rt, f'Step: {step}, Loss: {loss.item()}')  # ddpkit: global rank 0 only
            ddpkit.print0(rt, f'Epoch {epoch} Finished !')  # ddpkit: global rank 0 only


if __name__ == "__main__":  # ddpkit
    main()
