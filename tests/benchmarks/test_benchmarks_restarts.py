"""benchmarks/restarts.py, the restart benchmark against torchrun: where the kill and the next
attempt's first step are read from the output, how torchrun is run as fairly as it allows, the
table; and that it starts as the docs run it. No training runs here: the benchmark itself does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import restarts  # noqa: E402
from benchmarks.restarts import SETUPS, Restart, RunResult  # noqa: E402

OURS_OUTPUT = [
    (1.0, "CPU1:INFO | [CPU 1] Step [12/30] | Loss: 3.3613\n"),
    (1.1, "CPU1:WARNING | [CPU 1] fault injected: SIGKILL after step 12 (PRETRAIN_FAULTS)\n"),
    (1.2, "CPU0:INFO | [CPU 0] Step [12/30] | Loss: 3.3613\n"),  # rank 0 finishing the killed step
    (1.3, "launcher:   INFO | [CPU 1] Step [0/30] | Loss: 5.5805\n"),  # the summary quoting the dead worker
    (1.4, "launcher: restart 1 of 1 in 1 s: CPU1 was killed by SIGKILL\n"),
    (6.0, "CPU1:INFO | [CPU 1] Resumed from runs/x/checkpoints/step_10 at step 10\n"),
    (7.5, "CPU0:INFO | [CPU 0] Step [10/30] | Loss: 3.2716\n"),
    (7.6, "CPU1:INFO | [CPU 1] Step [10/30] | Loss: 3.2716\n"),
]


def test_the_kill_is_the_fault_line_and_the_next_first_step_the_first_worker_step_below_it():
    restart = restarts.restart_timing(OURS_OUTPUT)
    assert restart == Restart(killed_at=1.1, killed_step=12, next_at=7.5, next_step=10)
    assert restart.seconds == pytest.approx(6.4) and restart.redone == 3


def test_torchruns_unprefixed_lines_starting_over_redo_every_step_up_to_the_kill():
    output = [
        (2.0, "WARNING | [CPU 1] fault injected: SIGKILL after step 15 (PRETRAIN_FAULTS)\n"),
        (2.1, "INFO | [CPU 0] Step [15/30] | Loss: 3.1\n"),
        (2.2, "E1126 02:31:28.804000 19278 api.py:1002] failed (exitcode: -9) local_rank: 1\n"),
        (4.0, "INFO | [CPU 0] Validation | Step [30/30] | Loss: 1.9\n"),  # not a step line
        (5.0, "INFO | [CPU 1] Step [0/30] | Loss: 5.5\n"),
    ]
    restart = restarts.restart_timing(output)
    assert restart is not None and restart.next_step == 0 and restart.redone == 16
    assert restart.seconds == pytest.approx(3.0)


def test_a_run_that_never_restarted_has_a_kill_but_no_next_step_and_one_never_killed_has_none():
    killed_only = restarts.restart_timing(OURS_OUTPUT[:5])
    assert killed_only == Restart(1.1, 12) and killed_only.seconds is None and killed_only.redone is None
    assert restarts.restart_timing([(1.0, "CPU0:INFO | [CPU 0] Step [3/30]\n")]) is None


def run(exit_code: int | None, seconds: float | None, next_step: int | None = 10, wall: float = 20.0) -> RunResult:
    restart = Restart(1.0, 15, None if seconds is None else 1.0 + seconds, None if seconds is None else next_step)
    return RunResult(exit_code, 0 if exit_code is not None else None, wall, restart)


def test_a_row_shows_the_median_and_range_the_restart_point_and_every_exit_code():
    cells = restarts.row(SETUPS[0], [run(0, 6.0), run(0, 5.5, wall=19.0), run(0, 7.25, wall=22.0)])
    assert cells == [SETUPS[0].label, "checkpoint step_10", "6.00 (5.50–7.25)", "6", "20.0 (19.0–22.0)", "0", "0"]


def test_a_row_says_how_many_runs_restarted_when_not_all_did_and_names_a_timeout():
    cells = restarts.row(SETUPS[4], [run(0, 2.0, next_step=0), run(1, None), run(None, None)])
    assert cells[1:4] == ["step 0", "2.00; 1 of 3 runs", "16; 1 of 3 runs"]
    assert cells[5:] == ["0; 2 of 3 runs", "0, 1, timeout"]
    assert restarts.row(SETUPS[4], [run(1, None)])[1:3] == ["no restart", "—"]


def test_the_backoffs_share_is_our_default_rows_median_minus_the_zero_backoff_rows():
    line = restarts.backoff_share({SETUPS[0]: [run(0, 3.5), run(0, 3.0)], SETUPS[1]: [run(0, 2.0)]})
    assert line is not None and line.startswith("The backoff's share: 1.25 s of our 3.25 s") and "overlap" not in line
    noisy = restarts.backoff_share({SETUPS[0]: [run(0, 3.0)], SETUPS[1]: [run(0, 2.0), run(0, 3.7)]})
    assert noisy is not None and noisy.startswith("The backoff's share: 0.15 s") and noisy.endswith("ranges overlap.")
    assert restarts.backoff_share({SETUPS[0]: [run(0, 3.5)], SETUPS[1]: [run(1, None)]}) is None


def test_torchrun_resumes_through_the_scripts_own_flags_and_its_standalone_store_is_not_shared(tmp_path):
    args = restarts.parse_args([])
    config = tmp_path / "config.json"
    resuming, starting_over, static = SETUPS[2], SETUPS[3], SETUPS[4]
    argv = restarts.tool_argv(resuming, args, tmp_path, config)
    assert "--standalone" in argv and argv[argv.index("--max-restarts") + 1] == "1"
    assert argv[argv.index("pretrain_main.py") :] == ["pretrain_main.py", "--config", str(config), "--resume", "auto"] + [
        "--run-dir",
        str(tmp_path / "run"),
    ]
    assert "--resume" not in restarts.tool_argv(starting_over, args, tmp_path, config)
    assert "--master-port" in restarts.tool_argv(static, args, tmp_path, config)
    env = restarts.tool_env(resuming, "m", 15, tmp_path)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["PRETRAIN_FAULTS"] == "0:1:15:sigkill"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in restarts.tool_env(static, "m", 15, tmp_path)
    with pytest.raises(RuntimeError, match="config.json"):
        restarts.tool_argv(resuming, args, tmp_path, None)


def test_our_rows_pass_a_backoff_only_where_they_set_one(tmp_path):
    args = restarts.parse_args(["--quick"])
    assert args.repeat == 1
    default, zero = (restarts.tool_argv(setup, args, tmp_path, None) for setup in SETUPS[:2])
    assert "--restart-backoff" not in default
    assert zero[zero.index("--restart-backoff") + 1] == "0" and "training.checkpoint_interval=10" in zero


@pytest.mark.parametrize("argv", [["--kill-step", "10"], ["--kill-step", "30"], ["--kill-step", "0"], ["--repeat", "0"]])
def test_a_kill_step_the_next_attempt_could_not_start_below_or_no_repeat_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        restarts.parse_args(argv)
    assert stopped.value.code == 2 and "error: --" in capsys.readouterr().err


def test_the_benchmark_run_as_a_script_answers_help():
    result = subprocess.run(
        [sys.executable, str(Path("benchmarks") / "restarts.py"), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "--repeat" in result.stdout and "--quick" in result.stdout and "--markdown" in result.stdout


def test_torchrun_gets_our_resolved_config_with_its_resume_emptied_and_all_else_kept(tmp_path):
    ours = tmp_path / "config.json"
    ours.write_text(json.dumps({"preset": "debug", "training": {"resume": "/runs/x/checkpoints/step_10", "max_steps": 30}}))
    written = restarts.resume_emptied(ours, tmp_path / "torchrun.json")
    assert json.loads(written.read_text()) == {"preset": "debug", "training": {"resume": "", "max_steps": 30}}
