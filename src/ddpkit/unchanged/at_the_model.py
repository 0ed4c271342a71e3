"""Batches cut where they enter a model, and the losses models return (``ddpkit run --unchanged``).

Where no DataLoader splits the batches (the script cuts them by hand: nanoGPT's ``get_batch``), a model that returned
its loss at its first call gets this rank's share of each batch from then on, as DataParallel scatters one: each
positional tensor argument cut along its first dimension (``split``), the loss it returns valued as the whole batch's
(``whole_batch_losses``: its gradient stays the share's). One that returned no loss is computed whole on every rank
(``computed_whole``). A count of items given to a model's call (``num_items_in_batch``) is made the whole batch's, and
the loss the model returns a part of the batch's sum (``items_of_the_batch``).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules import module as module_code
from torch.utils import _pytree as pytree

from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger
from ddpkit.data.split_batches import Share, rows_of_share, share_of
from ddpkit.unchanged.adoption import class_name
from ddpkit.unchanged.batches import Batch
from ddpkit.unchanged.divided import Call, rows_of
from ddpkit.unchanged.gathered import Gather, ScaleGradient, batch_shaped, map_tensors

NOT_SPLIT = ("--unchanged: this model's batches come from no DataLoader; it returned its loss at its first call, so "
             "they are split where they enter it, but it returns none now, and a loss computed outside it would meet "
             "targets that were not split: return the loss from every call, or give the script a DataLoader over a "
             "map-style data set, or run it without --unchanged")
NO_ROWS = ("--unchanged: this model's batches come from no DataLoader and it returned its loss at its first call, so "
           "they are split where they enter it, but this call gives it no tensor with a row per sample to split: "
           "give it its batch as tensors, or give the script a DataLoader over a map-style data set, or run it "
           "without --unchanged")
# A model first called on a DataLoader's batches, then trained on a batch that no pass handed out and that differs
# across the ranks (a loader's share that could not be followed to the model): there is no one device's batch to cut.
NOT_FOLLOWED = ("--unchanged: this model was first called on a DataLoader's batches, and now trains on a batch that "
                "no DataLoader's pass handed out and that differs across the processes (a batch of a loader that "
                "ddpkit could not follow to the model): give it its batches from the DataLoader, or from one wrapper "
                "that fetches them ahead, or run it without --unchanged")


class AtTheModel:
    """What a model's call does with its batch and its losses where the batch is cut at the model (see the module);
    ``current_call()`` is the root call going on."""

    def __init__(self, *, rank: int, world_size: int, batch: Batch, current_call: Callable[[], Call | None]):
        self.rank = rank
        self.world_size = world_size
        self.batch = batch
        self.current_call = current_call
        self.whole: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models computed whole on every rank
        # Whether a model's calls on a loader's whole batch can be cut at the model, its outputs gathered (``learn``).
        self.cut_whole: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
        self._kept: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()  # a tried call's buffers
        # Models whose first call, on batches no loader split, returned their loss: split at their calls from then on.
        self.with_loss: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # Those whose other outputs (logits) the script read at that first step: gathered on its shares from then on.
        self.outputs_read: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # Models whose training call wrote buffers of their own (not BatchNorm's): computed whole on a whole batch.
        self.writes_buffers: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()  # what it writes
        # Models whose first call on a loader's whole batch returned a loss, computed both ways (``check_both_ways``):
        # those whose loss is a mean or a sum over rows, with the layout of their outputs and the places of their
        # losses in it (cut on a whole batch, as ``learn`` says), and those whose loss is computed across the rows of
        # its batch, or could not be shown not to be (computed whole on a whole batch, as ``writes_buffers``).
        self.losses_kept: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()
        self.on_a_share = False  # a loss computed both ways, on this rank's share: the group is found (``own_group``)
        # (Each with what it does: computes across its rows, or is given too few of them to be cut.)
        self.couples_rows: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.rows_kept: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # computed both ways, and found row by row

    def split(self, args: tuple) -> tuple[tuple, Share | None]:
        """This rank's share of the batch in ``args``: each tensor argument cut along its first dimension. (With a
        loss that couples the batch, each rank's gradient then weighs 1, or 0 for a stand-in: ``gathered``.) None
        where no positional argument is a tensor (``model(idx=x, targets=y)``): the call's keywords show its rows
        (``split_keywords``), and they are cut alike where there are positional ones (``keywords_and_items``)."""
        sizes = {arg.shape[0] for arg in args if isinstance(arg, torch.Tensor) and arg.dim() > 0}
        if not sizes:
            return args, None
        share = self._share_of_rows(sizes)
        return rows_of_share(args, share), share

    def split_keywords(self, kwargs: dict) -> Share:
        """This rank's share of a batch that no DataLoader split, given to a model's call by keyword alone: its first
        tensor's rows (as a positional call's first argument is its batch), which every keyword tensor with as many
        rows shares (``keywords_and_items``); another (a class weight, positions of shape (1, T)) is given whole."""
        first = next((value for value in kwargs.values() if isinstance(value, torch.Tensor) and value.dim() > 0), None)
        return self._share_of_rows(set() if first is None else {first.shape[0]})

    def _share_of_rows(self, sizes: set[int]) -> Share:
        if len(sizes) != 1:
            raise UsageError(NO_ROWS if not sizes else
                             f"--unchanged: the model's tensor arguments do not share a batch size (first dimensions "
                             f"{sorted(sizes)}), so they cannot be split across the processes: give the script a "
                             "DataLoader, or run it without --unchanged", said_elsewhere=self.rank != 0)
        share = share_of(range(sizes.pop()), self.rank, self.world_size)
        self.batch.set(float(share.weight > 0) if self.batch.coupled else share.weight, samples=share.samples)
        return share

    def computed_whole(self, module: nn.Module) -> None:
        """``module``'s inputs come from no split DataLoader and its first call returned no loss (the script computes
        it outside, from targets that were not split): every rank computes each of its calls whole, from the shared
        streams, as one device would. Exact, and no faster: said once."""
        self.whole.add(module)
        if self.rank == 0:
            logger.warning(f"--unchanged: {class_name(module)} gets inputs that no DataLoader split (a batch cut by "
                           "hand, a whole graph or data set) and its loss is computed outside it: every process "
                           "computes each of its steps whole, as one device does (exact, and no faster). A DataLoader "
                           "over a map-style data set would split its batches")

    def whole_batch_losses(self, output, *, summed: bool | None = None, scale: float = 1.0, required: bool = True,
                           at: list[int] | None = None):
        """``output`` of a model that got this rank's share of a batch, its losses (tensors of one element that
        require grad; ``at``: its leaves at these places, as every rank has them) valued as the whole batch's: what
        the script prints is then one process's number. Their gradient stays this rank's own (times ``scale``).
        ``summed``: each rank's loss is a part of a sum (else the batch's reduction says). A loss valued whole already
        (``counted``) is left as it is. ``required``: a model that returns no loss is refused (its loss would meet
        targets that were not split)."""
        leaves, spec = pytree.tree_flatten(output)
        if required and not any(is_a_loss(leaf, self.batch.fewest_rows) for leaf in leaves):
            raise UsageError(NOT_SPLIT, said_elsewhere=self.rank != 0)  # every rank meets it: rank 0 says it
        # (At given places, every one of them is all-reduced, as many on every rank; one valued whole is kept.)
        losses = [index for index, leaf in enumerate(leaves) if is_a_loss(leaf, self.batch.fewest_rows)] \
            if at is None else list(at)
        whole = {index for index in losses if scale == 1.0 and self.batch.is_valued_whole(leaves[index])}
        if at is None:
            losses = [index for index in losses if index not in whole]
        if not losses:
            return output
        weight = 1.0 if (self.batch.summed if summed is None else summed) else self.batch.weight
        values = torch.stack([leaves[index].detach().reshape(()).to(torch.float64) * weight for index in losses])
        dist.all_reduce(values)
        for index, value in zip(losses, values):
            if index in whole:
                continue
            leaf = leaves[index] if scale == 1.0 else ScaleGradient.apply(leaves[index], scale)
            leaves[index] = leaf + (value.to(leaf.dtype).reshape(leaf.shape) - leaf).detach()
        return pytree.tree_unflatten(leaves, spec)

    def items_of_the_batch(self, module: nn.Module, args: tuple, kwargs: dict):
        """A model's pre-hook: a split batch's count of items given to its call (``num_items_in_batch``, as
        transformers' models take it), counted by the script from its share, becomes the whole batch's (summed over
        the ranks), so that the loss it returns is its share's part of one device's sum (``after``)."""
        items = kwargs.get("num_items_in_batch")
        call = self.current_call()
        if (items is None or call is None or call.module is not module or call.evaluating or self.batch.whole
                or self.batch.coupled or self.batch.summed):
            return None
        if call.gathered:  # (a whole batch cut at the model: the script counted the whole batch's items already)
            call.items_counted = True
            return None
        device = items.device if isinstance(items, torch.Tensor) else next(module.parameters()).device
        total = torch.as_tensor(items, dtype=torch.float64, device=device) * float(self.batch.current_weight() > 0)
        dist.all_reduce(total)
        call.items_counted = True
        items = total.to(items.dtype) if isinstance(items, torch.Tensor) else type(items)(total.item())
        return args, {**kwargs, "num_items_in_batch": items}

    def writes_buffers_in_training(self, module: nn.Module,
                                   what: str = "buffers of its own in training (not BatchNorm's statistics)") -> None:
        """``module``'s first training call changed buffers of its own (a running mean of its inputs, an EMA
        codebook, a normaliser's statistics), or wrote its parameters in place outside autograd (``what``: an
        ``nn.Embedding`` with ``max_norm`` renormalises the rows that its batch looks up), which a share would change
        otherwise than the whole batch: its calls on a loader's batches are computed whole on every process from then
        on, its loader's batches whole (the gathered way: ``step_rule``), so that its buffers and parameters are one
        device's. Said once."""
        if module in self.writes_buffers:
            return
        self.writes_buffers[module] = what
        if self.rank == 0 and self.world_size > 1:
            logger.warning(f"--unchanged: {class_name(module)} writes {what}: every process computes its calls on "
                           "the whole batch, so that they are one device's (exact, and no faster for that model)")

    def checks(self) -> bool:
        """Whether a loss that a model returns is computed both ways here: not where the script's loss is a sum
        (``--loss-reduction sum``: a model that returns one is computed whole) or couples the batch, nor where each
        rank's batch is its own (a stream that splits itself: there is no whole batch)."""
        return not (self.batch.summed or self.batch.coupled or self.batch.own_batches)

    def check_both_ways(self, module: nn.Module, args: tuple, given: dict, *, sharded: bool = False,
                        losses: bool = True) -> bool:
        """A model's first training call on a loader's whole batch (``args`` and keywords ``given``), computed both
        ways: whether what it computes is row by row, which its code shows nowhere that the step's watch sees
        (``step_rule`` follows the script's code, not the model's). ``losses``: it returned a loss, which must be a
        mean or a sum over its rows (counted or not), not one computed across them (an in-batch contrastive loss, a
        load-balancing term); and every output with a row per sample must be the share's rows of the whole batch's,
        not computed across them (batch statistics written by hand, in-batch similarities, a minibatch's spread).
        Computed as the whole batch, then as this rank's share, its losses made the batch's as the split way makes them
        (``counted``, ``whole_batch_losses``), in evaluation (no dropout; BatchNorm by its running statistics),
        gradients off, from the same random state, every buffer and mode put back. The losses are the whole batch's
        outputs of one element (the batch has a row per process at least), found there and read at the same places
        of the share's. Where the two differ on any rank, or cannot be computed: ``couples_rows``, said once, and
        False; where they agree: True (``losses_kept``, with the places kept: ``losses_in``; ``rows_kept``). The whole
        batch's call raising (the model's own error: its real call meets it again) is decided together; the share's
        raising ends the run with the model's error (another rank would wait in a collective), and so does any raising
        in a sharded model's calls (FSDP's own collectives)."""
        rows = rows_of((*args, *given.values()))
        whole = None
        if rows is not None and rows >= self.world_size:
            try:
                whole = self._in_evaluation(module, args, given, None)
            except Exception as error:  # noqa: BLE001 - the model's own, in a call the script did not make
                if sharded:
                    raise
                logger.debug(f"--unchanged: {class_name(module)}'s outputs on the whole batch: {error!r}")
        places = [] if whole is None or not losses else [index for index, leaf in enumerate(whole[0])
                                                           if _one_value(leaf)]
        found = torch.tensor([float(whole is not None and (bool(places) or not losses))], device=device_of(module))
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
        if found.item() == 0:  # (no loss in evaluation, or outputs that could not be computed, on some rank)
            if rows is not None and rows < self.world_size:  # (the same on every rank: its whole batch)
                self.computed_across_rows(module, f"{rows} of them, {self.world_size} processes", losses=losses,
                                          what="is given fewer rows than there are processes")
            else:
                self.computed_across_rows(module, f"its {'losses' if losses else 'outputs'} could not be computed "
                                                  "both ways", losses=losses)
            return False
        summed = given.get("num_items_in_batch") is not None  # (each share's loss a part of the batch's sum)
        share = share_of(range(rows), self.rank, self.world_size)
        part, spec = self._in_evaluation(module, args, given, share, summed=summed, at=places)
        agreed = spec == whole[1] and all(_close(whole[0][index], part[index]) for index in places)
        rows_apart = agreed and not _rows_agree(whole[0], part, share, rows)
        if rows_apart:
            # (A model that draws at random in evaluation too, a VAE's noise: its rows' draws are each process's own, as
            # dropout's are; whether it also computes across its rows cannot be told. A loss is compared as it is.)
            agreed = not losses and self._draws_at_random(module, args, given, whole[0])
        decided = torch.tensor([float(agreed), float(rows_apart)], device=device_of(module))
        dist.all_reduce(decided, op=dist.ReduceOp.MIN)
        if decided[0].item() == 1:
            if losses:
                self.losses_kept[module] = (whole[1], places)
            self.rows_kept.add(module)
            return True
        self.computed_across_rows(module, "its outputs on a share of the batch are not the share's rows of its outputs "
                                          "on the whole batch" if decided[1].item() == 1 or not losses else
                                          "its loss on a share of the batch, made the batch's, is not its loss on the "
                                          "whole batch", losses=losses)
        return False

    def checked(self, module: nn.Module) -> bool:
        """Whether ``module``'s first call was computed both ways (``check_both_ways``), whatever it showed."""
        return module in self.rows_kept or module in self.couples_rows

    def losses_in(self, module: nn.Module, output) -> list[int]:
        """The places of the losses in ``output`` of a model whose losses a split keeps (``check_both_ways``), where its
        outputs are laid out as they were then (the same on every rank); none otherwise."""
        kept = self.losses_kept.get(module)
        return kept[1] if kept is not None and pytree.tree_flatten(output)[1] == kept[0] else []

    def _draws_at_random(self, module: nn.Module, args: tuple, given: dict, whole: list) -> bool:
        """Whether ``module``'s outputs on the whole batch in evaluation (``whole``) come out otherwise from another
        random state (computed again as ``_in_evaluation`` computes them, its generators seeded anew in the fork)."""
        again = self._in_evaluation(module, args, given, None, reseeded=True)[0]
        return any(isinstance(leaf, torch.Tensor) and not torch.equal(leaf, other) for leaf, other in zip(whole, again))

    def _in_evaluation(self, module: nn.Module, args: tuple, given: dict, share: Share | None, *, summed: bool = False,
                       at: list[int] | None = None, reseeded: bool = False) -> tuple[list, object]:
        """``module``'s outputs (their leaves, and their layout) on the batch, or on this rank's ``share`` of it with
        the losses at the places ``at`` made the batch's (``summed``: each a part of the batch's sum), in evaluation,
        gradients off, its random state, buffers and modes put back after, and the batch's state. ``reseeded``: from
        another random state than the one going on (its generators seeded inside the fork)."""
        modes = [(part, part.training) for part in module.modules()]
        kept = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
        # BatchNorm keeping no running statistics normalises by its batch's in evaluation too; in training ddpkit
        # computes it over all the processes' rows (``strategies.sync_bn``). So here it normalises by fixed ones,
        # as one that keeps them does: what its statistics do is not what this compares.
        free = [part for part in module.modules() if isinstance(part, nn.modules.batchnorm._BatchNorm)
                and part.running_mean is None]
        try:
            with set_aside(module, self.batch), _fixed_statistics(free, device_of(module)):
                if reseeded:
                    seed = torch.randint(2**62, ()).item() + 1  # (not the state going on: a draw from it, moved on)
                    torch.default_generator.manual_seed(seed)
                    if device_of(module).type == "cuda":
                        torch.cuda.manual_seed(seed)  # (the current device's: the one the fork puts back)
                module.train(False)
                if share is None:
                    output = module(*args, **given)
                else:
                    self.batch.set(share.weight, samples=share.samples)
                    self.batch.checking = self.on_a_share = True  # (``counted`` counts; the group is found)
                    names = [name for name, value in given.items() if isinstance(value, torch.Tensor) and value.dim()]
                    cut = dict(zip(names, rows_of_share(tuple(given[name] for name in names), share)))
                    output = module(*rows_of_share(args, share), **{**given, **cut})
                    self.batch.checking = self.on_a_share = False
                    output = self._at_places(output, at, summed)
                leaves, spec = pytree.tree_flatten(output)
                return [leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec
        finally:
            self.batch.checking = self.on_a_share = False
            for part, training in modes:
                part.training = training
            for buffer, value in kept:
                if not torch.equal(buffer, value):
                    # (Through ``.data``, whose version is its own: a buffer that the script's call, before these,
                    # saved for its backward, BatchNorm's running statistics among them, is saved as it was.)
                    buffer.data.copy_(value)

    def _at_places(self, output, at: list[int], summed: bool):
        """``whole_batch_losses`` at the places ``at``: one all-reduce of as many values on every rank. Where this
        rank's outputs hold no one-element tensor at one of them (a layout that differs with the share), its values
        count 0 and its outputs stay as they are: ``check_both_ways`` then finds the layouts apart."""
        leaves = pytree.tree_leaves(output)
        if all(index < len(leaves) and _one_value(leaves[index]) for index in at):
            return self.whole_batch_losses(output, summed=summed or None, required=False, at=at)
        device = next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
        dist.all_reduce(torch.zeros(len(at), dtype=torch.float64, device=device))
        return output

    def computed_across_rows(self, module: nn.Module, why: str, *, losses: bool = True, what: str | None = None
                             ) -> None:
        """``module`` computes across the rows of its batch (``why``): the loss it returns (``losses``), or its
        outputs; or ``what`` it does instead (a call given fewer rows than processes, which cannot be cut). Its calls
        on a loader's batches are computed whole on every process from then on, its loader's batches whole (the
        gathered way), so that what it computes is one device's. Said once."""
        if module in self.couples_rows:
            return
        self.couples_rows[module] = what or "computes across the rows of its batch"
        if self.rank == 0:
            what = what or ("returns a loss that is not shown to be a mean or a sum over the rows of its batch"
                            if losses else "computes across the rows of its batch")
            logger.warning(f"--unchanged: {class_name(module)} {what} ({why}): every process computes its calls on "
                           "the whole batch, so that it computes as one device does (exact, and no faster for that "
                           "model)")

    def is_whole(self, module: nn.Module) -> bool:
        return module in self.whole

    def learn(self, module: nn.Module, args: tuple, kwargs: dict, output,
              both_ways: Callable[[], bool] | None = None) -> None:
        """A training call of ``module`` on a loader's whole batch, computed whole: whether its later calls on such
        batches can be cut at the model (``split_whole``). They can where its tensor arguments are positional and
        share their first dimension, and its outputs are one row per sample (a tensor, or a tuple, list, dict or
        dataclass of them), and losses a split keeps beside them (``check_both_ways``), and where what it computes
        is row by row: ``both_ways()`` (``check_both_ways``, where not computed so yet). The rows are then gathered,
        the losses made the batch's. Decided at its first such call, together (one all-reduce)."""
        if module in self.cut_whole:
            return
        rows = rows_of((*args, *kwargs.values()))
        cut = torch.tensor([float(rows is not None and self._gatherable(module, output, rows)
                                  and module not in self.writes_buffers and module not in self.couples_rows)],
                           device=device_of(module))
        dist.all_reduce(cut, op=dist.ReduceOp.MIN)
        self.cut_whole[module] = bool(cut.item()) and (both_ways is None or self.checked(module) or both_ways())
        if not self.cut_whole[module]:
            self._said_whole(module)

    def _gatherable(self, module: nn.Module, output, rows: int) -> bool:
        """Whether ``output`` can be gathered: one row per sample, but for the losses of a model whose losses were
        computed both ways and found to be means or sums over rows (``losses_kept``), which are made the batch's."""
        if batch_shaped(output, rows):
            return True
        return module in self.losses_kept and batch_shaped(map_tensors(output, lambda leaf: None if is_a_loss(leaf)
                                                                       else leaf), rows)

    def _said_whole(self, module: nn.Module) -> None:
        """A model whose calls cannot be cut: said once where it trains on a stream (a map-style loader's batches are
        split by the loader, but for a pass's first ones)."""
        if self.batch.stream and self.rank == 0:
            logger.warning(f"--unchanged: {class_name(module)} trains on a stream's batches, which every process "
                           "reads whole, and its calls cannot be cut (tensors given by keyword, or outputs that are "
                           "not one row per sample): every process computes each of its steps whole, exact and no "
                           "faster than one device")

    def split_first(self, module: nn.Module, args: tuple) -> tuple[tuple, Share] | None:
        """``split_whole`` for a model's first training call on a loader's whole batch, whose outputs have not shown
        yet that they can be gathered: cut where its call gives no tensor by keyword (read from torch's frame that
        calls the hooks: none, where it cannot be read). Its buffers are kept, so that ``cut_as_tried`` can undo the
        call if its outputs turn out not to be one row per sample."""
        cut = self._cut(module, args, keywords=False)
        if cut is not None:
            self._kept[module] = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
        return cut

    def cut_as_tried(self, module: nn.Module, rows: int, output, both_ways: Callable[[], bool]) -> bool:
        """Whether a tried first call's ``output`` (``split_first``) can be gathered: one row per sample on every
        rank, and rows computed row by row (``both_ways()``: ``check_both_ways``, in evaluation). The model's calls are
        cut from then on. If not, what the call changed is undone (its buffers, BatchNorm's running statistics, as they
        were; the batch whole again) and the model is computed whole, as before; where it returned a loss on every
        rank, its losses are computed both ways first (``check_both_ways``, which the caller runs where this leaves
        the model undecided), and its call made again, whole, decides (``learn``)."""
        decided = torch.tensor([float(batch_shaped(output, rows) and module not in self.writes_buffers
                                      and module not in self.couples_rows),
                                float(returns_a_loss(output) and self.checks())], device=device_of(module))
        dist.all_reduce(decided, op=dist.ReduceOp.MIN)  # (a loss on every rank: a share of one row shows none apart)
        kept = self._kept.pop(module)
        self.cut_whole[module] = bool(decided[0].item()) and (self.checked(module) or both_ways())
        if not self.cut_whole[module]:
            with torch.no_grad():
                for buffer, value in kept:
                    buffer.copy_(value)
            self.batch.set_whole()
            if decided[1].item() and not self.checked(module):  # (decided by its call made again, whole, once its
                del self.cut_whole[module]  # losses are computed both ways)
            else:
                self._said_whole(module)
        return module in self.cut_whole and self.cut_whole[module]

    def split_whole(self, module: nn.Module, args: tuple) -> tuple[tuple, Share] | None:
        """This rank's share of a loader's whole batch in ``args``, for a model that showed it can be cut (``learn``),
        the batch weighed as split from here on; None: computed whole (a batch smaller than the world, each rank's
        batch its own)."""
        return self._cut(module, args) if self.cut_whole.get(module) else None

    def _cut(self, module: nn.Module, args: tuple, *, keywords: bool = True) -> tuple[tuple, Share] | None:
        """The call's positional tensors cut here; its keyword tensors (``model(**batch)``) by the model's own
        pre-hook (``keywords_and_items``), which PyTorch gives the keywords that a global pre-hook does not get.
        ``keywords``: whether that pre-hook is on the model for this call (not at its first: PyTorch reads a call's
        hooks before the global pre-hooks adopt the model; a first call by keyword is whole, and ``learn``s)."""
        given = call_keywords(module)
        if given is None or self.batch.own_batches or not keywords and any(
                isinstance(value, torch.Tensor) for value in given.values()):
            return None
        rows = rows_of((*args, *given.values()))
        if rows is None or rows < self.world_size or any(map(_gradient_taken_whole, (*args, *given.values()))):
            return None
        share = share_of(range(rows), self.rank, self.world_size)
        # (A loss that a model computes over its share is counted as on a split batch: ``counted``.)
        self.batch.set(share.weight, gathered=module not in self.losses_kept, samples=share.samples)
        return rows_of_share(args, share), share

    def keywords_and_items(self, module: nn.Module, args: tuple, kwargs: dict):
        """A model's own forward pre-hook: the keyword tensors of a call cut at the model cut alike (this rank's
        rows; of a batch cut by hand, those with a row per sample: ``model(x, targets=y)``), then a count of items
        given to it made the whole batch's (``items_of_the_batch``)."""
        call = self.current_call()
        ours = call is not None and call.module is module and call.share is not None
        names = [name for name, value in kwargs.items() if isinstance(value, torch.Tensor) and value.dim() > 0
                 and (not ours or not call.by_hand or value.shape[0] == call.share.samples)]
        cut = ours and (call.gathered or call.by_hand) and names
        if cut:
            kwargs = {**kwargs, **dict(zip(names, rows_of_share(tuple(kwargs[name] for name in names), call.share)))}
        changed = self.items_of_the_batch(module, args, kwargs)
        return changed if changed is not None else (args, kwargs) if cut else None


def _gradient_taken_whole(value) -> bool:
    """Whether ``value``, given to a model's call, is a tensor whose gradient the script may take whole: one that
    requires grad (a gradient penalty's interpolated samples, an adversarial example) and is not another model's
    outputs gathered here. A call cut at the model gives the gradient of this rank's rows alone, zeros elsewhere
    (``torch.autograd.grad`` of the whole batch's loss would read them), so such a call is computed whole, as one
    device computes it; the gradient of gathered outputs (a GAN's generator's, through its discriminator) is read at
    this rank's rows alone (``gathered.Gather``), so they are cut."""
    return isinstance(value, torch.Tensor) and value.requires_grad and getattr(
        value.grad_fn, "_forward_cls", None) is not Gather


def _one_value(leaf) -> bool:
    """A floating-point tensor of one element: a loss, among a whole batch's outputs (its rows are 2 at least)."""
    return isinstance(leaf, torch.Tensor) and leaf.numel() == 1 and leaf.is_floating_point()


def _close(whole: torch.Tensor, part: torch.Tensor) -> bool:
    """Two values of one loss, the whole batch's and its shares' made whole, equal but for rounding (the square root of
    the precision of the loss's own dtype, relative)."""
    tolerance = torch.finfo(whole.dtype).eps ** 0.5 if whole.is_floating_point() else 0.0
    whole, part = whole.double().item(), part.double().item()
    return abs(whole - part) <= tolerance * max(abs(whole), abs(part), 1e-12)


@contextlib.contextmanager
def set_aside(module: nn.Module, batch: Batch):
    """A call of ``module`` that the script did not make (``check_both_ways``' calls, ``Models._writes_alike``):
    from a fork of the random state (the current GPU's too), gradients off, and the batch's state put back after."""
    kept = (batch.weight, batch.whole, batch.gathered, batch.own_batches)
    devices = [torch.cuda.current_device()] if device_of(module).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield
    finally:
        batch.weight, batch.whole, batch.gathered, batch.own_batches = kept


@contextlib.contextmanager
def _fixed_statistics(layers: list, device: torch.device):
    """BatchNorm ``layers`` that keep no running statistics given fixed ones (a mean of 0, a variance of 1) for the
    time of the block, then none again."""
    for layer in layers:
        layer.track_running_stats = True
        layer.running_mean = torch.zeros(layer.num_features, device=device)
        layer.running_var = torch.ones_like(layer.running_mean)
    try:
        yield
    finally:
        for layer in layers:
            layer.track_running_stats, layer.running_mean, layer.running_var = False, None, None


def _rows_agree(whole: list, part: list, share: Share, rows: int) -> bool:
    """Whether each floating-point output of a whole batch's call that has a row per sample (``rows``) holds, at the
    rows of ``share``, this rank's outputs on its share (``part``, the same layout), but for rounding: a relative
    difference (their norms) within the square root of the precision they were computed in, float32's on a GPU being
    TF32's where PyTorch allows it (2**-10: 0.031). Other outputs are not compared (a loss is, by ``_close``)."""
    at = slice(share.indices[0], share.indices[-1] + 1)
    for leaf, mine in zip(whole, part):
        if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() and leaf.size(0) == rows):
            continue
        if not isinstance(mine, torch.Tensor) or mine.shape != leaf[at].shape:
            return False
        expected, difference = leaf[at].double(), (leaf[at].double() - mine.double())
        if difference.norm() > _precision(leaf) * max(expected.norm().item(), 1e-30):
            return False
    return True


