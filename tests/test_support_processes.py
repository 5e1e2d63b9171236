"""tests/support/processes.py's live_children, which every test's guard against leftover processes
reads before and after the test: it finds the descendants psutil's recursive walk finds
(grandchildren, children a thread started), and no zombie. (Compared on the processes a test
starts: live_children leaves out the shared helpers an earlier test of this process may have left.)"""

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
        trees = [psutil.Process(process.pid) for process in started]
        expected = {process.pid for tree in trees for process in [tree, *tree.children(recursive=True)]}  # psutil's own walk
        assert len(expected) == 6 and set(live_children()) - before == expected
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
