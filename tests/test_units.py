"""Pure unit tests: sampler arithmetic, device/backend choice, launcher command lines, config validation."""

import collections
import os
import socket
import threading
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from ddpkit.core import network
from ddpkit.data import eval_indices, train_loader
from ddpkit.core.env import DistEnv
from ddpkit.core.errors import UsageError
from ddpkit.launch.launcher import LaunchOptions, resolve_nproc, torchrun_argv
from ddpkit.core.process_group import Runtime, choose_backend, choose_device, free_port, job_store
from ddpkit.launch.rendezvous import bind_address
from ddpkit.app.train.config import TrainConfig
from listening import listening


def runtime(rank: int, world: int) -> Runtime:
    return Runtime(env=DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world),
                   backend="gloo" if world > 1 else None, device=torch.device("cpu"))


def dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def epoch_batches(n: int, world: int, batch: int, epoch: int, seed: int = 0) -> list[list[list[int]]]:
    """batches[rank][step] = sample ids, through ddpkit's own train_loader."""
    out = []
    for rank in range(world):
        loader = train_loader(dataset(n), batch_size=batch, runtime=runtime(rank, world), seed=seed, workers=0)
        loader.set_epoch(epoch)
        out.append([b[0].tolist() for b in loader])
    return out


@pytest.mark.parametrize("n", [96, 101, 127])
def test_each_kept_sample_once_per_epoch_across_ranks(n):
    batches = epoch_batches(n, world=2, batch=8, epoch=0)
    assert len(batches[0]) == len(batches[1]) == n // 16  # equal step counts: no rank waits for another
    seen = collections.Counter(i for rank in batches for step in rank for i in step)
    assert set(seen.values()) == {1}
    assert len(seen) == (n // 16) * 16  # only the last incomplete *global* batch is left out


@pytest.mark.parametrize("n", [96, 101])
def test_global_order_is_the_same_for_world_sizes_1_and_2(n):
    one = epoch_batches(n, world=1, batch=16, epoch=3)[0]
    two = epoch_batches(n, world=2, batch=8, epoch=3)
    assert len(one) == len(two[0])
    for step, big in enumerate(one):
        assert sorted(two[0][step] + two[1][step]) == sorted(big)


def test_a_new_order_each_epoch_without_calling_set_epoch():
    loader = train_loader(dataset(64), batch_size=8, runtime=runtime(0, 1), seed=0, workers=0)
    first = [b[0].tolist() for b in loader]
    second = [b[0].tolist() for b in loader]  # the loader moves to the next epoch by itself
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, []))
    loader.set_epoch(0)
    assert [b[0].tolist() for b in loader] == first  # and is reproducible from seed and epoch


def test_order_depends_on_the_seed():
    assert epoch_batches(64, 1, 8, 0, seed=0) != epoch_batches(64, 1, 8, 0, seed=1)


@pytest.mark.parametrize("n, padding", [(96, 0), (101, 1)])
def test_without_drop_last_every_sample_is_seen_and_only_padding_repeats(n, padding):
    ids = []
    for rank in range(2):
        loader = train_loader(dataset(n), batch_size=8, runtime=runtime(rank, 2), seed=0, workers=0, drop_last=False)
        ids += [i for batch in loader for i in batch[0].tolist()]
    counts = collections.Counter(ids)
    assert set(counts) == set(range(n))  # every sample, the last partial batch included
    assert len(ids) == n + padding  # DistributedSampler evens the ranks out with `padding` repeats


def test_distributed_sampler_without_drop_last_pads_with_duplicates():
    # Why evaluation must not use DistributedSampler: with drop_last off it repeats samples to even out.
    from torch.utils.data import DistributedSampler

    ids = [i for r in range(2) for i in DistributedSampler(dataset(11), num_replicas=2, rank=r, shuffle=False)]
    counts = collections.Counter(ids)
    assert len(ids) == 12 and set(counts) == set(range(11)) and sorted(counts.values())[-1] == 2


@pytest.mark.parametrize("n, world", [(11, 2), (10, 2), (7, 3), (1, 2), (5, 1)])
def test_eval_shards_cover_every_sample_exactly_once(n, world):
    ids = [i for rank in range(world) for i in eval_indices(n, rank, world)]
    assert sorted(ids) == list(range(n))


def test_too_small_a_dataset_for_one_global_batch():
    with pytest.raises(UsageError, match=r"10 samples, fewer than one global batch of 16 \(8 per process x 2"):
        train_loader(dataset(10), batch_size=8, runtime=runtime(0, 2), workers=0)


