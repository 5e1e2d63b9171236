"""Exit codes of a training process, which the launcher passes on as its own (torch-free,
so the launcher can name them without importing torch). The launcher's own codes are in
launcher/exit_codes.py; docs/failures.md ("Exit codes") lists both."""

import signal

SUCCESS = 0
"""Training finished (or a tool did what it was asked)."""
ERROR = 1
"""An unexpected error (a Python traceback says where), or a collective timed out."""
BAD_INPUT = 2
"""Bad input: config, data, resume point, an unwritable directory; one line says which
(pretrain/run/refusal.py)."""
NUMERICAL_FAILURE = 3
"""The loss or the gradient norm became NaN or Inf (a report, a checkpoint and a tensor dump
were written; docs/numerics.md, "Troubleshooting")."""
PEER_LOST = 4
"""A consequence of another rank's failure: that rank went away during a collective (gloo's
"Connection closed by peer", NCCL's remote error), or removed what they shared (an unfinished
checkpoint); the launcher waits a moment for that rank's own failure and reports it as the
cause (pretrain/distributed/peer_loss.py)."""


def by_signal(signum: int) -> int:
    """The exit code of a process stopped by signal signum, as a shell reports it: 128 + signum
    (129: SIGHUP, 130: SIGINT, 141: SIGPIPE, 143: SIGTERM). A training process stopped by a signal
    exits with it after saving. The one place this sum is written."""
    return 128 + signum


def signal_of(exit_code: int) -> int | None:
    """The signal a shell-style exit code reports (by_signal's inverse), None for an ordinary exit."""
    signum = exit_code - by_signal(0)
    return signum if 0 < signum < signal.NSIG else None


MEANINGS = {
    NUMERICAL_FAILURE: "numerical failure: NaN or Inf in training",
    PEER_LOST: "a consequence of another rank's failure",
}
"""What the launcher's failure summary says of a training worker's exit code."""
AGREED = frozenset({NUMERICAL_FAILURE})
"""Codes that every rank exits with together, having agreed on the step: the launcher gives
the others a moment to finish and exit on their own before it stops them."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ctrl-C, Slurm's and kill's SIGTERM, a closed terminal's SIGHUP: a stop asked for."""
STOPPED = frozenset(by_signal(s) for s in STOP_SIGNALS)
"""Codes a training worker exits with after a stop signal: it finished the step and saved first."""


def stop_signal(error: BaseException) -> signal.Signals | None:
    """The stop signal an exception stands for, if any: KeyboardInterrupt is SIGINT, and a
    SystemExit with a stop signal's code is that signal (pretrain/data/cache.py's sigterm_as_exit
    raises one for SIGTERM and SIGHUP, the launcher between two attempts for any of them)."""
    if isinstance(error, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(error, SystemExit):
        return next((sig for sig in STOP_SIGNALS if error.code == by_signal(sig)), None)
    return None


CONSEQUENCES = frozenset({PEER_LOST})
"""Codes of a failure that another rank's failure caused: the launcher waits a moment for that
rank's own exit, and reports it as the first failure (the cause) when it comes."""
