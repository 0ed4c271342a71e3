"""The script's models, found as it calls them (``ddpkit run --unchanged``), through PyTorch's global module hooks
(``register_module_forward_pre_hook`` and ``register_module_forward_hook``).

A module called from the script's own code (not from inside another module's forward), in training mode with
gradients on, that has parameters to train, is a model: at that first call, on every rank alike, it becomes a DDP
replica (``strategies.in_place.Replica``): its parameters and buffers rank 0's, its gradients all-reduced during
backward, weighted by this rank's share of the batch, DDP's reducer built from what its first step's graph needs. A
loss module (no parameters) is left alone. A loader's whole batch is cut at the model where the model allows
(``at_the_model.AtTheModel.split_whole``), its outputs gathered.

What follows from a root call is here; which modules are models and what each becomes is ``adoption``'s, and what a
batch cut at the model and its returned losses become is ``at_the_model``'s. Under ``--shard``, a model that the
script moves to a GPU is seen there first (``Module.to`` and ``Module.cuda`` replaced: ``_moves_seen``), and sharded
on the way where ``--shard`` says so (``Adoption.move``).
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import site
import sys
import sysconfig
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules import module as module_hooks
from torch.utils import _pytree as pytree

from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger
from ddpkit.data.split_batches import share_sizes
from ddpkit.strategies.in_place import Replica
from ddpkit.unchanged.adoption import Adoption, class_name, is_trainable
from ddpkit.unchanged.at_the_model import (NOT_FOLLOWED, AtTheModel, call_keywords, device_of, is_a_loss,
                                            returns_a_loss, set_aside)
from ddpkit.unchanged.batches import Batch
from ddpkit.unchanged.branches import ReadsItsData
from ddpkit.unchanged.divided import KEYWORDS_SEEN, Call, Evaluations, rows_of
from ddpkit.unchanged.gathered import Gather, ScaleGradient, gathered
from ddpkit.unchanged.kept import read_again, script_frame
from ddpkit.unchanged.randomness import Streams
from ddpkit.unchanged.step_rule import ROWS
from ddpkit.unchanged.taken import TakenGradients


RAISED = object()  # what ``Models.after`` gets for the output of a call that raised


class Models:
    """The global hooks, the models they found, and what each root call of one does."""

    def __init__(self, *, rank: int, world_size: int, batch: Batch, streams: Streams,
                 witness: Callable[..., None], shard: str = "never", optimizers=None,
                 wait_for_rank_0: Callable[[], None] = lambda: None, stand_aside: Callable[[], None] = lambda: None,
                 find_unused: bool = False, the_same_everywhere: Callable[[object], bool] = lambda args: True,
                 watching: Callable[[], object] = lambda: None):
        self.rank = rank
        self.watching = watching  # the training step being watched (``step_rule.StepWatch``), or None
        self.witness = witness  # told of each call of a model: in training or not (``Loaders.witness``)
        self.the_same_everywhere = the_same_everywhere  # whether a call's arguments are the same on every rank
        self.world_size = world_size
        self.batch = batch
        self.streams = streams
        self.depth = 0
        self.off = False
        self.taken: TakenGradients | None = None  # (installed where several processes train: ``install``)
        self._calls: list[Call] = []  # the open root call
        self.at_the_model = AtTheModel(rank=rank, world_size=world_size, batch=batch,
                                       current_call=lambda: self._calls[-1] if self._calls else None)
        self.adoption = Adoption(rank=rank, world_size=world_size, batch=batch, shard=shard, optimizers=optimizers,
                                 wait_for_rank_0=wait_for_rank_0, stand_aside=stand_aside,
                                 items_hook=self._keywords, find_unused=find_unused)
        self.evaluations = Evaluations(rank=rank, world_size=world_size)
        # Models that return several outputs, none computed from another (a head and an auxiliary head; not a loss
        # computed from the logits it returns with them): a step may leave one unused. Decided at a first call.
        self.several_outputs: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.functional: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # called under torch.func (said once)
        self.split_trained: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # trained on a split loader's shares
        self.held_said = False  # a share handed out again was trained on (``_held_share``)
        self._outputs_seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._keeping: nn.Module | None = None  # a first call on a hand-cut batch that returned its loss (``_learned``)
        self._reading: tuple[nn.Module, ReadsItsData] | None = None  # a call of a replica's first step (``_before``)

    def install(self) -> None:
        # torch warns a script that compiles a module that global hooks fire once more around the compiled module:
        # they are these, and they act at the outer call alone (``depth``).
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        self._handles = [module_hooks.register_module_forward_pre_hook(self.before)]
        if KEYWORDS_SEEN:
            self._handles.append(module_hooks.register_module_forward_hook(self.after, always_call=True,
                                                                           with_kwargs=True))
        else:
            self._handles.append(module_hooks.register_module_forward_hook(
                lambda module, args, output: self.after(module, args, {}, output), always_call=True))

        if self.world_size > 1 and self.adoption.shard != "never":
            self._undo_moves = _moves_seen(self)
        if self.world_size > 1:  # (gradients that the script takes itself: ``taken``)
            self.taken = TakenGradients.installed(rank=self.rank, adoption=self.adoption, batch=self.batch)

    def uninstall(self) -> None:
        self.off = True
        self._read_its_data(agreed=False)
        if self.taken is not None:
            self.taken.uninstall()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        getattr(self, "_undo_moves", lambda: None)()
        self._undo_moves = lambda: None

    def before(self, module: nn.Module, args: tuple):
        self.depth += 1
        if self.depth > 1 and self._reading is not None and self._reading[0] in self.adoption.sharded:
            self._block_called(module)
        if self.depth != 1 or self.off or self._left_to_the_script(module, args):
            return None
        watch = self.watching()
        if watch is None:
            return self._before(module, args)
        watch.pause()  # (a model's code is not the script's loop: ``step_rule``)
        calls = len(self._calls)
        try:
            return self._before(module, args)
        finally:
            if len(self._calls) == calls:
                watch.resume()  # not a model (a loss module): its code is the script's step

    def _before(self, module: nn.Module, args: tuple):
        if not (module.training and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()):
            return self.evaluating(module, args)
        first = False
        if module not in self.adoption.found:
            if module in self.adoption.passed or not self.adoption.adopt(module):
                return None
            first = True
        self.witness(training=True, current=self._current(args))
        if first and self.world_size > 1:
            self._hooked(module)
        from_loader = self.batch.loader_passes > 0 and not self.batch.coupled
        # (One process: nothing to split. A model whose first call returned no loss: every call whole, below.)
        split = self.world_size > 1 and not from_loader and not first and not self.at_the_model.is_whole(module)
        held = split and not self.batch.coupled and module not in self.at_the_model.with_loss
        if held:  # on a batch no pass handed out: the same on every rank (the shared streams'), whole; else a share
            # that a split pass handed out, handed out again (``_held_share``)
            held, split = not self.the_same_everywhere(args) and self._held_share(module, args), False
        share, whole_args, cut = None, args, None
        if split:
            args, share = self.at_the_model.split(args)
        elif from_loader and not self.batch.loader_share and self.world_size > 1:
            # A loader's whole batch (a pass's first ones, a stream's, the gathered way's): this rank's share of it, the
            # outputs gathered; at each call (two views), though a call before it set the batch's weight to a share's.
            # (A model's first call: cut where nothing rules it out, undone in ``after`` if its outputs cannot be
            # gathered. A sharded model's first call is whole: it shows the way.)
            if not first:
                cut = self.at_the_model.split_whole(module, args)
            elif module not in self.adoption.sharded and module not in self.at_the_model.couples_rows:
                cut = self.at_the_model.split_first(module, args)
            if cut is not None:
                args, share = cut
        elif not from_loader and not held:
            self.batch.set_whole()  # the same computation on every rank, from the shared streams: one device's
        if share is not None:
            self.streams.enter_forward()  # each rank's rows draw their own dropout, as rows of one batch do
        self._open(module, whole_args, share=share, cut=cut, first=first, from_loader=from_loader, by_hand=split)
        # What leaves through its inputs (to a model that made them: a GAN's generator) is unweighted again: the
        # weight of gathered outputs (``after``), and a sharded model's.
        inputs = self.batch.current_weight() if cut is not None else 1.0
        if module in self.adoption.sharded:
            if first and module not in self.adoption.sharded_before:
                from ddpkit.strategies.fsdp import fsdp2

                # fully_shard's pre-forward hook (it gathers the root's parameters) was added during this call: run it.
                args, _ = fsdp2().fully_shard.state(module)._pre_forward(module, args, {})
            if first and not _compiled(module):  # (its first call, whole: does it skip a block on some data?)
                self._watch_its_data(module)
            factor = self.sharded_weight()
            return _differentiated_once(_scaled_gradients(args, inputs / factor if factor else 0.0), module, self.rank)
        replica = self.adoption.replicas.get(module)
        if replica is not None:  # (a tried call's DDP forward begins in ``after``, once it is one)
            # (A model of several outputs on the gathered way: a step may leave one of them unused, a loss term that
            # some batches have, which DDP meets only where it looks for unused parameters.)
            replica.before(args, begin=not self._calls[-1].tried,
                           unused=self.batch.gathered_way and module in self.several_outputs)
            if replica.needed >= 0 and not _compiled(module):  # (its first step: does its forward read its data?)
                self._watch_its_data(module)
            self._calls[-1].versions = _versions(module) if first else None  # (once DDP, which writes them, is built)
        return _scaled_gradients(args, inputs) if share is not None else None

    def _keywords(self, module: nn.Module, args: tuple, kwargs: dict):
        """A model's own forward pre-hook (the global one, ``before``, is not given the call's keywords): a batch that
        no loader split, given by keyword alone, split here (``AtTheModel.split_keywords``); then its keyword tensors
        cut (``AtTheModel.keywords_and_items``)."""
        call = self._calls[-1] if self._calls else None
        if call is not None and call.module is module and call.by_hand and call.share is None:
            call.share = self.at_the_model.split_keywords(kwargs)
            self.streams.enter_forward()  # (as ``_before`` does for a share of positional tensors)
        return self.at_the_model.keywords_and_items(module, args, kwargs)

    def _current(self, args: tuple) -> bool:
        """Whether a training call is given rows of the batch that its loader handed out last (as the watch of that
        step follows them): a loop that skipped batches before it, not a wrapper that fetched this one ahead."""
        watch = self.watching()
        return watch is not None and any(watch.kind(leaf) == ROWS for leaf in pytree.tree_leaves(args))

    def _hooked(self, module: nn.Module) -> None:
        """A model's first training call, on several processes: where it holds hooks of the script's own, what they
        read would be a share's rows, so its calls are computed whole (``computed_across_rows``)."""
        hooked = _hooks_of_the_script(module)
        if hooked is not None:
            self.at_the_model.computed_across_rows(module, hooked, what="runs hooks of the script's own inside it, "
                                                   "which would read a share of its batch")

    def _open(self, module: nn.Module, whole_args: tuple, *, share, cut, first: bool, from_loader: bool,
              by_hand: bool) -> None:
        """The root call's ``Call``: at a model's first training call, what it holds (its buffers, and the tensors
        kept on its layers: ``_left_behind``)."""
        tried = first and cut is not None
        learning = first and not self.batch.loader_passes and not self.batch.coupled
        self._calls.append(Call(module, whole_args, share=share, gathered=cut is not None, tried=tried, by_hand=by_hand,
                                buffers=own_buffers(module) if first else None,
                                attributes=held_tensors(module) if first and self.world_size > 1 else None,
                                keywords=call_keywords(module) if tried or learning and not KEYWORDS_SEEN else {},
                                learning=learning,
                                of_a_split_batch=from_loader and self.batch.loader_share and self.world_size > 1))
        if self._calls[-1].of_a_split_batch:
            self.split_trained.add(module)

    def _left_behind(self, module: nn.Module, call: Call) -> None:
        """What a model's first training call left that a call cut at the model would leave a share's: buffers that
        it wrote, tensors that it kept on itself. Such a model is computed whole from then on."""
        wrote = call.buffers is not None and any(not torch.equal(buffer, value) for buffer, value in call.buffers)
        if call.tried and self.world_size > 1:  # (whether any rank's share wrote: every rank then computes it again)
            anywhere = torch.tensor([float(wrote)], device=device_of(module))
            dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
            wrote = bool(anywhere.item())
        if wrote and not (call.tried and self._writes_alike(module, call)):
            self.at_the_model.writes_buffers_in_training(module)
        elif call.versions is not None and any(parameter._version != version for parameter, version in call.versions):
            self.at_the_model.writes_buffers_in_training(
                module, "its parameters in place in training, outside autograd (as nn.Embedding's max_norm does)")
        if call.attributes is None:
            return
        kept = kept_on_itself(module, call.attributes,
                              len(call.share.indices) if call.share is not None else rows_of(call.whole_args))
        if kept is not None:  # (the script may read it: the whole batch's only where the call is whole)
            self.at_the_model.computed_across_rows(module, kept, what="keeps tensors that it computes on itself, "
                                                   "which would be a share's")
            if call.tried:  # (made again whole, ``cut_as_tried``: what it appended to its lists, taken back)
                put_back(call.attributes)

    def _writes_alike(self, module: nn.Module, call: Call) -> bool:
        """Whether the buffers that a model's first training call wrote, tried on this rank's share of a loader's
        whole batch (``call.buffers``: as they were before it), come out the same from its call on the whole batch:
        what spectral norm's power iteration or a step counter writes depends on the model's weights alone, what a
        running mean of its inputs writes on its rows. Computed again whole from the buffers as they were, in
        training, gradients off, from the same random state, the batch whole (BatchNorm by its own rows), its calls
        inside left alone (``depth``); then every buffer put back as the share's call left it; one all-reduce. Where
        they agree on every rank, the model's calls are cut as any other's, its buffers written alike on every
        process. Not for a sharded model (its call's collectives are FSDP's)."""
        same = False
        if module not in self.adoption.sharded:
            left = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]  # (BatchNorm's too)
            self.depth += 1
            try:
                with set_aside(module, self.batch):
                    for buffer, value in call.buffers:
                        buffer.data.copy_(value)
                    self.batch.set_whole()
                    module(*call.whole_args, **call.keywords)
                    written = {id(buffer): value for buffer, value in left}  # (by the share's call)
                    same = all(torch.equal(buffer, written[id(buffer)]) for buffer, _ in call.buffers)
            except Exception as error:  # noqa: BLE001 - the model's own, in a call the script did not make
                logger.debug(f"--unchanged: {class_name(module)} on the whole batch, for its buffers: {error!r}")
            finally:
                self.depth -= 1
                for buffer, value in left:
                    buffer.data.copy_(value)
        agreed = torch.tensor([float(same)], device=device_of(module))
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        return agreed.item() == 1

    def _held_share(self, module: nn.Module, args: tuple) -> bool:
        """A model trained on a split loader's shares, now on a batch that no pass handed out and that differs
        across the processes: outside a pass nothing else can (the script's draws there come from the shared
        streams), so it is each process's share of a batch that a split pass handed out, handed out again by what
        kept it (``itertools.cycle(loader)`` replays a pass's batches in their order), and that pass's steps were
        proven split (``step_rule``). Trained as that share: weighed by its rows over all the processes' (one
        all-reduce), as its pass weighed it; said once. Else (a model never trained on a split loader's shares, or
        no tensor argument to count): refused in one line."""
        tensors = [arg for arg in args if isinstance(arg, torch.Tensor) and arg.dim() > 0]
        if module not in self.split_trained or not tensors:
            raise UsageError(NOT_FOLLOWED, said_elsewhere=self.rank != 0)
        # (A stand-in, the row a rank without a sample of a small batch was given, is a copy of that batch's last
        # row: the two weighed alike are the same mean as the one.)
        rows = tensors[0].size(0)
        total = torch.tensor([float(rows)], dtype=torch.float64, device=tensors[0].device)
        dist.all_reduce(total)
        self.batch.set(rows / total.item(), samples=int(total.item()))
        if not self.held_said and self.rank == 0:
            logger.info(f"--unchanged: {class_name(module)} trains on each process's shares of batches that a split "
                        "pass handed out, handed out again once the pass had ended (itertools.cycle(loader)): as "
                        "the shares they are, each weighed by its rows")
        self.held_said = True
        return True

    def _left_to_the_script(self, module: nn.Module, args: tuple) -> bool:
        """Whether ``module``'s call is left as it is: one under torch.func (``_functional``), whose gradients are the
        script's own, not a call of the model's to cut or average (in training, said once; refused on a batch that
        its loader split); a first call of a model with lazy modules (``nn.LazyLinear``), whose parameters it makes
        (every process the same, from the shared streams: a script's dry run, or a pass's first batch, whole)."""
        if module in self.adoption.found or module in self.adoption.passed:  # (not read again: the hot path)
            if torch._C._functorch.peek_interpreter_stack() is None:
                return False
        else:
            parameters = list(module.parameters())
            if any(nn.parameter.is_lazy(parameter) for parameter in parameters):
                if module.training and torch.is_grad_enabled():
                    self.witness(training=True, current=self._current(args))  # (its pass trains)
                return True  # (lazy modules' shapes are not known yet: made at this call, found at the next)
            if not _functional(parameters):
                return False
        if not (module.training and torch.is_grad_enabled()):
            return True
        if module not in self.functional and self.world_size > 1 and self.rank == 0:
            logger.warning(f"--unchanged: {class_name(module)} is called under torch.func (vmap, grad or "
                           "functional_call), and the script takes its gradients itself: every process computes "
                           "each of its steps whole, as one device does (exact, and no faster)")
        self.functional.add(module)
        if self.world_size > 1 and self.batch.loader_share:
            raise UsageError(f"--unchanged: {class_name(module)} is called under torch.func on a batch that its "
                             "loader split (another model trains on it), and the gradients the script takes there "
                             "would be this process's share's: train it on a loader of its own",
                             said_elsewhere=self.rank != 0)
        return True

    def evaluating(self, module: nn.Module, args: tuple):
        """A model called without training: its loader's pass learns it is an evaluation, and a whole batch is
        divided across the ranks where the model allows (``divided``)."""
        if module not in self.adoption.found and (module in self.adoption.passed or not is_trainable(module)):
            return None
        self.witness(training=False)
        divided = self.evaluations.divide(module, args) if self.batch.loader_passes and self.batch.whole else None
        self._calls.append(Call(module, args, evaluating=True, share=None if divided is None else divided[1]))
        return None if divided is None else divided[0]

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output=RAISED):
        self.depth -= 1
        if self.depth != 0 or not self._calls or self._calls[-1].module is not module:
            return None
        call = self._calls[-1]
        self._read_its_data()
        result = self._after(module, args, kwargs, output)
        if self._keeping is module:
            self._keeping = None
            self._kept(module, output if result is None else result)
        watch = self.watching()
        if watch is not None and output is not RAISED:
            watch.outputs(output if result is None else result, training=not call.evaluating)
            if module in self.at_the_model.writes_buffers:
                watch.unproven(f"{class_name(module)} writes {self.at_the_model.writes_buffers[module]}")
            if module in self.at_the_model.couples_rows:
                watch.unproven(f"{class_name(module)} {self.at_the_model.couples_rows[module]}")
            watch.resume()
        return result

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output=RAISED):
        call = self._calls.pop()
        if output is RAISED:  # the call raised (torch then calls this hook without its keywords): unwound only
            if call.share is not None and not call.evaluating:
                self.streams.leave_forward()
            if module in self.adoption.replicas:
                Replica.unwound()
            return None
        if call.evaluating:
            return self.evaluations.finish(call, kwargs, output)
        share = call.share
        split = share is not None
        if split:
            self.streams.leave_forward()
        self._left_behind(module, call)
        if call.tried and not self.at_the_model.cut_as_tried(
                module, len(share.indices), output, lambda: self._both_ways(module, call.whole_args, call.keywords,
                                                                            losses=False)):
            if module not in self.at_the_model.cut_whole:  # (a loss on every rank: computed both ways, before the
                self._both_ways(module, call.whole_args, call.keywords)  # script's own call, which comes last)
            # Again, whole (``cut_as_tried`` undid what the cut call did), with the keywords it was given.
            return module(*call.whole_args, **call.keywords)
        if module not in self._outputs_seen:
            self._outputs_seen.add(module)
            if independent_outputs(output) > 1:
                self.several_outputs.add(module)
        replica = self.adoption.replicas.get(module)
        if replica is not None and replica.needed >= 0:  # (the reducer's first step: one backward pass per call)
            output = _reached_once(output, replica.name, self.rank, lambda: self.taken.within)
        if call.tried and replica is not None:
            replica.begin()
        if not split and self.world_size > 1:
            self._learned(module, call, kwargs, output)
        # (Gathered outputs: the loss is the whole batch's on every rank, whatever its reduction.)
        scale = 1.0 if call.gathered else self.batch.output_scale()
        if module in self.adoption.sharded:
            scale *= self.sharded_weight()
        if call.gathered:
            output = self._gathered(call, output)
        elif call.items_counted and returns_a_loss(output, self.batch.fewest_rows):
            weight = self.batch.current_weight()  # (a sum's part: its gradient counts whole, DDP weighs it by share)
            output = self.at_the_model.whole_batch_losses(output, summed=True, scale=1.0 / weight if weight else 0.0)
            split = True
        elif split and self.batch.coupled:
            output = gathered(output, sizes=share_sizes(share.samples, world_size=self.world_size), rank=self.rank,
                              rows=len(share.indices), with_gradients=True)
        elif split:
            output = self.at_the_model.whole_batch_losses(output)
            if module in self.at_the_model.outputs_read:
                output = self._gathered_by_hand(share, output)
        elif (self.batch.loader_passes and not self.batch.whole and not self.batch.coupled
              and returns_a_loss(output, self.batch.fewest_rows)):
            # A loss the model computed from this rank's share of a loader's batch: the value the script reads is the
            # whole batch's (its gradient the share's, which DDP weighs).
            output, split = self.at_the_model.whole_batch_losses(output, required=False), True
        if scale != 1.0:
            output, split = _scaled_gradients(output, scale), True
        if replica is not None:
            return replica.after(output)  # DDP's forward ends with the output the script gets
        return output if split else None

    def _gathered(self, call: Call, output):
        """The outputs of a call cut at the model, gathered into the whole batch's. Every rank computes the whole
        batch's loss from them, and the gradient of its own rows is its part of one device's: divided by this rank's
        weight, which DDP multiplies back in (as a split batch's). A loss the model returns (one that a split keeps:
        ``AtTheModel.check_both_ways``) is made the batch's, as on a split batch."""
        weight, rows, share = self.batch.current_weight(), len(call.share.indices), call.share
        losses = self.at_the_model.losses_in(call.module, output)
        kept = ()
        if losses:
            output = self.at_the_model.whole_batch_losses(output, summed=call.items_counted or None, at=losses,
                                                          scale=1.0 / weight if call.items_counted and weight else 1.0)
            leaves = pytree.tree_leaves(output)
            kept = [leaves[index] for index in losses]
            self.batch.gathered = True  # (what the script computes from the outputs is the whole batch's)
        return gathered(_scaled_gradients(output, 1.0 / weight, but=kept), rank=self.rank, rows=rows,
                        sizes=share_sizes(share.samples, world_size=self.world_size), with_gradients=True, kept=kept)

    def _whole_by_hand(self, module: nn.Module, call: Call, kwargs: dict) -> bool:
        """A model's first call on a batch cut by hand returned its loss: computed both ways (``_both_ways``), whether
        that loss is a mean or a sum over the rows of its batch, which a split keeps. Where it is not shown to be one
        (an in-batch contrastive loss computed inside the model), every call is computed whole on every process."""
        if not self.at_the_model.checks():
            return False
        keywords = kwargs if KEYWORDS_SEEN else call.keywords  # (this torch's global hooks are not given them)
        if keywords is None:  # (a torch whose module code reads otherwise: the call cannot be made again)
            self.at_the_model.computed_across_rows(module, "its call's keywords cannot be read on this torch")
            return True
        return not self._both_ways(module, call.whole_args, keywords)

    def _watch_its_data(self, module: nn.Module) -> None:
        """A watched call begins (``branches``); one that a call left open, which never reached its end, is closed
        first, and its mode leaves torch's stack."""
        from ddpkit.strategies.fsdp import is_fsdp2

        self._read_its_data(agreed=False)
        sharded = module in self.adoption.sharded
        self._reading = (module, ReadsItsData(block=is_fsdp2 if sharded else None).start())

    def _read_its_data(self, *, agreed: bool = True) -> None:
        """The end of a forward of a replica's first step (every process ends the same ones: one all-reduce agrees on
        what any of them saw, ``branches``). Where it read its tensors' values (a branch on its data), DDP looks for
        unused parameters from then on (``Replica.needs``). Where it computed a loss that its data decides whether to
        compute (inside ``if positive.any():``), which some processes' shares would compute and others' not, its
        calls are computed whole from then on, its loader's batches whole (``computed_across_rows``)."""
        if self._reading is None:
            return
        module, reading = self._reading
        self._reading = None
        read = reading.end()
        if not agreed:
            return
        if module in self.adoption.sharded:
            self._blocks_skipped(module, reading.block, reading.guarded)
            return
        replica = self.adoption.replicas[module]
        seen = torch.tensor([float(read), float(bool(reading.guarded))], device=replica.parameters[0].device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        read, guarded = (bool(value) for value in seen.tolist())
        replica.reads_its_data = replica.reads_its_data or read
        if guarded:
            self.at_the_model.computed_across_rows(
                module, f"{reading.guarded or 'a loss'} behind an `if`, a loop or a return on a tensor of its data",
                losses=False,
                what="computes a loss inside its forward that its data decides whether to compute, which some "
                     "processes' shares of a batch would compute and others' not")

    def _block_called(self, module: nn.Module) -> None:
        """A module called inside a sharded model's first call, watched (``_reading``): one of its sharded blocks,
        called inside a block of code that its data decides whether to run, is noted (``_blocks_skipped``)."""
        from ddpkit.strategies.fsdp import is_fsdp2

        reading = self._reading[1]
        if not reading.block and is_fsdp2(module) and reading.guards(sys._getframe(2)):
            reading.block = class_name(module)

    def _blocks_skipped(self, module: nn.Module, block: str, loss: str) -> None:
        """The end of a sharded model's first call: where it called, or may call, one of its sharded blocks only
        where its data says so (experts that a router reaches), a share of a later batch would skip that block on
        some processes and not on others, and FSDP's all-gather of its parameters would wait forever on those that
        call it; where it computes a loss that way (``_read_its_data``), the loss's all-reduce would: refused in one
        line, on every process alike (one all-reduce)."""
        skipped = torch.tensor([float(bool(block)), float(bool(loss))], device=next(module.parameters()).device)
        dist.all_reduce(skipped, op=dist.ReduceOp.MAX)
        blocked, counted = (bool(value) for value in skipped.tolist())
        if blocked:
            raise UsageError(f"--unchanged --shard: {class_name(module)} calls its block {block or 'of layers'} only "
                             "where its data says so (behind an `if`, a loop or a return on a tensor of its batch), "
                             "so that a share of a batch would skip it on some processes and not on others, and "
                             "FSDP's gather of that block's parameters would wait forever on the processes that call "
                             "it: run with --shard never (a whole model on each process, exact)",
                             said_elsewhere=self.rank != 0)
        if counted:
            raise UsageError(f"--unchanged --shard: {class_name(module)} computes a loss ({loss or 'of torch'}) only "
                             "where its data says so (behind an `if`, a loop or a return on a tensor of its batch), "
                             "so that a share of a batch would compute it on some processes and not on others, and "
                             "the all-reduce that makes its mean the batch's would wait forever on the processes "
                             "that compute it: run with --shard never (a whole model on each process, computed whole "
                             "there: exact)",
                             said_elsewhere=self.rank != 0)

    def _kept(self, module: nn.Module, output) -> None:
        """A first call on a batch cut by hand returned its loss, and ``output`` as the script gets it (DDP's forward
        ended): where the script's code keeps its other outputs and reads them again, at any step (``kept``), they
        are gathered on its shares from then on (``_gathered_by_hand``)."""
        if not any(isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and not is_a_loss(leaf)
                   for leaf in pytree.tree_leaves(output)):
            return
        kept = read_again(script_frame(sys._getframe(1)), output, is_a_loss)
        if kept is None:
            return
        self.at_the_model.outputs_read.add(module)
        if self.rank == 0:
            how = (f"keeps {class_name(module)}'s outputs beside its loss as `{kept}` and reads them"
                   if kept.isidentifier() else f"uses {class_name(module)}'s outputs beside its loss {kept}")
            logger.info(f"--unchanged: the loop {how}, on batches cut by hand: each call's are gathered into the "
                        "whole batch's, as on one device")

    def _gathered_by_hand(self, share, output):
        """The outputs of a call on this rank's share of a batch cut by hand, whose loss is valued whole already: the
        others with a row per sample gathered into the whole batch's (its logits, which the loop compares with the
        batch's labels), as DataParallel gathers them. The gradient of this rank's rows is its part of one device's:
        divided by its weight, which DDP multiplies back in; the loss's gradient is the share's already."""
        weight, rows = self.batch.current_weight(), len(share.indices)
        sizes = share_sizes(share.samples, world_size=self.world_size)

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() == 0 or tensor.size(0) != rows or is_a_loss(tensor):
                return tensor
            if tensor.requires_grad:
                tensor = ScaleGradient.apply(tensor, 1.0 / weight if weight else 0.0)
            return Gather.apply(tensor, sizes, self.rank)

        return pytree.tree_map_only(torch.Tensor, gather, output)

    def _learned(self, module: nn.Module, call: Call, kwargs: dict, output) -> None:
        """What a whole training call of ``module`` shows, on several processes: where no loader made its batch, at its
        first call, whether it returns its loss (split at its calls from then on) or not (computed whole); on a
        loader's whole batch, whether its calls can be cut (``AtTheModel.learn``) and what the loss it returns is."""
        if call.learning:
            if not returns_a_loss(output):
                self.at_the_model.computed_whole(module)
            elif self._whole_by_hand(module, call, kwargs):
                self.at_the_model.whole.add(module)  # (said: ``computed_across_rows``)
            else:
                self.at_the_model.with_loss.add(module)  # split at its calls from now on
                self._keeping = module  # (its outputs as the script gets them: ``after``)
        elif self.batch.loader_passes and self.batch.whole and not self.batch.coupled:
            if not self.at_the_model.checked(module) and returns_a_loss(output) and self.at_the_model.checks():
                if KEYWORDS_SEEN:
                    self._both_ways(module, call.whole_args, kwargs)
                else:  # (this torch's global hooks are not given the call's keywords: it cannot be made again)
                    self.at_the_model.computed_across_rows(module, "its call's keywords cannot be read on this torch")
            both_ways = None if self.batch.own_batches or not KEYWORDS_SEEN and kwargs else (
                lambda: self._both_ways(module, call.whole_args, kwargs, losses=False))
            self.at_the_model.learn(module, call.whole_args, kwargs, output, both_ways)

    def _both_ways(self, module: nn.Module, args: tuple, kwargs: dict, *, losses: bool = True) -> bool:
        """``at_the_model.check_both_ways``, its calls of the model left alone by these hooks (they are not the
        script's: ``depth``)."""
        self.depth += 1
        try:
            return self.at_the_model.check_both_ways(module, args, kwargs, sharded=module in self.adoption.sharded,
                                                     losses=losses)
        finally:
            self.depth -= 1

    def holds_a_share(self) -> bool:
        """Whether a model's call is open that computes only this rank's rows of its batch, the other ranks the rest
        (cut at the model, divided in an evaluation, or on a share that its loader split): the code inside it finds
        the process group (``own_group``), as a model's code under DDP does."""
        if self.at_the_model.on_a_share:
            return True  # (a loss computed both ways: its share's call finds what a cut call finds)
        call = self._calls[-1] if self._calls else None
        return call is not None and (call.share is not None or call.of_a_split_batch)

    def sharded_weight(self) -> float:
        """What the gradient of a sharded model's call is multiplied by, inside it: FSDP averages the ranks'
        gradients (the sum over N), so each rank's counts its batch's weight times N. (A replica's weight is applied
        as DDP reduces its gradients: ``in_place.weighted_all_reduce``; FSDP has no such hook on every torch.) The
        gradient leaving the call through its inputs is divided by it again (``before``)."""
        return self.world_size * self.batch.current_weight()


def independent_outputs(output) -> int:
    """How many of ``output``'s tensors that require grad are computed from none of the others (one walk of each
    one's autograd graph, once per model): transformers' loss, computed from the logits returned with it, is not."""
    tensors = [leaf for leaf in pytree.tree_leaves(output)
               if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None]
    if len(tensors) < 2:
        return len(tensors)
    nodes = {tensor.grad_fn for tensor in tensors}
    under: set = set()  # the outputs' nodes that another output's graph reaches
    for tensor in tensors:
        seen, stack = {tensor.grad_fn}, [tensor.grad_fn]
        while stack:
            for following, _ in stack.pop().next_functions:
                if following is not None and following not in seen:
                    seen.add(following)
                    stack.append(following)
                    if following in nodes:
                        under.add(following)
    return len(nodes - under)


def held_tensors(module: nn.Module) -> dict[tuple[int, str], tuple[set[int], object]]:
    """The tensors that ``module``'s layers hold as attributes of their own (not parameters nor buffers), each
    attribute's (in a list, tuple or dict too) by id, with a copy of each list's and dict's items: read before a
    model's first training call (``kept_on_itself``, ``put_back``)."""
    return {(id(layer), name): ({id(leaf) for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)},
                                (value, copy.copy(value)) if isinstance(value, (list, dict)) else None)
            for layer in module.modules() for name, value in vars(layer).items()
            if name not in _torch_own() and isinstance(value, (torch.Tensor, list, tuple, dict))}