def test_device_choice():
    assert choose_device("auto", local_rank=0, local_world_size=2, cuda_count=0) == "cpu"
    assert choose_device("auto", local_rank=1, local_world_size=2, cuda_count=2) == "cuda"
    # 4 processes, 2 GPUs: they cannot each own one, so auto stays on the CPU.
    assert choose_device("auto", local_rank=0, local_world_size=4, cuda_count=2) == "cpu"
    with pytest.raises(UsageError, match="no CUDA GPU is visible"):
        choose_device("cuda", local_rank=0, local_world_size=1, cuda_count=0)
    with pytest.raises(UsageError, match="local rank 2 has no GPU of its own: 2 visible for 4 processes"):
        choose_device("cuda", local_rank=2, local_world_size=4, cuda_count=2)


def test_backend_choice():
    assert choose_backend("auto", device="cpu", local_world_size=2, cuda_count=0) == "gloo"
    assert choose_backend("gloo", device="cuda", local_world_size=2, cuda_count=2) == "gloo"
    with pytest.raises(UsageError, match=r"nccl needs one CUDA GPU per process, but 0 GPU\(s\) are visible for 2"):
        choose_backend("nccl", device="cpu", local_world_size=2, cuda_count=0)


def test_a_free_port_for_a_later_bind_is_bindable_and_outside_the_kernels_ephemeral_range(tmp_path, monkeypatch):
    """Outside it, no outgoing connection can take the port before mp.spawn's rank 0 binds it (the kernel hands
    ephemeral ports to every connection: a race that failed a --launcher spawn test once in six suite runs)."""
    from ddpkit.core.process_group import LOWEST_PICKED_PORT, ephemeral_ports

    low, high = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST_PICKED_PORT <= port < low for port in ports), (ports, low)
    assert len(ports) > 1  # a random pick, not one fixed port every process would try first
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("1024\t65000\n")
    assert ephemeral_ports(str(ranges)) == (1024, 65000)
    assert ephemeral_ports(str(tmp_path / "absent")) == (32768, 60999)
    from ddpkit.core import process_group

    monkeypatch.setattr(process_group, "ephemeral_ports", lambda: (1024, 65000))
    assert 1024 <= free_port() <= 65000  # no room below the range: the kernel's own pick


def _stores_of_a_two_rank_job(master_addr: str, *, local_world_size: int) -> tuple[int, set]:
    """Rank 0's and rank 1's job_store, made in this process (rank 0 waits for rank 1 in a thread): the port
    and what this process then listens on."""
    port = free_port()
    environments = [DistEnv(rank=rank, local_rank=rank % local_world_size, world_size=2,
                            local_world_size=local_world_size, master_addr=master_addr, master_port=port)
                    for rank in (0, 1)]
    made = {}
    host = threading.Thread(target=lambda: made.update(rank0=job_store(environments[0], timeout_s=30)))
    host.start()
    made["rank1"] = job_store(environments[1], timeout_s=30)
    host.join()
    made["rank1"].set("from rank 1", "seen")
    assert made["rank0"].get("from rank 1") == b"seen"  # one store: rank 1 reached rank 0's
    return port, {found for found in listening(os.getpid()) if found[1] == port}


def test_the_job_store_listens_on_loopback_when_every_rank_is_on_this_machine():
    # MASTER_ADDR names this machine (torchrun gives its host name): every rank connects to 127.0.0.1 instead.
    port, found = _stores_of_a_two_rank_job(socket.gethostname(), local_world_size=2)
    assert found == {("127.0.0.1", port)}


def test_the_job_store_across_machines_listens_on_the_address_the_other_nodes_use():
    address = next((ip for ip in network.addresses().values() if not network.is_loopback(ip)), None)
    if address is None:
        pytest.skip("this machine has no address besides loopback")
    port, found = _stores_of_a_two_rank_job(address, local_world_size=1)
    assert found == {(address, port)}
    # A MASTER_ADDR that resolves to loopback here although the job spans machines (the host-name trap) or
    # that is not this machine's: every interface, as PyTorch's own store.
    assert bind_address("127.0.0.1", one_machine=False) is None and bind_address("192.0.2.254", one_machine=False) is None
    assert bind_address(address, one_machine=False) == address


def test_torchrun_command_line_single_node_uses_a_free_port():
    assert torchrun_argv(LaunchOptions(nproc_per_node=2), ["x.py"]) == [
        "--nproc-per-node", "2", "--rdzv-backend", "ddpkit-loopback", "--rdzv-endpoint", "127.0.0.1:0",
        "--rdzv-id", f"ddpkit-{os.getpid()}", "--max-restarts", "0", "x.py"]


