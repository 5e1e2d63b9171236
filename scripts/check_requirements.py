"""Print the requirements (from the given files) that are not installed, or installed in a
version below the requirement's `>=` floor. Exit 0 when every one is satisfied.

Standard library only: it runs before anything is installed. Only `>=` floors are compared
(that is all the requirement files use); other specifiers count as satisfied when present."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

REQUIREMENT = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?P<spec>[^;#]*)")


def requirements(path: Path) -> list[tuple[str, str, str]]:
    """(distribution name, specifier, full line) for each requirement in the file."""
    found = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if match := REQUIREMENT.match(line):
            found.append((match["name"], match["spec"].strip(), line))
    return found


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version: '2.13.0+cpu' -> (2, 13, 0); '2.5.0rc1' -> (2, 5, 0)."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        numbers.append(int(digits.group()))
    return tuple(numbers)


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        # A torch built from source or vendored by a cluster image may carry no metadata;
        # importable is what counts then.
        if name == "torch" and importlib.util.find_spec("torch") is not None:
            return "0+unknown"
        return None


def satisfied(name: str, spec: str) -> bool:
    version = installed_version(name)
    if version is None:
        return False
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        if clause.startswith(">=") and version != "0+unknown" and release(version) < release(clause[2:].strip()):
            return False
    return True


def unsatisfied(paths: list[Path]) -> list[str]:
    return [line for path in paths for name, spec, line in requirements(path) if not satisfied(name, spec)]


if __name__ == "__main__":
    lines = unsatisfied([Path(p) for p in sys.argv[1:]])
    print("\n".join(lines))
    sys.exit(1 if lines else 0)
