"""``ddpkit run --unchanged --shard``: a one-device script's model sharded in place (FSDP2), its training the same as on
one device, its files one device's.

The choice of layout (``unchanged.layouts``), the blocks (``repeated_blocks``) and the settings are tested in this
process; the runs (tests/unchanged_sharded_script.py, sharded on 2 processes against 1) are slow tests, shared through
a module fixture.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import run_ddpkit
from ddpkit.core.errors import UsageError
from ddpkit.strategies.sharded_in_place import repeated_blocks
from ddpkit.unchanged import Setting, layouts
from ddpkit.unchanged.layouts import SHARD_IN_PLACE
from test_unchanged import counted_one, one_process_both, steps_one  # noqa: F401 (references shared, once per run)

SCRIPT = str(Path(__file__).with_name("unchanged_sharded_script.py"))

GiB, MiB = 2**30, 2**20


# -- in this process ---------------------------------------------------------------------------------------------------

def test_auto_keeps_the_replica_while_the_state_fits_then_shards_gradients_and_state_then_everything():
    adam = layouts.Estimate(parameter_bytes=4 * GiB, state_factor=2.0, how="Adam's 2 buffers")
    # A replica adds the gradients (4) and the moments (8): 12 GiB; 80 GiB in all, a quarter kept for activations.
    assert layouts.choose(adam, world_size=8, free=70 * GiB, total=80 * GiB)[0] == "replica"  # 12 <= 70 - 20
    assert layouts.choose(adam, world_size=8, free=32 * GiB, total=80 * GiB)[0] == "replica"  # 12 <= 32 - 20
    assert layouts.choose(adam, world_size=8, free=31 * GiB, total=80 * GiB)[0] == "zero2"  # 2 GiB of shards fit 11
    seven_billion = layouts.Estimate(parameter_bytes=28 * GiB, state_factor=2.0, how="Adam's 2 buffers")
    assert layouts.choose(seven_billion, world_size=8, free=40 * GiB, total=80 * GiB)[0] == "zero2"  # 14 <= 20
    layout, figures = layouts.choose(seven_billion, world_size=8, free=30 * GiB, total=80 * GiB)
    assert layout == "full"
    assert figures == ("its training state adds 84.00 GiB as a replica (parameters 28.00 GiB, their gradients, "
                       "Adam's 2 buffers), 14.00 GiB with gradients and optimizer state sharded 8 ways; 30.00 GiB "
                       "free of 80.00 GiB, 25% of it kept for activations")


def test_the_optimizer_state_is_estimated_from_its_kind_and_settings():
    weight = nn.Parameter(torch.zeros(10))
    factor = lambda optimizer: layouts.state_per_parameter(optimizer)[0]  # noqa: E731
    assert factor(torch.optim.Adam([weight])) == 2.0
    assert factor(torch.optim.AdamW([weight], amsgrad=True)) == 3.0
    assert factor(torch.optim.SGD([weight], lr=0.1)) == 0.0
    assert factor(torch.optim.SGD([weight], lr=0.1, momentum=0.9)) == 1.0
    assert factor(torch.optim.RMSprop([weight], momentum=0.9, centered=True)) == 3.0

    class Lion(torch.optim.SGD):
        pass

    assert layouts.state_per_parameter(Lion([weight], lr=0.1)) == (2.0, "Lion: assumed as Adam's")
    assert layouts.estimate([weight], []) == layouts.Estimate(40, 2.0, "no optimizer yet: assumed Adam's two moments")
    both = layouts.estimate([weight], [torch.optim.SGD([weight], lr=0.1, momentum=0.9), torch.optim.Adam([weight])])
    assert (both.parameter_bytes, both.state_factor) == (40, 3.0)


def test_the_blocks_sharded_first_are_the_outermost_repeated_modules():
    import torchvision

    resnet = torchvision.models.resnet18()
    blocks = repeated_blocks(resnet)
    assert [type(block).__name__ for block in blocks] == ["BasicBlock"] * 8
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32), num_layers=3, enable_nested_tensor=False)
    assert [type(block).__name__ for block in repeated_blocks(encoder)] == ["TransformerEncoderLayer"] * 3
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert repeated_blocks(mlp) == [mlp[0], mlp[2], mlp[4]]  # no repeated part has parts: its repeated layers
    assert repeated_blocks(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8))) == []  # the root alone


def test_the_setting_carries_the_sharding_and_refuses_an_unknown_one():
    assert Setting.decode(Setting(seed=3, loss_reduction="sum", shard="always").encode()) == Setting(3, "sum", "always")
    assert Setting.decode("3:sum") == Setting(3, "sum", "auto")
    with pytest.raises(UsageError, match="`shard` must be one of auto, always, never, got 'half'"):
        Setting(shard="half")


def test_auto_says_its_choice_and_its_figures_in_one_line(monkeypatch, caplog):
    from ddpkit.core.logs import logger
    from ddpkit.unchanged.adoption import Adoption
    from ddpkit.unchanged.batches import Batch
    from ddpkit.unchanged.optimizers import Optimizers

    model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.ReLU(), nn.Linear(1024, 1024, bias=False))  # 8 MiB
    models = Adoption(rank=0, world_size=2, batch=Batch(world_size=2), shard="auto", optimizers=Optimizers(rank=0))
    monkeypatch.setattr(layouts, "least_of_all_ranks", lambda memory, device: memory)
    logger.addHandler(caplog.handler)  # ddpkit's logger does not propagate to the root, where caplog listens
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            # A replica adds 24 MiB (gradients 8, moments 16), sharded 2 ways 16 MiB; a quarter of 1 GiB kept.
            for free, chosen in ((GiB // 4 + 24 * MiB, "replica"), (GiB // 4 + 20 * MiB, "zero2"),
                                 (GiB // 4 + 10 * MiB, "full")):
                monkeypatch.setattr(layouts, "device_memory", lambda device, free=free: (int(free), GiB))
                assert models.layout(model) == chosen
            monkeypatch.setattr(layouts, "device_memory", lambda device: None)  # the CPU: a replica, nothing said
            assert models.layout(model) == "replica"
    finally:
        logger.removeHandler(caplog.handler)
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 3, said
    assert said[0].startswith("--unchanged: Sequential stays a whole replica on each of the 2 processes (--shard auto: "
                              "its training state adds 24.0 MiB as a replica (parameters 8.0 MiB, their gradients, no "
                              "optimizer yet: assumed Adam's two moments), 16.0 MiB with gradients and optimizer state "
                              "sharded 2 ways; 280.0 MiB free of 1.00 GiB, 25% of it kept for activations)")
    assert "has its gradients and optimizer state sharded 2 ways, its parameters whole during a step" in said[1]
    assert "is sharded 2 ways in place: its parameters, gradients and optimizer state (FSDP2)" in said[2]


def test_only_optimizers_that_step_each_element_on_its_own_are_sharded():
    from ddpkit.unchanged.optimizers import steps_each_element

    weight = nn.Parameter(torch.zeros(4))

    class Scaled(torch.optim.SGD):  # a step of its own: not known to step each element alone
        def step(self, closure=None):
            return super().step(closure)

    class Renamed(torch.optim.AdamW):  # torch's own step
        pass

    assert steps_each_element(torch.optim.Adam([weight])) and steps_each_element(Renamed([weight]))
    assert steps_each_element(torch.optim.SGD([weight], lr=0.1, momentum=0.9))
    assert not steps_each_element(torch.optim.LBFGS([weight])) and not steps_each_element(Scaled([weight], lr=0.1))


def test_a_step_not_elementwise_or_a_sparse_layer_keeps_auto_on_the_replica_and_is_refused_by_always(
        monkeypatch, caplog):
    from ddpkit.core.logs import logger
    from ddpkit.unchanged.adoption import Adoption
    from ddpkit.unchanged.batches import Batch
    from ddpkit.unchanged.optimizers import Optimizers

    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizers = Optimizers(rank=0)
    lbfgs = torch.optim.LBFGS(model.parameters())  # the script holds its optimizer: Optimizers' hold is weak
    optimizers.built.add(lbfgs)  # (as the wrap of Optimizer.__init__ records it)
    ratings = nn.Sequential(nn.Embedding(9, 4, sparse=True), nn.Linear(4, 1))  # (its gradients: sparse tensors)
    sgd = torch.optim.SGD(ratings.parameters(), lr=0.1)
    optimizers.built.add(sgd)
    monkeypatch.setattr(layouts, "device_memory", lambda device: (0, GiB))  # nothing free: auto would shard
    monkeypatch.setattr(layouts, "least_of_all_ranks", lambda memory, device: memory)

    def models(shard: str) -> Adoption:
        return Adoption(rank=0, world_size=2, batch=Batch(world_size=2), shard=shard, optimizers=optimizers)

    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            assert models("auto").layout(model) == "replica"
            assert models("auto").layout(ratings) == "replica"
    finally:
        logger.removeHandler(caplog.handler)
    said, sparse = [record.getMessage() for record in caplog.records]
    assert sparse.endswith("; but its Embedding has sparse gradients, which a shard cannot hold: it may run out of "
                           "memory)")
    assert said.startswith("--unchanged: Sequential stays a whole replica on each of the 2 processes (--shard auto: "
                           "its training state adds ")
    assert said.endswith("; but LBFGS steps it, and over a shard its step would not be one device's: it may run out "
                         "of memory)")
    with pytest.raises(UsageError, match=r"^--unchanged --shard: LBFGS steps Sequential's parameters, and it is not one "
                                         r"of torch.optim's optimizers that update each element on its own .* Run with "
                                         r"--shard never"):
        models("always").layout(model)
    with pytest.raises(UsageError, match=r"^--unchanged --shard: Sequential holds an Embedding with sparse=True, and a "
                                         r"shard's gradients are dense: run with --shard never \(each process a whole "
                                         r"replica\)$"):
        models("always").layout(ratings)


# -- runs: sharded on 2 processes against one device ---------------------------------------------------------------

@pytest.fixture(scope="module")
def sharding_torch() -> None:
    """Skips where this torch cannot shard an unchanged script (``layouts.SHARD_IN_PLACE``)."""
    from ddpkit.core.version import torch_at_least

    if not torch_at_least(SHARD_IN_PLACE):
        pytest.skip(f"--shard needs torch {SHARD_IN_PLACE}, this is {torch.__version__}: tests/test_cli.py checks the "
                    "refusal")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sharding_torch):
    """Each kind of run of tests/unchanged_sharded_script.py on 1 process (one device: nothing to shard) and sharded on
    2, the same seed; the MLP's in two parts, an epoch and then a resume from the script's own checkpoint."""
    done = {}
    for name, parts in (("mlp", (["mlp", "32", "3", "1"], ["mlp", "32", "3", "2"])), ("resnet", (["resnet"],))):
        for processes in (1, 2):
            out = tmp_path_factory.mktemp(f"{name}{processes}")
            outputs = []
            for arguments in parts:
                result = run_ddpkit("run", "--unchanged", "--seed", "5", "--shard", "always", "--nproc-per-node",
                                    str(processes), SCRIPT, str(out), *arguments, timeout=180)
                assert result.returncode == 0, result.stdout + result.stderr
                outputs.append(result.stdout + result.stderr)
            done[name, processes] = out, outputs
    return done


def _loaded(out: Path, name: str):
    return torch.load(out / name, weights_only=True)


def _worst(one: dict, other: dict) -> float:
    assert list(one) == list(other)
    return max(((one[key] - other[key]).abs().max() / one[key].abs().max().clamp_min(1e-12)).item()
               for key in one if one[key].is_floating_point())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_a_sharded_model_trains_on_two_processes_to_one_devices_weights(runs, name):
    (one, _), (two, said) = runs[name, 1], runs[name, 2]
    alone, sharded = _loaded(one, "result.pt"), _loaded(two, "result.pt")
    assert sharded["isinstance"] is True  # the script's class holds: isinstance(model, Net / ResNet)
    assert all(type(value) is torch.Tensor for value in sharded["state"].values())  # plain, one device's keys
    assert _worst(alone["state"], sharded["state"]) < 1e-9  # float64: FSDP2's all-gathers and reduce-scatters
    assert sharded["evaluation"][0] == alone["evaluation"][0]
    assert sharded["evaluation"][1] == pytest.approx(alone["evaluation"][1], rel=1e-9)
    assert _worst(_loaded(one, "copy.pt"), _loaded(two, "copy.pt")) < 1e-9  # a deep copy: whole, the plain class
    assert all(output.count("is sharded 2 ways in place") == 1 for output in said), said


@pytest.mark.slow
def test_the_scripts_own_resume_from_its_state_dicts_continues_as_one_device_and_its_files_load_without_ddpkit(runs):
    (one, alone), (two, sharded) = runs["mlp", 1], runs["mlp", 2]
    assert "resumed at epoch 1" in alone[1] and "resumed at epoch 1" in sharded[1]
    check = f"""