@functools.cache
def _torch_own() -> frozenset[str]:
    """The attributes that torch's ``Module`` keeps on every module (its parameters', buffers', layers' and hooks'
    dictionaries): not the model's own."""
    return frozenset(vars(nn.Module())) | {"__getstate__"}


def put_back(before: dict[tuple[int, str], tuple[set[int], object]]) -> None:
    """Each list and dict that a layer held before a model's first call, with the items it held then: that call,
    tried on a share, is made again whole (an auxiliary loss appended to a list is then appended once, the whole
    batch's)."""
    for _, kept in before.values():
        if kept is not None:
            held, items = kept
            if isinstance(held, list):
                held[:] = items
            else:
                held.clear()
                held.update(items)


def kept_on_itself(module: nn.Module, before: dict, rows: int | None) -> str | None:
    """Where a model's training call on ``rows`` rows left on one of its layers a tensor that it computed from its
    batch (``self.hidden = ...``, an auxiliary loss kept for the loop to add, as mixture-of-experts layers keep
    theirs), which one, said as the run says it; else None. The script may read it outside the call: cut at the
    model, it would be a share's. Told from the tensor: made in this call, with a gradient to come, and a row per
    sample or a single value (a weight recomputed from the parameters at each call, as the older ``weight_norm``
    keeps it, is neither: it splits)."""
    for name, layer in module.named_modules():
        for attribute, value in vars(layer).items():
            if attribute in _torch_own() or not isinstance(value, (torch.Tensor, list, tuple, dict)):
                continue
            held = before.get((id(layer), attribute), (set(),))[0]
            if any(isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None and id(leaf) not in held
                   and (leaf.numel() == 1 or (leaf.dim() > 0 and leaf.size(0) == rows))
                   for leaf in pytree.tree_leaves(value)):
                return f"self.{name}.{attribute}" if name else f"self.{attribute}"
    return None


