"""Every stop signal a scheduler or a terminal sends ends a run with the step finished, a
checkpoint and the documented exit code: SIGTERM to every process of the job (as Slurm sends
it), with and without DataLoader worker processes, and SIGHUP (a closed terminal) to the
launcher or to a training process; a console whose reader goes away (`| head`) stops the run the
same way, with 141. DataLoader workers ignore the job's signals (pretrain/data/loader.py) and
still end with their training process."""

from __future__ import annotations

import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import psutil
import pytest

from support.processes import ROOT, alive, launcher_env, wait_until
from pretrain.checkpoint import save_restore
from pretrain.data import loader
from support.datasets import Part, write_dataset
from test_supervised_training import long_run, read_until, start_training


def family(proc: subprocess.Popen) -> list[psutil.Process]:
    """The launcher and every process below it: guardian, training workers, DataLoader workers."""
    launcher = psutil.Process(proc.pid)
    return [launcher, *launcher.children(recursive=True)]


def dataloader_workers(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Of family(): the children of the training workers, their DataLoader workers."""
    launcher = processes[0].pid
    trainers = {p.pid for p in processes if p.ppid() == launcher and "RANK" in p.environ()}
    return [p for p in processes if p.ppid() in trainers]


def saved_checkpoint(run_dir, out: str, stop_signal: str) -> None:
    """The checkpoint both ranks reported saving when they stopped; checks it is complete."""
    stopped = [line for line in out.splitlines() if f"Stopped by {stop_signal} after step" in line]
    assert len(stopped) == 2 and stopped[0].split("after step")[1] == stopped[1].split("after step")[1], out[-3000:]
    saved = run_dir / "checkpoints" / stopped[0].rsplit("/", 1)[1]
    assert {p.name for p in saved.iterdir()} >= {"model.pt", "optimizer.pt", "rng_rank0.pt", "rng_rank1.pt"}
    assert save_restore.read_state(saved)["steps_done"] == int(saved.name.removeprefix("step_"))


def exit_codes(run_dir) -> list[int]:
    return [r["exit_code"] for r in json.loads((run_dir / "workers.json").read_text())]


@pytest.mark.parametrize("num_workers", [2, 0])
@pytest.mark.slow
def test_sigterm_to_every_process_of_the_job_saves_a_checkpoint_and_exits_143(processes, tmp_path, num_workers):
    proc = start_training(processes, tmp_path, "--set", f"training.num_workers={num_workers}")
    read_until(proc, "CPU1:INFO | [CPU 1] Step [2/")
    job = family(proc)
    assert len(dataloader_workers(job)) == 2 * num_workers  # so the signal reaches them too
    for process in job:  # as Slurm's scancel or a preemption does
        process.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    out = proc.stdout.read()
    saved_checkpoint(tmp_path / "run", out, "SIGTERM")
    assert "launcher: stopped: every worker exited within" in out and "had to be killed" not in out
    assert exit_codes(tmp_path / "run") == [143, 143]
    assert wait_until(lambda: not any(alive(p.pid) for p in job), timeout=5)


@pytest.mark.slow
def test_sighup_to_the_launcher_saves_a_checkpoint_and_exits_129(processes, tmp_path):
    proc = start_training(processes, tmp_path, "--set", "training.num_workers=2")
    read_until(proc, "CPU1:INFO | [CPU 1] Step [2/")
    job = family(proc)
    proc.send_signal(signal.SIGHUP)  # the terminal closed (ssh dropped)
    assert proc.wait(timeout=60) == 129
    out = proc.stdout.read()
    assert "launcher: received SIGHUP: asking the workers to stop gracefully" in out
    saved_checkpoint(tmp_path / "run", out, "SIGTERM")  # what the launcher sends its workers
    assert "launcher: stopped: every worker exited within" in out and "of SIGHUP" in out
    assert exit_codes(tmp_path / "run") == [143, 143]
    assert wait_until(lambda: not any(alive(p.pid) for p in job), timeout=5)


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid(1) (util-linux)")
@pytest.mark.slow
def test_closing_the_terminal_of_a_run_saves_a_checkpoint_and_exits_129(processes, tmp_path):
    # The launcher leads a session whose controlling terminal is a pseudo-terminal; closing its
    # master side is a hang-up: the kernel sends SIGHUP, and writes to the terminal fail (EIO).
    master, terminal = pty.openpty()
    run_dir = tmp_path / "run"
    proc = processes(  # setsid(1) forks unless it starts outside a group of its own
        ["setsid", "--ctty", sys.executable, "-m", "launcher", *long_run(tmp_path, run_dir), "--device", "cpu"]
        + ["--set", "training.num_workers=2"],
        cwd=ROOT,
        env=launcher_env(),
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        own_group=False,
    )
    os.close(terminal)
    try:
        seen = b""
        while b"[CPU 1] Step [2/" not in seen:
            seen += os.read(master, 65536)  # OSError (EIO) once the launcher has ended
        job = family(proc)
    finally:
        os.close(master)
    assert proc.wait(timeout=60) == 129
    log = (run_dir / "logs" / "combined.log").read_text()
    assert "launcher: received SIGHUP: asking the workers to stop gracefully" in log
    saved_checkpoint(run_dir, log, "SIGTERM")
    assert exit_codes(run_dir) == [143, 143]
    assert wait_until(lambda: not any(alive(p.pid) for p in job), timeout=5)


@pytest.mark.slow
def test_sighup_to_a_training_process_and_its_dataloader_workers_saves_and_exits_129(processes, tmp_path):
    # Without the launcher, in a session of its own, as a terminal's hang-up reaches a job.
    run_dir = tmp_path / "run"
    proc = processes(
        [sys.executable, "pretrain_main.py", *long_run(tmp_path, run_dir), "--set", "system.device=cpu"]
        + ["--set", "training.num_workers=2"],
        cwd=ROOT,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    read_until(proc, "Step [2/")
    job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert len(job) == 3
    os.killpg(proc.pid, signal.SIGHUP)
    assert proc.wait(timeout=60) == 129
    out = proc.stdout.read()
    stopped = [line for line in out.splitlines() if "Stopped by SIGHUP after step" in line]
    assert len(stopped) == 1 and "Traceback" not in out, out[-3000:]
    saved = run_dir / "checkpoints" / stopped[0].rsplit("/", 1)[1]
    assert save_restore.read_state(saved)["steps_done"] == int(saved.name.removeprefix("step_"))
    assert wait_until(lambda: not any(alive(p.pid) for p in job), timeout=5)


def test_a_training_process_stops_on_sighup_and_a_second_one_never_ends_it_at_once():
    source = (
        "import os, signal\n"
        "from pretrain.run import stopping\n"
        "stopping.REPEAT_AFTER_SECONDS = 0  # any repeat would be a second request\n"
        "request = stopping.StopRequest()\n"
        "with request.installed():\n"
        "    os.kill(os.getpid(), signal.SIGHUP)\n"
        "    os.kill(os.getpid(), signal.SIGHUP)\n"
        "    print('stopping on', signal.Signals(request.signum).name, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM still ends it at once\n"
        "    print('not reached', flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=30, env=launcher_env())
    assert result.returncode == -signal.SIGTERM
    assert result.stdout == "stopping on SIGHUP\n"


HOLDS_A_LOADER = textwrap.dedent("""
    import multiprocessing, sys
    from pretrain.data.loader import TrainBatches
    batches = iter(TrainBatches(sys.argv[1], 8, batch_size=4, rank=0, world_size=1, seed=0, num_workers=2))
    next(batches)
    print(*(child.pid for child in multiprocessing.active_children()), flush=True)
    sys.stdin.readline()  # the test signals the workers now
    for _ in range(40):  # more than they prefetch: each worker must still be serving
        next(batches)
    print("40 more batches", flush=True)
    # Exit holding the iterator: its workers must not keep this process from ending.
""")


def test_dataloader_workers_survive_the_job_signals_and_end_with_their_process(tmp_path):
    data = write_dataset(tmp_path / "data", train=[Part(np.arange(4000), "train.bin")], val=[Part(np.arange(100), "val.bin")])
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDS_A_LOADER, str(data)],
        cwd=ROOT,
        env=launcher_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers = [int(pid) for pid in proc.stdout.readline().split()]
    assert len(workers) == 2
    for pid in workers:
        for sig in loader.JOB_SIGNALS:
            os.kill(pid, sig)
    try:
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        proc.kill()  # should it hang at exit (its workers then leave on their own: torch's watchdog)
    assert proc.returncode == 0 and out == "40 more batches\n", err[-3000:]
    assert wait_until(lambda: not any(alive(pid) for pid in workers), timeout=5)


def test_a_signal_that_arrives_while_the_workers_start_is_delivered_to_the_process_afterwards():
    received: list[int] = []

    class Loader:  # stands in for a DataLoader whose workers are being forked
        def __iter__(self):
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # to this thread, which forks
            assert signal.SIGTERM in signal.sigpending() and received == []  # held back meanwhile
            return (batch for batch in [])

    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: received.append(signum))
    try:
        loader.start_workers(Loader())  # type: ignore[arg-type]
        assert received == [signal.SIGTERM]
        assert not set(loader.JOB_SIGNALS) & signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        signal.signal(signal.SIGTERM, previous)


STOPS_WHEN_HUNG_UP_TWICE = """
    import os, signal, sys, time
    from pathlib import Path
    log = Path(sys.argv[1])

    def seen(text):  # a handshake: wait until the supervisor has logged text
        deadline = time.monotonic() + 30
        while text not in log.read_text():
            if time.monotonic() > deadline:
                sys.exit(5)
            time.sleep(0.01)

    def finish_step_and_save(signum, frame):
        if os.environ["RANK"] == "0":
            os.kill(os.getppid(), signal.SIGHUP)  # the hang-up again, while the workers are stopping
            seen("received SIGHUP: already stopping")
        print("saved", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, finish_step_and_save)
    print("ready", flush=True)
    if os.environ["RANK"] == "0":
        seen("CPU1:ready")
        os.kill(os.getppid(), signal.SIGHUP)  # the terminal closed
    time.sleep(60)
"""


def test_a_second_sighup_to_the_supervisor_lets_the_workers_finish_stopping(script, tmp_path):
    from test_supervisor import make_worker, supervise

    argv = [*script(STOPS_WHEN_HUNG_UP_TWICE, "hung_up.py"), str(tmp_path / "logs" / "combined.log")]
    survive = signal.signal(signal.SIGHUP, lambda *_: None)  # should the supervisor not handle it
    try:
        code, out, _ = supervise([make_worker(0, argv), make_worker(1, argv)], tmp_path, stop_leaders_only=True)
    finally:
        signal.signal(signal.SIGHUP, survive)
    assert code == 129 and out.count(":saved") == 2, out
    assert "launcher: received SIGHUP: asking the workers to stop gracefully" in out
    assert "launcher: received SIGHUP: already stopping; carrying on" in out and "killing" not in out


def ignored_signals(pid: int) -> set[int]:
    """The signals a process ignores (SigIgn in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as status:
        mask = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
    return {sig for sig in range(1, 64) if mask >> (sig - 1) & 1}


def test_the_guardian_outlives_a_sigterm_to_every_process_and_leaves_when_told_done():
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.processes.guardian", "unused-token"],
        cwd=ROOT,
        env=launcher_env(),
        stdin=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_until(lambda: signal.SIGTERM in ignored_signals(proc.pid), timeout=30)  # it has started
        proc.send_signal(signal.SIGTERM)
        proc.communicate("done\n", timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0


@pytest.mark.slow
def test_a_killed_training_process_takes_its_dataloader_workers_and_its_peers_fail_at_once(processes, tmp_path):
    """Its forked workers hold copies of its sockets to the other ranks: were they left for
    torch's watchdog (every MP_STATUS_CHECK_INTERVAL, 5 s), the peers would notice only then."""
    from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL

    proc = start_training(processes, tmp_path, "--set", "training.num_workers=2")
    read_until(proc, "CPU1:INFO | [CPU 1] Step [2/")
    trainer = next(p for p in family(proc) if p.ppid() == proc.pid and "RANK" in p.environ())
    helpers = trainer.children()
    assert len(helpers) == 2
    trainer.kill()  # as the OOM killer does
    assert wait_until(lambda: not any(alive(p.pid) for p in helpers), timeout=MP_STATUS_CHECK_INTERVAL / 2)
    assert proc.wait(timeout=60) == 137
    teardown = float(proc.stdout.read().split("teardown took ")[1].split(" s")[0])
    assert teardown < MP_STATUS_CHECK_INTERVAL * 0.8  # 5.0 s before, 0.1 s measured


@pytest.mark.slow
def test_a_console_whose_reader_goes_away_stops_the_run_with_a_checkpoint_and_exits_141(processes, tmp_path):
    # `run_training.sh --debug | head -30`: the reader takes a few lines, then closes its end.
    proc = start_training(processes, tmp_path)
    read_until(proc, "CPU1:INFO | [CPU 1] Step [2/")
    job = family(proc)
    proc.stdout.close()
    assert proc.wait(timeout=60) == 141  # 128 + SIGPIPE, as a shell reports a pipeline's writer
    log = (tmp_path / "run" / "logs" / "combined.log").read_text()
    assert "launcher: console output closed (broken pipe): asking the workers to stop gracefully" in log
    saved_checkpoint(tmp_path / "run", log, "SIGTERM")
    assert "launcher: stopped: console output closed (broken pipe); every worker exited within" in log
    assert exit_codes(tmp_path / "run") == [143, 143]
    assert wait_until(lambda: not any(alive(p.pid) for p in job), timeout=5)
