"""Pipeline parallel across processes: the model cut into stages, one per rank, micro-batches flowing through.

    ddpkit train --strategy pipeline --nproc-per-node 4 --microbatches 8                # 4 stages
    ddpkit train --strategy pipeline --nproc-per-node 4 --stages 2 --pipeline-schedule gpipe  # 2 stages x 2 replicas

The batch of each step is split into ``microbatches`` pieces; while stage 2 works on micro-batch 1, stage 1
already works on micro-batch 2, so the stages overlap (the tutorials' pipeline moved one whole batch
through its devices in turn, and never overlapped). The stages idle at the start and end of each step
(the "bubble"): (stages - 1) / (microbatches + stages - 1) of the step, so more micro-batches waste less.
GPipe runs all forwards, then all backwards (activations of every micro-batch are kept); 1F1B starts
each micro-batch's backward as soon as the last stage has its loss (at most ``stages`` micro-batches of
activations held). The schedules are PyTorch's (torch.distributed.pipelining); ddpkit cuts the model
(``split``), lays out the ranks, and feeds the schedule.

With ``stages`` < world size, ``world_size / stages`` pipelines run side by side as data-parallel replicas:
ranks ``r*stages ... r*stages + stages - 1`` form pipeline ``r``, and each stage is wrapped in DDP over the
ranks holding the same stage in the other pipelines.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ddpkit.core.errors import UsageError
from ddpkit.core.process_group import Runtime, broadcast_buffers
from ddpkit.core.snapshot import snapshot
from ddpkit.core.version import require_torch
from ddpkit.strategies import split
from ddpkit.strategies.base import Strategy, unwrap
from ddpkit.strategies import state as state_layouts

PIPELINE_SCHEDULES = ("gpipe", "1f1b")  # torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B
# The torch whose schedules evaluate (``schedule.eval``, pytorch#157795): a pipeline's forward without a backward.
PIPELINE_EVAL = "2.9"


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Which stage and which replica each rank is; checks that the numbers fit together."""

    world_size: int
    stages: int
    microbatches: int
    batch_size: int  # per pipeline, split into microbatches

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise UsageError(f"`stages` must be at least 1, got {self.stages}")
        if self.world_size % self.stages:
            raise UsageError(
                f"`stages` {self.stages} does not divide the world size {self.world_size}: the world is "
                f"stages x data-parallel replicas; use a `stages` that divides {self.world_size}"
            )
        if self.microbatches < 1:
            raise UsageError(f"`microbatches` must be at least 1, got {self.microbatches}")
        if self.batch_size % self.microbatches:
            raise UsageError(
                f"`batch_size` {self.batch_size} does not split into {self.microbatches} equal micro-batches; "
                f"use a `batch_size` that is a multiple of `microbatches` {self.microbatches}"
            )

    @property
    def replicas(self) -> int:
        return self.world_size // self.stages

    def stage_of(self, rank: int) -> int:
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages


class Pipeline(nn.Module):
    """This rank's stage and the schedule that runs every stage of its pipeline in step.

    ``module`` is the stage (``split.Pieces``, in DDP when there are replicas). ``train_step(images, labels)``
    runs one optimizer step's forwards and backwards and returns the batch's mean loss on the last stage
    (None on the others). Calling the module evaluates: the last stage returns the outputs, the others None.
    """

    is_pipeline = True  # unwrap() looks inside it

    def __init__(self, module: nn.Module, stage, schedule, layout: PipelineLayout, rank: int, replica_group=None):
        super().__init__()
        self.module = module
        self.stage, self.schedule, self.layout = stage, schedule, layout
        self.replica_group = replica_group  # this stage's ranks in every pipeline (None with one pipeline)
        self.is_first = stage.is_first
        self.is_last = stage.is_last
        self.replica = layout.replica_of(rank)

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        inputs = (images,) if self.is_first else ()
        self.schedule.step(*inputs, target=labels if self.is_last else None, losses=losses if self.is_last else None)
        if not self.is_last:
            return None
        # Equal micro-batches: the mean of their mean losses is the batch's mean loss.
        return torch.stack([loss.detach() for loss in losses]).mean()

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor | None:
        # The schedule's buffers have the shapes of the first step: a short last batch is padded to the
        # full batch with copies of its first image, and the copies' outputs are dropped.
        count = images.shape[0]
        full = self.layout.batch_size
        if count < full:
            images = torch.cat([images, images[:1].expand(full - count, *images.shape[1:])])
        if not self.is_last:
            self.schedule.eval(*((images,) if self.is_first else ()))
            return None
        # The schedule computes its loss on the last stage, so it wants targets; the caller scores the outputs.
        placeholder = torch.zeros(full, dtype=torch.long, device=self.stage.device)
        output = self.schedule.eval(*((images,) if self.is_first else ()), target=placeholder)
        return output[:count]