def _versions(module: nn.Module) -> list[tuple[nn.Parameter, int]]:
    """``module``'s parameters, each with its version counter, which each write in place raises (``_left_behind``:
    an ``nn.Embedding`` with ``max_norm`` renormalises its weight's rows in its forward)."""
    return [(parameter, parameter._version) for parameter in module.parameters()]


def own_buffers(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``module``'s buffers but BatchNorm's (which are kept over the whole batch: ``sync_bn``), each with a copy of
    its value, to tell whether a training call writes them."""
    norms = {id(buffer) for part in module.modules() if isinstance(part, nn.modules.batchnorm._BatchNorm)
             for buffer in part.buffers()}
    return [(buffer, buffer.detach().clone()) for buffer in module.buffers() if id(buffer) not in norms]


def _scaled_gradients(tree, scale: float, but=()):
    """``tree``'s tensors that require grad (but those in ``but``), their gradient multiplied by ``scale`` in
    backward."""
    if scale == 1.0:
        return tree
    return pytree.tree_map_only(torch.Tensor, lambda t: ScaleGradient.apply(t, scale) if t.requires_grad and not any(
        t is other for other in but) else t, tree)


def _functional(parameters: list[torch.Tensor]) -> bool:
    """Whether a module whose ``parameters`` these are now is called under a transform of torch.func (``vmap``,
    ``grad``: per-sample gradients) or with tensors of the script's own in place of its parameters
    (``torch.func.functional_call``). Such a call is left as it is: the script takes its gradients itself, and sets
    them (``p.grad = ...``) where DDP's reducer would never see them; with no training call of a model seen, its
    loader's batches stay whole on every process, which computes each step as one device does. (A model found
    already, ``functional_call`` alone, is read as a call of its own: ``Models._left_to_the_script``.)"""
    return (torch._C._functorch.peek_interpreter_stack() is not None
            or any(not isinstance(parameter, nn.Parameter) for parameter in parameters))


class _Reached(torch.autograd.Function):
    """The identity over the output tensors of one call of a replica's, whose backward counts the backward passes that
    reach them (``_reached_once``)."""

    @staticmethod
    def forward(ctx, state: dict, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        ctx.set_materialize_grads(False)
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        state = ctx.state
        if not state["taking"]():  # (a gradient the script takes, ``torch.autograd.grad``, accumulates nothing)
            if state["reached"]:
                raise UsageError(AGAIN.format(name=state["name"]), said_elsewhere=state["rank"] != 0)
            state["reached"] = True
        return (None, *grads)


AGAIN = ("--unchanged: the outputs of one call of {name} were differentiated by a second backward pass before its next "
         "call (backward(retain_graph=True), then another), which DDP cannot average: each call's gradients are "
         "averaged in one backward pass. Add the losses and call backward once (the same gradients, one device's)")


def _reached_once(output, name: str, rank: int, taking: Callable[[], bool]):
    """``output``, its tensors that require a gradient through ``_Reached``, on the reducer's first step (its probe,
    the first step of every DDP built): a second backward pass through one call, whose gradients DDP would leave this
    process's (its static graph's first step reduces the first backward pass's alone, and the steps after it
    fail, "marked as ready twice"), is refused in one line, on every process alike, before the first optimizer
    step. ``taking``: whether a gradient that the script takes goes on."""
    leaves, spec = pytree.tree_flatten(output)
    at = [index for index, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    if not at:
        return output
    state = {"name": name, "rank": rank, "taking": taking, "reached": False}
    for index, tensor in zip(at, _Reached.apply(state, *(leaves[index] for index in at))):
        leaves[index] = tensor
    return pytree.tree_unflatten(leaves, spec)


class _Once(torch.autograd.Function):
    """The identity, whose backward refuses to be differentiated again (``_differentiated_once``)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, name: str, rank: int) -> torch.Tensor:
        ctx.name, ctx.rank = name, rank
        ctx.set_materialize_grads(False)
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None]:
        if torch.is_grad_enabled():  # (a backward with create_graph=True: its graph is being made, to differentiate)
            raise UsageError(TWICE.format(name=ctx.name), said_elsewhere=ctx.rank != 0)  # (every rank meets it)
        return grad, None, None


