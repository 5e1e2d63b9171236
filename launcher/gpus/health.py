"""Whether a GPU is healthy: the health readings of NVML or AMD SMI (launcher/gpus/devices.py
Health) judged before a run chooses its GPUs, and watched while it runs.

Unhealthy, so never chosen by `--gpus all` or `auto:N` (a warning when named in `--gpus`):
- failing: any volatile uncorrectable ECC error, retired pages pending (AMD: bad pages pending), a
  row remapping pending or failed, a bad page AMD's driver could not retire, a lost GPU. Each needs
  a reset or a new GPU; a job there crashes, or computes on bad memory.
- slowed: clocks held down for a reason that means trouble (hardware slowdown, thermal slowdown,
  power brake; AMD's throttle reasons are read as these names, launcher/gpus/amd.py), or a PCIe
  link narrower than its maximum: in a synchronous run the slowest GPU sets every rank's pace.
Never held against a GPU: idle, applications clocks, the software power cap (a busy GPU at its
power limit), sync boost, display clocks; a PCIe link below its top generation (an idle GPU lowers
its link speed to save power; only its width counts); a reading NVML cannot give (not supported).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from launcher.gpus import vendors
from launcher.gpus.devices import Gpu, Health

BAD_CLOCK_REASONS = {
    "hw_slowdown": "hardware slowdown",
    "hw_thermal": "thermal slowdown",
    "sw_thermal": "driver thermal slowdown",
    "hw_power_brake": "power brake",
}
"""The clock reasons that mean trouble (devices.CLOCK_REASONS names), as a line says them."""
FAILING = "this GPU is failing; a restart (--max-restarts) or the next launch leaves it out"
STOP_WAIT = 2.0
"""Seconds the end of a run waits for the watch's thread to finish a reading under way."""


@dataclass(frozen=True)
class Assessment:
    """The verdict on one GPU's readings, with the reason for each finding."""

    failing: tuple[str, ...] = ()
    """Memory errors, a lost GPU: the GPU needs a reset or replacing."""
    slowed: tuple[str, ...] = ()
    """Clock reasons that mean trouble, a narrowed PCIe link: the GPU would pace the run."""
    known: bool = True
    """NVML gave at least one reading."""

    @property
    def healthy(self) -> bool:
        return not self.failing and not self.slowed

    @property
    def reasons(self) -> tuple[str, ...]:
        return self.failing + self.slowed

    def describe(self) -> str:
        """The table's HEALTH cell: ok, the reasons, or ? where NVML can tell nothing."""
        return "; ".join(self.reasons) if self.reasons else "ok" if self.known else "?"


def assess(health: Health) -> Assessment:
    """Judge one GPU's readings; a reading that is None (NVML cannot tell) counts for nothing."""
    failing = []
    if health.lost:
        failing.append("GPU is lost")
    if health.ecc_uncorrected:
        failing.append(ecc_errors(health.ecc_uncorrected))
    if health.retired_pages_pending:
        failing.append("retired pages pending")
    if health.remapping_pending:
        failing.append("row remapping pending")
    if health.remapping_failed:
        failing.append("row remapping failed")
    if health.pages_unretirable:
        failing.append(unretirable(health.pages_unretirable))
    slowed = []
    clocks = bad_clocks(health)
    if clocks:
        slowed.append(f"clocks: {clocks}")
    if narrow_pcie(health):
        slowed.append(f"PCIe x{health.pcie_width} of x{health.pcie_max_width}")
    readings = [getattr(health, f.name) for f in dataclasses.fields(health) if f.name != "lost"]
    return Assessment(tuple(failing), tuple(slowed), known=health.lost or any(r is not None for r in readings))


def ecc_errors(count: int, new: bool = False) -> str:
    return f"{count} {'new ' if new else ''}uncorrectable ECC error{'s' if count != 1 else ''} (volatile)"


def unretirable(count: int, new: bool = False) -> str:
    return f"{count} {'new ' if new else ''}bad page{'s' if count != 1 else ''} that could not be retired"


def bad_clocks(health: Health) -> str | None:
    """The clock reasons now set that mean trouble ("thermal slowdown"), or None."""
    named = [text for name, text in BAD_CLOCK_REASONS.items() if name in (health.clock_reasons or ())]
    return ", ".join(named) or None


def narrow_pcie(health: Health) -> bool:
    """The link has fewer lanes than it can have (its generation is not compared)."""
    return health.pcie_width is not None and health.pcie_max_width is not None and health.pcie_width < health.pcie_max_width


