"""Writes ``traindata.pt``: 100 sine waves of 1000 steps (or the length given) (period 2*pi*20), each shifted by a random offset.

Written to behave like pytorch/examples time_sequence_prediction/generate_sine_wave.py: the same seed (NumPy's 2),
sizes and file (a float64 NumPy array pickled with ``torch.save`` into the current folder).

Addition for small CPU runs: an optional first argument, the waves' length (default 1000, as in the example).
"""
import sys

import numpy as np
import torch

np.random.seed(2)

T = 20
L = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
N = 100

x = np.empty((N, L), 'int64')
x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
data = np.sin(x / 1.0 / T).astype('float64')
torch.save(data, open('traindata.pt', 'wb'))