TWICE = ("--unchanged --shard: the gradient with respect to {name}'s inputs is taken with create_graph=True (a "
         "gradient penalty), and FSDP cannot differentiate twice through a sharded model: its second backward would "
         "not be one device's. Run without --shard (every process then holds the model whole, and trains it exactly)")


def _differentiated_once(args: tuple, module: nn.Module, rank: int) -> tuple:
    """A sharded model's inputs that require grad (its arguments, as its call gets them), each through ``_Once``: a
    gradient taken with respect to them to be differentiated again (WGAN-GP's penalty: ``torch.autograd.grad`` with
    ``create_graph=True``) is refused in one line, on every process alike, before the step that would train on it."""
    return pytree.tree_map_only(torch.Tensor, lambda tensor: _Once.apply(tensor, class_name(module), rank)
                                if tensor.requires_grad else tensor, args)


def _moves_seen(models: Models) -> Callable[[], None]:
    """``nn.Module.to`` and ``nn.Module.cuda`` replaced (PyTorch has no hook for a module's move; ``--shard`` only):
    a move to a GPU that the script's own code makes, outside any forward, goes through ``Adoption.move`` first,
    which shards a model on the way where ``--shard`` says so; every other call is the original's, untouched (a
    library's moves of its own modules included). Returns what puts the originals back."""
    original_to, original_cuda = nn.Module.to, nn.Module.cuda

    @functools.wraps(original_to)
    def to(module, *args, **kwargs):
        if models.depth == 0 and not models.off and _by_the_script(sys._getframe(1)):
            try:
                device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
            except (TypeError, RuntimeError):  # (the original says what is wrong with the arguments)
                device = dtype = None
            if device is not None and device.type == "cuda":
                device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
                if dtype is not None:
                    original_to(module, dtype)  # (its dtype first, on the CPU: on the device it arrives sharded)
                if models.adoption.move(module, device):
                    return module
        return original_to(module, *args, **kwargs)

    @functools.wraps(original_cuda)
    def cuda(module, device=None):
        if models.depth == 0 and not models.off and torch.cuda.is_available() and _by_the_script(sys._getframe(1)):
            index = device if isinstance(device, int) else None if device is None else torch.device(device).index
            if models.adoption.move(module, torch.device("cuda", torch.cuda.current_device() if index is None
                                                         else index)):
                return module
        return original_cuda(module, device)

    nn.Module.to, nn.Module.cuda = to, cuda

    def undo() -> None:
        nn.Module.to, nn.Module.cuda = original_to, original_cuda

    return undo


