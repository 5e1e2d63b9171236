"""tests/support/processes.py's live_children, which every test's guard against leftover processes
reads before and after the test: it finds the same descendants psutil's recursive walk of the
whole machine finds (grandchildren, children a thread started), and no zombie."""

from __future__ import annotations

import subprocess
import threading

import psutil
from support.processes import live_children, wait_until

# A shell that starts two sleepers below it, then waits for them: three processes, two levels.
TREE = ["bash", "-c", "sleep 60 & sleep 60 & wait"]


def psutil_descendants() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def test_live_children_are_the_descendants_psutil_finds_grandchildren_and_a_threads_children_included():
    before = set(live_children())
    started: list[subprocess.Popen] = [subprocess.Popen(TREE)]
    checked = threading.Event()

    def start_from_a_thread() -> None:  # its child is listed under this thread's task while the thread lives
        started.append(subprocess.Popen(TREE))
        checked.wait(timeout=30)

    thread = threading.Thread(target=start_from_a_thread)
    thread.start()
    try:
        assert wait_until(lambda: len(set(live_children()) - before) == 6, timeout=10), live_children()
        found = set(live_children()) - before
        assert found == psutil_descendants() - before
        assert {process.pid for process in started} <= found
    finally:
        checked.set()
        thread.join()
        for process in started:
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait()


def test_a_dead_child_not_yet_reaped_is_not_live():
    zombie = subprocess.Popen(["true"])
    assert wait_until(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE, timeout=10)
    assert zombie.pid in psutil_descendants()
    assert zombie.pid not in live_children()
    zombie.wait()
