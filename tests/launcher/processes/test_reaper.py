"""Which processes belong to a run, and the guardian that cleans up after a dead launcher."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from support.processes import alive, wait_until
from launcher.processes import guardian, reaper
from launcher.processes.reaper import ProcessInfo
from launcher.processes.run_processes import RunProcesses


def info(
    pid: int, ppid: int, pgid: int | None = None, sid: int | None = None, *, tagged: bool = False, zombie: bool = False
) -> ProcessInfo:
    return ProcessInfo(pid, ppid, pgid or pid, sid or pid, started=1, zombie=zombie, tagged=tagged)


def test_a_process_belongs_to_the_run_by_token_group_session_or_descent():
    table = [
        info(10, 1),  # the worker, a root
        info(11, 10, pgid=10, sid=10),  # in the worker's group
        info(12, 11, pgid=12, sid=12),  # setsid child of a group member: a descendant
        info(13, 12, pgid=13, sid=13),  # its child, environment cleared: still a descendant
        info(20, 1, pgid=20, sid=20, tagged=True),  # a double-forked daemon: the token
        info(21, 20, pgid=21, sid=21),  # the daemon's child: no token, no root above it
        info(30, 1, pgid=30, sid=10),  # left the group but not the session
        info(40, 1),  # unrelated
        info(41, 10, zombie=True),  # dead already
    ]
    assert reaper.members(table, groups={10}, roots={10}, exclude=set()) == {10, 11, 12, 13, 20, 30}
    assert reaper.members(table, groups={10}, roots={10}, exclude={20}) == {10, 11, 12, 13, 30}


def test_a_subreaper_root_finds_orphans_that_were_re_parented_to_it():
    table = [info(5, 1), info(50, 5, pgid=50, sid=50), info(51, 50, pgid=51, sid=51), info(60, 1)]
    assert reaper.members(table, groups=set(), roots={5}, exclude={5}) == {50, 51}


@pytest.fixture
def sleeper():
    """Start a sleeping child, optionally carrying a run token; all are killed afterwards."""
    started: list[subprocess.Popen] = []

    def start(token: str | None = None) -> subprocess.Popen:
        env = dict(os.environ, **({reaper.TOKEN_VAR: token} if token else {}))
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def carries(pid: int, token: str) -> bool:
    """Whether a scan finds pid tagged: just after Popen returns, the kernel may not yet have set up
    the new program's environment (the exec closed Popen's pipe first), and the file reads empty."""
    return any(p.pid == pid and p.tagged for p in reaper.scan(token))


def test_scan_sees_a_real_child_and_whether_it_carries_the_token(sleeper):
    token = reaper.new_token()
    tagged, plain = sleeper(token), sleeper()
    assert wait_until(lambda: carries(tagged.pid, token))
    found = {p.pid: p for p in reaper.scan(token)}
    assert found[tagged.pid].tagged and not found[plain.pid].tagged
    assert found[tagged.pid].ppid == os.getpid()
    assert reaper.start_time(tagged.pid) == found[tagged.pid].started


def test_scan_reads_the_token_only_of_processes_started_since_the_time_it_is_given(sleeper):
    token = reaper.new_token()
    tagged = sleeper(token)
    assert wait_until(lambda: carries(tagged.pid, token))
    started = reaper.start_time(tagged.pid)
    assert started is not None
    assert {p.pid: p for p in reaper.scan(token, since=started)}[tagged.pid].tagged
    older = {p.pid: p for p in reaper.scan(token, since=started + 1)}[tagged.pid]  # as if it predated the token
    assert not older.tagged and older.started == started


class ReportedToGuardian:
    """Stands in for the guardian process: what the launcher's half-second pass tells it."""

    pid = -1

    def __init__(self) -> None:
        self.processes: dict[int, int] = {}

    def add_processes(self, processes: dict[int, int]) -> None:
        self.processes.update(processes)


def test_the_half_second_pass_reports_a_tagged_process_that_escaped_every_group_once_it_started_after_the_launcher(sleeper):
    processes = RunProcesses([], adopt_orphans=False)
    token = processes.token
    processes.guardian = ReportedToGuardian()  # type: ignore[assignment]
    escaped = sleeper(token)  # no worker group, no root above it: found by its token alone

    def reported() -> bool:  # passes repeat: one just after the exec may find its environment not yet set up
        processes.report_to_guardian()
        return escaped.pid in processes.guardian.processes

    assert wait_until(reported, timeout=10)
    assert processes.guardian.processes[escaped.pid] == reaper.start_time(escaped.pid)


def test_the_guardian_kills_the_run_when_its_pipe_closes_without_done(sleeper):
    token = reaper.new_token()
    tagged, seen = sleeper(token), sleeper()
    commands = io.StringIO(f"pid {seen.pid} {reaper.start_time(seen.pid)}\n")
    assert guardian.watch(token, commands) == 2
    assert wait_until(lambda: tagged.poll() is not None and seen.poll() is not None, timeout=3)


def test_the_guardian_kills_nothing_once_told_done_and_never_a_reused_pid(sleeper):
    token = reaper.new_token()
    tagged, other = sleeper(token), sleeper()
    assert guardian.watch(token, io.StringIO("done\n")) == 0
    # A pid whose start time differs is another process now: left alone.
    assert guardian.watch("unused", io.StringIO(f"pid {other.pid} {reaper.start_time(other.pid) + 1}\n")) == 0
    assert alive(tagged.pid) and alive(other.pid)
