"""A one-device script on a timm model, as timm's documentation shows training one: ``create_model``,
``create_optimizer_v2`` (AdamW with weight decay), a cosine schedule from ``create_scheduler_v2``, an EMA of the
weights (``ModelEmaV3``), label smoothing; in float64. benchmarks/public_unchanged.py runs it under ``ddpkit run
--unchanged`` on 1 and 2 processes.

    python tests/unchanged_timm_script.py OUT

writes OUT/result.pt: the model's and the EMA's weights, and the EMA's printed evaluation.
"""

import os
import sys

import timm
import torch
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch.utils.data import DataLoader, TensorDataset

out = sys.argv[1]
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
images, labels = torch.randn(44, 3, 32, 32), torch.randint(0, 4, (44,))
model = timm.create_model("resnet10t", pretrained=False, num_classes=4)
optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
scheduler, epochs = create_scheduler_v2(optimizer, sched="cosine", num_epochs=2, warmup_epochs=0)
ema = ModelEmaV3(model, decay=0.9)
criterion = LabelSmoothingCrossEntropy(smoothing=0.1)
loader = DataLoader(TensorDataset(images, labels), batch_size=8, shuffle=True)
for epoch in range(epochs):
    model.train()
    for step, (x, y) in enumerate(loader):
        loss = criterion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ema.update(model, step=epoch * len(loader) + step)
    scheduler.step(epoch + 1)
    ema.module.eval()
    with torch.no_grad():
        correct = sum(int((ema.module(x).argmax(1) == y).sum()) for x, y in DataLoader(TensorDataset(images, labels),
                                                                                      batch_size=11))
    print(f"epoch {epoch}: the EMA gets {correct}/{len(labels)}")
torch.save({"weights": {"model": model.state_dict(), "ema": ema.module.state_dict()}},
           os.path.join(out, "result.pt"))
