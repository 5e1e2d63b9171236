"""A NaN in a 2-rank CPU run under the launcher: the report names the tensors and the first
module, the evidence (dump, checkpoint) is written and loads safely, the run exits with the
numerical-failure code and nothing survives."""

from __future__ import annotations

import json
import math
import subprocess

import numpy as np
import pytest

import torch

from support.checkpointing import make_trainer
from support.processes import alive
from support.runs import run_launcher
from pretrain.checkpoint import save_restore
from pretrain.run.exit_codes import NUMERICAL_FAILURE

POISONED = "layers.1.feed_forward.w13.weight"


def poisoned_checkpoint(tmp_path):
    """A step_0 checkpoint whose layers.1.feed_forward.w13 holds one NaN: a poisoned weight."""
    trainer = make_trainer(tmp_path / "cache", tmp_path / "run")
    with torch.no_grad():
        trainer.model.get_parameter(POISONED)[3, 5] = float("nan")
    return save_restore.save(trainer, 0, trainer.run_dir)


def launch_from(tmp_path, resume_from, *sets: str) -> subprocess.CompletedProcess:
    options = [
        item
        for key_value in ("training.batch_size=2", "data.context_length=32", f"data.cache_dir={tmp_path / 'cache'}", *sets)
        for item in ("--set", key_value)
    ]
    return run_launcher(
        "--debug",
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--max-steps",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
        "--resume",
        str(resume_from),
        *options,
        timeout=180,
    )


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("nan")
    result = launch_from(tmp_path, poisoned_checkpoint(tmp_path))
    return tmp_path / "run", result


@pytest.mark.slow
def test_the_run_exits_with_the_numerical_failure_code_and_the_summary_names_it(failed_run):
    run_dir, result = failed_run
    assert result.returncode == NUMERICAL_FAILURE == 3, result.stdout[-3000:]
    assert "exit code 3 (numerical failure: NaN or Inf in training)" in result.stdout
    assert "Hint: the loss or the gradients became NaN or Inf: CPU0, CPU1 logged NaN GRADIENT DETECTED with" in result.stdout


@pytest.mark.slow
def test_every_affected_rank_reports_the_poisoned_weight_and_the_first_module_that_went_bad(failed_run):
    _, result = failed_run
    for rank in (0, 1):
        lines = [line.removeprefix(f"CPU{rank}:") for line in result.stdout.splitlines() if line.startswith(f"CPU{rank}:")]
        banner = lines.index(f"NaN GRADIENT DETECTED [CPU {rank}]")
        report = lines[banner : banner + 40]
        assert report[2:5] == ["Step: 0", "Loss: nan", "Gradient Norm: nan"]
        assert f"  {POISONED} (768, 128) value: 1 NaN of 98304; first values [" in "\n".join(report)
        assert "first non-finite: layers.1.feed_forward.w13, forward output" in report


@pytest.mark.slow
def test_the_dump_loads_without_pickle_and_holds_the_nans_the_report_counted(failed_run):
    run_dir, result = failed_run
    with np.load(run_dir / "debug" / "nan_debug_step_0.npz", allow_pickle=False) as dump:
        poisoned = dump[f"param/{POISONED}"]
        assert poisoned.shape == (768, 128) and np.isnan(poisoned).sum() == 1 and math.isnan(poisoned[3, 5])
        grads_with_nan = [key for key in dump.files if key.startswith("grad/") and np.isnan(dump[key]).any()]
        params = [key for key in dump.files if key.startswith("param/")]
    assert len(params) == 15 and grads_with_nan  # every parameter of the debug model is there
    assert f"CPU0:Total layers with NaN gradients: {len(grads_with_nan)}" in result.stdout


@pytest.mark.slow
def test_the_checkpoint_holds_the_state_before_the_step_and_loads(failed_run):
    run_dir, _ = failed_run
    saved = run_dir / "checkpoints" / "nan_grad_step_0"
    assert save_restore.read_state(saved)["steps_done"] == 0
    weights = save_restore.load_tensors(saved, "model.pt")
    assert torch.isnan(weights[POISONED]).sum() == 1  # the evidence, as it was before the step
    assert torch.isfinite(weights["output.weight"]).all()  # the bad update was never applied


@pytest.mark.slow
def test_no_worker_survives_a_numerical_failure(failed_run):
    run_dir, _ = failed_run
    record = json.loads((run_dir / "workers.json").read_text())
    assert [r["exit_code"] for r in record] == [NUMERICAL_FAILURE] * 2
    assert not any(alive(r["pid"]) for r in record)


@pytest.mark.slow
def test_under_fsdp_the_shards_are_gathered_into_the_same_report_and_dump(tmp_path):
    # Also resumes a checkpoint saved before any update (no optimizer moments) into FSDP.
    result = launch_from(tmp_path, poisoned_checkpoint(tmp_path), "training.parallelism=fsdp")
    assert result.returncode == NUMERICAL_FAILURE, result.stdout[-3000:]
    assert "CPU0:first non-finite: layers.1.feed_forward.w13, forward output" in result.stdout
    assert f"CPU1:  {POISONED} (768, 128) value: 1 NaN of 98304; first values [" in result.stdout
    with np.load(tmp_path / "run" / "debug" / "nan_debug_step_0.npz", allow_pickle=False) as dump:
        assert dump[f"param/{POISONED}"].shape == (768, 128) and np.isnan(dump[f"param/{POISONED}"]).sum() == 1
        assert np.isnan(dump["grad/output.weight"]).all()
    assert (tmp_path / "run" / "checkpoints" / "nan_grad_step_0" / "dcp").is_dir()
