#!/usr/bin/env python
"""Fits a degree-4 polynomial with one linear layer, stopping when the loss is below 1e-3.

Written to behave like pytorch/examples regression/main.py on one device: the same random target polynomial, the
same batches of 32 drawn by hand (``get_batch``), the same smooth L1 loss computed outside the model, the same update
by hand (``param.data.add_(-0.1 * param.grad)``, no optimizer), the same stop and the same printed lines. The
example has no flags and saves nothing.

Addition: the learned layer's weights are saved to ``regression.pt`` at the end, to compare runs.
"""
from __future__ import print_function

from itertools import count

import torch
import torch.nn.functional as F

POLY_DEGREE = 4
W_target = torch.randn(POLY_DEGREE, 1) * 5
b_target = torch.randn(1) * 5


def make_features(x):
    """Builds features i.e. a matrix with columns [x, x^2, x^3, x^4]."""
    x = x.unsqueeze(1)
    return torch.cat([x ** i for i in range(1, POLY_DEGREE + 1)], 1)


def f(x):
    """The function to approximate."""
    return x.mm(W_target) + b_target.item()


def poly_desc(W, b):
    """A polynomial as a string."""
    result = 'y = '
    for i, w in enumerate(W):
        result += '{:+.2f} x^{} '.format(w, i + 1)
    result += '{:+.2f}'.format(b[0])
    return result


def get_batch(batch_size=32):
    """Builds a batch i.e. (x, f(x)) pair."""
    random = torch.randn(batch_size)
    x = make_features(random)
    y = f(x)
    return x, y


fc = torch.nn.Linear(W_target.size(0), 1)

for batch_idx in count(1):
    batch_x, batch_y = get_batch()
    fc.zero_grad()
    output = F.smooth_l1_loss(fc(batch_x), batch_y)
    loss = output.item()
    output.backward()
    for param in fc.parameters():
        param.data.add_(-0.1 * param.grad)
    if loss < 1e-3:
        break

print('Loss: {:.6f} after {} batches'.format(loss, batch_idx))
print('==> Learned function:\t' + poly_desc(fc.weight.view(-1), fc.bias))
print('==> Actual function:\t' + poly_desc(W_target.view(-1), b_target))
torch.save(fc.state_dict(), 'regression.pt')
