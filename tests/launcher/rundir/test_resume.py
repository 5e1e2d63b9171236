"""--resume: which run directory and which checkpoint each form of it names, and which
checkpoint directories count as complete."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from support.processes import ROOT, one_line_error
from launcher.supervise.printer import Printer
from launcher.rundir.choice import resume_point
from pretrain import config as cfg
from pretrain.checkpoint.files import checkpoint_problem
from pretrain.checkpoint.resume import ResumeError, checkpoint_at, damaged_after, latest, resolve_resume


def checkpoint_dir(run: Path, steps: int, complete: bool = True, name: str | None = None) -> Path:
    """<run>/checkpoints/step_<steps> (or name), with a state.json and model files when complete."""
    path = run / "checkpoints" / (name or f"step_{steps}")
    path.mkdir(parents=True)
    return fill(path, steps) if complete else path


def state(steps: int) -> dict:
    """A valid state.json (pretrain/checkpoint/files.py state_problem) after `steps` steps."""
    return {
        "format_version": 2,
        "steps_done": steps,
        "world_size": 1,
        "parallelism": "single",
        "loader": {"epoch": 0, "batch_index": steps},
    }


def fill(path: Path, steps: int, world_size: int = 1) -> Path:
    """Make path a complete checkpoint of `steps` steps written by world_size ranks, as far as
    choosing one goes: every file a resume reads, whole as far as can be told without torch."""
    (path / "state.json").write_text(json.dumps({**state(steps), "world_size": world_size}))
    (path / "config.json").write_text("{}")
    for file in ("model.pt", "optimizer.pt", *(f"rng_rank{rank}.pt" for rank in range(world_size))):
        torch_file(path / file)
    return path


def torch_file(path: Path) -> None:
    """A file in torch.save's format (a zip archive), as far as a look without torch can tell."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", b"")


def written_at(checkpoint: Path, seconds: int) -> None:
    os.utime(checkpoint / "state.json", (seconds, seconds))


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
    checkpoint_dir(run, 500, name="nan_grad_step_500")  # a named checkpoint is not a step_<N>
    checkpoint_dir(run, 600, name="step_600.deleting")  # being pruned
    checkpoint_dir(run, 700, name="step_700.superseded")  # set aside by resuming an earlier checkpoint
    weightless = checkpoint_dir(run, 800)
    (weightless / "model.pt").unlink()  # state.json alone is not a checkpoint
    assert latest(run / "checkpoints") == ten  # 10 > 9: by number, not by name
    assert latest(tmp_path / "nothing") is None


def sharded(run: Path, steps: int, world_size: int = 2) -> Path:
    """An FSDP checkpoint: dcp/.metadata (a pickle naming each rank's shard, as DCP's does) and
    the shards, no model.pt or optimizer.pt."""
    path = checkpoint_dir(run, steps, complete=False)
    fill(path, steps, world_size)
    (path / "model.pt").unlink()
    (path / "optimizer.pt").unlink()
    (path / "dcp").mkdir()
    shards = [f"__{rank}_0.distcp" for rank in range(world_size)]
    (path / "dcp" / ".metadata").write_bytes(
        pickle.dumps({"storage_data": {n: {"relative_path": s} for n, s in enumerate(shards)}})
    )
    for shard in shards:
        (path / "dcp" / shard).write_bytes(b"tensor bytes")
    return path


def test_a_sharded_checkpoint_is_complete_with_its_dcp_metadata_and_every_shard_it_names(tmp_path):
    path = sharded(tmp_path / "run", 4)
    assert latest(tmp_path / "run" / "checkpoints", 2) == path
    (path / "dcp" / "__1_0.distcp").unlink()
    assert latest(tmp_path / "run" / "checkpoints", 2) is None
    assert (
        checkpoint_problem(path, 2) == "dcp/__1_0.distcp is missing (an incomplete checkpoint); use another checkpoint of the run"
    )
    (path / "dcp" / ".metadata").write_bytes(b"")  # written last by DCP: a save cut short
    assert checkpoint_problem(path, 2) == "dcp/.metadata is empty (a damaged checkpoint); use another checkpoint of the run"


