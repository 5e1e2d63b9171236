"""Print the requirements (from the given files) whose distribution is not installed.

Standard library only: it runs before anything is installed. Exit 0 when all are present."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path


def requirement_names(path: Path) -> list[tuple[str, str]]:
    """(distribution name, full requirement line) for each requirement in the file."""
    found = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            found.append((re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0], line))
    return found


def installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        # A torch built from source or vendored by a cluster image may carry no metadata;
        # importable is what counts, and it must be reused, never replaced.
        return name == "torch" and importlib.util.find_spec("torch") is not None


def missing(paths: list[Path]) -> list[str]:
    lines = []
    for path in paths:
        for name, line in requirement_names(path):
            if not installed(name):
                lines.append(line)
    return lines


if __name__ == "__main__":
    absent = missing([Path(p) for p in sys.argv[1:]])
    print("\n".join(absent))
    sys.exit(1 if absent else 0)
