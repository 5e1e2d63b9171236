"""How a supervisor tears a run down: the options launcher/supervise/supervisor.py's rules refer to."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SupervisorOptions:
    kill_grace: float = 5.0
    """After a failure, seconds between SIGTERM and SIGKILL for the other workers (rule 2)."""
    stop_timeout: float = 120.0
    """On SIGINT/SIGTERM/SIGHUP, seconds the workers get to stop on their own (rule 3)."""
    hang_timeout: float | None = None
    """A worker that prints nothing for this long has failed (rule 1); None: never."""
    stack_dump_signal: int | None = None
    """The signal on which the workers print their Python stacks (only for commands known to
    handle it; by default it would kill them)."""
    stop_leaders_only: bool = False
    """A graceful stop signals only each worker process, which stops its own helpers (for
    training workers); otherwise their whole groups."""
    run_dir: Path | None = None
    """Where workers.json goes, and the directory the last line names."""
    logs_dir: Path | None = None
    """Where the logs are, as the failure summary names them (default: <run_dir>/logs)."""
    exit_record: str = "workers.json"
    """The file in run_dir with each worker's exit (one per node in a job of several)."""
    adopt_orphans: bool = False
    """Make this process a child subreaper, so descendants that double fork stay findable; only
    for a process that runs nothing but this supervisor."""
    exit_meanings: dict[int, str] = field(default_factory=dict)
    """What the workers' own exit codes mean, named in the summary."""
    agreed_exit_codes: frozenset[int] = frozenset()
    """Codes every worker exits with together (rule 2)."""
    stop_exit_codes: frozenset[int] = frozenset()
    """Codes a worker exits with after it handled a stop signal (a training worker saves, then exits
    by_signal(n)): read as that stop. Any worker killed by a stop signal is one."""
    consequence_exit_codes: frozenset[int] = frozenset()
    """Codes of a worker whose failure another worker's caused (it lost the connection to it):
    such an exit decides nothing while another worker may still report the cause (rule 1)."""
    cause_wait: float = 5.0
    """After a consequence exit, seconds the supervisor waits for another worker's failure, the
    cause, before it reports the consequence itself as the first failure (rule 1)."""