def test_a_checkpoint_left_aside_by_a_killed_replace_is_still_found_and_resumable(tmp_path, runs):
    run = tmp_path / "run"
    checkpoint_dir(run, 3)
    aside = checkpoint_dir(run, 5, name="step_5.old")  # killed between moving step_5 aside and the new one in
    assert latest(run / "checkpoints") == aside
    assert resolve_resume("auto", str(run), runs) == (run, aside)
    assert resolve_resume(str(aside), None, runs) == (run, aside)
    checkpoint_dir(run, 5)  # the replacement arrived: the .old is on its way out
    assert latest(run / "checkpoints") == run / "checkpoints" / "step_5"
    with pytest.raises(ResumeError, match="an unfinished checkpoint save"):
        resolve_resume(str(aside), None, runs)


def test_auto_with_a_run_directory_continues_its_latest_checkpoint(tmp_path, runs):
    run = tmp_path / "run"
    checkpoint_dir(run, 3)
    six = checkpoint_dir(run, 6)
    assert resolve_resume("auto", str(run), runs) == (run, six)


def test_auto_with_a_run_directory_that_has_no_checkpoint_starts_fresh_there(tmp_path, runs):
    checkpoint_dir(runs / "20261121-090000-aaaa", 4)  # other runs are not considered
    assert resolve_resume("auto", str(tmp_path / "run"), runs) == (tmp_path / "run", None)


def test_auto_alone_continues_the_run_whose_latest_checkpoint_was_written_last(runs):
    written_at(checkpoint_dir(runs / "20261120-235959-ffff", 8), 1_000)
    wanted = checkpoint_dir(runs / "20261121-070000-0001", 2)
    written_at(wanted, 3_000)
    written_at(checkpoint_dir(runs / "my-experiment", 5), 2_000)  # named by the user: sorts after every run id
    checkpoint_dir(runs / "zz-started", 7, complete=False)  # nothing complete
    (runs / "zzz-never-saved").mkdir()
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
    fill(path, 10)
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
    assert one_line_error(error) == (
        f"--resume {tmp_path / 'run'}: the run has no complete checkpoint yet; give a checkpoint directory"
    )


def test_a_directory_that_is_neither_a_checkpoint_nor_a_run_is_refused(tmp_path, runs):
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(ResumeError) as error:
        resolve_resume(str(tmp_path / "elsewhere"), None, runs)
    assert one_line_error(error) == (
        f"--resume {tmp_path / 'elsewhere'}: neither a checkpoint (no state.json) nor a "
        "run directory (no checkpoints/); give <run dir>/checkpoints/step_<N> or a run "
        "directory"
    )


@pytest.mark.parametrize(
    "name, problem",
    [
        ("missing", "no such directory"),
        ("file.txt", "not a directory"),
    ],
)
def test_a_path_that_is_not_a_directory_is_refused_naming_why(tmp_path, runs, name, problem):
    (tmp_path / "file.txt").write_text("")
    with pytest.raises(ResumeError) as error:
        resolve_resume(str(tmp_path / name), None, runs)
    assert one_line_error(error) == (
        f"--resume {tmp_path / name}: {problem}; give a checkpoint (<run dir>/checkpoints/step_<N>) or a run directory"
    )


def test_checkpoint_at_names_the_checkpoint_a_path_means_and_starts_its_errors_with_the_path(tmp_path):
    run = tmp_path / "run"
    checkpoint_dir(run, 2)
    four = checkpoint_dir(run, 4)
    assert checkpoint_at(run) == four  # a run directory: its latest checkpoint
    assert checkpoint_at(run / "checkpoints" / "step_2") == run / "checkpoints" / "step_2"
    with pytest.raises(ResumeError) as error:
        checkpoint_at(tmp_path / "missing")
    assert one_line_error(error).startswith(f"{tmp_path / 'missing'}: no such directory; ")


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
    assert one_line_error(error) == (
        f"--resume {path}: state.json is unreadable (Unterminated string starting at: "
        "line 1 column 2 (char 1)); use another checkpoint of the run"
    )


