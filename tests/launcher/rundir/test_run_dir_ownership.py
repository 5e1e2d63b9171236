"""A run directory has one owner (launcher/rundir/lock.py): a second launch into a live run, a
--resume of a live run, and a fresh run over a finished one's checkpoints are refused in one line;
the lock dies with its launcher, SIGKILL included. CPU workers, debug preset, a few steps."""

from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import ROOT, launcher_env, wait_until
from launcher import cli
from launcher.rundir import choice
from launcher.rundir import lock
from launcher.supervise.printer import Printer
from launcher.processes.reaper import start_time
from pretrain import config as cfg
from pretrain.checkpoint.resume import latest

CPU = ("--device", "cpu", "--nproc", "1")


def launcher_argv(run: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *CPU, "--run-dir", str(run), *options]


def train(tmp_path: Path, run: Path, *options: str) -> subprocess.CompletedProcess:
    """A debug training run to its end (or its refusal)."""
    return subprocess.run(
        launcher_argv(run, "--debug", "--set", f"data.cache_dir={tmp_path / 'cache'}", *options),
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def start_training(processes, tmp_path: Path, run: Path, *options: str) -> subprocess.Popen:
    """A debug run that goes on until killed (at the latest when the test ends); returns once it
    holds its run directory (the launcher says `run directory:` after taking it and writing its config)."""
    proc = processes(
        launcher_argv(run, "--debug", "--max-steps", "100000", "--set", f"data.cache_dir={tmp_path / 'cache'}", *options),
        cwd=ROOT,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    while "launcher: run directory:" not in (line := proc.stdout.readline()):
        assert line, "the launcher ended before it took its run directory:\n" + "".join(lines[-20:])
        lines.append(line)
    return proc


def assert_refused(result: subprocess.CompletedProcess, *texts: str) -> str:
    """Exit 2, one line on stderr holding every text, no traceback, no worker started."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("launcher: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr and "CPU0:" not in result.stdout
    for text in texts:
        assert text in result.stderr, result.stderr
    return result.stderr


@pytest.mark.slow
def test_a_second_launcher_on_a_run_directory_in_use_is_refused_in_one_line_naming_the_first(processes, tmp_path):
    run = tmp_path / "run"
    first = start_training(processes, tmp_path, run, "--set", "training.seed=1")
    config = (run / "config.json").read_bytes()
    second = train(tmp_path, run, "--max-steps", "30", "--set", "training.seed=2")
    assert_refused(
        second,
        f"run directory {run} is in use by the launcher pid {first.pid} (started ",
        "; wait for it to end, or choose another with --run-dir",
    )
    assert (run / "config.json").read_bytes() == config  # the first run's workers read it
    record = json.loads((run / "launcher.lock").read_text())
    assert record["pid"] == first.pid and record["start_ticks"] == start_time(first.pid)
    assert record["host"] == socket.gethostname() and record["started"] in second.stderr


@pytest.mark.slow
def test_resume_auto_or_a_checkpoint_of_a_run_that_is_still_training_is_refused(processes, tmp_path):
    run = tmp_path / "run"
    first = start_training(processes, tmp_path, run, "--set", "training.checkpoint_interval=2")
    assert wait_until(lambda: latest(run / "checkpoints") is not None, timeout=60)
    auto = train(tmp_path, run, "--resume", "auto")
    assert_refused(
        auto,
        f"run directory {run} is still training under the launcher pid {first.pid} (started ",
        "continue it with --resume auto once that launcher ends, or for a new run leave out --resume "
        "and choose another --run-dir",
    )
    elsewhere = train(tmp_path, tmp_path / "other", "--resume", str(run))
    assert_refused(
        elsewhere,
        f"--resume {run}: its run {run} is still training under the launcher pid {first.pid}",
        "resume it once that launcher ends, or from a copy of the checkpoint made outside that run",
    )
    assert not (tmp_path / "other").exists()  # a refused launch leaves no run directory behind


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A run directory that held only logs (a launch that failed early, say), then a debug run of
    2 steps into it; the tests below work on copies of it."""
    tmp_path = tmp_path_factory.mktemp("finished")
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "combined.log").write_text("launcher: an earlier launch\n")
    return run, train(tmp_path, run, "--max-steps", "2")


def copy_of(finished: tuple[Path, subprocess.CompletedProcess], to: Path) -> Path:
    run, result = finished
    assert result.returncode == 0, result.stdout + result.stderr
    return shutil.copytree(run, to)


@pytest.mark.slow
def test_a_fresh_run_into_a_directory_holding_a_run_is_refused_with_both_ways_out_and_resume_auto_continues_it(
    tmp_path, finished
):
    run = copy_of(finished, tmp_path / "run")  # a directory holding only logs was reused
    assert "launcher: an earlier launch" in (run / "logs" / "combined.log").read_text()
    metrics, config = (run / "metrics.jsonl").read_bytes(), (run / "config.json").read_bytes()
    again = train(tmp_path, run, "--max-steps", "4")
    assert_refused(
        again,
        f"run directory {run} already holds a run (checkpoints/step_2, metrics.jsonl",
        "continue it with --resume auto (or a checkpoint path), or choose another --run-dir for a new run",
    )
    assert (run / "metrics.jsonl").read_bytes() == metrics and (run / "config.json").read_bytes() == config
    resumed = train(tmp_path, run, "--max-steps", "4", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"launcher: resuming from {run / 'checkpoints' / 'step_2'}" in resumed.stdout
    assert latest(run / "checkpoints") == run / "checkpoints" / "step_4"


SLEEPER = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"


def test_the_lock_dies_with_a_launcher_killed_by_sigkill_and_generic_commands_are_locked_too(processes, tmp_path):
    run, child = tmp_path / "run", tmp_path / "sleeper.py"
    child.write_text(SLEEPER)
    first = processes(
        launcher_argv(run, "--", sys.executable, str(child)), cwd=ROOT, env=launcher_env(), stdout=subprocess.PIPE, text=True
    )
    assert ":pid " in first.stdout.readline()  # its worker runs: it holds the run directory
    true = launcher_argv(run, "--", "true")
    refused = subprocess.run(true, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=60)
    assert_refused(refused, f"run directory {run} is in use by the launcher pid {first.pid} (started ")
    first.kill()
    first.wait(timeout=30)
    after = subprocess.run(true, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=60)
    assert after.returncode == 0, after.stderr


@pytest.mark.slow
def test_resume_auto_alone_refuses_the_newest_run_while_it_trains_and_takes_it_once_free(tmp_path, monkeypatch, finished):
    live = copy_of(finished, tmp_path / "runs" / "live")
    monkeypatch.setenv("PRETRAIN_RUNS_DIR", str(tmp_path / "runs"))
    config = cfg.resolve("debug", sets=["training.resume=auto"])
    printer = Printer(io.StringIO(), None, colour=False)
    held = lock.take(live)  # as the launcher of that run would (another open file: a lock of its own)
    assert isinstance(held, lock.RunDirLock)
    with pytest.raises(cli.UsageError) as refused:
        choice.resume_point(config, None, printer)
    assert str(refused.value).startswith(f"run directory {live.resolve()} is still training under the launcher pid ")
    assert str(refused.value).endswith("or for a new run leave out --resume")  # no --run-dir given: none to change
    held.release()
    owned, resumed = choice.resume_point(config, None, printer)
    assert owned.path == live.resolve() and resumed.training.resume == str(live.resolve() / "checkpoints" / "step_2")
    owned.release()
