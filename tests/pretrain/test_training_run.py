"""Whole training runs on CPU (debug preset, tiny context): exact resume, single process and
two DDP ranks under the launcher; the loss falls; what a finished run leaves behind."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.processes import ROOT, free_port, launcher_env
from support.runs import run_debug_training, run_launcher
from pretrain.checkpoint import save_restore
from pretrain.observe.metrics import read_metrics

SMALL_RUN = ["--set", "data.context_length=64", "--set", "training.batch_size=4", "--set", "logging.log_interval=1"]


def train_losses(run_dir) -> dict[int, float]:
    """Step -> the exact global loss rank 0 recorded (metrics.jsonl keeps every digit)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"}


SINGLE = ["pretrain_main.py"]
TWO_RANKS = ["-m", "launcher", "--device", "cpu", "--nproc", "2"]


@pytest.mark.parametrize("command", [SINGLE, TWO_RANKS], ids=["single process", "two DDP ranks"])
@pytest.mark.slow
def test_twenty_steps_equal_ten_then_ten_resumed_from_the_checkpoint_at_every_step(tmp_path, command):
    whole = tmp_path / "whole"
    run_debug_training(tmp_path, command, whole, "--max-steps", "20", "--set", "training.checkpoint_interval=10")
    # Resume from a copy of the step-10 checkpoint alone, in a fresh run directory: nothing but
    # the checkpoint carries over.
    saved = tmp_path / "saved" / "step_10"
    shutil.copytree(whole / "checkpoints" / "step_10", saved)
    resumed = tmp_path / "resumed"
    out = run_debug_training(tmp_path, command, resumed, "--max-steps", "20", "--resume", str(saved)).stdout
    assert f"Resumed from {saved} at step 10" in out

    first, second = train_losses(whole), train_losses(resumed)
    assert sorted(first) == list(range(20)) and sorted(second) == list(range(10, 20))
    assert {step: first[step] for step in range(10, 20)} == second  # bit for bit
    assert torch.equal(
        save_restore.load_model_state(whole / "checkpoints" / "step_20")["output.weight"],
        save_restore.load_model_state(resumed / "checkpoints" / "step_20")["output.weight"],
    )


@pytest.fixture(scope="module")
def finished_then_resumed(tmp_path_factory) -> tuple[Path, str, Path, str]:
    """One single-process run shared by the tests below, which only read what it left: 8 steps
    with --resume auto into a fresh run directory (a checkpoint every 2 steps, the last 2 kept),
    its run directory copied as it finished, then the same command again to 11 steps.
    Returns (the finished run's copy, its output, the run directory resumed, the resumed output)."""
    tmp_path = tmp_path_factory.mktemp("finished")
    run_dir = tmp_path / "run"
    first = run_debug_training(
        tmp_path,
        SINGLE,
        run_dir,
        "--max-steps",
        "8",
        "--resume",
        "auto",
        "--set",
        "training.checkpoint_interval=2",
        "--set",
        "training.keep_checkpoints=2",
    ).stdout
    finished = shutil.copytree(run_dir, tmp_path / "finished")
    resumed = run_debug_training(tmp_path, SINGLE, run_dir, "--max-steps", "11", "--resume", "auto").stdout
    return finished, first, run_dir, resumed


@pytest.mark.slow
def test_resume_auto_continues_the_latest_checkpoint_of_the_run_directory(finished_then_resumed):
    _, _, run_dir, out = finished_then_resumed
    assert f"Resumed from {run_dir / 'checkpoints' / 'step_8'} at step 8" in out
    records = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert records == list(range(8)) + [8, 9, 10]  # the same metrics file, continued


@pytest.mark.slow
def test_resume_auto_without_a_checkpoint_starts_at_step_zero(finished_then_resumed):
    _, out, _, _ = finished_then_resumed
    assert "No checkpoint to resume from; starting at step 0" in out


@pytest.mark.slow
def test_the_loss_falls_on_the_builtin_corpus(tmp_path):
    run_dir = tmp_path / "run"
    run_debug_training(tmp_path, SINGLE, run_dir, "--max-steps", "30", "--set", "training.warmup_steps=3")
    losses = train_losses(run_dir)
    assert losses[0] == pytest.approx(5.55, abs=0.3)  # ln(257): uniform over the byte vocabulary
    assert losses[29] < losses[0] - 2.0  # bytes of English are far from uniform


@pytest.mark.slow
def test_a_finished_run_leaves_checkpoints_metrics_and_exported_weights(finished_then_resumed):
    run_dir, out, _, _ = finished_then_resumed
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_6", "step_8"]
    assert "Tokens/s:" in out and "MFU" not in out  # no MFU on a CPU: its peak is not known
    kinds = [r["kind"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert kinds.count("train") == 8 and [kind for kind in kinds if kind in ("train", "val")][-1] == "val"
    assert kinds.count("checkpoint") == 4 and kinds[-1] == "checkpoint"  # steps 2, 4, 6, and 8 saved after the last validation
    from pretrain.hf.exported import load_exported

    exported, described = load_exported(run_dir / "export")  # transformers' names and row order, read back as ours
    final = save_restore.load_model_state(run_dir / "checkpoints" / "step_8")
    assert described["model_type"] == "llama" and described["pretrain"]["exported_from"]["steps_done"] == 8
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k].to(torch.bfloat16)) for k in final)  # the export's default dtype


def test_a_context_longer_than_the_model_supports_is_refused_before_start_up(tmp_path):
    result = run_launcher(
        "--debug",
        "--device",
        "cpu",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "model.max_seq_len=64",
        "--set",
        "data.context_length=128",
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "launcher: error: data.context_length 128 is longer than the model supports (model.max_seq_len 64); "
        "lower data.context_length or raise model.max_seq_len"
    ]


def test_a_global_batch_that_does_not_divide_over_the_ranks_is_refused_with_the_nearest_sizes(tmp_path):
    result = run_launcher(
        "--debug",
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        f"data.cache_dir={tmp_path / 'cache'}",
        "--set",
        "training.batch_size=4",
        "--set",
        "training.global_batch_size=20",
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "launcher: error: training.global_batch_size 20 is not a multiple of training.batch_size 4 x 2 rank(s) "
        "= 8; use 16 or 24, or change batch_size"
    )
    assert not (tmp_path / "run" / "logs" / "cpu0.log").exists()  # refused before any worker started


@pytest.mark.slow
def test_ranks_started_without_the_launcher_or_a_run_directory_share_one_run_directory(tmp_path):
    """As under torchrun: rank 0 names the run directory for every rank."""
    import re

    port = free_port()
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "pretrain_main.py",
                "--debug",
                "--max-steps",
                "2",
                "--set",
                f"data.cache_dir={tmp_path / 'cache'}",
                *SMALL_RUN,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=launcher_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in ranks]
    run_dirs = [re.findall(r"Run directory: (\S+)", out) for out in outputs]
    try:
        assert [proc.returncode for proc in ranks] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
        assert len(run_dirs[0]) == 1 and run_dirs[0] == run_dirs[1]
        assert (ROOT / "runs" / run_dirs[0][0].split("/")[-1] / "checkpoints" / "step_2" / "rng_rank1.pt").exists()
    finally:
        for found in {d for dirs in run_dirs for d in dirs}:
            shutil.rmtree(found, ignore_errors=True)