def test_torchrun_command_line_multi_node_passes_flags_through():
    argv = torchrun_argv(LaunchOptions(nproc_per_node=4, nnodes=2, node_rank=1, master_addr="10.0.0.1"), ["-m", "m"])
    assert argv == ["--nproc-per-node", "4", "--nnodes", "2", "--rdzv-backend", "ddpkit-static", "--rdzv-endpoint",
                    "10.0.0.1:29500", "--rdzv-conf", "rank=1,timeout=900", "--max-restarts", "0", "-m", "m"]
    waiting = LaunchOptions(nnodes=2, master_addr="h", rdzv_timeout_s=30.5)
    assert torchrun_argv(waiting, ["x.py"])[-5:-3] == ["--rdzv-conf", "rank=0,timeout=31"]
    elastic = LaunchOptions(nnodes=2, rdzv_endpoint="h:29400", rdzv_timeout_s=60)
    assert torchrun_argv(elastic, ["x.py"])[-5:-3] == ["--rdzv-conf", "join_timeout=60"]


def test_nproc_auto():
    assert resolve_nproc("auto", cuda_count=0) == 2
    assert resolve_nproc("auto", cuda_count=8) == 8
    assert resolve_nproc("3") == 3
    with pytest.raises(UsageError, match="whole number or auto, got 'x'"):
        resolve_nproc("x")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"nproc_per_node": 0}, "--nproc-per-node must be at least 1"),
        ({"nnodes": 2, "node_rank": 2, "master_addr": "h"}, r"--node-rank must be in 0..1 for --nnodes 2, got 2"),
        ({"master_port": 70000}, "--master-port must be in 1..65535"),
        ({"launcher": "spawn", "nnodes": 2, "master_addr": "h"}, "spawn starts processes on this machine only"),
        ({"launcher": "spawn", "max_restarts": 1}, "--max-restarts needs torchrun's elastic agent"),
        ({"nnodes": 2}, "--nnodes 2 needs --master-addr"),
        ({"rdzv_timeout_s": float("nan")}, "--rdzv-timeout must be a finite number of seconds above 0, got nan"),
        ({"rdzv_timeout_s": 0.0}, "--rdzv-timeout must be a finite number of seconds above 0, got 0.0"),
    ],
)
def test_launch_options_validation(options, message):
    with pytest.raises(UsageError, match=message):
        LaunchOptions(**options)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"epochs": -1}, "--epochs must be at least 1, got -1"),
        ({"batch_size": 0}, "--batch-size must be at least 1, got 0"),
        ({"accumulate": 0}, "--accumulate must be at least 1"),
        ({"lr": -0.1}, "--lr must be a positive number"),
        ({"model": "resnet5"}, r"unknown model 'resnet5' \(did you mean"),
        ({"data": "imagenet"}, "unknown data set 'imagenet'"),
        ({"data": "synthetic:0"}, "positive whole number"),
        ({"data": "folder:/nonexistent/x"}, "folder '/nonexistent/x' does not exist"),
        ({"sync_bn": True, "strategy": "single"}, "--sync-bn .* needs --strategy ddp"),
        ({"bucket_cap_mb": 0}, "--bucket-cap-mb must be positive"),
        ({"timeout": float("nan")}, "--timeout must be a finite number of seconds, at least 1, got nan"),
        ({"output_dir": ""}, "--output-dir needs a folder, got an empty name"),
    ],
)
def test_train_config_validation(fields, message):
    with pytest.raises(UsageError, match=message):
        TrainConfig(**fields).validate()


def test_every_train_setting_is_one_flag_with_the_configs_default_and_choices():
    import dataclasses

    from ddpkit.app.cli import _train_config, build_parser

    parser = build_parser()
    assert _train_config(parser.parse_args(["train"])) == TrainConfig()
    flags = parser.parse_args(["train", "--batch-size", "8", "--no-progress", "--zero", "--lr", "0.5",
                               "--split-at", "layer3", "--amp", "bf16"])
    assert dataclasses.asdict(_train_config(flags)) == {
        **dataclasses.asdict(TrainConfig()), "batch_size": 8, "progress": False, "zero": True, "lr": 0.5,
        "split_at": "layer3", "amp": "bf16"}
    train = next(action for action in parser._actions if action.dest == "command").choices["train"]
    by_dest = {action.dest: action for action in train._actions}
    for field in dataclasses.fields(TrainConfig):
        assert field.name in by_dest, f"{field.name} has no flag"
        if field.metadata.get("choices"):
            assert tuple(by_dest[field.name].choices) == tuple(field.metadata["choices"])


def test_the_config_module_docstring_example_runs():
    import doctest

    from ddpkit.app import config

    failures, tried = doctest.testmod(config)
    assert tried >= 6 and failures == 0


