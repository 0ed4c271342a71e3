"""Which random draws agree across the ranks of ``ddpkit run --unchanged``, and which differ.

- **Shared, from the start:** every rank seeds torch (CPU and CUDA), Python's ``random`` and NumPy with the run's
  seed before the script's first line. Unseeded random data sets, a ``random_split``, a seed the script draws, the
  model's initialisation: the same on every rank. The script's own ``manual_seed`` applies as it would.
- **The order of every split DataLoader** comes from ddpkit's own stream (``data.split_batches.SharedStream``), the
  same on every rank and the same at any world size, whatever the global streams do.
- **Per rank, during a training pass over a split DataLoader:** from its first step (whole, and drawing from the
  shared streams: ``unchanged.batches``) to its end, each rank draws from global streams of its own (seeded from
  (seed, rank) at the first pass, then continued from pass to pass). Draws made per sample then differ across ranks
  as they differ across the samples of one device's batch: dropout masks, a GAN's ``torch.randn(batch_size, nz)``, a
  VAE's noise, the loader's worker seeds (random augmentations). Outside such passes (evaluation, the script's code
  between epochs) the streams are shared again.
- **Batches that no DataLoader split** (nanoGPT's ``get_batch`` draws them with ``torch.randint``), and a stream's
  (an ``IterableDataset``'s loader, which every rank reads whole): the shared streams, so every rank cuts (or reads)
  the same batch; the draws made inside the forward pass of a model in training on a batch cut at the model
  (dropout) come from a stream of each rank's own.
"""

from __future__ import annotations

import hashlib

import torch

from ddpkit.data.split_batches import global_random_states, seed_global_random_states, set_global_random_states


def derived_seed(seed: int, *purpose: object) -> int:
    """A seed for ``purpose`` (a rank, a loader's number), the same on every rank that asks with the same words."""
    digest = hashlib.sha256("/".join(map(str, (seed, *purpose))).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Streams:
    """The run's random streams on this rank: shared, but for the time of a split loader's training pass (and of a
    training forward pass where nothing split the batch), when they are this rank's own (see the module)."""

    def __init__(self, seed: int, rank: int):
        self.seed = seed
        self.rank = rank
        self._passes = 0  # split loaders' training passes going on
        self._own: tuple | None = None  # this rank's streams while no pass goes on (None: not drawn from yet)
        self._forward: tuple | None = None  # this rank's in-forward stream, for batches that nothing split
        self._shared: list[tuple] = []

    def start(self) -> None:
        seed_global_random_states(self.seed)

    def enter_pass(self) -> None:
        """A split loader starts a training pass: this rank's own streams until it ends."""
        self._passes += 1
        if self._passes > 1:
            return
        self._shared.append(global_random_states())
        if self._own is None:
            seed_global_random_states(derived_seed(self.seed, "rank", self.rank))
        else:
            set_global_random_states(self._own)

    def leave_pass(self) -> None:
        self._passes -= 1
        if self._passes == 0:
            self._own = global_random_states()
            set_global_random_states(self._shared.pop())

    def enter_forward(self) -> None:
        """A training forward pass outside a split loader's pass: this rank's own stream inside it (dropout)."""
        if self._passes:
            return
        self._shared.append(global_random_states(torch_only=True))
        if self._forward is None:
            torch.manual_seed(derived_seed(self.seed, "forward", self.rank))
        else:
            set_global_random_states(self._forward)

    def leave_forward(self) -> None:
        if self._passes:
            return
        self._forward = global_random_states(torch_only=True)
        set_global_random_states(self._shared.pop())
