"""A child process for work that Python cannot interrupt, so that a stop signal ends it at once.

Rust code (BPE training in `tokenizers`, Xet downloads in huggingface_hub) keeps Python's main
thread until it returns, and Python runs a signal handler only between two bytecodes of that
thread: Ctrl-C or SIGTERM was acted on when the work ended. Run in a child (bpe_process.py,
hub_process.py), the work no longer holds this process, which only waits in system calls that a
signal interrupts (a pipe, waitpid), so its handler runs at once. What both children share is
here: starting `python -c` with this process's pid (the child dies with it:
pretrain/run/parent_death.py), ending it (killed and reaped) when anything, a stop signal first, ends
the wait, and what its exit status means. Standard library only: the launcher must start fast.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What a terminal (Ctrl-C, hang-up) or a scheduler (SIGTERM) sends to every process of a job:
a child that one of these ended means this process is being stopped too."""
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

Child = subprocess.Popen[bytes]


def child_code(module: str) -> str:
    """The `python -c` program that runs module's child_main, this package importable."""
    return f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); from {module} import child_main; child_main()"


def start_child(
    code: str, args: list[str], *, stdin: int | IO[bytes], stdout: int | IO[bytes], stderr: int | IO[bytes] | None = None
) -> Child:
    """`python -c code args... <this pid>`; the child calls child_args() first."""
    return subprocess.Popen([sys.executable, "-c", code, *args, str(os.getpid())], stdin=stdin, stdout=stdout, stderr=stderr)


def kill_and_reap(child: Child) -> None:
    """SIGKILL the child (if it still runs) and wait for it."""
    with contextlib.suppress(ProcessLookupError):
        child.kill()
    reap(child)


def reap(child: Child) -> None:
    """Wait for a child that was killed: a second signal meanwhile must not leave it unreaped."""
    with contextlib.suppress(BaseException):
        child.wait()


@contextlib.contextmanager
def ended_on_the_way_out(child: Child, end: Callable[[Child], None] = kill_and_reap) -> Iterator[None]:
    """Within, wait for the child; any exception out of it (KeyboardInterrupt, sigterm_as_exit's
    SystemExit, an error) first ends the child (end: kill and reap). Its pipes are closed after."""
    try:
        yield
    except BaseException:
        if child.returncode is None:
            end(child)
        raise
    finally:
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def how_it_failed(returncode: int) -> str:
    """What a non-zero exit status says, for a one-line DataError ("was killed by SIGKILL",
    "failed (exit code 1)"). A child that a stop signal ended means the terminal or the scheduler
    signalled this process too, and the child died first: that signal is raised here now, as if it
    had come first (its handler raises; one that returns lets the failure be told)."""
    if -returncode in STOP_SIGNALS:
        signal.raise_signal(-returncode)
    return f"was killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"failed (exit code {returncode})"


def child_args() -> list[str]:
    """In the child, first thing after its signal handling: die with the parent, and the
    arguments start_child was given."""
    from pretrain.run.parent_death import die_with_parent

    die_with_parent(int(sys.argv[-1]))
    return sys.argv[1:-1]
