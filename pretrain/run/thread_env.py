"""The thread-count variables a training process reads, checked before anything starts.

A value that is not a number of threads does not fail where it is read: libgomp prints a warning
and runs every rank on all cores (20 steps took 60 s instead of 9 s on two ranks), MKL falls back
to one thread, and torch.compile's pool raises a ValueError deep inside the first compile. So the
launcher (before it spawns, launcher/cli.py) and `python -m pretrain` (before it imports torch)
refuse one in one line. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")
"""OpenMP's and MKL's threads per process, and torch.compile's worker pool: what the launcher sets
for its workers (launcher/processes/worker.py, keeping the user's own values) or passes on."""
MAX_THREADS = 65536
_COUNT = re.compile(r"\s*0*([1-9][0-9]{0,5})\s*")
"""A positive whole number, spaces around it allowed (as libgomp and int() allow them)."""


def _is_thread_count(value: str) -> bool:
    match = _COUNT.fullmatch(value)
    return match is not None and int(match.group(1)) <= MAX_THREADS


def _is_valid(name: str, value: str) -> bool:
    if name == "OMP_NUM_THREADS":  # OpenMP also takes one count per nesting level: 4,2
        return all(_is_thread_count(part) for part in value.split(","))
    return _is_thread_count(value)


def bad_thread_variable(env: Mapping[str, str]) -> str | None:
    """The one-line refusal of the first thread variable in env that is not a number of threads,
    naming the variable, its value and the fix; None when every one set is valid."""
    for name in THREAD_VARIABLES:
        value = env.get(name)
        if value is not None and not _is_valid(name, value):
            return (
                f"{name}={value!r} is not a number of threads; set it to a whole number from 1 to {MAX_THREADS} "
                f"(export {name}=4) or unset it (unset {name})"
            )
    return None
