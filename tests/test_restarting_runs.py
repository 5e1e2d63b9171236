"""--max-restarts end to end, with real launchers and workers on CPU: a command of one's own restarted
as torchrun would by the rules of launcher/supervise/restarts.py, training resumed from its last
checkpoint with the same losses as an uninterrupted run, and the refusals of bad restart options."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

from conftest import wait_until
from helpers import run_launcher as launch

# Rank 1 dies by SIGKILL in the first FAILING attempts; every rank says what it sees first.
KILLED_WHILE = """
import os, signal, sys
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
print(f"attempt {attempt} of {os.environ['TORCHELASTIC_MAX_RESTARTS']}: rank {rank} of {os.environ['WORLD_SIZE']}", flush=True)
if rank == 1 and attempt < FAILING:
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(EXIT)
"""


def own_command(script, failing: int, exit_code: int = 0) -> list[str]:
    return script(KILLED_WHILE.replace("FAILING", str(failing)).replace("EXIT", str(exit_code)))


def attempts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]


def test_a_command_whose_worker_is_killed_runs_again_and_its_workers_see_the_restart_count(tmp_path, script):
    run_dir = tmp_path / "run"
    options = ["--nproc", "2", "--max-restarts", "2", "--restart-backoff", "0", "--run-dir", str(run_dir)]
    result = launch(*options, "--", *own_command(script, 1))
    assert result.returncode == 0, result.stdout[-2000:]
    assert "launcher: restart 1 of 2 in 0 s: CPU1 was killed by SIGKILL" in result.stdout
    assert "CPU1:attempt 0 of 2: rank 1 of 2" in result.stdout and "CPU1:attempt 1 of 2: rank 1 of 2" in result.stdout
    assert [(a["attempt"], a["exit_code"], a["worker"], a["restarted"]) for a in attempts(run_dir)] == [
        (0, 137, "CPU1", True),
        (1, 0, None, False),
    ]
    assert "launcher: attempts: 2 (restarts.jsonl)" in result.stdout


def test_a_spent_budget_ends_with_the_last_failures_code_and_every_attempt_listed(tmp_path, script):
    run_dir = tmp_path / "run"
    options = ["--nproc", "2", "--max-restarts", "1", "--restart-backoff", "0", "--run-dir", str(run_dir)]
    result = launch(*options, "--", *own_command(script, 9))
    assert result.returncode == 137
    assert "launcher: not restarted: CPU1 was killed by SIGKILL; the restart budget (1) is used up" in result.stdout
    assert [a["exit_code"] for a in attempts(run_dir)] == [137, 137]
    assert re.search(r"launcher:   1\. from step 0 on CPU0, CPU1: CPU1: killed by SIGKILL; exit code 137", result.stdout)


def test_a_command_that_fails_on_its_own_is_not_restarted(tmp_path, script):
    run_dir = tmp_path / "run"
    result = launch("--nproc", "2", "--max-restarts", "3", "--run-dir", str(run_dir), "--", *own_command(script, 0, exit_code=1))
    assert result.returncode == 1
    assert "launcher: not restarted: exit code 1 shows no hardware, network or timeout cause: it would repeat" in result.stdout
    assert len(attempts(run_dir)) == 1 and "restart 1" not in result.stdout


def test_a_fail_fast_run_writes_no_record_and_says_nothing_of_restarts(tmp_path, script):
    run_dir = tmp_path / "run"
    result = launch("--nproc", "2", "--run-dir", str(run_dir), "--", *own_command(script, 1))
    assert result.returncode == 137
    assert not (run_dir / "restarts.jsonl").exists() and "restart" not in result.stdout


def test_ctrl_c_during_a_run_with_restarts_left_stops_it_without_a_restart(tmp_path, script, processes):
    run_dir = tmp_path / "run"
    command = script("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    launcher = processes(
        [sys.executable, "-m", "launcher", "--nproc", "2", "--max-restarts", "2", "--run-dir", str(run_dir), "--", *command],
        stdout=subprocess.PIPE,
        text=True,
    )
    seen = []
    assert wait_until(lambda: seen.append(launcher.stdout.readline()) or sum("ready" in line for line in seen) == 2, timeout=30)
    launcher.send_signal(signal.SIGINT)
    out = "".join(seen) + launcher.communicate(timeout=30)[0]
    assert launcher.returncode == 130, out
    assert "restart 1" not in out and attempts(run_dir)[0]["why"] == "the stop was asked for"


def test_restart_options_out_of_range_are_refused_in_one_line(tmp_path):
    for args, text in [
        (["--max-restarts", "-1"], "--max-restarts must be between 0 and 1000 (got -1); 0 turns restarts off"),
        (["--min-nproc", "1"], "--min-nproc only applies to restarts: add --max-restarts N"),
        (["--max-restarts", "1", "--min-nproc", "0"], "--min-nproc must be at least 1 (got 0)"),
        (["--max-restarts", "1", "--restart-backoff", "nan"], "--restart-backoff must be between 0 and 600 seconds (got nan)"),
    ]:
        result = launch(*args, "--debug", "--device", "cpu", "--run-dir", str(tmp_path / "r"))
        assert (result.returncode, result.stderr) == (2, f"launcher: error: {text}\n"), args


def test_min_nproc_above_the_workers_asked_for_or_a_global_batch_it_cannot_keep_is_refused_before_anything_runs(tmp_path):
    run_dir = tmp_path / "r"
    common = ["--debug", "--device", "cpu", "--max-restarts", "1", "--run-dir", str(run_dir)]
    above = launch(*common, "--nproc", "2", "--min-nproc", "3")
    assert above.returncode == 2
    assert above.stderr == "launcher: error: --min-nproc 3 is more than this run's 2 worker(s); give at most 2\n"
    batch = launch(*common, "--nproc", "3", "--min-nproc", "2")  # 3 x batch 8 = 24 sequences: 2 x 8 does not divide them
    assert batch.returncode == 2
    assert batch.stderr.startswith(
        "launcher: error: --min-nproc 2: the global batch of 24 sequences cannot be kept on 2 worker(s) "
        "(not a multiple of training.batch_size 8 x 2)"
    )
    assert not run_dir.exists()  # refused before the run directory was made


def test_the_launcher_help_names_the_restart_options():
    out = launch("--help").stdout
    for option in ("--max-restarts N", "--min-nproc M", "--restart-backoff S"):
        assert option in out
