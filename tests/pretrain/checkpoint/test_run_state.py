"""A checkpoint's state.json is validated like a config file (pretrain/checkpoint/files.py
state_problem): every damaged or hand-edited value is one line naming the file and the key, in
the launcher and in a training process alike (exit 2, no traceback), and a damaged checkpoint is
never the one `--resume auto` continues."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from support.processes import ROOT, launcher_env, one_line_error
from pretrain.checkpoint.files import StateError, latest, read_state
from pretrain.checkpoint.resume import ResumeError, damaged_after, resolve_resume

HINT = "the checkpoint is damaged: resume from an earlier one with --resume <run dir>/checkpoints/step_<N>"


def valid_state(steps: int = 10) -> dict:
    return {
        "format_version": 2,
        "steps_done": steps,
        "world_size": 1,
        "parallelism": "single",
        "loader": {"epoch": 0, "batch_index": steps},
        "lr_schedule": {"steps_done": steps, "lr": 1e-4},
    }


def checkpoint_with(run: Path, steps: int, state: object, raw: str | None = None) -> Path:
    """<run>/checkpoints/step_<steps> with model files and the given state.json."""
    path = run / "checkpoints" / f"step_{steps}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps(state) if raw is None else raw)
    (path / "config.json").write_text("{}")
    for name in ("model.pt", "optimizer.pt"):
        with zipfile.ZipFile(path / name, "w"):  # torch.save's format, as far as choosing a checkpoint looks
            pass
    return path


def without(key: str) -> dict:
    state = valid_state()
    del state[key]
    return state


def changed(**values) -> dict:
    return valid_state() | values


DAMAGE = {
    "negative steps": (changed(steps_done=-1), "steps_done must be a non-negative integer (got -1)"),
    "steps as a string": (changed(steps_done="10"), 'steps_done must be a non-negative integer (got "10")'),
    "steps as a boolean": (changed(steps_done=True), "steps_done must be a non-negative integer (got true)"),
    "steps as a float": (changed(steps_done=10.0), "steps_done must be a non-negative integer (got 10.0)"),
    "no steps": (without("steps_done"), "steps_done is missing"),
    "no loader": (without("loader"), "loader is missing"),
    "no world size": (without("world_size"), "world_size is missing"),
    "no parallelism": (without("parallelism"), "parallelism is missing"),
    "zero ranks": (changed(world_size=0), "world_size must be a positive integer (got 0)"),
    "loader not an object": (changed(loader=[0, 10]), "loader must be an object with epoch and batch_index (got [0, 10])"),
    "loader without epoch": (changed(loader={"batch_index": 10}), "loader.epoch is missing"),
    "negative batch index": (
        changed(loader={"epoch": 0, "batch_index": -3}),
        "loader.batch_index must be a non-negative integer (got -3)",
    ),
    "unknown parallelism": (changed(parallelism="tp"), 'parallelism must be one of single, ddp, fsdp, hsdp (got "tp")'),
    "schedule not an object": (changed(lr_schedule=3), "lr_schedule must be an object whose lr is a non-negative number (got 3)"),
    "format version a string": (changed(format_version="2"), 'format_version must be an integer from 1 to 2 (got "2")'),
    "steps not those of the name": (
        changed(steps_done=7, loader={"epoch": 0, "batch_index": 7}),
        "steps_done is 7, but the directory is step_10",
    ),
    "an array": ([1, 2], "not a JSON object (got an array)"),
    "null": (None, "not a JSON object (got null)"),
}


@pytest.mark.parametrize("state, problem", DAMAGE.values(), ids=DAMAGE.keys())
def test_each_damaged_value_in_state_json_is_one_line_naming_the_key(tmp_path, state, problem):
    path = checkpoint_with(tmp_path / "run", 10, state)
    with pytest.raises(StateError) as error:
        read_state(path)
    assert one_line_error(error) == f"checkpoint {path}: state.json: {problem}; {HINT}, or start fresh"


def test_a_format_1_state_without_parallelism_is_still_read(tmp_path):
    state = without("parallelism") | {"format_version": 1}
    del state["lr_schedule"]
    assert read_state(checkpoint_with(tmp_path / "run", 10, state))["steps_done"] == 10


def test_keys_a_later_version_adds_are_ignored(tmp_path):
    path = checkpoint_with(tmp_path / "run", 10, valid_state() | {"tokens_seen": 12345})
    assert read_state(path)["steps_done"] == 10


def test_a_named_or_set_aside_checkpoint_may_hold_any_step_count(tmp_path):
    path = tmp_path / "run" / "checkpoints" / "nan_grad_step_3"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps(valid_state(3)))
    assert read_state(path)["steps_done"] == 3


def test_an_explicit_resume_of_a_damaged_checkpoint_is_a_resume_error_naming_the_key(tmp_path):
    path = checkpoint_with(tmp_path / "run", 10, changed(steps_done=-1))
    with pytest.raises(ResumeError) as error:
        resolve_resume(str(path), None, tmp_path / "runs")
    assert one_line_error(error).startswith(f"--resume {path}: state.json: steps_done must be a non-negative integer")


def test_resume_auto_never_continues_a_checkpoint_whose_state_is_damaged(tmp_path):
    run = tmp_path / "run"
    five = checkpoint_with(run, 5, valid_state(5))
    checkpoint_with(run, 10, changed(steps_done=-1))  # the highest number, but it would resume "at step -1"
    assert latest(run / "checkpoints") == five
    assert resolve_resume("auto", str(run), tmp_path / "runs") == (run, five.resolve())
    # and says why it passed over the later one
    (skipped,) = damaged_after(five)
    assert skipped.startswith("step_10: state.json: steps_done must be a non-negative integer (got -1)")
    (run / "checkpoints" / "step_12").mkdir()  # cut short by a crash before its model files: not listed
    assert damaged_after(five) == [skipped]
    assert damaged_after(run / "checkpoints" / "step_10") == []


DEBUG_RUN = ["--debug", "--set", "data.context_length=64", "--set", "training.batch_size=4"]


@pytest.mark.parametrize(
    "entry", [["pretrain_main.py"], ["-m", "launcher", "--device", "cpu"]], ids=["training process", "launcher"]
)
@pytest.mark.slow
def test_resuming_a_checkpoint_without_its_loader_position_exits_2_with_one_line(tmp_path, entry):
    path = checkpoint_with(tmp_path / "run", 10, without("loader"))
    result = subprocess.run(
        [
            sys.executable,
            *entry,
            *DEBUG_RUN,
            "--set",
            f"data.cache_dir={tmp_path / 'cache'}",
            "--resume",
            str(path),
            "--max-steps",
            "12",
        ],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if "state.json" in line]
    assert len(errors) == 1 and errors[0].endswith(f"--resume {path}: state.json: loader is missing; {HINT}, or start fresh"), (
        output[-3000:]
    )
    assert (path / "state.json").exists() and not list((tmp_path / "run" / "checkpoints").glob("*.superseded"))
