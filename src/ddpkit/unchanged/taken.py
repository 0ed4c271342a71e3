"""Gradients that the script takes itself, with respect to a model's parameters (``ddpkit run --unchanged``, several
processes): ``torch.autograd.grad(loss, model.parameters())``, whose result a script sets as the gradients by hand
(``p.grad = g``), steps with, or makes fast weights from (MAML's inner step, ``create_graph=True``).

DDP averages the gradients that a backward accumulates into ``.grad``; ``torch.autograd.grad`` accumulates nothing,
so on its own each process would hold its part: its share's gradient, or on the gathered way its rows'. Here each
such gradient is made the whole batch's as DDP's reducer would make it: the sum over the processes of each one's
times the model's weight for this batch (``in_place.Replica.weight``). Its backward (``create_graph=True``) is the
identity: every process computes the same loss from it, and the gradient that flows back through each process's part
is its part of one device's, which DDP's reducer sums in the script's next backward.

Every process takes the same gradients where this acts: the step is not proven on the split way (``step_rule``: a
tensor that trains, used outside the model), so its loader takes the gathered way, where every process runs the
script's code on the whole batch. Under ``--shard``, a sharded model's gradients exist only in FSDP's backward:
refused in one line. (``torch.autograd.grad`` is replaced: PyTorch has no hook there.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.core.errors import UsageError
from ddpkit.unchanged.adoption import class_name


class TakenGradients:
    """The replacement of ``torch.autograd.grad``: the original's result, each gradient of a replica's parameter made
    the whole batch's. ``owners`` gives the replicas (``in_place.Replica``) and the sharded models, as held now."""

    def __init__(self, *, rank: int, owners: Callable[[], tuple[list, list[nn.Module]]], cut: Callable[[], bool]):
        self.rank = rank
        self.owners = owners
        self.cut = cut  # the models' calls on this batch are cut across the processes, their outputs gathered
        self.original = torch.autograd.grad
        self.within = False  # a call of ours goes on (torch's function modes call this again, from the original)
        functools.update_wrapper(self, self.original)

    @classmethod
    def installed(cls, *, rank: int, adoption, batch) -> TakenGradients:
        """Installed for ``adoption``'s models (``unchanged.adoption``) on ``batch``'s calls (``uninstall`` undoes
        it)."""
        taken = cls(rank=rank, owners=lambda: (list(adoption.replicas.values()), list(adoption.sharded)),
                    cut=lambda: batch.gathered)
        taken.install()
        return taken

    def install(self) -> None:
        torch.autograd.grad = self

    def uninstall(self) -> None:
        if torch.autograd.grad is self:
            torch.autograd.grad = self.original

    def __call__(self, outputs, inputs=None, *args, **kwargs):
        if self.within or inputs is None:
            return self.original(outputs, inputs, *args, **kwargs)
        if not isinstance(inputs, torch.Tensor):
            inputs = tuple(inputs)  # (``model.parameters()``, a generator, read once here: torch reads a tuple too)
        taken = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
        replicas, sharded = self.owners()
        # (Each taken tensor's replica, where it is one of its parameters: the tensors live, so their ids are theirs.)
        owners = {id(parameter): replica for replica in replicas for parameter in replica.parameters}
        owned = [owners.get(id(tensor)) for tensor in taken]
        self.refuse(taken, owned, sharded, kwargs.get("create_graph", args[2] if len(args) > 2 else False))
        self.within = True
        try:
            result = self.original(outputs, inputs, *args, **kwargs)
        finally:
            self.within = False
        if not any(owner is not None and owner.ddp is not None for owner in owned):
            return result
        return tuple(ReducedGradient.apply(gradient, owner.weight())
                     if gradient is not None and owner is not None and owner.ddp is not None else gradient
                     for owner, gradient in zip(owned, result))

    def refuse(self, taken: tuple, owned: list, sharded: list[nn.Module], create_graph: bool) -> None:
        """One line, before anything is computed, for a gradient with respect to a sharded model's parameters (FSDP
        makes them only in a backward), and for one with respect to the parameters of a model whose calls on this
        batch were cut (``owned``: each taken tensor's replica, or None), with ``create_graph=True``: its first
        derivative is one device's, but the second, through the gathered outputs (whose gradient each process divides
        by its weight, which DDP multiplies back in once), would count each process's part of it twice."""
        for module in sharded:
            if any(any(tensor is parameter for parameter in module.parameters()) for tensor in taken):
                raise UsageError(f"--unchanged --shard: torch.autograd.grad with respect to {class_name(module)}'s "
                                 "parameters, which are sharded: FSDP makes their gradients only in a backward "
                                 "(loss.backward()). Run with --shard never", said_elsewhere=self.rank != 0)
        if not create_graph or not self.cut():
            return
        owner = next((replica for replica in owned if replica is not None), None)
        if owner is not None:
            raise UsageError(f"--unchanged: torch.autograd.grad(..., create_graph=True) with respect to {owner.name}'s "
                             "parameters, on a batch whose model calls are cut across the processes: the second "
                             "derivative would not be one device's. Such a step (a meta-learning inner step, a "
                             "gradient-norm penalty) trains as one device's on one process: run with "
                             "--nproc-per-node 1", said_elsewhere=self.rank != 0)


class ReducedGradient(torch.autograd.Function):
    """The sum over the processes of each one's ``gradient`` times its ``weight`` forward; the identity backward (see
    the module)."""

    @staticmethod
    def forward(ctx, gradient: torch.Tensor, weight: float) -> torch.Tensor:
        reduced = gradient.detach() * weight
        dist.all_reduce(reduced)
        return reduced

    @staticmethod
    def backward(ctx, upstream: torch.Tensor):
        return upstream, None
