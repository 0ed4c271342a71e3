"""GPU-only checks (NCCL, DataParallel, AMP); run on a machine with CUDA: `pytest -m gpu`."""

import pytest
import torch

from conftest import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SMALL = ["--model", "convnet", "--data", "synthetic:256", "--epochs", "1", "--batch-size", "32"]


def test_ddp_on_one_gpu_with_nccl_and_bf16(tmp_path):
    _, rows = train(tmp_path, *SMALL, "--nproc-per-node", "1", "--backend", "nccl", "--amp", "bf16")
    assert rows[0]["world_size"] == 1


def test_fp16_with_grad_scaler(tmp_path):
    _, rows = train(tmp_path, *SMALL, "--nproc-per-node", "1", "--amp", "fp16")
    assert rows[0]["train_loss"] == rows[0]["train_loss"]  # not NaN


def test_data_parallel_matches_single(tmp_path):
    single, _ = train(tmp_path / "single", *SMALL, "--nproc-per-node", "1", "--strategy", "single")
    dp, _ = train(tmp_path / "dp", *SMALL, "--nproc-per-node", "1", "--strategy", "dp")
    for key in single:
        torch.testing.assert_close(dp[key], single[key], rtol=1e-4, atol=1e-5)


def test_debug_shows_each_rank_on_its_own_gpu(tmp_path):
    from conftest import run_ddpkit

    n = torch.cuda.device_count()
    result = run_ddpkit("train", *SMALL, "--nproc-per-node", str(n), "--debug", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for rank in range(n):
        assert f"[rank{rank}]: ddpkit: local rank {rank}, pid " in result.stderr
        assert f"data: cuda:{rank}, model: cuda:{rank}" in result.stderr


def test_bench_on_the_gpus_reports_dp_memory_per_gpu_and_bf16(tmp_path):
    import json

    from conftest import run_ddpkit

    n = torch.cuda.device_count()
    result = run_ddpkit("bench", "--model", "resnet18", "--nproc", f"1,{n}", "--precision", "bf16", "--channels-last",
                        "--steps", "5", "--warmup", "3", "--repeats", "2", "--json", str(tmp_path / "b.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "b.json").read_text())
    dp = [r for r in report["results"] if r["strategy"] == "dp"]
    assert dp and all(len(r["peak_memory_bytes"]) == n for r in dp)
    assert report["environment"]["devices"] and report["environment"]["nccl"]


def test_resume_state_with_cuda_rng_round_trips(tmp_path):
    from ddpkit import checkpoint

    torch.cuda.manual_seed(3)
    state = checkpoint.rng_state(torch.device("cuda", 0))
    expected = torch.rand(4, device="cuda")
    checkpoint.atomic_save({"rng": state}, tmp_path / "rng.pt")
    torch.cuda.manual_seed(9)
    checkpoint.set_rng_state(checkpoint.load_file(tmp_path / "rng.pt")["rng"], torch.device("cuda", 0))
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_fsdp_saves_sharded_checkpoints_asynchronously_from_the_gpu(tmp_path):
    # CUDA tensors staged to host memory by DCP's async save, its collectives on a gloo group beside NCCL;
    # the epoch's last checkpoint holds the model that model.pt holds.
    from ddpkit.app.cli import main

    state, _ = train(tmp_path, *SMALL, "--nproc-per-node", "1", "--backend", "nccl", "--strategy", "fsdp",
                     "--async-checkpoint", "--checkpoint-every", "3")
    assert main(["checkpoint", "export", str(tmp_path), str(tmp_path / "exported.pt")]) == 0
    exported = torch.load(tmp_path / "exported.pt", weights_only=True)
    assert exported.keys() == state.keys() and all(torch.equal(exported[k], state[k]) for k in state)


def test_batches_reach_the_gpu_ahead_on_a_thread_and_stream_of_their_own_in_order():
    import ddpkit
    from torch.utils.data import TensorDataset

    x, y = torch.arange(64 * 3, dtype=torch.float32).view(64, 3), torch.arange(64)
    with ddpkit.Job("single", device="cuda") as job:
        loader = job.train_loader(TensorDataset(x, y), batch_size=8, shuffle=False, workers=1)  # on the thread
        for _ in range(2):
            seen = []
            for inputs, labels in loader:
                assert inputs.is_cuda and torch.equal(inputs.cpu(), x[labels.cpu()])
                torch.cuda._sleep(2_000_000)  # a long kernel on the training stream; the next copy runs beside it
                seen.append(labels.cpu())
            assert torch.equal(torch.cat(seen), y)


def test_train_from_jpegs_decoded_on_the_gpu(tmp_path):
    from ddpkit.data.sample_images import write_folder

    write_folder(str(tmp_path / "jpegs"), images=64, classes=4, val_images=16, size=(64, 48))
    _, rows = train(tmp_path / "out", "--model", "convnet", "--image-size", "32", "--data", f"folder:{tmp_path / 'jpegs'}",
                    "--decode", "gpu", "--epochs", "1", "--batch-size", "16", "--nproc-per-node", "1")
    assert rows[0]["skipped_samples"] == 0 and rows[0]["val_count"] == 16
    # auto, measured on the GPU machine: with no loader processes, nvJPEG; said with the measured pace.
    _, rows = train(tmp_path / "auto", "--model", "convnet", "--image-size", "32", "--data",
                    f"folder:{tmp_path / 'jpegs'}", "--workers", "0", "--epochs", "1", "--batch-size", "16",
                    "--nproc-per-node", "1")
    said = (tmp_path / "auto" / "logs" / "rank0.log").read_text()
    assert rows[0]["val_count"] == 16 and "decode auto: gpu: 0 loader processes x " in said, said


def test_asynchronous_saves_from_the_gpu_reuse_one_pinned_copy_and_keep_each_saved_state(tmp_path):
    import torch.nn as nn

    import ddpkit
    from ddpkit.checkpoint import export_model
    from ddpkit.checkpoint.folder import checkpoint_name

    expected = []
    with ddpkit.Job("single", device="cuda") as job:
        model, optimizer = job.setup(nn.Linear(64, 64), torch.optim.Adam, lr=0.1)
        saver = job.checkpointer(tmp_path, model=model, optimizer=optimizer, async_save=True, keep=3)
        for step in range(1, 4):
            job.backward(model(torch.randn(8, 64, device="cuda")).square().mean())
            job.step(optimizer)
            expected.append(model.weight.detach().cpu().clone())
            saver.save(global_step=step)
            if step == 1:
                cache = saver._staging._stager.state_dict_cache  # allocated by the first save
            with torch.no_grad():
                model.weight.add_(1.0)  # training goes on while the copy is written: the file keeps the saved step
        saver.wait()
        assert saver._staging._stager.state_dict_cache is cache  # the same pinned copy, saves 2 and 3
        # The weights and Adam's moments (its 0-dim step counts live on the CPU, and DCP copies them plainly).
        tensors = [t for t in torch.utils._pytree.tree_leaves(cache) if isinstance(t, torch.Tensor) and t.dim() > 0]
        assert len(tensors) >= 6 and all(t.is_pinned() for t in tensors)
    for step, weight in enumerate(expected, start=1):
        export_model(tmp_path / checkpoint_name(step, sharded=True), tmp_path / f"{step}.pt")
        assert torch.equal(torch.load(tmp_path / f"{step}.pt", weights_only=True)["weight"], weight)


def test_the_watch_tells_a_thread_waiting_on_the_gpu_from_one_evaluating():
    # The watch's GPU signal (ddpkit.watch.activity) on a real GPU: a training thread that waits for the device as
    # one in a NCCL collective does (the host spins in a synchronize, allocates nothing, its frame does not move)
    # is not at work; one in a long evaluation of its own (forwards, no progress marks) is.
    import threading
    import time

    from ddpkit.watch.activity import Activity

    device = torch.device("cuda")
    torch.ones(1, device=device)

    def wait_on_the_device(stop: threading.Event) -> None:
        torch.cuda._sleep(10_000_000_000)  # some seconds of one kernel; the thread waits for it
        torch.cuda.synchronize(device)

    def evaluate(stop: threading.Event) -> None:
        model = torch.nn.Linear(512, 512).to(device)
        with torch.no_grad():
            while not stop.is_set():
                model(torch.randn(64, 512, device=device)).sum().item()

    for work, at_work in ((wait_on_the_device, False), (evaluate, True)):
        stop = threading.Event()
        thread = threading.Thread(target=work, args=(stop,))
        thread.start()
        time.sleep(0.3)
        activity = Activity(thread.ident, device)
        readings = []
        for _ in range(3):
            time.sleep(0.5)
            readings.append(activity.working())
        stop.set()
        thread.join()
        assert readings == [at_work] * 3, work.__name__


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks with NCCL need two GPUs (NCCL refuses "
                              "two ranks on one); the one-GPU check of the same signal is the test above")


@TWO_GPUS
def test_a_rank_asleep_while_the_other_waits_in_nccl_is_named(tmp_path):
    from conftest import run_ddpkit

    from test_heartbeat import SLEEPER

    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    result = run_ddpkit("run", "--stall-timeout", "5", "--nproc-per-node", "2", str(script), timeout=120,
                        DDPKIT_HEARTBEAT_S="1")
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("stalled:") == 1 and "[rank0]: ddpkit: error: rank 1 (host " in result.stderr
    assert "while its heartbeat goes on: it is alive but not advancing" in result.stderr
    assert "The other ranks wait for it: 0 at step 3" in result.stderr  # where rank 0's host waits: its phase varies


@TWO_GPUS
def test_a_long_evaluation_on_rank_0_while_rank_1_waits_in_nccl_is_not_a_stall(tmp_path):
    from conftest import run_ddpkit

    script = tmp_path / "evaluates.py"
    script.write_text("""import time, torch, torch.nn as nn, ddpkit
with ddpkit.Job("ddp") as job:
    model = job.setup(nn.Linear(512, 512))
    started = time.monotonic()
    if job.rank == 0:  # a metric of its own over all predictions, say: no progress marks, 2x the stall timeout
        with torch.no_grad():
            while time.monotonic() - started < 12:
                model(torch.randn(64, 512, device=job.device)).sum().item()
    torch.distributed.barrier()  # rank 1 waits here, in NCCL
    job.print("evaluated")
""")
    result = run_ddpkit("run", "--stall-timeout", "5", "--nproc-per-node", "2", str(script), timeout=120,
                        DDPKIT_HEARTBEAT_S="1")
    assert result.returncode == 0 and "evaluated" in result.stdout, result.stderr
    assert "stalled" not in result.stderr
