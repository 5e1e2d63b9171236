"""PRETRAIN_FAULTS (pretrain/run/faults.py): each form read, each malformed value refused in one
line, attempts matched against TORCHELASTIC_RESTART_COUNT, and a real training process that kills
itself, or exits, right after the step's line."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from support.processes import ROOT, launcher_env
from support.runs import assert_one_line_error, run_in_process, run_launcher
from pretrain import train
from pretrain.run import faults
from pretrain.run.faults import ATTEMPT_VAR, FAULTS_VAR, Fault, FaultsError


def test_each_action_is_read_with_its_attempt_rank_and_step():
    assert faults.parse("0:1:10:sigkill, 2:0:3:sigsegv,*:3:0:exit=7,1:1:5:sleep=0.25") == (
        Fault(0, 1, 10, "sigkill"),
        Fault(2, 0, 3, "sigsegv"),
        Fault(None, 3, 0, "exit", 7),
        Fault(1, 1, 5, "sleep", 0.25),
    )


def test_an_empty_value_scripts_no_fault():
    assert faults.parse("") == () and faults.parse(" , ") == ()
    assert faults.scripted({}) == () and faults.for_rank((), 0) is None


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("0:1:10", "has 3 field(s), not 4"),
        ("0:1:10:sigkill:now", "has 5 field(s), not 4"),
        ("first:1:10:sigkill", "ATTEMPT 'first' is not a whole number or *"),
        ("0:-1:10:sigkill", "RANK '-1' is not a whole number"),
        ("0:1:ten:sigkill", "STEP 'ten' is not a whole number"),
        ("0:1:10:sigterm", "ACTION 'sigterm' is not"),
        ("0:1:10:sigkill=9", "ACTION 'sigkill=9' is not"),
        ("0:1:10:exit=256", "ACTION 'exit=256' is not"),
        ("0:1:10:exit", "ACTION 'exit' is not"),
        ("0:1:10:sleep=-1", "ACTION 'sleep=-1' is not"),
        ("0:1:10:sleep=nan", "ACTION 'sleep=nan' is not"),
    ],
)
def test_a_malformed_entry_is_refused_in_one_line_naming_it_and_the_form(entry, problem):
    with pytest.raises(FaultsError) as caught:
        faults.parse(f"*:0:1:exit=3,{entry}")
    message = str(caught.value)
    assert "\n" not in message and caught.value.exit_code == 2
    assert message.startswith(f"PRETRAIN_FAULTS entry {entry!r}: {problem}")
    assert message.endswith(f"the form is {faults.FORM}")


@pytest.mark.parametrize(("attempt", "steps"), [(None, [2, 9]), ("0", [2, 9]), ("1", [5, 9])], ids=["unset", "0", "1"])
def test_an_entry_fires_only_in_its_attempt_and_star_in_every_one(attempt, steps):
    environ = {FAULTS_VAR: "0:0:2:sigkill,1:0:5:exit=4,*:0:9:sigsegv"}
    if attempt is not None:
        environ[ATTEMPT_VAR] = attempt
    assert [fault.step for fault in faults.scripted(environ)] == steps


def test_a_restart_count_that_is_not_a_number_is_refused():
    with pytest.raises(FaultsError, match="TORCHELASTIC_RESTART_COUNT='x' is not a whole number"):
        faults.scripted({FAULTS_VAR: "0:0:2:sigkill", ATTEMPT_VAR: "x"})


def test_a_rank_gets_only_its_own_faults_and_sleeps_from_their_step_on():
    scripted = faults.parse("0:0:2:sigkill,0:1:3:exit=7,0:1:4:sleep=0.5,0:1:6:sleep=0.25")
    assert faults.for_rank(scripted, 2) is None
    mine = faults.for_rank(scripted, 1)
    assert mine is not None and list(mine.ends) == [3]
    assert [mine.sleep_seconds(step) for step in (3, 4, 5, 6, 100)] == [0, 0.5, 0.5, 0.75, 0.75]


def test_a_step_without_a_fault_neither_logs_nor_ends_the_process():
    said: list[str] = []
    mine = faults.for_rank(faults.parse("0:0:2:exit=7"), 0)
    assert mine is not None
    mine.after_step(1, said.append)
    mine.after_step(3, said.append)
    assert said == []


def test_a_malformed_value_stops_training_before_it_starts(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(FAULTS_VAR, "0:0:2:sigstop")
    argv = ["--debug", "--max-steps", "1", "--run-dir", str(tmp_path / "run"), "--set", f"data.cache_dir={tmp_path}"]
    result = run_in_process(train.main, argv, capsys)
    assert_one_line_error(result, "PRETRAIN_FAULTS entry '0:0:2:sigstop'", prefix="pretrain: error: ")


def test_a_fault_for_a_rank_beyond_the_world_size_is_refused_by_the_launcher_before_any_worker_starts(tmp_path):
    # It would never fire: the run would end 0 and pass for one that survived the fault.
    result = run_launcher(
        "--debug", "--device", "cpu", "--nproc", "2", "--max-steps", "4", "--run-dir", str(tmp_path / "run"),
        "--set", f"data.cache_dir={tmp_path / 'cache'}",
        timeout=120,
        **{FAULTS_VAR: "0:1:2:sleep=0,0:5:3:sigkill"},
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (
        "launcher: error: PRETRAIN_FAULTS names rank 5, but the world size is 2 (ranks 0-1), "
        "so that fault would never fire; give a rank below 2\n"
    )
    assert "CPU0:" not in result.stdout and not (tmp_path / "run").exists()


def test_faults_of_ranks_within_the_world_size_pass_the_check():
    faults.check_ranks(faults.parse("0:0:2:sigkill,*:1:3:sleep=1"), 2)


def run_with_fault(tmp_path, fault: str) -> subprocess.CompletedProcess:
    """Four debug steps of one training process (a step line each) with PRETRAIN_FAULTS=fault."""
    return subprocess.run(
        [
            sys.executable,
            "pretrain_main.py",
            "--debug",
            "--max-steps",
            "4",
            "--run-dir",
            str(tmp_path / "run"),
            *("--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.context_length=32"),
            *("--set", "training.batch_size=2", "--set", "logging.log_interval=1", "--set", "debug.trace_nonfinite=false"),
        ],
        cwd=ROOT,
        env=launcher_env(**{FAULTS_VAR: fault}),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("fault", "code", "said"),
    [("0:0:2:sigkill", -signal.SIGKILL, "SIGKILL"), ("*:0:2:exit=7", 7, "exit 7")],
    ids=["sigkill", "exit=7"],
)
@pytest.mark.slow
def test_a_training_process_ends_as_scripted_right_after_the_steps_line(tmp_path, fault, code, said):
    result = run_with_fault(tmp_path, fault)
    assert result.returncode == code, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    step_line = next(i for i, line in enumerate(lines) if "Step [2/4]" in line)
    assert lines[step_line + 1].endswith(f"fault injected: {said} after step 2 (PRETRAIN_FAULTS)")
    assert "Step [3/4]" not in result.stdout