def test_secrets_in_the_environment_are_never_printed_or_recorded():
    import doctest

    from ddpkit.launch import nccl

    failures, tried = doctest.testmod(nccl)
    assert tried >= 2 and failures == 0
    environ = {"NCCL_IB_PASSWORD": "hunter2", "NCCL_ALGO": "Ring", "GLOO_AUTH_TOKEN": "t0k", "NCCL_IB_PKEY": "3"}
    assert nccl.in_effect(environ) == {"NCCL_ALGO": "Ring", "NCCL_IB_PASSWORD": "<hidden>", "NCCL_IB_PKEY": "3"}
    assert nccl.in_effect(environ, prefixes=("GLOO_",)) == {"GLOO_AUTH_TOKEN": "<hidden>"}


def test_batchnorm_is_found_where_it_is_and_only_there():
    from ddpkit.app.train.resume import has_batchnorm
    from ddpkit.zoo import ConvNet, Net

    assert has_batchnorm(Net()) and not has_batchnorm(ConvNet())


def test_batchnorm_over_all_ranks_is_pytorchs_where_the_mean_dwarfs_the_spread(group_of_one):
    """``synced_batch_norm`` (here over a group of one) against PyTorch's BatchNorm on the same rows, in float32 with a
    mean 500 times the spread: its statistics come from sums of squares about each rank's own mean. Sums of the raw
    squares, even accumulated in float64, lost digits there: the input's gradient was 4.3e-5 away. In float64, its
    gradients are checked against finite differences."""
    import torch.nn as nn

    from ddpkit.strategies.sync_bn import synced_batch_norm

    torch.manual_seed(0)
    synced, plain = nn.BatchNorm2d(8), nn.BatchNorm2d(8)
    with torch.no_grad():
        synced.weight.uniform_(), synced.bias.uniform_()
    plain.load_state_dict(synced.state_dict())
    rows = (torch.randn(16, 8, 9, 9) * 2 + 1e3).requires_grad_()
    theirs = rows.detach().clone().requires_grad_()
    grad = torch.randn_like(rows)
    synced_batch_norm(synced, rows).backward(grad)
    plain(theirs).backward(grad)

    def apart(mine, reference):
        return float((mine - reference).norm() / reference.norm())

    assert apart(rows.grad, theirs.grad) < 1e-5 and apart(synced.running_var, plain.running_var) < 1e-6
    assert apart(synced.weight.grad, plain.weight.grad) < 1e-4 and apart(synced.running_mean, plain.running_mean) < 1e-6
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):  # (no rows: torch's own error)
        synced_batch_norm(nn.BatchNorm2d(8), torch.empty(0, 8, 9, 9))
    layer = nn.BatchNorm2d(3).double()
    small = torch.randn(4, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, weight, bias: synced_batch_norm(layer, x), (small, layer.weight,
                                                                                           layer.bias))


def test_waiting_until_only_python_holds_tensors_returns_once_the_other_holder_lets_go():
    from ddpkit.data import wait_until_only_python_holds

    tensor = torch.zeros(1)
    holder = [tensor.view(1)]  # another reference to its TensorImpl, as gloo's thread holds a collective's
    threading.Timer(0.05, holder.clear).start()
    started = time.monotonic()
    wait_until_only_python_holds([tensor], timeout_s=30)
    assert tensor._use_count() == 1 and time.monotonic() - started < 20
    held = tensor.view(1)  # never let go: it gives up after its timeout
    wait_until_only_python_holds([tensor], timeout_s=0.05)
    assert tensor._use_count() == 2 and held is not None


def test_variables_set_for_a_block_are_as_before_after_it(monkeypatch):
    from ddpkit.launch.launcher import variables_set

    monkeypatch.setenv("DDPKIT_TEST_KEPT", "before")
    monkeypatch.delenv("DDPKIT_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError), variables_set({"DDPKIT_TEST_KEPT": "inside", "DDPKIT_TEST_NEW": "1"}):
        assert os.environ["DDPKIT_TEST_KEPT"] == "inside" and os.environ["DDPKIT_TEST_NEW"] == "1"
        raise RuntimeError("the block failed")
    assert os.environ["DDPKIT_TEST_KEPT"] == "before" and "DDPKIT_TEST_NEW" not in os.environ


def test_a_feature_for_a_newer_torch_is_refused_in_one_line_naming_it(monkeypatch):
    from ddpkit.core import version

    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    assert version.torch_at_least("2.4") and version.torch_at_least("2.4.1") and not version.torch_at_least("2.5")
    with pytest.raises(UsageError) as caught:
        version.require_torch("2.7", "`strategy` fsdp on the CPU")
    assert str(caught.value) == ("`strategy` fsdp on the CPU needs torch>=2.7 (this is torch 2.4.1+cu121); "
                                 "upgrade it: pip install -U 'torch>=2.7'")
    monkeypatch.setattr(torch, "__version__", "2.9.0a0+git1234")  # a nightly of 2.9 has 2.9's features
    assert version.torch_at_least("2.9") and not version.torch_at_least("2.10")
    version.require_torch("2.7", "`strategy` fsdp on the CPU")
