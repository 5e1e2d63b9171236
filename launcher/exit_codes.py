"""Every exit code the launcher itself returns (a worker's own codes, which it passes on, are in
pretrain/run/exit_codes.py); docs/failures.md ("Exit codes") lists both. The launcher otherwise exits
with the first failed worker's code, a death by signal n as by_signal(n) = 128 + n."""

from __future__ import annotations

import signal

from pretrain.run.exit_codes import STOP_SIGNALS, by_signal, stop_signal

__all__ = [
    "STOP_SIGNALS",
    "EXIT_BROKEN_PIPE",
    "EXIT_CANNOT_EXECUTE",
    "EXIT_COMMAND_NOT_FOUND",
    "EXIT_HANG",
    "EXIT_INTERRUPTED",
    "EXIT_NODE_LOST",
    "EXIT_NO_ADDRESS_SPACE",
    "EXIT_OTHER_NODE_FAILED",
    "EXIT_RUN_DIR_LOST",
    "EXIT_USAGE",
    "by_signal",
    "stop_signal",
]

EXIT_USAGE = 2
"""Bad input, refused in one line before anything is spawned (launcher/errors.py, pretrain/run/refusal.py)."""
EXIT_NO_ADDRESS_SPACE = EXIT_USAGE
"""The launcher itself, or the start of a worker, ran out of memory or address space (`ulimit -v`):
one line, as any refusal of bad input, nothing left running (launcher/address_space.py)."""
EXIT_RUN_DIR_LOST = 74
"""The run directory or its lock file was deleted, moved or replaced while the run was live
(sysexits' EX_IOERR: the files the run writes are no longer where it writes them; launcher/rundir/lock.py)."""
EXIT_OTHER_NODE_FAILED = 75
"""Several machines: another node failed first, and this one stopped because of it (launcher/nodes/node.py)."""
EXIT_NODE_LOST = 76
"""Several machines: a node was lost (frozen, or its heartbeats stopped; launcher/nodes/node.py)."""
EXIT_HANG = 124
"""A worker printed nothing for hang_timeout seconds, as timeout(1) reports it (launcher/supervise/outcome.py)."""
EXIT_CANNOT_EXECUTE = 126
"""A worker's command exists but cannot be executed, as a shell says (launcher/processes/worker.py)."""
EXIT_COMMAND_NOT_FOUND = 127
"""A worker's command does not exist, as a shell says (launcher/processes/worker.py)."""
EXIT_INTERRUPTED = by_signal(signal.SIGINT)
"""Ctrl-C before any worker started (130); once they run, the graceful stop exits with by_signal too."""
EXIT_BROKEN_PIPE = by_signal(signal.SIGPIPE)
"""The reader of the launcher's output went away (`| head`): 141, as a shell pipeline reports it."""
