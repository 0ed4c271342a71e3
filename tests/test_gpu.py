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
        assert f"data: cuda:{rank}, model: cuda:{rank}" in result.stdout
