"""Progress lines (pretrain/observe/progress.py, the worker contract's LAUNCHER_PROGRESS_MARK): the
step a worker has just finished reaches the launcher after every step, whatever the log interval,
is shown nowhere, and is the step the restart rules judge and the record keeps."""

from __future__ import annotations

import json
from pathlib import Path

from support.runs import run_launcher as launch
from launcher.supervise.outcome import Watch
from launcher.supervise.restarts import PROGRESS_MARK, PROGRESS_VAR
from pretrain.observe import progress


def attempts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]


def test_a_worker_reports_each_step_only_when_the_launcher_names_a_marker(monkeypatch, capsys):
    assert progress.PROGRESS_VAR == PROGRESS_VAR  # the two sides' one name, kept apart by the imports' direction
    monkeypatch.delenv(PROGRESS_VAR, raising=False)
    assert progress.reporter() is None  # alone, under torchrun: nothing is written
    monkeypatch.setenv(PROGRESS_VAR, PROGRESS_MARK)
    report = progress.reporter()
    assert report is not None
    report(12)
    report(13)
    assert capsys.readouterr().out == f"{PROGRESS_MARK}12\n{PROGRESS_MARK}13\n"


def test_the_watch_takes_a_progress_line_as_the_step_reached_and_keeps_it_out_of_the_tail():
    watch = Watch(last_output=0.0)
    watch.see("INFO | [CPU 1] Step [10/30] | Loss: 3.27", now=1.0)
    assert watch.progress(f"{PROGRESS_MARK}12") and watch.last_step == 12
    assert not watch.progress("INFO | [CPU 1] Step [15/30] | Loss: 3.10")
    assert watch.progress(f"{PROGRESS_MARK}not a number") and watch.last_step == 12
    assert list(watch.tail) == ["INFO | [CPU 1] Step [10/30] | Loss: 3.27"] and watch.last_output == 1.0


REPORTS_THEN_DIES = """
import os, signal, sys
mark, attempt = os.environ["LAUNCHER_PROGRESS_MARK"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print("INFO | [CPU 0] Step [0/9] | Loss: 3.0", flush=True)
for step in range(3 + attempt):
    sys.stdout.write(f"{mark}{step}\\n")
    sys.stdout.flush()
print(f"attempt {attempt} done", flush=True)
if attempt == 0:
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_launcher_records_the_step_a_command_reported_and_prints_its_progress_lines_nowhere(tmp_path, script):
    run_dir = tmp_path / "run"
    options = ["--nproc", "1", "--max-restarts", "1", "--restart-backoff", "0", "--run-dir", str(run_dir)]
    result = launch(*options, "--", *script(REPORTS_THEN_DIES))
    assert result.returncode == 0, result.stdout[-2000:]
    assert [(a["step"], a["restarted"]) for a in attempts(run_dir)] == [(2, True), (3, False)]
    assert "CPU0: killed by SIGKILL at step 2; restarted" in result.stdout and "attempt 1 done" in result.stdout
    logs = [path.read_text() for path in (run_dir / "logs").glob("*.log")]
    assert len(logs) == 2 and all("attempt 0 done" in log for log in logs)  # cpu0.log and combined.log
    for text in [result.stdout, result.stderr, *logs]:
        assert "progress" not in text and "\x1f" not in text


def test_two_failures_a_step_apart_between_the_same_logged_steps_are_not_the_same_failure(tmp_path):
    """The issue's run, shorter: both attempts last log step 3 (logging.log_interval=3), but one
    dies after step 4 and the other after step 5, so the second is restarted too. Both resume from
    step_3; short windows and batches, since the six workers' start-up is the cost, not the steps."""
    run_dir = tmp_path / "run"
    argv = ["--debug", "--device", "cpu", "--nproc", "2", "--max-steps", "7", "--run-dir", str(run_dir)]
    argv += ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "logging.log_interval=3"]
    argv += ["--set", "data.context_length=64", "--set", "training.batch_size=4"]
    argv += ["--set", "training.checkpoint_interval=3", "--max-restarts", "3", "--restart-backoff", "0"]
    result = launch(*argv, timeout=300, PRETRAIN_FAULTS="0:1:4:sigkill,1:1:5:sigkill")
    assert result.returncode == 0, result.stdout[-3000:]
    assert [(a["step"], a["restarted"]) for a in attempts(run_dir)] == [(4, True), (5, True), (6, False)]
    assert "CPU1: killed by SIGKILL at step 4; restarted" in result.stdout
    assert "\x1f" not in (run_dir / "logs" / "cpu1.log").read_text()
