"""Print the requirements (from the given files) that are not installed, or installed in a
version below the requirement's `>=` floor. Exit 0 when every one is satisfied.

With --newer, print instead one line for each installed package at or above a `<` upper bound
(exit 0): such a version is used, not replaced (a GPU machine's torch matches its driver), and
scripts/setup.sh shows these lines as warnings.

Standard library only: it runs before anything is installed. Only `>=` floors and `<` bounds
are compared (that is all the requirement files use); other specifiers count as satisfied when
present."""

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


def above_bound(name: str, spec: str) -> str | None:
    """The `<` bound that the installed version reaches, or None (also when not installed)."""
    version = installed_version(name)
    if version is None or version == "0+unknown":
        return None
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        if clause.startswith("<") and not clause.startswith("<=") and release(version) >= release(clause[1:].strip()):
            return clause[1:].strip()
    return None


def newer_than_tested(paths: list[Path]) -> list[str]:
    """One line per installed package at or above its requirement's upper bound."""
    lines = []
    for path in paths:
        for name, spec, line in requirements(path):
            if bound := above_bound(name, spec):
                lines.append(
                    f"{name} {installed_version(name)} is newer than tested (below {bound}: {line}); "
                    f"using it; if it fails, install a tested one: pip install '{line}'"
                )
    return lines


if __name__ == "__main__":
    if sys.argv[1:2] == ["--newer"]:
        print("\n".join(newer_than_tested([Path(p) for p in sys.argv[2:]])))
        sys.exit(0)
    lines = unsatisfied([Path(p) for p in sys.argv[1:]])
    print("\n".join(lines))
    sys.exit(1 if lines else 0)
