"""A run directory deleted, moved or replaced while its launcher runs (issue 28, item 13): the
launcher stops the run at once in one line (exit 74) without recreating the directory, and a
second launch into the path is refused while the first launcher lives, lock file or not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from support.processes import ROOT, launcher_env, wait_until
from launcher.rundir import lock as run_lock
from launcher.exit_codes import EXIT_RUN_DIR_LOST
from launcher.rundir.lock import LockHolder, RunDirLock, RunDirLost

SLEEPER = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"


def held(run: Path, lock_name: str = run_lock.LOCK_NAME) -> RunDirLock:
    owned = run_lock.take(run, lock_name)
    assert isinstance(owned, RunDirLock), owned
    return owned


def lost_line(owned: RunDirLock) -> str:
    with pytest.raises(RunDirLost) as lost:
        run_lock.check_held(owned.path)
    assert lost.value.exit_code == EXIT_RUN_DIR_LOST
    return str(lost.value)


def test_a_held_run_directory_that_is_still_there_passes_the_check(tmp_path):
    owned = held(tmp_path / "run")
    run_lock.check_held(owned.path)
    run_lock.check_held(tmp_path / "not held")  # a directory this process does not hold is not its business
    run_lock.check_held(None)
    owned.release()
    shutil.rmtree(tmp_path / "run")
    run_lock.check_held(tmp_path / "run")  # released: no longer watched


def made_again(run: Path) -> None:
    shutil.rmtree(run)
    run.mkdir()


def lock_replaced(run: Path) -> None:
    (run / "launcher.lock").rename(run / "aside")
    (run / "launcher.lock").write_text("")


CHANGES = {
    "deleted": (shutil.rmtree, "run directory {run} was deleted or moved away while the run was live"),
    "moved": (lambda run: run.rename(run.with_name("moved")), "run directory {run} was deleted or moved away while"),
    "made again": (made_again, "run directory {run} was deleted or moved away, and another directory made in its place while"),
    "lock deleted": (
        lambda run: (run / "launcher.lock").unlink(),
        "its lock file {run}/launcher.lock was deleted, so that another launch could take the run directory while",
    ),
    "lock replaced": (lock_replaced, "its lock file {run}/launcher.lock was replaced by another file while"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_run_directory_or_lock_that_vanished_or_was_replaced_fails_the_check_in_one_line(tmp_path, change):
    run = tmp_path / "run"
    owned = held(run)
    make_change, why = CHANGES[change]
    make_change(run)
    line = lost_line(owned)
    assert line.startswith(why.format(run=run)) and "\n" not in line
    assert line.endswith(
        "stopped every worker at once, without a checkpoint (writing one would recreate the directory "
        "without its lock, logs and config, or mix with another run's files)"
    )
    owned.abandon()  # as the launcher does on its way out: removes nothing that is there now
    assert run.exists() == (why.startswith("its lock") or "another directory" in why)


def test_a_second_take_of_a_deleted_run_directory_is_refused_while_the_first_holder_lives(tmp_path):
    run = tmp_path / "run"
    first = held(run)
    shutil.rmtree(run)
    second = run_lock.take(run)
    assert isinstance(second, LockHolder) and second.pid == os.getpid() and second.current
    assert run_lock.holder_of(run) == second  # the look --resume takes sees it too
    assert not run.exists()  # the refused take made nothing
    first.release()
    assert isinstance(again := run_lock.take(run), RunDirLock)
    again.release()


def test_node_locks_of_one_run_directory_are_held_side_by_side(tmp_path):
    run = tmp_path / "run"
    node0, node1 = held(run), held(run, run_lock.node_lock_name(1))
    assert isinstance(run_lock.take(run, run_lock.node_lock_name(1)), LockHolder)
    (run / "launcher.node1.lock").unlink()
    with pytest.raises(RunDirLost, match="launcher.node1.lock was deleted"):
        run_lock.check_held(run)
    node1.release()
    run_lock.check_held(run)  # node 0's lock is whole
    (run / "launcher.lock").unlink()
    with pytest.raises(RunDirLost, match=r"launcher\.lock was deleted"):
        run_lock.check_held(run)
    node0.release()


def launch(processes, run: Path, *command: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "launcher", "--device", "cpu", "--nproc", "1", "--run-dir", str(run), "--", *command]
    return processes(argv, cwd=ROOT, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_launcher_whose_run_directory_is_deleted_stops_its_workers_at_once_and_does_not_recreate_it(processes, tmp_path):
    run = tmp_path / "run"
    first = launch(processes, run, sys.executable, "-c", SLEEPER)
    assert first.stdout is not None and first.stderr is not None
    while ":pid " not in (line := first.stdout.readline()):
        assert line, first.stderr.read()
    worker = int(line.split()[-1])
    shutil.rmtree(run)
    assert first.wait(timeout=30) == EXIT_RUN_DIR_LOST
    assert first.stderr.read() == (
        f"launcher: error: run directory {run} was deleted or moved away while the run was live; stopped every worker "
        "at once, without a checkpoint (writing one would recreate the directory without its lock, logs and config, "
        "or mix with another run's files)\n"
    )
    assert wait_until(lambda: not psutil.pid_exists(worker), timeout=10)
    assert not run.exists()


HOLDER = """
import sys, time
from pathlib import Path
from launcher.rundir import lock as run_lock
owned = run_lock.take(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_launch_into_a_deleted_run_directory_is_refused_while_the_first_launcher_lives(processes, tmp_path):
    # A holder that does not watch its directory stands for a launcher between two of its checks.
    run = tmp_path / "run"
    first = processes([sys.executable, "-c", HOLDER, str(run)], cwd=ROOT, env=launcher_env(), stdout=subprocess.PIPE, text=True)
    assert first.stdout is not None and first.stdout.readline() == "held\n"
    shutil.rmtree(run)
    second = subprocess.run(
        [sys.executable, "-m", "launcher", "--device", "cpu", "--nproc", "1", "--run-dir", str(run), "--", "true"],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2, second.stdout + second.stderr
    assert second.stderr.startswith(f"launcher: error: run directory {run} is in use by the launcher pid {first.pid} (started ")
    assert second.stderr.count("\n") == 1 and not run.exists()
