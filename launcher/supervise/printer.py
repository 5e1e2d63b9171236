"""Where lines go: the console with a prefix per worker, a prefix-free log per worker, and
one combined log. Only the supervisor's event loop calls this, so lines never interleave.
A worker's line that starts with LOG_ONLY_MARK is for the logs alone: a consequence's traceback,
which would bury on the console the line of the rank that failed first.

A destination that fails (a full disk: ENOSPC, EIO, EDQUOT; a hung-up terminal: EIO) is
reported once and then left alone, and the others go on: a log file's failure is told on the
console, the console's in the combined log. A run is never stopped, nor its summary lost,
because a log could not be written. A closed pipe (`| head`) is the reader asking for no more:
the console is left as above and on_console_closed is called (the supervisor stops the run
gracefully, as on SIGHUP: docs/failures.md "Stop signals"); without it (nothing is running
yet), BrokenPipeError goes up to the command line."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

LAUNCHER_PREFIX = "launcher"
COMBINED_LOG = "combined.log"
LOG_ONLY_VAR = "LAUNCHER_LOG_ONLY_MARK"
"""In every worker's environment: the marker of a line meant for the logs only (the worker
contract, docs/design.md "Log format"; pretrain/distributed/peer_loss.py marks a consequence's traceback)."""
LOG_ONLY_MARK = "\x1flog-only\x1f"
"""A word between unit separators: no line starts so by chance, a terminal shows no separator, and
none of Python's line boundaries is among them (str.splitlines splits at \\x1c-\\x1e)."""
CONSOLE_CLOSED = "console output closed (broken pipe)"
"""What the combined log and the summary call a console whose reader went away."""
CONSOLE_CLOSED_SIGNAL = signal.SIGPIPE
"""The signal a closed console stops the run as (exit code 141, as a shell reports it: launcher/exit_codes.py); none is sent."""
_COLOURS = ["36", "33", "35", "32", "34", "31", "96", "93"]  # cyan, yellow, magenta, ...


def use_colour(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set."""
    return stream.isatty() and "NO_COLOR" not in os.environ


class Printer:
    def __init__(self, console: TextIO, logs_dir: Path | None, colour: bool = False) -> None:
        self._console: TextIO | None = console
        self._colour = colour
        self._logs_dir = logs_dir
        self._files: dict[str, TextIO] = {}
        self._failed: set[str] = set()
        """Log files that could not be written: reported once, then no longer tried."""
        self._colour_of: dict[str, str] = {}
        self.on_console_closed: Callable[[], None] | None = None
        """Called once when the console's reader goes away (the supervisor's); None: BrokenPipeError is raised."""
        if logs_dir is not None:
            self._file(COMBINED_LOG)  # created at once, so it exists even for a run that prints nothing

    def _prefix(self, label: str) -> str:
        if not self._colour:
            return f"{label}:"
        code = self._colour_of.setdefault(label, _COLOURS[len(self._colour_of) % len(_COLOURS)])
        return f"\033[{code}m{label}:\033[0m"

    def worker_line(self, label: str, line: str) -> None:
        """One line (without its newline) that the worker labelled `label` wrote. A line that
        starts with LOG_ONLY_MARK goes, without it, to the logs only, unless the worker's own log
        cannot take it: then the console does, so that nothing is lost."""
        if is_log_only(line):
            line = line.removeprefix(LOG_ONLY_MARK)
            self._to_log(COMBINED_LOG, f"{label}:{line}\n")
            if not self._to_log(f"{label.lower()}.log", line + "\n"):
                self._to_console(f"{self._prefix(label)}{line}\n")
            return
        self._to_console(f"{self._prefix(label)}{line}\n")
        self._to_log(f"{label.lower()}.log", line + "\n")
        self._to_log(COMBINED_LOG, f"{label}:{line}\n")

    def launcher_line(self, message: str) -> None:
        """A line of the supervisor's own, under a prefix no worker uses."""
        lines = message.splitlines() or [""]
        self._to_console("".join(f"{self._prefix(LAUNCHER_PREFIX)} {line}\n" for line in lines))
        self._to_log(COMBINED_LOG, "".join(f"{LAUNCHER_PREFIX}: {line}\n" for line in lines))

    def console_line(self, message: str) -> None:
        """A line of the supervisor's for the console alone: where the run's files are, which the
        combined log, one of them, need not say."""
        self._to_console(f"{self._prefix(LAUNCHER_PREFIX)} {message}\n")

    def close(self) -> None:
        for handle in self._files.values():
            with contextlib.suppress(OSError):  # what a failed write left in its buffer
                handle.close()
        self._files.clear()
        self._logs_dir = None  # nothing is written after close

    # --- destinations ---------------------------------------------------------------------

    def _to_console(self, text: str) -> None:
        if self._console is None:
            return
        try:
            self._console.write(text)
            self._console.flush()
        except BrokenPipeError:
            if self.on_console_closed is None:
                raise
            console, self._console = self._console, None
            _silence(console)  # what its buffer holds would fail again at exit
            self.on_console_closed()
        except OSError as error:
            console, self._console = self._console, None
            _silence(console)
            self._to_log(
                COMBINED_LOG,
                f"{LAUNCHER_PREFIX}: warning: cannot write the console: {_reason(error)}; "
                "it stops here, the logs keep everything\n",
            )

    def _to_log(self, name: str, text: str) -> bool:
        """Append text to logs/<name>; whether it was written."""
        if self._logs_dir is None or name in self._failed:
            return False
        try:
            handle = self._file(name)
            if handle is not None:
                handle.write(text)  # line buffered: written now, or the error is raised now
                return True
        except OSError as error:
            self._give_up(name, error)
        return False

    def _file(self, name: str) -> TextIO | None:
        """The open log file logs/<name>, opened on first use; None when it has failed."""
        if name in self._failed:
            return None
        if name not in self._files:
            assert self._logs_dir is not None
            try:
                self._files[name] = open(self._logs_dir / name, "a", encoding="utf-8", buffering=1)
            except OSError as error:
                self._give_up(name, error)
                return None
        return self._files[name]

    def _give_up(self, name: str, error: OSError) -> None:
        """Stop writing logs/<name> and say so once, on the console (and in the combined log,
        unless that is the one that failed)."""
        assert self._logs_dir is not None
        self._failed.add(name)  # first: the warning below must not come back here
        handle = self._files.pop(name, None)
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()
        self.launcher_line(
            f"warning: cannot write {self._logs_dir / name}: {_reason(error)}; this log stops here, the console keeps everything"
        )


def is_log_only(line: str) -> bool:
    """A worker's line meant for the logs only (LOG_ONLY_MARK)."""
    return line.startswith(LOG_ONLY_MARK)


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def _silence(console: TextIO) -> None:
    """Point a console that failed at /dev/null: what it still holds in its buffer would
    otherwise fail again when Python flushes it at exit (exit status 120)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, console.fileno())
        finally:
            os.close(devnull)