def stage_shapes(parts: list[list[tuple[str, nn.Module]]], sample: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of each stage for one micro-batch like ``sample``: one forward in eval mode, no grad.

    Handed to PipelineStage up front, so it does not infer them with a probe forward at the first step
    (which, through DDP, breaks the DDP reducer under GPipe at the second step).
    """
    modules = [module for part in parts for _, module in part]
    modes = [module.training for module in modules]
    for module in modules:
        module.eval()  # no BatchNorm statistics from the blank sample
    shapes, x = [], sample
    with torch.no_grad():
        for index, part in enumerate(parts):
            y = split.Pieces(part)(x)
            # Activations that arrive from another stage carry gradients; the model's images do not.
            shapes.append((x.detach().requires_grad_(index > 0), y.detach().requires_grad_(index < len(parts) - 1)))
            x = y
    for module, mode in zip(modules, modes):
        module.train(mode)
    return shapes


@dataclasses.dataclass(frozen=True)
class PipelineParallel(Strategy):
    stages: int | None = None  # stages per pipeline (None: the world size); world = stages x replicas
    microbatches: int | None = None  # per step (None: 2 x stages); must divide the batch
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b
    split_at: str | None = None  # comma-separated piece names where stages 2, 3, ... begin (None: balanced)

    name: ClassVar[str] = "pipeline"
    shards_model: ClassVar[bool] = True
    can_shard_checkpoints: ClassVar[bool] = False  # its stages' state has no sharded layout yet: full checkpoints

    def adopt_optimizer(self, optimizer, model: nn.Module, names: dict[int, str]):
        raise UsageError("under `strategy` pipeline each rank holds one stage: make the optimizer with "
                         "job.setup(model, OptimizerClass, example=batch, **settings) instead of `prepare`")

    def __post_init__(self) -> None:
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise UsageError(f"`pipeline_schedule` must be one of {', '.join(PIPELINE_SCHEDULES)}, "
                             f"got {self.pipeline_schedule!r}")
        for name, value in (("`stages`", self.stages), ("`microbatches`", self.microbatches)):
            if value is not None and value < 1:
                raise UsageError(f"{name} must be at least 1, got {value}")

    def layout(self, world_size: int, batch_size: int) -> PipelineLayout:
        stages = self.stages or world_size
        return PipelineLayout(world_size=world_size, stages=stages, microbatches=self.microbatches or 2 * stages,
                              batch_size=batch_size)

    def split_names(self) -> list[str] | None:
        return self.split_at.split(",") if self.split_at else None

    def check(self, *, world_size: int, cuda_count: int, batch_size: int | None = None, build_model=None) -> None:  # noqa: ARG002
        """The stages fit the world, the batch the micro-batches, and (given ``build_model``) the model can be cut."""
        layout = self.layout(world_size, batch_size or (self.microbatches or 2 * (self.stages or world_size)))
        if build_model is not None:
            split.cut(build_model(), layout.stages, self.split_names())
        require_torch(PIPELINE_EVAL, "`strategy` pipeline")

    def check_training(self, *, accumulate: int, amp: str) -> None:
        if accumulate > 1:
            raise UsageError("`accumulate` with `strategy` pipeline: the pipeline accumulates over its micro-batches "
                             "already; raise `microbatches` and `batch_size` instead")
        if amp != "off":
            raise UsageError(f"`amp` {amp} is not supported with `strategy` pipeline yet; use `amp` off")

    def data_part(self, rank: int, world_size: int) -> tuple[int, int]:
        # The stages of one pipeline share their data; only the replicas split it.
        stages = self.stages or world_size
        return rank // stages, world_size // stages

    def wrap(self, model: nn.Module, runtime: Runtime, *, example: torch.Tensor | None = None) -> Pipeline:
        """Cut ``model`` into stages and build this rank's stage and schedule.

        ``example``: one batch of inputs (values unused), on the CPU, for the activations' shapes.
        """
        if runtime.backend is None:
            raise UsageError("`strategy` pipeline needs a process group; start it with a launcher (ddpkit run / torchrun)")
        require_torch(PIPELINE_EVAL, "`strategy` pipeline")
        if example is None:
            raise UsageError("a pipeline needs an example batch of inputs to size its stages: wrap(..., example=batch)")
        # Imported here: torch.distributed.pipelining takes a second to import, which every ddpkit command would pay.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        layout = self.layout(runtime.world_size, example.shape[0])
        parts = split.cut(model, layout.stages, self.split_names())
        index = layout.stage_of(runtime.rank)
        sample = example[: layout.batch_size // layout.microbatches]
        inputs, outputs = (tensor.to(runtime.device) for tensor in stage_shapes(parts, sample)[index])
        module: nn.Module = split.Pieces(parts[index]).to(runtime.device)
        mesh = init_device_mesh(runtime.device.type, (layout.replicas, layout.stages), mesh_dim_names=("dp", "pp"))
        replica_group = mesh.get_group("dp") if layout.replicas > 1 else None
        if replica_group is not None:
            on_gpu = runtime.device.type == "cuda"
            # broadcast_buffers=False: no collective in the evaluation forwards (a replica may have no validation
            # batch); sync_buffers gives every replica pipeline 0's BatchNorm statistics at each epoch's end.
            module = DistributedDataParallel(module, process_group=replica_group, broadcast_buffers=False,
                                             device_ids=[runtime.device.index] if on_gpu else None)
        stage = PipelineStage(module, index, layout.stages, runtime.device, input_args=inputs, output_args=outputs,
                              group=mesh.get_group("pp"))
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.pipeline_schedule]
        runner = schedule(stage, n_microbatches=layout.microbatches, loss_fn=F.cross_entropy)
        return Pipeline(module, stage, runner, layout, runtime.rank, replica_group)

    def set_gradient_sync(self, model: nn.Module, enabled: bool, *, first_backward: bool) -> None:  # noqa: ARG002
        """The schedule synchronises the replicas on each step (accumulation is refused)."""

    def forward_backward(self, model: Pipeline, inputs, targets, loss_fn, backward, autocast) -> torch.Tensor | None:  # noqa: ARG002
        return model.train_step(inputs, targets)  # its micro-batches go through every stage; cross-entropy loss

    def eval_module(self, model: nn.Module) -> nn.Module:
        return model  # the stages pass activations on

    def sync_buffers(self, model: Pipeline, runtime: Runtime) -> None:
        if model.replica_group is not None:
            broadcast_buffers(unwrap(model), runtime, group=model.replica_group)

    def sharded_state(self, model: nn.Module, optimizer) -> dict:  # noqa: ARG002
        raise UsageError("sharded checkpoints are not available for pipelines yet (their stages' replicas "
                         "would each write the same part); use the full format (--checkpoint-format full)")

    def full_model_state(self, model: Pipeline, runtime: Runtime) -> dict[str, torch.Tensor] | None:
        mine = snapshot(unwrap(model).state_dict())
        return state_layouts.merge_stages(model.replica, runtime, mine, state_layouts.merge_dicts)

    def full_optimizer_state(self, model: Pipeline, optimizer, runtime: Runtime) -> dict | None:
        from ddpkit.strategies.fsdp import full_options, state_dicts

        # No cpu_offload: with it only global rank 0 would get its stage's state, and every stage needs its own.
        mine = state_dicts().get_optimizer_state_dict(unwrap(model), optimizer, options=full_options(cpu_offload=False))
        return state_layouts.merge_stages(model.replica, runtime, snapshot(mine), state_layouts.merge_optimizer_states)

    def load_model_state(self, model: Pipeline, state: dict[str, torch.Tensor]) -> None:
        # A stage knows only its own parameters' names, and converting a numbered optimizer state needs
        # the whole model's: load into the bare model before wrapping instead (as ddpkit train does).
        raise UsageError("resuming after setup is not available for pipelines: call Checkpointer.load(source, "
                         "model=bare_model) before job.setup, then Resumed.restore(...)")

    def load_optimizer_state(self, model: Pipeline, optimizer, saved: dict, names: list[str], check) -> None:
        from ddpkit.strategies.fsdp import full_options, state_dicts

        named = saved if state_layouts.is_named(saved) else state_layouts.numbered_to_named(saved, names)
        target = unwrap(model)
        named = state_layouts.only(named, {name for name, _ in target.named_parameters()})
        check(optimizer, named)
        state_dicts().set_optimizer_state_dict(target, optimizer, named, options=full_options(cpu_offload=False))

