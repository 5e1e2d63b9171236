"""--resume: which run directory and which checkpoint each form of it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, one_line_error
from pretrain.resume import ResumeError, latest, resolve_resume


def checkpoint_dir(run: Path, steps: int, complete: bool = True) -> Path:
    """<run>/checkpoints/step_<steps>, with a state.json when complete."""
    path = run / "checkpoints" / f"step_{steps}"
    path.mkdir(parents=True)
    if complete:
        (path / "state.json").write_text(json.dumps({"format_version": 2, "steps_done": steps}))
    return path


@pytest.fixture
def runs(tmp_path) -> Path:
    return tmp_path / "runs"


def test_no_resume_starts_fresh_in_the_given_run_directory_or_a_new_one(runs, tmp_path):
    checkpoint_dir(tmp_path / "run", 5)
    assert resolve_resume("", str(tmp_path / "run"), runs) == (tmp_path / "run", None)
    assert resolve_resume("", None, runs) == (None, None)


def test_latest_is_the_highest_complete_step_ignoring_unfinished_saves(tmp_path):
    run = tmp_path / "run"
    checkpoint_dir(run, 9)
    ten = checkpoint_dir(run, 10)
    checkpoint_dir(run, 200, complete=False)  # no state.json
    (run / "checkpoints" / "step_300").mkdir()
    (run / "checkpoints" / "step_300" / "state.json").write_text("{")  # cut short
    (run / "checkpoints" / "step_400.tmp").mkdir()
    (run / "checkpoints" / "step_400.tmp" / "state.json").write_text('{"steps_done": 400}')
    (run / "checkpoints" / "nan_grad_step_500").mkdir()  # a named checkpoint is not a step_<N>
    (run / "checkpoints" / "nan_grad_step_500" / "state.json").write_text('{"steps_done": 500}')
    assert latest(run / "checkpoints") == ten  # 10 > 9: by number, not by name
    assert latest(tmp_path / "nothing") is None


def test_auto_with_a_run_directory_continues_its_latest_checkpoint(tmp_path, runs):
    run = tmp_path / "run"
    checkpoint_dir(run, 3)
    six = checkpoint_dir(run, 6)
    assert resolve_resume("auto", str(run), runs) == (run, six)


def test_auto_with_a_run_directory_that_has_no_checkpoint_starts_fresh_there(tmp_path, runs):
    checkpoint_dir(runs / "20261121-090000-aaaa", 4)  # other runs are not considered
    assert resolve_resume("auto", str(tmp_path / "run"), runs) == (tmp_path / "run", None)


def test_auto_alone_continues_the_newest_run_that_has_a_checkpoint(runs):
    checkpoint_dir(runs / "20261120-235959-ffff", 8)
    wanted = checkpoint_dir(runs / "20261121-070000-0001", 2)
    checkpoint_dir(runs / "20261121-080000-0002", 7, complete=False)  # newest, but nothing complete
    (runs / "20261121-090000-0003").mkdir()  # newest of all: started, never saved
    assert resolve_resume("auto", None, runs) == (runs / "20261121-070000-0001", wanted)


def test_auto_alone_without_any_checkpoint_starts_a_new_run(runs, tmp_path):
    assert resolve_resume("auto", None, runs) == (None, None)  # no runs directory at all
    (runs / "20261121-090000-0003" / "checkpoints").mkdir(parents=True)
    assert resolve_resume("auto", None, runs) == (None, None)


def test_a_checkpoint_path_continues_in_the_run_it_belongs_to_unless_a_run_directory_is_given(tmp_path, runs):
    run = tmp_path / "run"
    path = checkpoint_dir(run, 10)
    assert resolve_resume(str(path), None, runs) == (run, path)
    assert resolve_resume(str(path), str(tmp_path / "elsewhere"), runs) == (tmp_path / "elsewhere", path)


def test_a_checkpoint_copied_out_of_its_run_starts_a_new_run(tmp_path, runs):
    path = tmp_path / "saved" / "step_10"
    path.mkdir(parents=True)
    (path / "state.json").write_text('{"steps_done": 10}')
    assert resolve_resume(str(path), None, runs) == (None, path)


def test_a_relative_checkpoint_path_is_made_absolute(tmp_path, runs, monkeypatch):
    path = checkpoint_dir(tmp_path / "run", 10)
    monkeypatch.chdir(tmp_path)
    assert resolve_resume("run/checkpoints/step_10", None, runs) == (tmp_path / "run", path)


def test_a_run_directory_path_continues_its_latest_checkpoint(tmp_path, runs):
    run = tmp_path / "run"
    checkpoint_dir(run, 2)
    four = checkpoint_dir(run, 4)
    assert resolve_resume(str(run), None, runs) == (run, four)
    assert resolve_resume(str(run), str(tmp_path / "next"), runs) == (tmp_path / "next", four)


def test_a_run_directory_without_a_complete_checkpoint_is_refused(tmp_path, runs):
    checkpoint_dir(tmp_path / "run", 4, complete=False)
    with pytest.raises(ResumeError) as error:
        resolve_resume(str(tmp_path / "run"), None, runs)
    assert one_line_error(error) == (f"--resume {tmp_path / 'run'}: no checkpoint there (expected a "
                                     "checkpoints/step_<N> directory or a run directory that has one)")


@pytest.mark.parametrize("name, problem", [
    ("missing", "no such directory"),
    ("file.txt", "not a directory"),
])
def test_a_path_that_is_not_a_directory_is_refused_naming_why(tmp_path, runs, name, problem):
    (tmp_path / "file.txt").write_text("")
    with pytest.raises(ResumeError) as error:
        resolve_resume(str(tmp_path / name), None, runs)
    assert one_line_error(error) == (f"--resume {tmp_path / name}: {problem} (expected a checkpoints/step_<N> "
                                     "directory or a run directory that has one)")


def test_an_unfinished_save_is_refused_pointing_to_the_complete_ones(tmp_path, runs):
    unfinished = tmp_path / "run" / "checkpoints" / "step_5.tmp"
    unfinished.mkdir(parents=True)
    (unfinished / "state.json").write_text('{"steps_done": 5}')
    with pytest.raises(ResumeError) as error:
        resolve_resume(str(unfinished), None, runs)
    assert "an unfinished checkpoint save" in one_line_error(error)


def test_a_checkpoint_with_a_damaged_state_file_is_refused(tmp_path, runs):
    path = checkpoint_dir(tmp_path / "run", 5)
    (path / "state.json").write_text('{"steps_do')
    with pytest.raises(ResumeError) as error:
        resolve_resume(str(path), None, runs)
    assert one_line_error(error) == (f"--resume {path}: the checkpoint's state.json is unreadable (the checkpoint "
                                     "is damaged); use another checkpoint of the run")


def test_resolving_imports_no_torch():
    # The launcher resolves --resume before any worker starts; torch would cost it seconds.
    code = "import sys, pretrain.resume; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.stdout.strip() == "False", result.stderr
