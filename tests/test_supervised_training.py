"""The launcher supervising real training workers (2 CPU ranks, gloo, debug preset):
a graceful stop on Ctrl-C, a killed rank and its peer's stack dump, a frozen peer caught by
the hang watchdog with stack dumps, and by the collective timeout."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import psutil

from conftest import ROOT, alive, launcher_env, wait_until
from pretrain import checkpoint


def start_training(tmp_path, *options: str) -> subprocess.Popen:
    """A long debug run that prints a step line every step."""
    return subprocess.Popen(
        [sys.executable, "-m", "launcher", "--debug", "--device", "cpu", "--max-steps", "100000",
         "--run-dir", str(tmp_path / "run"), "--set", f"data.cache_dir={tmp_path / 'cache'}",
         "--set", "logging.log_interval=1", *options],
        cwd=ROOT, env=launcher_env(), stdout=subprocess.PIPE, text=True)


def read_until(proc: subprocess.Popen, text: str) -> list[str]:
    lines = []
    while text not in (line := proc.stdout.readline()):
        assert line, f"the launcher ended before printing {text!r}:\n" + "".join(lines[-30:])
        lines.append(line)
    return lines + [line]


def worker_processes(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The training workers, by rank."""
    workers = [p for p in psutil.Process(launcher.pid).children() if "pretrain_main.py" in " ".join(p.cmdline())]
    return sorted(workers, key=lambda p: int(p.environ()["RANK"]))


def test_ctrl_c_ends_training_after_a_step_with_a_checkpoint_and_exit_130(tmp_path):
    proc = start_training(tmp_path)
    read_until(proc, "CPU1:INFO | [CPU 1] Step [2/")
    workers = worker_processes(proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    out = proc.stdout.read()
    stopped = [line for line in out.splitlines() if "Stopped by SIGTERM after step" in line]
    assert len(stopped) == 2 and stopped[0].split("after step")[1] == stopped[1].split("after step")[1]
    saved = tmp_path / "run" / "checkpoints" / stopped[0].rsplit("/", 1)[1]
    assert {p.name for p in saved.iterdir()} >= {"model.pt", "optimizer.pt", "rng_rank0.pt", "rng_rank1.pt"}
    assert checkpoint.read_state(saved)["steps_done"] == int(saved.name.removeprefix("step_"))
    assert "launcher: stopped: every worker exited within" in out and "had to be killed" not in out
    record = json.loads((tmp_path / "run" / "workers.json").read_text())
    assert [r["exit_code"] for r in record] == [128 + signal.SIGTERM] * 2
    assert not any(alive(w.pid) for w in workers)


def test_when_a_rank_is_killed_its_peer_writes_every_thread_stack_to_its_log(tmp_path):
    proc = start_training(tmp_path, "--kill-grace", "1")
    read_until(proc, "CPU1:INFO | [CPU 1] Step [2/")
    workers = worker_processes(proc)
    workers[1].kill()  # from outside, as the OOM killer would
    assert proc.wait(timeout=60) == 128 + signal.SIGKILL
    summary = proc.stdout.read().split("FAILED:")[1]
    assert summary.startswith(" CPU1 (rank 1) failed first") and "killed by SIGKILL" in summary
    # Asked by the supervisor (SIGUSR1), rank 0 wrote faulthandler's dump of all its threads
    # to its own log, and the summary shows its innermost frames. Where it was depends on
    # timing: still training, or already leaving after gloo saw the peer gone.
    log = (tmp_path / "run" / "logs" / "cpu0.log").read_text()
    assert "\nCurrent thread 0x" in log and re.search(r'\n  File ".*\.py", line \d+ in \w+\n', log)
    assert re.search(r"CPU0: \S+ \(", summary.split("Where each worker was")[1])
    assert wait_until(lambda: not any(alive(w.pid) for w in workers), timeout=3)


def test_a_frozen_rank_is_caught_by_the_hang_timeout_and_the_summary_shows_where_each_rank_was(tmp_path):
    # Above the silent start-up (importing torch) of a loaded 2-core machine.
    proc = start_training(tmp_path, "--hang-timeout", "5", "--kill-grace", "1")
    read_until(proc, "CPU1:INFO | [CPU 1] Step [2/")
    workers = worker_processes(proc)
    workers[1].suspend()  # SIGSTOP: rank 1 freezes; rank 0 waits for it in an all-reduce
    frozen_at = time.monotonic()
    assert proc.wait(timeout=60) == 124
    assert time.monotonic() - frozen_at < 5 + 0.3 + 1 + 3  # hang timeout, dump wait, grace, slack
    summary = proc.stdout.read().split("FAILED:")[1]
    # The frozen rank is blamed, not rank 0 that went quiet waiting for it.
    assert summary.startswith(" CPU1 (rank 1) failed first")
    assert "printed nothing for 5 s and did not answer the stack-dump request (frozen), exit code 124" in summary
    where = summary.split("Where each worker was")[1]
    # Rank 0's stack dump: waiting for the frozen peer (in backward's gradient all-reduce,
    # or in the all-reduce after the step).
    assert re.search(r"CPU0: (all_reduce|_engine_run_backward) \(", where), where
    assert "CPU1: no stack dump: the process was stopped" in where
    assert wait_until(lambda: not any(alive(w.pid) for w in workers), timeout=3)


def test_a_frozen_rank_fails_its_peers_after_the_collective_timeout(tmp_path):
    # The timeout also bounds the rendezvous, so it must exceed the ranks' start-up skew.
    proc = start_training(tmp_path, "--set", "system.collective_timeout=4", "--kill-grace", "1")
    read_until(proc, "CPU1:INFO | [CPU 1] Step [2/")
    workers = worker_processes(proc)
    workers[1].suspend()
    frozen_at = time.monotonic()
    assert proc.wait(timeout=60) == 1
    assert time.monotonic() - frozen_at < 4 + 1 + 4  # collective timeout, grace, slack
    out = proc.stdout.read()
    assert "waited longer than system.collective_timeout (4 s) for the other ranks" in out
    assert "FAILED: CPU0 (rank 0) failed first" in out
    assert "CPU1: no stack dump: the process was stopped" in out
    assert wait_until(lambda: not any(alive(w.pid) for w in workers), timeout=3)
