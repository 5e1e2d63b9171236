"""A small watcher process that cleans up after a launcher that could not: one killed with
SIGKILL dies before its teardown runs. Its workers die with it (parent-death signal), but
what they started does not; the guardian kills those.

    python -m launcher.processes.guardian TOKEN     (stdin: a pipe whose write end only the launcher holds)

The launcher writes `group <pgid>` for every worker it starts, `pid <pid> <start time>`
for every process of the run it has seen (it looks every SNAPSHOT_INTERVAL seconds), and
`done` after its own teardown. End of file without `done` means the launcher died: every
process carrying the run's token, in one of those groups, or seen by the launcher, is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import IO

from launcher.processes import reaper
from launcher.processes.worker import with_package_root
from pretrain.run.files import PACKAGE_ROOT


def watch(token: str, commands: IO[str]) -> int:
    groups: set[int] = set()
    known: dict[int, int] = {}
    for line in commands:
        match line.split():
            case ["group", pgid]:
                groups.add(int(pgid))
            case ["pid", pid, started]:
                known[int(pid)] = int(started)
            case ["done"]:
                return 0
    return reaper.kill_run(token, groups=groups, roots=set(), exclude={os.getpid()}, known=known)


def main() -> None:
    # A terminal's Ctrl-C or hang-up reaches the launcher's group, never this one (it has a
    # session of its own), but be sure; a scheduler's SIGTERM does reach it (Slurm signals every
    # process of a job), while the launcher still has a graceful stop to watch over. Only the
    # pipe decides when the guardian acts.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    watch(sys.argv[1], sys.stdin)


class Guardian:
    """The launcher's end: start the guardian, tell it about groups, dismiss it."""

    def __init__(self, token: str, env: dict[str, str]) -> None:
        env = with_package_root({k: v for k, v in env.items() if k != reaper.TOKEN_VAR}, PACKAGE_ROOT)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "launcher.processes.guardian", token],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=env,
            text=True,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self._process.pid

    def _send(self, line: str) -> None:
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(line + "\n")
            self._process.stdin.flush()
        except OSError:
            pass  # the guardian is gone; the launcher's own teardown still runs

    def add_group(self, pgid: int) -> None:
        self._send(f"group {pgid}")

    def add_processes(self, processes: dict[int, int]) -> None:
        """pid -> start time of processes of the run to kill should the launcher die."""
        if processes:
            self._send("\n".join(f"pid {pid} {started}" for pid, started in processes.items()))

    def dismiss(self) -> None:
        """The launcher has cleaned up itself: the guardian exits without killing anything."""
        self._send("done")
        try:
            self._process.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        self._process.wait()


if __name__ == "__main__":
    main()
