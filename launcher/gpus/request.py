"""What the user asks of the GPUs, and what a refusal answers: the --gpus request (all, auto:N,
none, a list of ids), the free criteria (--min-free-memory, --max-utilization), each GPU's
Verdict, and DeviceError, which carries the verdicts to the GPU table. Which GPUs a run then gets
is launcher/gpus/selection.py's."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from launcher.gpus.devices import Gpu
from pretrain.run.refusal import Refusal

GIB = 1 << 30
DEFAULT_MIN_FREE_MEMORY = "90%"
DEFAULT_MAX_UTILIZATION = 10.0


class DeviceError(Refusal, ValueError):
    """The GPUs asked for cannot be had. The message is one line; `verdicts` (when there
    are some) say of every GPU why it was refused: the command line shows them as the GPU
    table (launcher/gpus/table.py)."""

    def __init__(self, message: str, verdicts: Sequence[Verdict] = ()) -> None:
        super().__init__(message)
        self.verdicts = tuple(verdicts)


@dataclass(frozen=True)
class Verdict:
    gpu: Gpu
    state: Literal["free", "busy", "unhealthy", "hidden", "mig", "claimed", "error", "chosen"]
    reasons: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.state in ("free", "chosen"):
            return self.state + ("" if self.gpu.utilization is not None else " (utilization unknown)")
        return (f"{self.state}: " if self.state in ("busy", "unhealthy") else "") + "; ".join(self.reasons)


@dataclass(frozen=True)
class GpuRequest:
    kind: Literal["all", "auto", "list", "none"]
    count: int = 0
    """auto: how many."""
    ids: tuple[str, ...] = ()
    """list: GPU ids ("3", MIG "0.1") or UUIDs (a unique prefix is enough)."""

    def __str__(self) -> str:
        return {"all": "all", "none": "none", "auto": f"auto:{self.count}"}.get(self.kind, ",".join(self.ids))


def parse_request(text: str) -> GpuRequest:
    """--gpus: all | auto:N | none | a comma-separated list of GPU ids or UUIDs."""
    value = text.strip()
    if value.lower() in ("all", "none"):
        return GpuRequest(value.lower())  # type: ignore[arg-type]
    if value.lower() == "auto" or value.lower().startswith("auto:"):
        count = value[5:] or "1"
        if not count.isdigit() or int(count) < 1:
            raise DeviceError(f"--gpus {text}: the count after auto: must be a whole number of at least 1, as in auto:2")
        return GpuRequest("auto", count=int(count))
    ids = tuple(str(int(part)) if part.strip().isdigit() else part.strip() for part in value.split(","))
    if not value or not all(re.fullmatch(r"\d+(\.\d+)?|(GPU|MIG)-[0-9A-Za-z-]+", i) for i in ids):
        raise DeviceError(
            f"--gpus {text!r} is not all, auto:N, none, or a list of GPU ids like 0,3 (`python -m launcher gpus` lists them)"
        )
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise DeviceError(f"--gpus {text} names GPU {', '.join(duplicates)} twice; one worker runs per GPU")
    return GpuRequest("list", ids=ids)


@dataclass(frozen=True)
class Criteria:
    """When a GPU counts as free."""

    min_free_memory: float = 0.9
    """Free memory needed: bytes when above 1, else a fraction of the device's total."""
    max_utilization: float = DEFAULT_MAX_UTILIZATION
    """Percent; a GPU busier than this (mean over the sampling window) is busy."""

    @classmethod
    def parse(cls, min_free_memory: str, max_utilization: str) -> Criteria:
        """From the --min-free-memory and --max-utilization option values."""
        return cls(parse_min_free_memory(min_free_memory), parse_max_utilization(max_utilization))

    def describe_memory(self) -> str:
        m = self.min_free_memory
        return f"{m:.0%}" if m <= 1 else f"{m / GIB:g} GiB"

    def needed(self, gpu: Gpu) -> float:
        return self.min_free_memory * gpu.memory_total if self.min_free_memory <= 1 else self.min_free_memory


_UNITS = {"": GIB, "g": GIB, "gib": GIB, "gb": 1e9, "m": 1 << 20, "mib": 1 << 20, "mb": 1e6}


def parse_min_free_memory(text: str) -> float:
    """--min-free-memory: a percentage of each GPU's memory ("90%") or an amount ("20GiB", "20")."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(%|[a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or (unit != "%" and unit not in _UNITS):
        raise DeviceError(f"--min-free-memory {text!r} is not a percentage (90%) or an amount (20GiB, 500MiB)")
    number = float(match.group(1))
    if unit == "%":
        if number > 100:
            raise DeviceError(f"--min-free-memory {text} is over 100%")
        return number / 100
    amount = number * _UNITS[unit]
    return max(amount, 1.01)  # above 1: an amount in bytes, never read as a fraction


def parse_max_utilization(text: str) -> float:
    """--max-utilization: percent, 0 to 100 ("10" or "10%")."""
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        value = -1.0
    if not 0 <= value <= 100:
        raise DeviceError(f"--max-utilization {text!r} must be a percentage from 0 to 100")
    return value