# --- what makes a checkpoint complete: every file a resume reads ---------------------------

DAMAGE = {
    "no optimizer.pt": (lambda path: (path / "optimizer.pt").unlink(), "optimizer.pt is missing (an incomplete checkpoint)"),
    "no rng_rank1.pt": (lambda path: (path / "rng_rank1.pt").unlink(), "rng_rank1.pt is missing (an incomplete checkpoint)"),
    "no model.pt": (lambda path: (path / "model.pt").unlink(), "model.pt is missing (an incomplete checkpoint)"),
    "no config.json": (lambda path: (path / "config.json").unlink(), "config.json is missing (an incomplete checkpoint)"),
    "a truncated model.pt": (
        lambda path: os.truncate(path / "model.pt", 30),
        "model.pt is damaged (not a whole torch.save file)",
    ),
    "an empty rng_rank0.pt": (lambda path: os.truncate(path / "rng_rank0.pt", 0), "rng_rank0.pt is empty (a damaged checkpoint)"),
    "a directory for optimizer.pt": (
        lambda path: ((path / "optimizer.pt").unlink(), (path / "optimizer.pt").mkdir()),
        "optimizer.pt is not a file (a damaged checkpoint)",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_resume_auto_passes_over_a_checkpoint_missing_any_file_a_resume_reads_and_says_which(tmp_path, runs, damage):
    run = tmp_path / "run"
    five = checkpoint_dir(run, 5)
    fill(five, 5, world_size=2)
    ten = checkpoint_dir(run, 10)
    fill(ten, 10, world_size=2)
    spoil, problem = DAMAGE[damage]
    spoil(ten)
    assert resolve_resume("auto", str(run), runs, world_size=2) == (run, five.resolve())
    assert damaged_after(five, world_size=2) == [f"step_10: {problem}; use another checkpoint of the run"]


@pytest.mark.parametrize("damage", DAMAGE)
def test_an_explicit_resume_of_an_incomplete_checkpoint_is_refused_naming_the_file(tmp_path, runs, damage):
    ten = checkpoint_dir(tmp_path / "run", 10)
    fill(ten, 10, world_size=2)
    spoil, problem = DAMAGE[damage]
    spoil(ten)
    with pytest.raises(ResumeError) as error:
        resolve_resume(str(ten), None, runs, world_size=2)
    assert one_line_error(error) == f"--resume {ten}: {problem}; use another checkpoint of the run"


def test_the_random_state_files_a_checkpoint_needs_are_those_of_the_ranks_both_runs_have(tmp_path, runs):
    # A rank the saving run did not have seeds its generators afresh (pretrain/checkpoint/save_restore.py), and
    # a rank the resuming run does not have reads nothing: neither file is needed.
    two = fill(checkpoint_dir(tmp_path / "two", 3, complete=False), 3, world_size=2)
    (two / "rng_rank1.pt").unlink()
    assert checkpoint_problem(two, 1) is None
    assert checkpoint_problem(two, 2) == "rng_rank1.pt is missing (an incomplete checkpoint); use another checkpoint of the run"
    one = fill(checkpoint_dir(tmp_path / "one", 3, complete=False), 3, world_size=1)
    assert checkpoint_problem(one, 4) is None
    assert checkpoint_problem(two, None) is None  # a reader of the model alone (export) reads none


def test_the_launcher_warns_of_each_checkpoint_auto_passes_over_naming_it_and_the_file(tmp_path):
    run = tmp_path / "run"
    fill(checkpoint_dir(run, 5, complete=False), 5, world_size=2)
    for steps, file in ((10, "optimizer.pt"), (15, "rng_rank1.pt")):
        (fill(checkpoint_dir(run, steps, complete=False), steps, world_size=2) / file).unlink()
    console = io.StringIO()
    config = cfg.resolve("debug", sets=["training.resume=auto"])
    owned, resumed = resume_point(config, str(run), Printer(console, None, colour=False), world_size=2)
    owned.abandon()
    assert resumed.training.resume == str(run / "checkpoints" / "step_5")
    fix = "(an incomplete checkpoint); use another checkpoint of the run"
    assert console.getvalue().splitlines() == [
        f"launcher: warning: not resuming from the later step_10: optimizer.pt is missing {fix}",
        f"launcher: warning: not resuming from the later step_15: rng_rank1.pt is missing {fix}",
        f"launcher: resuming from {run / 'checkpoints' / 'step_5'}",
    ]


def test_the_launcher_refuses_an_explicit_resume_of_an_incomplete_checkpoint_in_one_line_exit_2(tmp_path):
    ten = fill(checkpoint_dir(tmp_path / "run", 10, complete=False), 10, world_size=2)
    (ten / "rng_rank1.pt").unlink()
    argv = ["--device", "cpu", "--nproc", "2", "--debug", "--run-dir", str(tmp_path / "next"), "--resume", str(ten)]
    result = subprocess.run([sys.executable, "-m", "launcher", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    fix = "(an incomplete checkpoint); use another checkpoint of the run"
    assert result.stderr == f"launcher: error: --resume {ten}: rng_rank1.pt is missing {fix}\n"
    assert not (tmp_path / "next").exists()


def test_auto_in_a_run_directory_whose_checkpoints_are_all_damaged_is_refused_naming_the_damage_and_the_way_out(tmp_path, runs):
    run = tmp_path / "run"
    os.truncate(checkpoint_dir(run, 5) / "model.pt", 30)
    with pytest.raises(ResumeError) as error:
        resolve_resume("auto", str(run), runs, world_size=1)
    assert one_line_error(error) == (
        f"--resume auto: {run} has no complete checkpoint to resume from (step_5: model.pt is damaged (not a whole "
        f"torch.save file)); to start over on purpose, choose another --run-dir, or remove it from {run / 'checkpoints'} "
        "to start at step 0 there"
    )
    (checkpoint_dir(run, 10) / "optimizer.pt").unlink()
    with pytest.raises(ResumeError, match=r"\(step_5: model.pt is damaged .*; step_10: optimizer.pt is missing .*remove them"):
        resolve_resume("auto", str(run), runs, world_size=1)
    fill(run / "checkpoints" / "step_5", 5)  # an older complete one is still taken, the damaged newer one named
    assert resolve_resume("auto", str(run), runs, world_size=1) == (run, (run / "checkpoints" / "step_5").resolve())


def test_the_launcher_refuses_resume_auto_when_the_runs_only_checkpoint_is_damaged_and_adds_nothing_to_it(tmp_path):
    run = tmp_path / "run"
    (checkpoint_dir(run, 10) / "model.pt").write_bytes(b"")
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 9, "loss": 3.2}\n')
    argv = ["--device", "cpu", "--nproc", "1", "--debug", "--run-dir", str(run), "--resume", "auto"]
    result = subprocess.run([sys.executable, "-m", "launcher", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        f"launcher: error: --resume auto: {run} has no complete checkpoint to resume from (step_10: model.pt is empty "
        f"(a damaged checkpoint)); to start over on purpose, choose another --run-dir, or remove it from "
        f"{run / 'checkpoints'} to start at step 0 there\n"
    )
    assert (run / "metrics.jsonl").read_text() == '{"kind": "train", "step": 9, "loss": 3.2}\n'
    assert sorted(path.name for path in run.iterdir()) == ["checkpoints", "metrics.jsonl"]
