"""The launcher supervising real training workers (2 CPU ranks, gloo, debug preset):
a graceful stop on Ctrl-C, a killed rank and its peer's stack dump, a frozen peer caught by
the hang watchdog with stack dumps, and by the collective timeout."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from support.processes import ROOT, alive, launcher_env, wait_until
from pretrain.checkpoint import save_restore

pytestmark = pytest.mark.slow  # each test trains for real: 2 to 10 s apiece


def long_run(tmp_path, run_dir) -> list[str]:
    """The options of a debug run long enough to be stopped by hand, a step line every step, into
    run_dir, its data cache in tmp_path/cache (the launcher's and pretrain_main.py's alike)."""
    options = ["--debug", "--max-steps", "100000", "--run-dir", str(run_dir)]
    return options + ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "logging.log_interval=1"]


def start_training(processes, tmp_path, *options: str) -> subprocess.Popen:
    """A long debug run on CPU through the launcher; the processes fixture kills it (and everything
    it started) when the test ends, however it ends."""
    return processes(
        [sys.executable, "-m", "launcher", *long_run(tmp_path, tmp_path / "run"), "--device", "cpu", *options],
        cwd=ROOT,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        text=True,
    )


def read_until(proc: subprocess.Popen, text: str) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    while text not in (line := proc.stdout.readline()):
        assert line, f"the launcher ended before printing {text!r}:\n" + "".join(lines[-30:])
        lines.append(line)
    return lines + [line]


def worker_processes(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The training workers, by rank: the launcher's children that carry a RANK (the guardian does not)."""
    workers = [p for p in psutil.Process(launcher.pid).children() if "RANK" in p.environ()]
    return sorted(workers, key=lambda p: int(p.environ()["RANK"]))


@pytest.fixture(scope="module")
def startup_seconds() -> float:
    """How long two processes importing torch at once take here, measured once for the module's
    tests that need it (they run one after the other): the silent start-up of two training ranks,
    which a loaded machine stretches. Timeouts those tests set are derived from it."""
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", "import torch"]) for _ in range(2)]
    assert [proc.wait(timeout=300) for proc in procs] == [0, 0]
    return time.monotonic() - started


def timeout_above_startup(startup_seconds: float, floor: int, factor: float) -> int:
    """A timeout in whole seconds (as the messages print it): factor times the measured start-up,
    at least floor. A debug rank's silence before its first line was measured at about 1.1 times
    startup_seconds (1.6 s against 1.4 s), and the skew between two ranks' start-ups is less."""
    return max(floor, math.ceil(factor * startup_seconds))


def test_ctrl_c_ends_training_after_a_step_with_a_checkpoint_and_exit_130(processes, tmp_path):
    proc = start_training(processes, tmp_path)
    read_until(proc, "CPU1:INFO | [CPU 1] Step [2/")
    workers = worker_processes(proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    out = proc.stdout.read()
    stopped = [line for line in out.splitlines() if "Stopped by SIGTERM after step" in line]
    assert len(stopped) == 2 and stopped[0].split("after step")[1] == stopped[1].split("after step")[1]
    saved = tmp_path / "run" / "checkpoints" / stopped[0].rsplit("/", 1)[1]
    assert {p.name for p in saved.iterdir()} >= {"model.pt", "optimizer.pt", "rng_rank0.pt", "rng_rank1.pt"}
    assert save_restore.read_state(saved)["steps_done"] == int(saved.name.removeprefix("step_"))
    assert "launcher: stopped: every worker exited within" in out and "had to be killed" not in out
    record = json.loads((tmp_path / "run" / "workers.json").read_text())
    assert [r["exit_code"] for r in record] == [128 + signal.SIGTERM] * 2
    assert not any(alive(w.pid) for w in workers)


def test_when_a_rank_is_killed_its_peer_writes_every_thread_stack_to_its_log(processes, tmp_path):
    proc = start_training(processes, tmp_path, "--kill-grace", "1")
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
    assert "Where each worker was" in summary, summary
    assert re.search(r"CPU0: \S+ \(", summary.split("Where each worker was")[1]), summary
    assert wait_until(lambda: not any(alive(w.pid) for w in workers), timeout=3)


def test_a_frozen_rank_is_caught_by_the_hang_timeout_and_the_summary_shows_where_each_rank_was(
    processes, tmp_path, startup_seconds
):
    # Above the silent start-up (importing torch), which the watchdog also times: measured, since
    # a loaded 2-core machine stretches it past any fixed figure. Teardown gets as much again.
    hang = timeout_above_startup(startup_seconds, 5, factor=3)
    proc = start_training(processes, tmp_path, "--hang-timeout", str(hang), "--kill-grace", "1")
    read_until(proc, "CPU1:INFO | [CPU 1] Step [2/")
    workers = worker_processes(proc)
    workers[1].suspend()  # SIGSTOP: rank 1 freezes; rank 0 waits for it in an all-reduce
    frozen_at = time.monotonic()
    assert proc.wait(timeout=60 + 2 * hang) == 124
    assert time.monotonic() - frozen_at < hang + 0.3 + 1 + hang  # hang timeout, dump wait, grace, slack
    summary = proc.stdout.read().split("FAILED:")[1]
    # The frozen rank is blamed, not rank 0 that went quiet waiting for it.
    assert summary.startswith(" CPU1 (rank 1) failed first")
    assert f"printed nothing for {hang} s and did not answer the stack-dump request (frozen), exit code 124" in summary
    where = summary.split("Where each worker was")[1]
    # Rank 0's stack dump: waiting for the frozen peer (in backward's gradient all-reduce,
    # or in the all-reduce after the step).
    assert re.search(r"CPU0: (all_reduce|_engine_run_backward) \(", where), where
    assert "CPU1: no stack dump: the process was stopped" in where
    assert wait_until(lambda: not any(alive(w.pid) for w in workers), timeout=3)


def test_a_frozen_rank_fails_its_peers_after_the_collective_timeout(processes, tmp_path, startup_seconds):
    # The timeout also bounds the rendezvous, so it must exceed the ranks' start-up skew, which
    # a loaded machine stretches: derived from the measured start-up. Teardown gets as much again.
    collective = timeout_above_startup(startup_seconds, 4, factor=2)
    proc = start_training(processes, tmp_path, "--set", f"system.collective_timeout={collective}", "--kill-grace", "1")
    read_until(proc, "CPU1:INFO | [CPU 1] Step [2/")
    workers = worker_processes(proc)
    workers[1].suspend()
    frozen_at = time.monotonic()
    assert proc.wait(timeout=60 + 2 * collective) == 1
    assert time.monotonic() - frozen_at < collective + 1 + collective  # collective timeout, grace, slack
    out = proc.stdout.read()
    assert f"waited longer than system.collective_timeout ({collective} s) for the other ranks" in out
    assert "FAILED: CPU0 (rank 0) failed first" in out
    assert "CPU1: no stack dump: the process was stopped" in out
    assert wait_until(lambda: not any(alive(w.pid) for w in workers), timeout=3)
