"""The GPU table: every device, what it is doing, its health, and the launcher's verdict on it."""

from __future__ import annotations

from collections.abc import Sequence

from launcher.gpus import health
from launcher.gpus.request import GIB, Verdict
from launcher.gpus.devices import Gpu, GpuProcess

HEADER = ("GPU", "NAME", "BUS ID", "MEMORY USED", "UTIL", "PROCESSES", "HEALTH", "VERDICT")
MAX_PROCESSES_SHOWN = 3


def render(verdicts: Sequence[Verdict]) -> str:
    rows = [HEADER] + [_row(v) for v in verdicts]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in rows)


def _row(verdict: Verdict) -> tuple[str, ...]:
    gpu = verdict.gpu
    return (
        ("  " if gpu.mig else "") + gpu.id,
        gpu.name,
        gpu.pci_bus_id,
        f"{gpu.memory_used / GIB:.1f} / {gpu.memory_total / GIB:.1f} GiB",
        "n/a" if gpu.mig_enabled else "?" if gpu.utilization is None else f"{gpu.utilization:.0f}%",
        _processes(gpu),
        health.assess(gpu.health).describe(),
        "unhealthy" if verdict.state == "unhealthy" else verdict.describe(),  # HEALTH says why
    )


def _processes(gpu: Gpu) -> str:
    if not gpu.processes:
        return "-"
    shown = [_process(p) for p in gpu.processes[:MAX_PROCESSES_SHOWN]]
    more = len(gpu.processes) - MAX_PROCESSES_SHOWN
    return ", ".join(shown) + (f", +{more} more" if more > 0 else "")


def _process(process: GpuProcess) -> str:
    who = process.user or "not visible here"
    memory = "" if process.memory is None else f" {process.memory / GIB:.1f} GiB"
    return f"{process.pid} ({who}){memory}"
