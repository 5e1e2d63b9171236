"""Weights & Biases as an optional extra (pretrain/observe/wandb_log.py), with a fake `wandb` package made
in the test (the real one is not a dependency): what a run sends it, and that nothing imports it
unless the config asks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import ROOT, launcher_env
from support.runs import assert_one_line_error

FAKE_WANDB = """
import json, os, pathlib
RECORD = pathlib.Path(os.environ["FAKE_WANDB_RECORD"])
RECORD.parent.mkdir(parents=True, exist_ok=True)
with RECORD.open("a") as out:
    out.write(json.dumps({"imported": os.getpid()}) + "\\n")

class Run:
    def log(self, values, step):
        with RECORD.open("a") as out:
            out.write(json.dumps({"log": values, "step": step}) + "\\n")
    def finish(self):
        with RECORD.open("a") as out:
            out.write(json.dumps({"finish": True}) + "\\n")

def init(**kwargs):
    with RECORD.open("a") as out:
        out.write(json.dumps({"init": kwargs, "mode": os.environ.get("WANDB_MODE")}, default=str) + "\\n")
    return Run()
"""


def debug_run(tmp_path: Path, *sets: str, fake: bool = True) -> tuple[subprocess.CompletedProcess, list[dict]]:
    fake_dir = tmp_path / "fake"
    (fake_dir / "wandb").mkdir(parents=True, exist_ok=True)
    (fake_dir / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    record = tmp_path / "wandb-calls.jsonl"
    env = launcher_env(FAKE_WANDB_RECORD=str(record), WANDB_MODE="offline")
    if fake:
        env["PYTHONPATH"] = os.pathsep.join([str(fake_dir), env["PYTHONPATH"]])
    options = ["--debug", "--device", "cpu", "--max-steps", "3", "--run-dir", str(tmp_path / "run")]
    options += ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "logging.log_interval=1"]
    for assignment in sets:
        options += ["--set", assignment]
    result = subprocess.run(
        [sys.executable, "-m", "launcher", *options], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return result, calls


@pytest.mark.slow
def test_a_run_with_wandb_sends_the_metrics_of_rank_0_offline_as_asked(tmp_path):
    result, calls = debug_run(tmp_path, "logging.wandb=true", "logging.wandb_project=study")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    assert len([c for c in calls if "imported" in c]) == 1  # rank 0 only
    (init,) = [c for c in calls if "init" in c]
    assert init["mode"] == "offline"
    assert init["init"]["project"] == "study" and init["init"]["id"] == "run" and init["init"]["resume"] == "allow"
    assert init["init"]["config"]["training"]["max_steps"] == 3
    steps = [c["step"] for c in calls if "log" in c and "train/loss" in c["log"]]
    assert steps == [0, 1, 2]
    assert any("val/loss" in c.get("log", {}) for c in calls) and calls[-1] == {"finish": True}


@pytest.mark.slow
def test_nothing_imports_wandb_unless_the_config_asks(tmp_path):
    result, calls = debug_run(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert calls == []


def test_wandb_asked_for_but_not_installed_is_one_line_before_anything_starts(tmp_path):
    result, _ = debug_run(tmp_path, "logging.wandb=true", fake=False)
    assert_one_line_error(
        result, "logging.wandb is true but the wandb package is not installed: pip install wandb", quiet_stdout=False
    )
    assert not (tmp_path / "run" / "config.json").exists()
