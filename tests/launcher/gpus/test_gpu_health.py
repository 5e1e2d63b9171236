"""GPU health (launcher/gpus/health.py): the verdict on each NVML reading and its reason, unhealthy
GPUs in selection and in `python -m launcher gpus`, and the run-time watch, on scripted machines
(launcher/gpus/scripted_nvml.py) whose file a test replaces while the watch runs."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from support.processes import wait_until
from support.runs import run_launcher
from launcher.gpus import amd, health, nvml, vendors
from launcher.gpus.devices import VISIBILITY_VARIABLES
from launcher.gpus.health import HealthWatch, assess, changes
from launcher.gpus.nvml import Health
from launcher.gpus.placement import GpuOptions, place
from launcher.gpus.request import DeviceError
from launcher.supervise.printer import Printer

HEALTHY = Health(0, False, False, False, frozenset(), 16, 16)
FAST = 0.05  # the watch's interval in these tests, in seconds
FAULTS = {
    "nvidia": {
        "normal clocks": {"throttle": ["gpu_idle", "sw_power_cap"]},
        "thermal slowdown": {"throttle": ["hw_thermal", "sw_power_cap"]},
        "power brake": {"throttle": ["hw_power_brake"]},
        "hardware slowdown": {"throttle": ["hw_slowdown"]},
        "pages pending": {"retired_pages_pending": True},
        "unknown": {
            "ecc_uncorrected": None,
            "remapped_rows": None,
            "retired_pages_pending": None,
            "throttle": None,
            "pcie_width": None,
            "pcie_max_width": None,
        },
    },
    "amd": {
        "normal clocks": {"throttle": ["ppt"]},  # the package power limit: a busy GPU at its cap
        "thermal slowdown": {"throttle": ["socket_thermal", "ppt"]},
        "power brake": {"throttle": ["prochot"]},
        "hardware slowdown": {"throttle": ["prochot"]},
        "pages pending": {"bad_pages": {"pending": 1}},
        "unknown": {"ecc_uncorrected": None, "bad_pages": None, "throttle": None, "pcie_width": None, "pcie_max_width": None},
    },
}
"""A scripted GPU's keys for each fault, as each vendor's machine spells it (scripted_nvml.py, scripted_amdsmi.py)."""
READERS = {"nvidia": "NVML", "amd": "AMD SMI"}


@pytest.fixture(autouse=True)
def no_sampling_wait(monkeypatch):
    for backend in (nvml, amd):
        monkeypatch.setattr(backend, "UTILIZATION_WINDOW", 0.0)  # in this process only
    for variable in VISIBILITY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def replace_machine(path: Path, gpus: list[dict]) -> None:
    """Change the scripted machine as a GPU going bad would: atomically, never half-written (its
    vendor kept)."""
    draft = path.with_suffix(".draft")
    vendor = json.loads(path.read_text()).get("vendor", "nvidia")
    draft.write_text(json.dumps({"vendor": vendor, "gpus": gpus}))
    os.replace(draft, path)


# --- the verdict on each reading ------------------------------------------------------


@pytest.mark.parametrize(
    "changed, reason",
    [
        ({"ecc_uncorrected": 2}, "2 uncorrectable ECC errors (volatile)"),
        ({"ecc_uncorrected": 1}, "1 uncorrectable ECC error (volatile)"),
        ({"retired_pages_pending": True}, "retired pages pending"),
        ({"remapping_pending": True}, "row remapping pending"),
        ({"remapping_failed": True}, "row remapping failed"),
        ({"pages_unretirable": 2}, "2 bad pages that could not be retired"),
        ({"pages_unretirable": 1}, "1 bad page that could not be retired"),
        ({"clock_reasons": frozenset({"hw_thermal"})}, "clocks: thermal slowdown"),
        ({"clock_reasons": frozenset({"sw_thermal"})}, "clocks: driver thermal slowdown"),
        ({"clock_reasons": frozenset({"hw_power_brake", "sw_power_cap"})}, "clocks: power brake"),
        ({"clock_reasons": frozenset({"hw_slowdown", "hw_thermal"})}, "clocks: hardware slowdown, thermal slowdown"),
        ({"pcie_width": 8}, "PCIe x8 of x16"),
    ],
)
def test_each_bad_reading_makes_a_gpu_unhealthy_with_its_reason(changed, reason):
    verdict = assess(replace(HEALTHY, **changed))
    assert not verdict.healthy
    assert verdict.reasons == (reason,) and verdict.describe() == reason


def test_a_lost_gpu_is_failing_and_memory_errors_come_before_slowdowns():
    assert assess(Health(lost=True)).failing == ("GPU is lost",)
    both = assess(replace(HEALTHY, ecc_uncorrected=1, pcie_width=4))
    assert both.failing == ("1 uncorrectable ECC error (volatile)",) and both.slowed == ("PCIe x4 of x16",)
    assert both.describe() == "1 uncorrectable ECC error (volatile); PCIe x4 of x16"


@pytest.mark.parametrize(
    "reasons", [{"gpu_idle"}, {"applications_clocks"}, {"sw_power_cap"}, {"sync_boost"}, {"display_clocks"}, set()]
)
def test_normal_clock_reasons_are_healthy(reasons):
    verdict = assess(replace(HEALTHY, clock_reasons=frozenset(reasons)))
    assert verdict.healthy and verdict.describe() == "ok"


def test_readings_nvml_cannot_give_are_unknown_never_unhealthy():
    assert assess(Health()).healthy and assess(Health()).describe() == "?"
    partly = Health(pcie_width=16, pcie_max_width=16)  # a GPU without ECC: the rest is still judged
    assert assess(partly).describe() == "ok"
    assert assess(Health(pcie_width=8)).healthy  # no maximum to compare with


def test_a_link_at_full_width_is_healthy_whatever_its_generation():
    """An idle GPU lowers its PCIe generation to save power: only the lanes are read and compared."""
    assert "generation" not in " ".join(Health.__dataclass_fields__)
    assert assess(Health(pcie_width=16, pcie_max_width=16)).healthy


# --- changes between two readings -----------------------------------------------------


def test_changes_name_new_errors_and_clock_slowdowns_starting_and_ending():
    hot = replace(HEALTHY, clock_reasons=frozenset({"hw_thermal", "sw_power_cap"}))
    assert changes(HEALTHY, HEALTHY) == []
    assert changes(HEALTHY, replace(HEALTHY, ecc_uncorrected=2)) == [
        f"2 new uncorrectable ECC errors (volatile): {health.FAILING}"
    ]
    assert changes(replace(HEALTHY, ecc_uncorrected=2), replace(HEALTHY, ecc_uncorrected=3)) == [
        f"1 new uncorrectable ECC error (volatile): {health.FAILING}"
    ]
    assert changes(HEALTHY, replace(HEALTHY, remapping_pending=True)) == [f"row remapping pending: {health.FAILING}"]
    amd = replace(HEALTHY, pages_unretirable=0)  # AMD SMI reads bad pages it could not retire; NVML never
    assert changes(amd, replace(amd, pages_unretirable=2)) == [f"2 new bad pages that could not be retired: {health.FAILING}"]
    assert changes(amd, replace(amd, pages_unretirable=None)) == [] and changes(HEALTHY, amd) == []
    assert changes(HEALTHY, hot) == ["clocks: thermal slowdown"]
    assert changes(hot, HEALTHY) == ["clocks: no longer slowed (thermal slowdown ended)"]
    assert changes(HEALTHY, replace(HEALTHY, clock_reasons=frozenset({"sw_power_cap"}))) == []
    assert changes(HEALTHY, replace(HEALTHY, pcie_width=8)) == ["PCIe x8 of x16"]
    assert changes(HEALTHY, Health(lost=True)) == [f"GPU is lost: {health.FAILING}"]
    assert changes(HEALTHY, Health()) == []  # a reading missed is no news


# --- choosing GPUs --------------------------------------------------------------------


def test_all_skips_an_unhealthy_gpu_and_says_why(scripted_gpus, vendor):
    scripted_gpus([{}, {"ecc_uncorrected": 2}, FAULTS[vendor]["normal clocks"]])
    console = io.StringIO()
    placement = place(GpuOptions(device="cuda"), Printer(console, None))
    try:
        assert [gpu.id for gpu in placement.gpus] == ["0", "2"]
        assert "launcher:   GPU 1: unhealthy: 2 uncorrectable ECC errors (volatile)" in console.getvalue().splitlines()
    finally:
        placement.release()


def test_auto_never_takes_an_unhealthy_gpu_even_the_idlest(scripted_gpus, vendor):
    scripted_gpus([{"utilization": [5]}, FAULTS[vendor]["power brake"] | {"utilization": [0]}])
    placement = place(GpuOptions(gpus="auto:1"), Printer(io.StringIO(), None))
    try:
        assert [gpu.id for gpu in placement.gpus] == ["0"]
    finally:
        placement.release()


def test_naming_an_unhealthy_gpu_warns_and_uses_it(scripted_gpus, vendor):
    scripted_gpus([{}, FAULTS[vendor]["pages pending"]])
    console = io.StringIO()
    placement = place(GpuOptions(gpus="1"), Printer(console, None))
    try:
        assert [gpu.id for gpu in placement.gpus] == ["1"]
        assert console.getvalue().splitlines()[0] == (
            "launcher: warning: GPU 1 is unhealthy (retired pages pending); using it anyway as --gpus names it (--strict refuses)"
        )
    finally:
        placement.release()


def test_strict_refuses_a_named_unhealthy_gpu_in_one_line_with_exit_2(scripted_gpus, vendor, tmp_path):
    scripted_gpus([{}, {"ecc_uncorrected": 2}])
    started = tmp_path / "started"
    result = run_launcher("--gpus", "1", "--strict", "--", "touch", str(started))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "launcher: error: GPU 1 is unhealthy (2 uncorrectable ECC errors (volatile)); --strict refuses unhealthy GPUs; "
        "choose another GPU"
    ]
    assert not started.exists()


def test_launcher_gpus_shows_the_health_of_each_gpu_and_marks_the_failing_one_unhealthy(scripted_gpus, vendor):
    scripted_gpus([{}, {"ecc_uncorrected": 2}, FAULTS[vendor]["unknown"]])
    result = run_launcher("gpus")
    assert result.returncode == 0, result.stderr
    header, ok, failing, unknown = result.stdout.splitlines()
    at = header.index("HEALTH")
    assert header[at:].split() == ["HEALTH", "VERDICT"]
    assert ok[at:].split() == ["ok", "free"]
    assert failing[at:].split() == ["2", "uncorrectable", "ECC", "errors", "(volatile)", "unhealthy"]
    assert unknown[at:].split() == ["?", "free"]


def test_with_no_free_gpu_the_error_says_free_means_healthy_too():
    from launcher.gpus import request, selection

    sick = nvml.Gpu("0", 0, "GPU-0", "H100", "?", 80 << 30, 0, 0.0, (), health=Health(ecc_uncorrected=1))
    with pytest.raises(DeviceError, match=r"none of the 1 GPU\(s\) is free \(free: .*unclaimed, healthy\)"):
        selection.select([sick], request.parse_request("all"), request.Criteria(), claim=lambda _: None, holder=lambda _: None)


# --- the watch during a run -----------------------------------------------------------


class Lines:
    """What the watch says, collected from its thread."""

    def __init__(self) -> None:
        self.said: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            self.said.append(line)


def watched(path: Path, lines: Lines, ids: tuple[str, ...] = ("0", "1")) -> HealthWatch:
    gpus = [gpu for gpu in vendors.backend(None).discover(window=0) if gpu.id in ids]
    return HealthWatch(gpus, [f"GPU{gpu.id}" for gpu in gpus], lines, interval=FAST)


def test_the_watch_says_one_line_when_a_gpu_of_the_run_gets_ecc_errors_mid_run(scripted_gpus, vendor):
    path = scripted_gpus([{}, {}, {}])
    lines = Lines()
    with watched(path, lines) as watch:
        assert wait_until(lambda: watch.polls >= 1)  # the baseline is read
        replace_machine(path, [{}, {"ecc_uncorrected": 2}, {"ecc_uncorrected": 5}])  # GPU 2 is not the run's
        assert wait_until(lambda: lines.said, timeout=5)
        polls = watch.polls
        assert wait_until(lambda: watch.polls >= polls + 3)  # and it is said once, not at every reading
    assert lines.said == [f"GPU1: 2 new uncorrectable ECC errors (volatile): {health.FAILING}"]


def test_an_error_that_came_between_choosing_the_gpus_and_the_watchs_first_reading_is_said(scripted_gpus):
    path = scripted_gpus([{}, {}])
    lines = Lines()
    watch = watched(path, lines)  # the GPUs as they were chosen: healthy
    replace_machine(path, [{}, {"ecc_uncorrected": 1}])  # before the watch reads them
    with watch:
        assert wait_until(lambda: lines.said, timeout=5)
    assert lines.said == [f"GPU1: 1 new uncorrectable ECC error (volatile): {health.FAILING}"]


def test_the_watch_says_when_a_bad_clock_reason_starts_and_stops_and_remembers_it(scripted_gpus, vendor):
    path = scripted_gpus([{}, {}])
    lines = Lines()
    with watched(path, lines) as watch:
        assert wait_until(lambda: watch.polls >= 1)
        assert watch.clocks("GPU1") is None
        replace_machine(path, [{}, FAULTS[vendor]["thermal slowdown"]])
        assert wait_until(lambda: lines.said == ["GPU1: clocks: thermal slowdown"], timeout=5)
        assert watch.clocks("GPU1") == "thermal slowdown" and watch.clocks("GPU0") is None
        replace_machine(path, [{}, {}])
        assert wait_until(lambda: len(lines.said) == 2, timeout=5)
    assert lines.said[1] == "GPU1: clocks: no longer slowed (thermal slowdown ended)"
    assert watch.clocks("GPU1") is None


def test_the_watch_says_nothing_while_nothing_changes(scripted_gpus, vendor):
    path = scripted_gpus([{"ecc_uncorrected": 3} | FAULTS[vendor]["hardware slowdown"], {}])  # bad from the start: not news
    lines = Lines()
    with watched(path, lines) as watch:
        assert wait_until(lambda: watch.polls >= 5)
    assert lines.said == []


def test_leaving_the_watch_stops_its_thread_at_once_not_after_the_interval(scripted_gpus):
    scripted_gpus([{}])
    (gpu,) = nvml.discover(window=0)
    with HealthWatch([gpu], ["GPU0"], Lines(), interval=60) as watch:
        assert wait_until(lambda: watch.polls >= 1)
        leaving = time.monotonic()
    assert time.monotonic() - leaving < 10.0  # the interval is 60 s
    assert not any(thread.name == "gpu-health-watch" for thread in threading.enumerate())


def test_the_watch_says_a_lost_gpu_once(scripted_gpus, vendor):
    path = scripted_gpus([{}, {}])
    lines = Lines()
    with watched(path, lines) as watch:
        assert wait_until(lambda: watch.polls >= 1)
        replace_machine(path, [{"lost": True}, {}])
        assert wait_until(lambda: lines.said, timeout=5)
        polls = watch.polls
        assert wait_until(lambda: watch.polls >= polls + 3)
    assert lines.said == [f"GPU0: GPU is lost: {health.FAILING}"]


def test_an_nvml_error_in_the_watch_is_one_line_once_and_never_raises(scripted_gpus, vendor):
    path = scripted_gpus([{}, {}])
    lines = Lines()
    with watched(path, lines) as watch:
        assert wait_until(lambda: watch.polls >= 1)
        path.write_text("{broken")  # every reading from now on fails
        assert wait_until(lambda: lines.said, timeout=5)
        polls = watch.polls
        assert wait_until(lambda: watch.polls >= polls + 3)  # readings go on failing: still the one line
    (line,) = lines.said
    assert line.startswith(f"GPU health watch: cannot read {READERS[vendor]} (scripted GPU machine {path}: ")
    assert line.endswith("; the run goes on without it")


def test_a_watch_of_cpu_workers_starts_no_thread():
    with HealthWatch([], ["CPU0", "CPU1"], lambda line: pytest.fail(line)):
        assert not any(thread.name == "gpu-health-watch" for thread in threading.enumerate())