import sys, torch
sys.argv = ["unchanged_sharded_script.py", "{two}", "none"]
exec(open({SCRIPT!r}).read().split("def mlp")[0])  # the script's classes, in a process that never imports ddpkit
checkpoint = torch.load("{two}/checkpoint.pt", weights_only=True)
model = Net(32, 3)
model.load_state_dict(checkpoint["model"])
optimizer = torch.optim.Adam(model.parameters())
optimizer.load_state_dict(checkpoint["optimizer"])
assert type(optimizer.state[model.head.weight]["exp_avg"]) is torch.Tensor
whole = torch.load("{two}/whole.pt", weights_only=False)["model"]
assert type(whole) is Net and not whole._forward_pre_hooks and not whole.blocks[0].up._state_dict_pre_hooks
result = torch.load("{two}/result.pt", weights_only=True)["state"]
assert all(torch.equal(whole.state_dict()[key], result[key]) for key in result)
print("modules:", sorted(name for name in sys.modules if name.startswith("ddpkit")))
"""
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "modules: []" in done.stdout
    saved_one, saved_two = _loaded(one, "checkpoint.pt"), _loaded(two, "checkpoint.pt")
    assert saved_two["epoch"] == 1 and _worst(saved_one["model"], saved_two["model"]) < 1e-9
    moments = lambda saved: {f"{index}.{key}": value for index, state in saved["optimizer"]["state"].items()  # noqa: E731
                             for key, value in state.items()}
    assert _worst(moments(saved_one), moments(saved_two)) < 1e-9


@pytest.fixture(scope="module")
def shared_script_runs(tmp_path_factory, sharding_torch, one_process_both) -> dict:
    """tests/unchanged_script.py (BatchNorm, uneven batches, accumulation, clipping, a GAN, stand-ins, evaluations,
    summed losses, a batch cut by hand, a coupled loss, whole models saved and copied), on 1 process (the reference
    tests/test_unchanged.py's runs share) and sharded on 2 in each mode, in float64."""
    from test_unchanged import unchanged

    tmp = tmp_path_factory.mktemp("shared-script")
    found = {"both": one_process_both}
    for nproc, mode, flags in ((2, "mean", ["--shard", "always"]),
                               (2, "sum", ["--shard", "always", "--loss-reduction", "sum"]),
                               (2, "coupled", ["--shard", "always", "--loss-reduction", "coupled"])):
        out, done = unchanged(tmp, nproc, mode, "--seed", "5", *flags, script_args=["float64"])
        found[mode] = out, done, torch.load(out / "result.pt", weights_only=True)
    return found


@pytest.mark.slow
def test_sharding_keeps_every_case_the_replica_keeps_exact_and_its_whole_models_plain(shared_script_runs):
    from test_unchanged import loaded_whole, worst_relative_difference

    one = shared_script_runs["both"][2]
    for mode, names, tolerance in (("mean", ("classifier",), 1e-12),
                                   ("mean", ("ones", "evaluated"), 1e-12), ("sum", ("autoencoder", "by_hand", "counted"),
                                                                            1e-12), ("coupled", ("clip",), 1e-12)):
        out, done, two = shared_script_runs[mode]
        assert done.stderr.count("is sharded 2 ways in place") >= 1, done.stderr
        assert worst_relative_difference({name: one["weights"][name] for name in names},
                                         {name: two["weights"][name] for name in names}) < tolerance, (mode, names)
    two = shared_script_runs["mean"][2]
    for name, counted in one["evaluations"].items():
        assert two["evaluations"][name][:2] == counted[:2] and two["evaluations"][name][2] == pytest.approx(counted[2],
                                                                                                          rel=1e-12)
    files = [str(shared_script_runs["both"][0] / "whole.pt"), str(shared_script_runs["both"][0] / "lm.pt"),
             str(shared_script_runs["mean"][0] / "whole.pt"), str(shared_script_runs["sum"][0] / "lm.pt"),
             str(shared_script_runs["mean"][0] / "best.pt")]
    loaded = loaded_whole(files, references=2)  # (each loaded with weights_only, allowed what 1 process's name)
    # The classifier saved whole (clipped), the language model: 2 processes sharded, and 1, their globals the same.
    for a, b in ((0, 2), (1, 3)):
        assert worst_relative_difference({"m": loaded[files[a]]["weights"]}, {"m": loaded[files[b]]["weights"]}) < 1e-12
        assert loaded[files[a]]["globals"] == loaded[files[b]]["globals"]
    assert shared_script_runs["sum"][2]["pickled"] == ["TinyLanguageModel", True]  # pickle.dumps of the model
    assert shared_script_runs["sum"][2]["pickled globals"] == one["pickled globals"]
    assert two["best_plain"][0] == "FSDPSequential"  # a deep copy: sharded like the model, and it evaluates on its own
    assert two["best_eval"] == pytest.approx(one["best_eval"], rel=1e-12)


@pytest.mark.slow
def test_a_script_that_reads_a_sharded_parameter_as_a_whole_tensor_is_told_why_in_one_line(tmp_path, sharding_torch):
    # pytorch/examples' regression (the corpus beside the project, as its authors wrote it) prints its learned function
    # from fc.weight.view(-1): a shard, between steps.
    script = Path(__file__).parents[2] / "shared" / "corpus" / "pytorch-examples" / "regression" / "main.py"
    if not script.exists():
        pytest.skip(f"no corpus at {script.parents[1]}: the shared folder beside the repository")
    done = run_ddpkit("run", "--unchanged", "--seed", "0", "--shard", "always", "--nproc-per-node", "2", str(script),
                      timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    said = done.stderr.count("--unchanged --shard: the script used a sharded parameter directly (`model.fc.weight`")
    assert said >= 1 and done.stdout.count("Loss:") >= 1, done.stderr  # (trained, then met the shard)


ZERO2 = """
import copy, sys
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed.tensor import DTensor
from ddpkit.strategies.sharded_in_place import shard_in_place, shard_on_the_way
from ddpkit.unchanged.optimizers import Optimizers

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_default_dtype(torch.float64)
optimizers = Optimizers(rank=rank)
optimizers.install()
for layout in sys.argv[1:]:  # each layout a model of its own, in one launch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    alone = copy.deepcopy(model)  # one device's, trained on the whole batch in this process
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    alone_optimizer = torch.optim.Adam(alone.parameters(), lr=0.01)
    if rank == 1:  # rank 0's values are the model's, however it is sharded
        with torch.no_grad():
            model[0].weight.add_(1.0)
    if layout == "arriving":  # on its way to the device (the CPU here): made there from rank 0's rows alone
        moved = shard_on_the_way(model, torch.device("cpu"), reshard_after_forward=True, weight=lambda: 0.5)
    else:
        moved = shard_in_place(model, reshard_after_forward=layout == "full", weight=lambda: 0.5)
    optimizers.repoint(moved, "Sequential")
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    for step in range(3):
        output = model(x[4 * rank:4 * rank + 4])  # this rank's half; FSDP averages the halves' gradients
        whole_after_forward = not isinstance(model[2].weight, DTensor)
        F.cross_entropy(output, y[4 * rank:4 * rank + 4]).backward()
        optimizer.step()
        optimizer.zero_grad()
        F.cross_entropy(alone(x), y).backward()
        alone_optimizer.step()
        alone_optimizer.zero_grad()
    try:  # an optimizer built over the sharded parameters that does not step each element alone: at its first step
        torch.optim.LBFGS(model.parameters()).step(lambda: 0.0)
    except Exception as error:
        print(f"rank {rank}: {layout}: {type(error).__name__}: {error}")
    # A whole state dict is rank 0's alone; the others hold stand-ins of one element each, and load it from rank 0.
    state, moments, expected = model.state_dict(), optimizer.state_dict(), alone.state_dict()
    held = sorted({value.untyped_storage().nbytes() // value.element_size() for value in
                   [*state.values(), *(value for each in moments["state"].values() for value in each.values()
                                       if value.dim())]
                   if value.numel() > 1})
    worst = max((state[key] - expected[key]).abs().max().item() for key in expected) if rank == 0 else 0.0
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.to_local().zero_()
    model.load_state_dict(state)
    optimizer.load_state_dict(moments)
    reloaded = model.state_dict()
    if rank == 0:
        worst = max(worst, *((reloaded[key] - expected[key]).abs().max().item() for key in expected))
    print(f"rank {rank}: {layout} whole after forward {whole_after_forward}, sharded between steps "
          f"{isinstance(model[2].weight, DTensor)}, worst {worst:.1e}, held {held}")
dist.destroy_process_group()
"""
LAYOUTS = ("zero2", "full", "arriving")


@pytest.fixture(scope="module")
def layouts_run(tmp_path_factory, sharding_torch) -> str:
    """The ZeRO-2, fully sharded and on-the-way layouts, each a model of its own, in one 2-process launch: its
    output."""
    folder = tmp_path_factory.mktemp("zero2")
    script = folder / "zero2.py"
    script.write_text(ZERO2)
    done = run_ddpkit("run", "--nproc-per-node", "2", str(script), *LAYOUTS, timeout=120, cwd=folder)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("layout, whole_during_step", [("zero2", True), ("full", False), ("arriving", False)])
def test_zero2_full_and_on_the_way_layouts_train_as_one_device_from_rank_0s_values(
        layouts_run, layout, whole_during_step):
    found = re.findall(rf"rank (\d): {layout} whole after forward (\w+), sharded between steps (\w+), worst (\S+), "
                       r"held (.*)", layouts_run)
    assert len(found) == 2, layouts_run
    for rank, whole, sharded, worst, held in found:
        assert (whole, sharded) == (str(whole_during_step), "True") and float(worst) < 1e-12
        # Rank 0 holds the whole state dicts (model and optimizer), rank 1 one element for each tensor, and loads
        # rank 0's values.
        assert (held == "[1]") == (rank == "1"), layouts_run
    said = f"{layout}: UsageError: --unchanged --shard: LBFGS steps a sharded model's parameters"
    assert layouts_run.count(said) == 2, layouts_run


def test_an_optimizers_state_not_shaped_as_its_parameter_cannot_be_sharded_and_is_refused_in_one_line():
    from ddpkit.unchanged.optimizers import Optimizers

    weight = nn.Parameter(torch.zeros(4, 6))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    optimizer.state[weight] = {"row_variance": torch.zeros(4)}  # a factored second moment, as Adafactor keeps
    optimizers = Optimizers(rank=0)
    optimizers.built.add(optimizer)
    with pytest.raises(UsageError, match=r"^--unchanged --shard: SGD holds state 'row_variance' for a parameter of "
                                         r"Net shaped \(4,\), not as the parameter \(4, 6\), so it cannot be sharded"):
        optimizers.repoint({weight: nn.Parameter(torch.zeros(4, 6))}, "Net")


@pytest.mark.slow
def test_means_over_counted_items_train_and_print_sharded_as_on_one_process(tmp_path, sharding_torch, counted_one):
    """tests/unchanged_counted_script.py (a transformers LM on padded batches, with and without num_items_in_batch; a
    loss with ignore_index in the script; class weights) with --shard always on 2 processes against 1."""
    from test_unchanged import assert_counted_means_as_on_one_process, counted_run

    assert_counted_means_as_on_one_process(counted_one, counted_run(tmp_path, 2, "--shard", "always"))


@pytest.mark.slow
def test_averaged_copies_of_a_sharded_model_are_sharded_alike_and_update_as_on_one_process(tmp_path, sharding_torch):
    """tests/unchanged_ema_script.py: an ``AveragedModel`` EMA built before training, with ``update_bn``; a deep copy
    taken after the first step, updated by the script's own loop; timm's ``ModelEmaV3``, which reads both models'
    state dicts at every update. Sharded on 2 processes against 1, in float64."""
    pytest.importorskip("timm", reason="the script's last model is timm's")
    found = []
    for processes in (1, 2):
        out = tmp_path / str(processes)
        out.mkdir()
        done = run_ddpkit("run", "--unchanged", "--seed", "5", "--shard", "always", "--nproc-per-node", str(processes),
                          str(Path(__file__).parent / "unchanged_ema_script.py"), str(out), timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        found.append(torch.load(out / "result.pt", weights_only=True))
    one, two = found
    for name in ("model", "averaged", "own", "net", "ema"):  # (the averaged model's n_averaged, BatchNorm's counts)
        assert _worst(one["weights"][name], two["weights"][name]) < 1e-9, name
        assert all(torch.equal(value, two["weights"][name][key]) for key, value in one["weights"][name].items()
                   if not value.is_floating_point()), name
    for name, loss in one["evaluations"].items():
        assert two["evaluations"][name] == pytest.approx(loss, rel=1e-9), name
    # The EMA kept in float32 of a float64 model: float32's rounding of what reaches it.
    assert _worst(one["weights"]["ema32"], two["weights"]["ema32"]) < 1e-6
    assert {value.dtype for value in two["weights"]["ema32"].values() if value.is_floating_point()} == {torch.float32}
    # Each copy is sharded (each process holds its shards), and its state dict whole and plain, one device's keys.
    assert two["classes"] == {"averaged": ["DTensor"], "own": ["DTensor"], "ema": ["DTensor"], "ema32": ["DTensor"]}
    assert one["classes"] == {"averaged": ["Parameter"], "own": ["Parameter"], "ema": ["Parameter"],
                              "ema32": ["Parameter"]}
    assert all(type(value) is torch.Tensor for weights in two["weights"].values() for value in weights.values())


PAIRED = """
import copy, json, sys
import torch, torch.distributed as dist, torch.nn as nn
from ddpkit.core.process_group import teardown
from ddpkit.strategies.sharded_in_place import in_rank_zeros_order

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
copies = [copy.deepcopy(model).double(), copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model).double()]
with torch.no_grad():
    copies[2][0].weight.add_(1.0)
    copies[3][1].bias.add_(1.0)
mine = copies if dist.get_rank() == 0 else [copies[i] for i in (2, 3, 1, 0)]
print(json.dumps([copies.index(found) for found in in_rank_zeros_order(mine)]))
teardown()
"""


def test_copies_of_a_model_are_paired_with_rank_0s_by_their_values_whatever_order_python_tracks_them_in(tmp_path):
    """``in_rank_zeros_order``: the copies found among the objects Python tracks came in another order on each rank
    where collections had run at other times (tests/unchanged_ema_script.py on the suite's warm ranks: an EMA in float32
    before the one in float64 on one rank, after it on the other, and their broadcasts did not pair). Here rank 1 finds
    them in another order than rank 0: two in float64 and two in float32, one of each with values of its own."""
    script = tmp_path / "paired.py"
    script.write_text(PAIRED)
    # (The script ends its group as ddpkit does, with ``teardown``. Its own ``dist.destroy_process_group()`` right
    # after the broadcast hung on the floor's torch 2.4 about one run in three: torch's bug that
    # ``process_group._destroy`` works around, met by a script that calls ``in_rank_zeros_order`` itself.)
    done = run_ddpkit("run", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(script), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert (tmp_path / "logs" / f"rank{rank}.log").read_text().strip().endswith("[0, 1, 2, 3]")


def test_a_move_to_a_gpu_by_the_script_shards_a_model_on_the_way_where_shard_says_so(monkeypatch, caplog):
    """``model.to(device)`` / ``model.cuda()`` from the script's code, outside a forward: ``Adoption.move`` decides
    (``always``; ``auto`` where a replica with its parameters arriving would not fit), and the model is sharded there
    by ``shard_on_the_way`` (run for real on 2 processes in the test above: this machine has no GPU to move to).
    Everything else is the original ``Module.to``."""
    from ddpkit.core.logs import logger
    from ddpkit.strategies import sharded_in_place
    from ddpkit.unchanged.batches import Batch
    from ddpkit.unchanged.models import Models
    from ddpkit.unchanged.optimizers import Optimizers

    sharded = []
    monkeypatch.setattr(sharded_in_place, "shard_on_the_way",
                        lambda module, device, **options: sharded.append((module, device, options)) or {})
    monkeypatch.setattr(sharded_in_place, "copies_of", lambda module, not_these: {})
    monkeypatch.setattr(layouts, "least_of_all_ranks", lambda memory, device: memory)
    model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.ReLU(), nn.Linear(1024, 1024, bias=False))  # 8 MiB
    frozen = nn.Linear(4, 4).requires_grad_(False)
    real_to, originals = nn.Module.to, []

    def original_to(module, *args, **kwargs):  # the original, but a move to a GPU (none here) is only recorded
        if "cuda" in f"{args}{kwargs}":
            return originals.append(module)
        return real_to(module, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to", original_to)
    monkeypatch.setattr(nn.Module, "cuda", lambda module, device=None: originals.append(module))
    for shard, free, expected in (("always", GiB, "full"), ("auto", GiB // 4 + 34 * MiB, None),
                                  ("auto", GiB // 4 + 30 * MiB, "zero2"), ("never", 0, None)):
        models = Models(rank=0, world_size=2, batch=Batch(world_size=2), streams=None, witness=lambda **_: None,
                        shard=shard, optimizers=Optimizers(rank=0))
        monkeypatch.setattr(layouts, "device_memory", lambda device, free=free: (int(free), GiB))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        models.install()
        try:
            sharded.clear()
            assert model.to(torch.float32) is model and frozen.to("cpu") is frozen  # not a GPU: the original's
            caplog.clear()
            logger.addHandler(caplog.handler)
            with caplog.at_level(logging.INFO, logger=logger.name):
                moved = model.to("cuda") if expected != "zero2" else model.cuda()
            logger.removeHandler(caplog.handler)
            if expected is None:  # a replica fits (32 MiB with the parameters arriving), or never: the original's,
                # and nothing said (the first call weighs it again, and says so)
                assert not sharded and moved is None and originals[-1] is model and not caplog.records
            else:
                assert moved is model and [(module, str(device)) for module, device, _ in sharded] == [
                    (model, "cuda:0")]
                assert sharded[0][2]["reshard_after_forward"] == (expected == "full")
                assert caplog.records[-1].getMessage().endswith("; on its way to cuda:0)")
            sharded.clear()
            models.depth = 1  # inside a forward: the original's
            assert frozen.cuda() is None and model.to("cuda") is None and not sharded and originals[-2:] == [frozen,
                                                                                                             model]
            models.depth = 0
        finally:
            models.uninstall()
    assert nn.Module.to is original_to


def test_an_averaged_model_over_buffers_too_is_refused_in_one_line_before_training():
    from torch.optim.swa_utils import AveragedModel

    from ddpkit.strategies.sharded_in_place import averaged_with_buffers

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    plain, over_buffers = AveragedModel(model), AveragedModel(model, use_buffers=True)
    assert averaged_with_buffers([plain, model], [plain.module]) is None  # (the parameters alone: sharded alike)
    said = averaged_with_buffers([plain, over_buffers, model], [plain.module, over_buffers.module])
    assert said.startswith("--unchanged --shard: AveragedModel(..., use_buffers=True) averages the model's buffers")
    assert said.endswith("or run with --shard never") and "\n" not in said


@pytest.mark.slow
@pytest.mark.parametrize("part, said", [("routed", "Routed calls its block Linear only where its data says so"),
                                        ("detected", "Detector computes a loss (smooth_l1_loss) only where its data"),
                                        ("renormed", "Factors holds an Embedding with max_norm")])
def test_a_model_that_skips_a_sharded_block_or_a_loss_where_its_data_says_is_refused_in_one_line(
        sharding_torch, tmp_path, part, said):
    """The steps script's parts under ``--shard always``: experts that a router calls only where a row reaches
    them (``if rows.any():``), each a sharded block; a detector whose box loss its forward computes only where its
    batch holds a positive, which its first batch does not. Its first call, whole, shows it, and the run stops there
    in one line, exit status 2, on every process alike (before: the second batch's shares skipped an expert on one
    process, and FSDP's all-gather of its parameters waited forever on the other; computed the box loss on one
    process, whose all-reduce of the loss's count found no partner). And embeddings whose forward renormalises their
    rows (``max_norm``), refused before sharding (before: silently 7.1 from one process, the gathered weights that
    it wrote dropped)."""
    from test_unchanged import STEPS

    done = run_ddpkit("run", "--unchanged", "--seed", "3", "--shard", "always", "--nproc-per-node", "2", STEPS,
                      str(tmp_path), part, timeout=90, cwd=tmp_path)
    assert done.returncode == 2, f"{done.stdout}\n{done.stderr}"
    assert done.stderr.count(f"--unchanged --shard: {said}") == 1
    assert "Traceback" not in done.stderr and "run with --shard never" in done.stderr


@pytest.mark.slow
def test_steps_that_take_the_gathered_way_train_sharded_as_on_one_process(sharding_torch, tmp_path, steps_one):
    """tests/unchanged_steps_script.py under ``--shard always`` on 2 processes against 1: every printed line and every
    weight to 1e-9 (the gathered way with FSDP2's averaging). Its part penalty, a gradient penalty (a second backward
    through the sharded critic, which FSDP cannot take as one device would: 8.2e-3 before), is refused in one line,
    exit status 2, at its first step; the parts after it (sparse embeddings, which a shard cannot hold; gradients
    taken with respect to sharded weights; a TorchScript model; experts that a router skips on some shares only, whose
    sharded blocks would not all-gather alike on every rank; two backward passes through one call) are not
    reached."""
    from test_unchanged import assert_steps_as_on_one_process, steps_run

    weights, printed, said = steps_run(tmp_path, 2, "--shard", "always", expect=2)
    assert said.count("FSDP cannot differentiate twice through a sharded model") == 1 and "Traceback" not in said, said
    late = ("penalty", "sparse", "taken", "scripted", "routed", "detected", "renormed", "again")  # (refused, after)
    one = ({part: value for part, value in steps_one[0].items() if part not in late},
           [line for line in steps_one[1] if line.split(" ")[0] not in late], steps_one[2])
    assert not set(late) & set(weights) and not any(line.split(" ")[0] in late for line in printed), printed
    assert_steps_as_on_one_process(one, (weights, printed, said))
