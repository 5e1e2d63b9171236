"""Every process of one supervised run (rule 4 of launcher/supervise/supervisor.py): the token its
workers carry in their environment, the guardian that kills them should the launcher die, and
the reaper's calls scoped to what belongs to the run."""

from __future__ import annotations

import os
import signal

from launcher.processes import reaper
from launcher.processes.guardian import Guardian
from launcher.processes.worker import Worker


class RunProcesses:
    def __init__(self, workers: list[Worker], adopt_orphans: bool) -> None:
        """adopt_orphans: make this process a child subreaper (launcher/supervise/options.py)."""
        self.workers = workers
        self.adopt_orphans = adopt_orphans
        self.token = reaper.new_token()
        # Every process that can carry the token starts after this one: the half-second pass
        # reads no older process's environment (most of a busy machine's).
        self._token_since = reaper.start_time(os.getpid()) or 0
        self.guardian: Guardian | None = None
        self._reported: dict[int, int] = {}

    def start_guardian(self) -> None:
        """Before any worker starts: what they spawn stays findable, and killable."""
        if self.adopt_orphans:
            reaper.become_subreaper()
        self.guardian = Guardian(self.token, dict(os.environ))

    def start(self, worker: Worker) -> None:
        """Start a worker carrying the token; raises OSError for a bad command."""
        worker.env[reaper.TOKEN_VAR] = self.token
        worker.start()
        assert worker.process is not None and self.guardian is not None
        self.guardian.add_group(worker.process.pid)

    def scope(self) -> tuple[set[int], set[int], set[int]]:
        """(worker groups, roots, excluded pids) for the reaper: what belongs to the run."""
        groups = {w.process.pid for w in self.workers if w.process is not None}
        roots = groups | ({os.getpid()} if self.adopt_orphans else set())  # orphans were re-parented here
        exclude = {self.guardian.pid} if self.guardian is not None else set()
        return groups, roots, exclude

    def report_to_guardian(self) -> None:
        """Tell the guardian the run's processes it has not heard of (one /proc pass)."""
        if self.guardian is None:
            return
        groups, roots, exclude = self.scope()
        processes = reaper.scan(self.token, since=self._token_since)
        pids = reaper.members(processes, groups=groups, roots=roots, exclude=exclude)
        new = {p.pid: p.started for p in processes if p.pid in pids and self._reported.get(p.pid) != p.started}
        self._reported.update(new)
        self.guardian.add_processes(new)
        if self.adopt_orphans:  # or adopted orphans that ended pile up as zombies in a long run
            reaper.reap_adopted(processes, keep=roots | exclude)

    def terminate(self, signalled: list[Worker]) -> None:
        """SIGTERM to every process of the run outside the groups of signalled (those got theirs)."""
        groups, roots, exclude = self.scope()
        reaper.terminate_run(
            self.token,
            groups=groups,
            roots=roots,
            exclude=exclude,
            signalled_groups={w.process.pid for w in signalled if w.process is not None},
        )

    def kill_all(self) -> None:
        """SIGKILL to every process of the run, then reap the workers."""
        for worker in self.workers:
            worker.signal_group(signal.SIGKILL)
        groups, roots, exclude = self.scope()
        reaper.kill_run(self.token, groups=groups, roots=roots, exclude=exclude)
        if self.adopt_orphans:
            reaper.reap_adopted(reaper.scan(None), keep=roots | exclude)
        for worker in self.workers:
            worker.reap()

    def dismiss_guardian(self) -> None:
        if self.guardian is not None:
            self.guardian.dismiss()
