"""``ddpkit run --unchanged``: a script written for one device, on N processes, training as it would on one.

    $ ddpkit run --unchanged --nproc-per-node 2 train.py --its-own-flags

What ddpkit puts into the script's processes, all of it here, before the script's first line (``install``):

- each process sees one device: its own GPU as ``cuda:0`` (CUDA_VISIBLE_DEVICES), or the CPU;
- the process group, started by ddpkit, which the script and the libraries it calls do not find
  (``torch.distributed.is_initialized()``: ``own_group``), but inside a model's call on a share of its batch;
- the same seeds on every rank, then streams of each rank's own once training begins (``randomness``);
- the script's DataLoaders, each batch split across the ranks (``batches``, ``ddpkit.data.split_batches``);
- its models, each a DDP replica in place when first called to train, gradients weighted by share
  (``models``, ``ddpkit.strategies.in_place``), BatchNorm over the whole batch; a loss that is a mean over counted
  items (tokens not ignored, class weights) weighted by its count (``counted``); or sharded in place where
  ``--shard`` says so (``layouts``, ``ddpkit.strategies.sharded_in_place``), at its first call or on its way to
  the GPU where the script moves it there (``Module.to`` and ``Module.cuda`` replaced: ``models``), its optimizers
  re-pointed (``optimizers``), its copies (an EMA's) sharded alike;
- ``torch.save`` to a path, by rank 0 alone, atomically (``saving``);
- the console, the files the script writes and its trackers' runs, once: rank 0's (``outputs``).

A script that starts its own process group, wraps its model in DDP or FSDP, or is built on ddpkit or on another
library that distributes it (Accelerate, Lightning, DeepSpeed, Horovod) runs as under ``ddpkit run``: --unchanged
stands aside, saying so in one line (``stands_aside``: from the calls its code makes whenever it runs, not from its
comments; a call behind a condition is found at run time: ``own_group``, ``adoption``). The script sees no launcher's
variables meanwhile, as a one-device run (``own_group``). docs/unchanged.md says what is split, what is
averaged, what stays the same and what it costs.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import random

import torch
import torch.distributed as dist

from ddpkit.core import process_group
from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger
from ddpkit.unchanged.own_group import Hidden

LOSS_REDUCTIONS = ("mean", "sum", "coupled")

# What the code of a script that distributes itself uses: it runs as under `ddpkit run`, and --unchanged stands aside.
DISTRIBUTING_NAMES = ("init_process_group", "DistributedDataParallel", "fully_shard", "FullyShardedDataParallel")
# Libraries that distribute a script themselves (their own launch, process group and wrappers), and ddpkit's library.
DISTRIBUTING_LIBRARIES = ("ddpkit", "accelerate", "lightning", "lightning_fabric", "pytorch_lightning", "deepspeed",
                          "horovod", "trl")
# Trainers that distribute themselves (Accelerate inside transformers' Trainer, and TRL's trainers built on it): a
# script that trains through one runs as under `ddpkit run`, each process a batch of its own (``TRAINER_BATCH``).
DISTRIBUTING_TRAINERS = {"transformers": ("Trainer", "Seq2SeqTrainer")}
TRAINER_BATCH = ("each of its steps then takes per_device_train_batch_size samples on every process, the number of "
                 "processes times one device's batch: divide per_device_train_batch_size by it (or "
                 "gradient_accumulation_steps) to keep one device's")


@dataclasses.dataclass(frozen=True)
class Setting:
    """What ``ddpkit run --unchanged`` hands each rank: the seed (None: rank 0 draws one), the loss's reduction,
    where the models' training state lives (``layouts.SHARDING``), and whether DDP looks for unused parameters at
    every step (``find_unused``; else from each model's first step: ``strategies.in_place.Replica``)."""

    seed: int | None = None
    loss_reduction: str = "mean"
    shard: str = "auto"
    find_unused: bool = False

    def __post_init__(self) -> None:
        from ddpkit.unchanged.layouts import SHARDING

        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise UsageError(f"`loss_reduction` must be one of {', '.join(LOSS_REDUCTIONS)}, got "
                             f"{self.loss_reduction!r}")
        if self.shard not in SHARDING:
            raise UsageError(f"`shard` must be one of {', '.join(SHARDING)}, got {self.shard!r}")

    def encode(self) -> str:
        """As one command-line word: ``SEED:REDUCTION:SHARD:UNUSED`` (SEED empty when none was given, UNUSED ``unused``
        or empty)."""
        return (f"{'' if self.seed is None else self.seed}:{self.loss_reduction}:{self.shard}:"
                f"{'unused' if self.find_unused else ''}")

    @classmethod
    def decode(cls, word: str) -> Setting:
        seed, reduction, shard, unused = (word.split(":") + ["", "", ""])[:4]
        return cls(seed=int(seed) if seed else None, loss_reduction=reduction or "mean", shard=shard or "auto",
                   find_unused=unused == "unused")


def stands_aside(source: str) -> str | None:
    """What makes ``source`` (a script's text) one that distributes itself whenever it runs, or None: a library it
    imports (``DISTRIBUTING_LIBRARIES``), a trainer of a library that distributes itself (``DISTRIBUTING_TRAINERS``),
    or a call of ``DISTRIBUTING_NAMES`` (under a name it imported one as, too) that no condition of the script's
    guards (``unguarded_call``). A script that makes such a call only when told to (pytorch/examples' ImageNet trainer
    with its ``--dist-*`` flags, nanoGPT where a launcher's RANK is set) runs under --unchanged, which stands aside
    at run time if the call comes (``own_group``, ``adoption``). Comments and strings count for nothing. A script
    that does not parse is left to Python to refuse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    aliases = {alias.asname or alias.name: alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names if alias.name in DISTRIBUTING_TRAINERS}  # `import transformers as tf`
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                if not getattr(node, "level", 0) and module.partition(".")[0] in DISTRIBUTING_LIBRARIES:
                    return f"imports {module}"
            imported = [alias.name for alias in node.names] if isinstance(node, ast.ImportFrom) else []
            library = (node.module or "").partition(".")[0] if isinstance(node, ast.ImportFrom) else ""
            trainer = next((name for name in imported if name in DISTRIBUTING_TRAINERS.get(library, ())), None)
            if trainer is not None and not node.level:
                return f"trains through {library}.{trainer}"
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
              and node.attr in DISTRIBUTING_TRAINERS[aliases[node.value.id]]):
            return f"trains through {aliases[node.value.id]}.{node.attr}"
    called = unguarded_call(tree)
    return None if called is None else f"calls {called}"


def unguarded_call(tree: ast.AST) -> str | None:
    """The first of ``DISTRIBUTING_NAMES`` that ``tree`` calls where no condition guards the call: at the top of the
    module, of its ``if __name__ == "__main__":`` or of a function (a loop's body and a ``try``'s count as the top,
    its handlers and an ``if``'s branches do not)."""
    names = {name: name for name in DISTRIBUTING_NAMES}
    names.update({alias.asname: alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  for alias in node.names if alias.name in DISTRIBUTING_NAMES and alias.asname})

    def visit(node: ast.AST, guarded: bool) -> str | None:
        if isinstance(node, ast.Call) and not guarded:
            callee = node.func
            name = callee.id if isinstance(callee, ast.Name) else callee.attr if isinstance(callee, ast.Attribute) \
                else None
            if name in names:
                return names[name]
        for field, value in ast.iter_fields(node):
            for index, child in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(child, ast.AST):
                    found = visit(child, guarded or _guards(node, field, index))
                    if found is not None:
                        return found
        return None

    return visit(tree, False)


def _guards(node: ast.AST, field: str, index: int) -> bool:
    """Whether what ``node`` holds in ``field`` (its ``index``-th item) runs only on a condition."""
    if isinstance(node, ast.If):
        return field != "test" and not (field == "body" and _is_main_guard(node.test))
    if isinstance(node, (ast.IfExp, ast.While)):
        return field != "test"
    if isinstance(node, (ast.For, ast.AsyncFor, ast.Try)):
        return field in ("orelse", "handlers")
    if isinstance(node, ast.BoolOp):
        return index > 0  # `a and init_process_group()`: the right side is a condition's
    return isinstance(node, ast.Match) and field == "cases"


def _is_main_guard(test: ast.AST) -> bool:
    """``__name__ == "__main__"``, either way round: the script's entry, not a condition."""
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and {ast.dump(test.left), ast.dump(test.comparators[0])}
            == {ast.dump(ast.Name(id="__name__", ctx=ast.Load())), ast.dump(ast.Constant(value="__main__"))})


HIDDEN = Hidden()  # the launcher's variables, out of the script's environment while --unchanged runs it


def launcher_environment() -> dict[str, str]:
    """This process's environment as the launcher set it, the variables that --unchanged keeps from the script
    included (what ddpkit's own code reads of it)."""
    return HIDDEN.environment()


def install(setting: Setting) -> None:
    """Put --unchanged into this process before the script runs. (Where the script distributes itself, ``ddpkit run``
    has said so once, having read it, and passes no --unchanged: ``stands_aside``.)"""
    environment = process_group.read_environment()
    if environment.rank != 0:
        os.environ.setdefault("TQDM_DISABLE", "1")  # one progress bar, rank 0's (read when tqdm is imported)
    own_gpu = one_gpu_each(environment.local_rank, environment.local_world_size)
    runtime = process_group.setup(own_gpu=own_gpu, environment=environment)
    from ddpkit.unchanged import outputs

    private = outputs.install(runtime)
    seed = shared_seed(setting.seed, runtime)
    HIDDEN.hide()  # the launcher's variables: the script's process is one device's (``own_group``)
    _install_hooks(runtime, setting, seed, undo=[HIDDEN.give_back, *([] if private is None else [private.uninstall])])
    if runtime.is_main:
        many = runtime.world_size > 1
        logger.info(f"--unchanged: {runtime.world_size} process{'es' if many else ''} train as one device would"
                    + (f" (each batch split {runtime.world_size} ways, the script's batch size and steps kept)"
                       if many else "") + f"; seed {seed}"
                    + ("" if setting.seed is not None else f" (drawn: repeat the run with --seed {seed})"))


def _install_hooks(runtime: process_group.Runtime, setting: Setting, seed: int, *, undo: list) -> None:
    """Every hook of --unchanged's; each one's ``uninstall`` goes into ``undo``, which standing aside at run time calls
    (a script found to distribute itself runs as under ``ddpkit run``, nothing of ours left in its way)."""
    from ddpkit.unchanged.batches import Batch, Loaders
    from ddpkit.unchanged.models import Models
    from ddpkit.unchanged.optimizers import Optimizers
    from ddpkit.unchanged.own_group import OwnGroup
    from ddpkit.unchanged.randomness import Streams
    from ddpkit.unchanged.saving import SaveOnce

    streams = Streams(seed, runtime.rank)
    streams.start()
    batch = Batch(world_size=runtime.world_size, summed=setting.loss_reduction == "sum",
                  coupled=setting.loss_reduction == "coupled")
    control = process_group.control_group(runtime)
    the_same_everywhere = functools.partial(alike_on_every_rank, group=control)
    loaders = Loaders(rank=runtime.rank, world_size=runtime.world_size, batch=batch, streams=streams,
                      the_same_everywhere=the_same_everywhere,
                      most_anywhere=lambda number: most_on_any_rank(number, control), group=control)
    loaders.install()
    undo.append(loaders.uninstall)
    if runtime.world_size > 1:
        from ddpkit.unchanged.counted import CountedMeans

        counted = CountedMeans(batch=batch)
        counted.install()
        undo.append(counted.uninstall)
    from ddpkit.core.version import torch_at_least
    from ddpkit.unchanged.layouts import SHARD_IN_PLACE

    shard = setting.shard if runtime.world_size > 1 else "never"  # one process has nothing to shard
    if shard == "auto" and (runtime.device.type != "cuda" or not torch_at_least(SHARD_IN_PLACE)):
        shard = "never"  # on the CPU, or a torch that cannot shard exactly, ``auto`` keeps the replica (``layouts``)
    # (``always`` on an older torch: refused by the launcher, before any process started: ``app.cli``.)
    optimizers = Optimizers(rank=runtime.rank)
    if shard != "never":
        optimizers.install()
        undo.append(optimizers.uninstall)

    def wait_for_rank_0() -> None:
        if control is not None:
            dist.barrier(group=control)

    def stand_aside() -> None:
        for step in undo:
            step()

    models = Models(rank=runtime.rank, world_size=runtime.world_size, batch=batch, streams=streams,
                    witness=loaders.witness, shard=shard, optimizers=optimizers, wait_for_rank_0=wait_for_rank_0,
                    stand_aside=stand_aside, find_unused=setting.find_unused,
                    the_same_everywhere=the_same_everywhere, watching=lambda: loaders.watching)
    models.install()
    undo.append(models.uninstall)
    saving = SaveOnce(rank=runtime.rank, wait_for_rank_0=wait_for_rank_0, sharding=shard != "never")
    saving.install()
    undo.append(saving.uninstall)
    own_group = OwnGroup(rank=runtime.rank, stand_aside=stand_aside, holds_a_share=models.holds_a_share)
    own_group.install()
    undo.append(own_group.uninstall)


def alike_on_every_rank(found, group) -> bool:
    """Whether ``found`` (a batch, or a call's arguments) is the same on every rank of ``group``: one all-reduce of its
    fingerprint (``core.process_group.fingerprint``)."""
    from ddpkit.core.process_group import fingerprint
    from ddpkit.unchanged.gathered import the_same_on_every_rank

    return the_same_on_every_rank([fingerprint(found)], group)


def most_on_any_rank(number: int, group) -> int:
    """``number``'s largest value over the ranks of ``group`` (one all-reduce)."""
    values = torch.tensor([number], dtype=torch.int64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return int(values.item())


def one_gpu_each(local_rank: int, local_world_size: int) -> bool:
    """Make this rank's GPU the only one it sees (CUDA_VISIBLE_DEVICES), before anything touches CUDA; False where
    there is no GPU. More processes than GPUs on this machine is refused."""
    count = torch.cuda.device_count()  # before CUDA starts it reads CUDA_VISIBLE_DEVICES anew every time
    if count == 0:
        return False
    if local_world_size > count:
        raise UsageError(f"--unchanged gives each process a GPU of its own, but this machine has {count} for "
                         f"{local_world_size} processes: give --nproc-per-node {count} (or fewer)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [name.strip() for name in visible.split(",")] if visible else [str(index) for index in range(count)]
    os.environ["CUDA_VISIBLE_DEVICES"] = names[local_rank]
    return True


def shared_seed(seed: int | None, runtime: process_group.Runtime) -> int:
    """``seed``, or one that rank 0 draws, the same on every rank."""
    if seed is not None:
        return seed
    return int(process_group.decided_by_main(runtime, lambda: random.SystemRandom().randrange(2**31)))
