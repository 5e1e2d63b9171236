"""What the scripted GPU machines (launcher/gpus/scripted_nvml.py for NVIDIA, scripted_amdsmi.py for
AMD) share: reading the file LAUNCHER_SCRIPTED_GPUS names, reading it again when it changes, the
vendor it describes, and the checks on its keys and values, each failure one BadScript line.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pretrain.run.refusal import Refusal

MIB = 1 << 20
VENDORS = ("nvidia", "amd")


class BadScript(Refusal, ValueError):
    """The scripted machine's file is missing or malformed (one line)."""


class ScriptedMachine:
    """A machine read from a JSON object, and read again from its file whenever the file changes
    (replace it atomically, with os.replace, so no reader sees half of it). A subclass fills
    itself in `_load` (which raises ValueError, TypeError... on a malformed machine)."""

    def __init__(self, machine: dict) -> None:
        self._path: str | None = None
        """The file it was read from, read again when it changes (None: a machine given as a dict)."""
        self._signature: tuple[int, int, int] | None = None
        self._load(machine)

    def _load(self, machine: dict) -> None:
        raise NotImplementedError

    @classmethod
    def from_file(cls, path: str) -> Any:
        signature = _signature(path)  # before reading: a change made while it is read is seen next time
        with script_errors(path):
            machine = cls(read_json(path))
        machine._path, machine._signature = path, signature
        return machine

    def _refresh(self) -> None:
        """Read the file again if it changed since it was read (a GPU going bad during a run)."""
        if self._path is None:
            return
        signature = _signature(self._path)
        if signature != self._signature:
            with script_errors(self._path):
                self._load(read_json(self._path))
            self._signature = signature


def scripted_vendor(path: str) -> str:
    """Whose GPUs the scripted machine file at `path` describes: its "vendor" key, "nvidia"
    when it has none. BadScript for a file that cannot be read or names another vendor."""
    with script_errors(path):
        vendor = read_json(path).get("vendor", "nvidia")
        if vendor not in VENDORS:
            raise ValueError(f"vendor must be one of {', '.join(VENDORS)}, not {vendor!r}")
    return str(vendor)


def read_json(path: str) -> dict:
    machine = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(machine, dict):
        raise ValueError("the top level must be an object")
    return machine


@contextlib.contextmanager
def script_errors(path: str) -> Iterator[None]:
    """A file that cannot be read, or describes no machine, is one BadScript line naming it."""
    try:
        yield
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as error:
        if isinstance(error, BadScript):
            raise
        raise BadScript(f"scripted GPU machine {path}: {error}; fix the file or unset LAUNCHER_SCRIPTED_GPUS") from None


def _signature(path: str | None) -> tuple[int, int, int] | None:
    """What tells a changed file: its mtime, its inode (os.replace makes a new one) and size."""
    if path is None:
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_ino, stat.st_size)


def links(machine: dict, count: int, kinds: tuple[str, ...], default: str) -> Callable[[int, int], str]:
    """How GPU i reaches GPU j: the "links" entry naming both, else the machine's "p2p" (`default`
    when it has none); every kind one of `kinds`."""
    fallback = machine.get("p2p", default)
    if fallback not in kinds:
        raise ValueError(f"p2p must be one of {', '.join(kinds)}, not {fallback!r}")
    pairs: dict[frozenset[int], str] = {}
    entries = machine.get("links", [])
    shape = f'links must be a list of {{"gpus": [i, j], "p2p": KIND}}: two GPU indices, KIND one of {", ".join(kinds)}'
    if not isinstance(entries, list):
        raise ValueError(shape)
    for link in entries:
        check_keys(link, {"gpus", "p2p"}, "links[]")
        gpus = link.get("gpus")
        if not (
            isinstance(gpus, list)
            and len(gpus) == 2
            and all(isinstance(i, int) and 0 <= i < count for i in gpus)
            and gpus[0] != gpus[1]
            and link.get("p2p") in kinds
        ):
            raise ValueError(shape)
        pairs[frozenset(gpus)] = link["p2p"]
    return lambda i, j: pairs.get(frozenset((i, j)), fallback)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def mib(spec: dict, key: str, default: float, where: str) -> int:
    value = spec.get(key, default)
    if not is_number(value) or value < 0:
        raise ValueError(f"{where}.{key} must be a number of MiB, not {value!r}")
    return int(value * MIB)


def count(spec: dict, key: str, where: str, minimum: int) -> int | None:
    value = spec[key]
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
        raise ValueError(f"{where}.{key} must be a whole number of at least {minimum}, or null")
    return value


def utilization(spec: dict, where: str) -> list[int] | None:
    """The successive utilization readings of a GPU (cycled by the machine); None: not supported."""
    readings = spec.get("utilization", [0])
    if readings is not None and not (isinstance(readings, list) and all(is_number(u) for u in readings)):
        raise ValueError(f"{where}.utilization must be a list of percentages or null")
    return None if readings is None else [int(u) for u in readings] or [0]


def process_list(spec: dict, where: str) -> list[dict]:
    processes = spec.get("processes", [])
    for process in processes if isinstance(processes, list) else [None]:
        if not (
            isinstance(process, dict)
            and isinstance(process.get("pid"), int)
            and process["pid"] > 0
            and (process.get("memory_mib") is None or is_number(process["memory_mib"]))
        ):
            raise ValueError(f'{where}.processes must be a list of {{"pid": N, "memory_mib": M}}')
    return processes


def check_keys(spec: Any, allowed: set[str], where: str) -> None:
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be an object")
    unknown = set(spec) - allowed
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {', '.join(sorted(unknown))}")
