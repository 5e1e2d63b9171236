"""Where lines go: the console with a prefix per worker, a prefix-free log per worker, and
one combined log. Only the supervisor's event loop calls this, so lines never interleave."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

LAUNCHER_PREFIX = "launcher"
_COLOURS = ["36", "33", "35", "32", "34", "31", "96", "93"]  # cyan, yellow, magenta, ...


def use_colour(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set."""
    return stream.isatty() and "NO_COLOR" not in os.environ


class Printer:
    def __init__(self, console: TextIO, logs_dir: Path | None, colour: bool = False) -> None:
        self._console = console
        self._colour = colour
        self._logs_dir = logs_dir
        self._files: dict[str, TextIO] = {}
        self._combined = self._open("combined.log") if logs_dir else None
        self._colour_of: dict[str, str] = {}

    def _open(self, name: str) -> TextIO:
        assert self._logs_dir is not None
        return open(self._logs_dir / name, "a", encoding="utf-8", buffering=1)

    def _prefix(self, label: str) -> str:
        if not self._colour:
            return f"{label}:"
        code = self._colour_of.setdefault(label, _COLOURS[len(self._colour_of) % len(_COLOURS)])
        return f"\033[{code}m{label}:\033[0m"

    def worker_line(self, label: str, line: str) -> None:
        """One line (without its newline) that the worker labelled `label` wrote."""
        self._console.write(f"{self._prefix(label)}{line}\n")
        self._console.flush()
        if self._logs_dir is not None:
            if label not in self._files:
                self._files[label] = self._open(f"{label.lower()}.log")
            self._files[label].write(line + "\n")
        if self._combined is not None:
            self._combined.write(f"{label}:{line}\n")

    def launcher_line(self, message: str) -> None:
        """A line of the supervisor's own, under a prefix no worker uses."""
        for line in message.splitlines() or [""]:
            self._console.write(f"{self._prefix(LAUNCHER_PREFIX)} {line}\n")
            if self._combined is not None:
                self._combined.write(f"{LAUNCHER_PREFIX}: {line}\n")
        self._console.flush()

    def close(self) -> None:
        for handle in [*self._files.values(), *([self._combined] if self._combined else [])]:
            handle.close()
        self._files.clear()
        self._combined = None
