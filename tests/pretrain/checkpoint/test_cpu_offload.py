"""Training with FSDP2's CPU offload (training.cpu_offload) end to end on CPU: one process and two
ranks under the launcher train the numbers the plain runs train, checkpoint, resume and export;
AdamW's fused kernel updates the parameters in host memory as torch's per-tensor loop does."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
import torch

from support.runs import run_debug_training
from pretrain.checkpoint import save_restore
from pretrain import config as cfg
from pretrain.observe.metrics import read_metrics
from pretrain.model.transformer import Transformer
from pretrain.optim.optimizers import build_optimizer, decay_groups

SINGLE = ["pretrain_main.py"]
TWO_RANKS = ["-m", "launcher", "--device", "cpu", "--nproc", "2"]


def run(tmp_path, command: list[str], name: str, *options: str) -> subprocess.CompletedProcess:
    return run_debug_training(tmp_path, command, tmp_path / name, "--max-steps", "4", *options)


def losses(tmp_path, name: str) -> list[float]:
    return [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"]


@pytest.mark.parametrize("command", [SINGLE, TWO_RANKS], ids=["one process", "two ranks"])
@pytest.mark.slow
def test_an_offloaded_run_trains_the_losses_of_a_plain_one_and_checkpoints_and_exports(tmp_path, command):
    plain = run(tmp_path, command, "plain", "--set", "training.cpu_offload=false")
    offloaded = run(tmp_path, command, "offloaded", "--set", "training.cpu_offload=true")
    assert "CPU offload" not in plain.stdout
    assert "FSDP; CPU offload (weights, gradients and optimizer state in host memory)" in offloaded.stdout
    if command == TWO_RANKS:
        assert "launcher: parallelism: FSDP with CPU offload over 2 CPU workers\n" in offloaded.stdout
    assert losses(tmp_path, "offloaded") == pytest.approx(losses(tmp_path, "plain"), rel=1e-5)
    assert len(losses(tmp_path, "plain")) == 4
    final = tmp_path / "offloaded" / "checkpoints" / "step_4"
    assert (final / "dcp").is_dir()  # sharded: the offloaded shards were saved where they live
    exported = tmp_path / "offloaded" / "export" / "model.safetensors"
    assert exported.is_file()
    resumed = run(tmp_path, command, "offloaded", "--set", "training.cpu_offload=true", "--max-steps", "5", "--resume", "auto")
    assert f"Resumed from {final} at step 4" in resumed.stdout
    assert save_restore.load_model_state(tmp_path / "offloaded" / "checkpoints" / "step_5")["output.weight"].isfinite().all()


def test_the_optimizer_is_fused_for_parameters_on_the_gpu_and_in_host_memory():
    model = Transformer(dataclasses.replace(cfg.debug().model, vocab_size=61), max_seq_len=8, seed=0)
    training = cfg.debug().training
    # A CUDA run whose parameters are in host memory (offload): torch's fused kernel runs on CPU tensors too.
    assert build_optimizer(model, training, torch.device("cuda", 0)).defaults["fused"] is True
    assert build_optimizer(model, training, torch.device("cpu")).defaults["fused"] is True


def test_fused_adamw_on_host_tensors_updates_as_the_per_tensor_loop():
    ours = Transformer(dataclasses.replace(cfg.debug().model, vocab_size=61), max_seq_len=8, seed=0)
    theirs = Transformer(dataclasses.replace(cfg.debug().model, vocab_size=61), max_seq_len=8, seed=0)
    training = cfg.debug().training
    fused = build_optimizer(ours, training, torch.device("cpu"))
    betas = (training.beta1, training.beta2)
    loop = torch.optim.AdamW(decay_groups(theirs, training.weight_decay), lr=training.learning_rate, betas=betas, foreach=False)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        fused.step()
        loop.step()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