HOOKS = {"_forward_pre_hooks": "a forward pre-hook", "_forward_hooks": "a forward hook",
         "_backward_pre_hooks": "a backward pre-hook", "_backward_hooks": "a backward hook"}


def _hooks_of_the_script(module: nn.Module) -> str | None:
    """Where ``module`` or one of its layers holds a hook of the script's own code (a function written in the
    script, not in a library, torch or ddpkit: ``register_forward_hook`` to read an activation, as a feature penalty,
    distillation or Grad-CAM does), which of them, said as the run says it; else None. Read at a model's first
    training call: a call cut at the model would give such a hook a share of its batch's rows."""
    for name, layer in module.named_modules():
        for kind, said in HOOKS.items():
            for hook in getattr(layer, kind, {}).values():
                function = inspect.unwrap(getattr(hook, "func", hook))  # (a functools.partial's function)
                function = getattr(function, "__func__", function)  # (a bound method's)
                code = getattr(function, "__code__", None) or getattr(type(function).__call__, "__code__", None)
                if code is not None and _written_by_the_script(code.co_filename):
                    return f"{said} on {f'its layer {name}, a' if name else 'it, a'} {class_name(layer)}"
    return None


def _by_the_script(frame) -> bool:
    """Whether ``frame`` runs the script's own code: not Python's installation, nor a library installed in it."""
    return _written_by_the_script(frame.f_code.co_filename)


def _written_by_the_script(path: str) -> bool:
    """Whether code of the file ``path`` is the script's own: not Python's installation, nor a library installed in
    it, nor ddpkit, nor code made from a string."""
    return not path.startswith("<") and not path.startswith(_installed())


@functools.cache
def _installed() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    folders = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths}
    folders.update(site.getsitepackages() + [site.getusersitepackages()])
    folders.add(os.path.dirname(os.path.dirname(__file__)))  # ddpkit's own moves (wherever it is installed)
    return tuple(os.path.join(os.path.abspath(folder), "") for folder in folders if folder)


def _compiled(module: nn.Module) -> bool:
    """A module that torch.compile compiles, or holds one that it compiles (``torch.compile(model)``,
    ``model.compile()``): no mode is entered around its forward, which would be compiled again without it."""
    return any(type(layer).__name__ == "OptimizedModule" or layer.__dict__.get("_compiled_call_impl") is not None
               for layer in module.modules())
