"""The real path through every part: run_training.sh -> launcher -> 2 CPU workers (gloo)
training the debug preset on the built-in corpus; and pretrain_main.py alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from support.processes import ROOT, launcher_env

STEP_LINE = re.compile(
    r"^(?P<prefix>CPU[01]):INFO \| \[CPU (?P<rank>[01])\] Step \[(?P<step>\d+)/(?P<total>\d+)\] \| "
    r"Loss: (?P<loss>\d+\.\d{4}) \| LR: \d\.\d{2}e[-+]\d{2} \| Grad Norm: \d+\.\d{4} \| ETA: \d+:\d{2}"
)


# Where there is no NVIDIA driver (this project's development and CI machines) the runs take
# the default path, which must find no GPU and choose CPU workers on its own.
NO_GPU = not os.path.exists("/proc/driver/nvidia/version")
DEVICE = [] if NO_GPU else ["--device", "cpu"]


def run_training(tmp_path, name: str, *args: str) -> subprocess.CompletedProcess:
    # PYTHON: run_training.sh uses the interpreter running these tests, which has everything.
    return subprocess.run(
        [
            "bash",
            str(ROOT / "run_training.sh"),
            "--debug",
            *DEVICE,
            "--run-dir",
            str(tmp_path / name),
            "--set",
            f"data.cache_dir={tmp_path / 'cache'}",
            *args,
        ],
        env=launcher_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("e2e")
    first = run_training(tmp_path, "run1")
    cache_after_first = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*")}
    # Two micro-batches per step: DDP's no_sync path, and the loss scaled across them.
    second = run_training(tmp_path, "run2", "--max-steps", "2", "--set", "training.grad_accum_nums=2")
    cache_after_second = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*")}
    return tmp_path, first, second, cache_after_first, cache_after_second


def step_lines(output: str) -> list[re.Match]:
    return [m for m in map(STEP_LINE.match, output.splitlines()) if m]


@pytest.mark.slow
def test_debug_run_exits_zero_with_step_lines_from_both_cpu_workers(two_runs):
    _, first, *_ = two_runs
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "setup:" not in first.stderr  # the interpreter had everything: nothing installed
    steps = step_lines(first.stdout)
    assert {m["prefix"] for m in steps} == {"CPU0", "CPU1"}
    assert all(m["prefix"] == f"CPU{m['rank']}" for m in steps)  # prefix and label agree
    for prefix in ("CPU0", "CPU1"):
        assert [int(m["step"]) for m in steps if m["prefix"] == prefix] == list(range(10))
    assert all(m["total"] == "10" for m in steps)


@pytest.mark.skipif(not NO_GPU, reason="this machine has an NVIDIA driver")
@pytest.mark.slow
def test_without_a_gpu_the_launcher_says_so_in_one_line_and_runs_two_cpu_workers(two_runs):
    _, first, *_ = two_runs
    said = [line for line in first.stdout.splitlines() if "no NVIDIA or AMD GPU found" in line]
    assert said == ["launcher: no NVIDIA or AMD GPU found; running 2 CPU worker processes (gloo); --nproc N changes the count"]


@pytest.mark.slow
def test_the_loss_falls_and_is_the_global_mean_on_every_rank(two_runs):
    _, first, *_ = two_runs
    losses = {p: [float(m["loss"]) for m in step_lines(first.stdout) if m["prefix"] == p] for p in ("CPU0", "CPU1")}
    assert losses["CPU0"] == losses["CPU1"]
    assert losses["CPU0"][-1] < losses["CPU0"][0] - 0.5


@pytest.mark.slow
def test_every_output_line_is_prefixed_by_its_worker_or_the_launcher(two_runs):
    _, first, *_ = two_runs
    assert all(line.startswith(("CPU0:", "CPU1:", "launcher: ")) for line in first.stdout.splitlines())
    assert "CPU0:DEBUG | [CPU 0] Model:" not in first.stdout  # the model line is INFO
    assert "CPU1:INFO | [CPU 1] Training complete" in first.stdout


@pytest.mark.slow
def test_the_run_directory_holds_the_resolved_config_and_the_logs(two_runs):
    tmp_path, *_ = two_runs
    run = tmp_path / "run1"
    config = json.loads((run / "config.json").read_text())
    assert (config["preset"], config["system"]["device"], config["model"]["n_layers"]) == ("debug", "cpu", 2)
    cpu1 = (run / "logs" / "cpu1.log").read_text()
    # (torch 2.9 and 2.10's gloo prints "[Gloo] Rank 1 is connected to ..." itself, first)
    first_own = next(line for line in cpu1.splitlines() if not line.startswith("[Gloo]"))
    assert first_own.startswith(("INFO", "DEBUG")) and "Step [9/10]" in cpu1 and "CPU1:" not in cpu1
    assert "CPU0:" in (run / "logs" / "combined.log").read_text()
    assert [w["exit_code"] for w in json.loads((run / "workers.json").read_text())] == [0, 0]


@pytest.mark.slow
def test_the_dataset_is_prepared_once_and_reused_by_the_next_run(two_runs):
    tmp_path, first, second, cache_after_first, cache_after_second = two_runs
    assert first.stdout.count("dataset: prepared") == 1  # by the launcher, by no worker
    assert "launcher: dataset: prepared" in first.stdout
    assert second.returncode == 0 and "launcher: dataset: reusing" in second.stdout
    assert "dataset: prepared" not in second.stdout
    assert cache_after_second == cache_after_first
    datasets = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(datasets) == 1 and datasets[0].name.startswith("builtin-byte-")
    assert {p.name for p in datasets[0].iterdir()} >= {"tokens.bin", "meta.json"}


@pytest.mark.slow
def test_max_steps_and_accumulation_on_the_command_line_shape_the_run(two_runs):
    _, _, second, *_ = two_runs
    assert second.returncode == 0, second.stdout[-3000:]
    assert {m["step"] + "/" + m["total"] for m in step_lines(second.stdout)} == {"0/2", "1/2"}
    assert "8 x 128 tokens per micro-batch, 2 micro-batches per step" in second.stdout


@pytest.mark.slow
def test_pretrain_main_trains_one_process_without_the_supervisor(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "pretrain_main.py"),
            "--debug",
            "--max-steps",
            "3",
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            "system.device=cpu",
            "--set",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^INFO \| \[CPU 0\] Step \[2/3\] \| Loss: ", result.stdout, re.M)
    assert (tmp_path / "r" / "config.json").exists()


def test_pretrain_main_config_error_is_one_line_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_main.py"), "--debug", "--set", "model.dim=130"],
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "pretrain: error: --set: model.dim: 130 is not divisible by model.n_heads (4)"


@pytest.mark.slow
def test_a_malformed_rank_variable_is_a_one_line_error():
    result = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_main.py"), "--debug"],
        env=launcher_env(RANK="abc"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "pretrain: error: environment variable RANK='abc' is not an integer"


def test_prepare_dataset_reports_an_unwritable_cache_as_one_line_naming_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = subprocess.run(
        [sys.executable, str(ROOT / "prepare_dataset.py"), "--debug", "--set", f"data.cache_dir={blocker / 'cache'}"],
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"prepare_dataset: error: {blocker}") and result.stderr.count("\n") == 1
    assert "[Errno" not in result.stderr