def changes(before: Health, now: Health) -> list[str]:
    """What changed for the worse between two readings of one GPU (and, for the clocks and the
    PCIe link, for the better), one text each. Only readings known both times are compared."""
    found = []
    if now.lost and not before.lost:
        found.append(f"GPU is lost: {FAILING}")
    if now.ecc_uncorrected is not None and before.ecc_uncorrected is not None and now.ecc_uncorrected > before.ecc_uncorrected:
        found.append(f"{ecc_errors(now.ecc_uncorrected - before.ecc_uncorrected, new=True)}: {FAILING}")
    for field, text in (
        ("retired_pages_pending", "retired pages pending"),
        ("remapping_pending", "row remapping pending"),
        ("remapping_failed", "row remapping failed"),
    ):
        if getattr(now, field) and getattr(before, field) is False:
            found.append(f"{text}: {FAILING}")
    if now.pages_unretirable is not None and before.pages_unretirable is not None:
        if now.pages_unretirable > before.pages_unretirable:
            found.append(f"{unretirable(now.pages_unretirable - before.pages_unretirable, new=True)}: {FAILING}")
    if now.clock_reasons is not None and before.clock_reasons is not None and bad_clocks(now) != bad_clocks(before):
        found.append(
            f"clocks: {bad_clocks(now)}" if bad_clocks(now) else f"clocks: no longer slowed ({bad_clocks(before)} ended)"
        )
    if now.pcie_width is not None and before.pcie_width is not None and narrow_pcie(now) != narrow_pcie(before):
        found.append(
            f"PCIe x{now.pcie_width} of x{now.pcie_max_width}" if narrow_pcie(now) else f"PCIe back to x{now.pcie_width}"
        )
    return found


def _carried_over(before: Health, now: Health) -> Health:
    """now, with what it could not read this time taken from before (so that a reading missed
    once does not make the next one look new)."""
    missing = {f.name: getattr(before, f.name) for f in dataclasses.fields(now) if getattr(now, f.name) is None}
    return dataclasses.replace(now, **missing)


class HealthWatch:
    """During a run, read the health of the run's GPUs every `interval` seconds (or the reader's
    min_interval_s where longer: amd-smi's) on a daemon thread, off the workers' path, and say one
    line, labelled as the workers are ("GPU5: ..."), when a GPU gets a new error, or starts or stops
    a clock slowdown that means trouble. The first reading is the baseline: what a GPU had when the
    run began is not said again.

        with HealthWatch(placement.gpus, labels, console.launcher_line):
            ...  # the supervised run

    It never raises into the run: an NVML error is said once, in one line, and the run goes on.
    say() is called from the watch's thread. Leaving the block stops the thread at once (an
    Event, not a sleep), waiting at most STOP_WAIT seconds for a reading under way."""

    def __init__(self, gpus: Sequence[Gpu], labels: Sequence[str], say: Callable[[str], None], interval: float = 5.0) -> None:
        """gpus: the run's devices on this node; labels: their workers' labels, in the same order
        (CPU workers: no gpus, and the watch does nothing)."""
        self._gpus = list(gpus)
        self._labels = dict(zip((gpu.id for gpu in self._gpus), labels, strict=True)) if self._gpus else {}
        self._say = say
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The baseline is what the GPUs were chosen on: an error that came between the choice and
        # the watch's first reading is still news (the first reading is compared with it).
        self._last: dict[str, Health] = {gpu.id: gpu.health for gpu in self._gpus}
        self._clocks: dict[str, str | None] = {}
        self._complained = False
        self.polls = 0
        """Readings tried so far."""

    def __enter__(self) -> HealthWatch:
        if self._gpus:
            self._thread = threading.Thread(target=self._watch, name="gpu-health-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_WAIT)

    def clocks(self, label: str) -> str | None:
        """The clock reasons that mean trouble in the latest reading of the GPU labelled `label`
        ("thermal slowdown"), or None: none, not read yet, or not a GPU of this run."""
        return self._clocks.get(label)

    def _watch(self) -> None:
        try:
            reader = vendors.of(self._gpus).HealthReader(self._gpus)
        except Exception as error:  # noqa: BLE001  # no driver, a broken script: the run goes on
            self._complain(error)
            return
        # A reader that is costly to run (amd-smi's: two processes a reading) says how long to leave.
        interval = max(self._interval, getattr(reader, "min_interval_s", 0.0))
        try:
            while not self._stop.is_set():
                self._poll(reader)
                self._stop.wait(interval)
        finally:
            with contextlib.suppress(Exception):
                reader.close()

    def _poll(self, reader: Any) -> None:
        try:
            readings = reader.read()
        except Exception as error:  # noqa: BLE001
            self._complain(error)
            return
        finally:
            self.polls += 1
        for gpu_id, now in readings.items():
            label = self._labels[gpu_id]
            before = self._last.get(gpu_id)
            if before is not None:
                for text in changes(before, now):
                    self._tell(f"{label}: {text}")
            self._last[gpu_id] = now if before is None else _carried_over(before, now)
            self._clocks[label] = bad_clocks(now)

    def _complain(self, error: Exception) -> None:
        if not self._complained:
            self._complained = True
            reader = "AMD SMI" if self._gpus[0].vendor == "amd" else "NVML"
            self._tell(f"GPU health watch: cannot read {reader} ({error}); the run goes on without it")

    def _tell(self, line: str) -> None:
        with contextlib.suppress(Exception):  # a closed console is the supervisor's to handle
            self._say(line)