def _precision(tensor: torch.Tensor) -> float:
    """The square root of the precision that ``tensor`` was computed in (see ``_rows_agree``)."""
    eps = torch.finfo(tensor.dtype).eps
    if tensor.dtype == torch.float32 and tensor.is_cuda and (
            torch.backends.cudnn.allow_tf32 or torch.get_float32_matmul_precision() != "highest"):
        eps = 2.0 ** -10
    return eps ** 0.5


def device_of(module: nn.Module) -> torch.device:
    tensor = next(module.parameters(), None)
    return torch.device("cpu") if tensor is None else tensor.device


def is_a_loss(leaf, fewest_rows: int | None = None) -> bool:
    """A loss among a model's outputs: a tensor of one element that requires grad (nanoGPT's model returns one). On a
    split batch whose smallest share has ``fewest_rows`` < 2, one with dimensions is not: it may be a share's one row
    of a per-row output (a regression's, of shape (1, 1)), which a process with two rows returns as two elements, and
    every process must tell the two apart alike (a loss is all-reduced). A loss of no dimension is one anywhere."""
    if not (isinstance(leaf, torch.Tensor) and leaf.numel() == 1 and leaf.requires_grad):
        return False
    return leaf.dim() == 0 or fewest_rows is None or fewest_rows >= 2


def returns_a_loss(output, fewest_rows: int | None = None) -> bool:
    return any(is_a_loss(leaf, fewest_rows) for leaf in pytree.tree_leaves(output))


def call_keywords(module: nn.Module) -> dict | None:
    """The keywords of ``module``'s call going on, from inside one of its global forward pre-hooks, which PyTorch
    calls without them: read from the frame of torch's own ``Module`` code that calls the hooks (``_call_impl``, or a
    function inside it), where it holds the module as ``self`` and a ``kwargs`` dictionary; None where no such frame
    is found (a release whose code differs). Read only."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_globals.get("__name__") == module_code.__name__:
            found = frame.f_locals
            if found.get("self") is module and isinstance(found.get("kwargs"), dict):
                return found["kwargs"]
    return None
