"""GPU discovery (launcher/gpus/nvml.py) run against scripted machines (launcher/gpus/scripted_nvml.py):
what each GPU and MIG device is, utilization sampled over a window, the processes on a GPU
and their owners, its health readings, and the errors for a missing driver or a malformed script."""

from __future__ import annotations

import getpass
import json
import re
import os
import time
from pathlib import Path

import pynvml
import pytest

from support.processes import one_line_error
from launcher.gpus import nvml, scripted_nvml
from launcher.gpus.scripted_nvml import ScriptedNvml

MIB = 1 << 20
NOT_HERE_PID = 4_000_000  # above any pid_max: a process of another container


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Script the machine that discovery sees: write its JSON and point the seam at it."""

    def make(spec: object, name: str = "machine.json") -> Path:
        path = tmp_path / name
        path.write_text(spec if isinstance(spec, str) else json.dumps(spec))
        monkeypatch.setenv(nvml.SCRIPTED_GPUS_VAR, str(path))
        return path

    return make


def by_id(gpus: list[nvml.Gpu]) -> dict[str, nvml.Gpu]:
    return {gpu.id: gpu for gpu in gpus}


def test_eight_idle_gpus_are_eight_whole_devices_in_nvml_order(machine):
    specs = [
        {
            "name": f"NVIDIA H100 80GB HBM3 #{i}",
            "uuid": f"GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd",
            "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0",
            "memory_total_mib": 81559,
            "memory_used_mib": 3 * i,
        }
        for i in range(8)
    ]
    machine({"gpus": specs})
    gpus = nvml.discover(window=0)
    assert [gpu.id for gpu in gpus] == [str(i) for i in range(8)]
    for i, (gpu, spec) in enumerate(zip(gpus, specs, strict=True)):
        assert gpu.index == i
        assert gpu.uuid == spec["uuid"]
        assert gpu.name == spec["name"]
        assert gpu.pci_bus_id == spec["pci_bus_id"]
        assert gpu.memory_total == 81559 * MIB
        assert gpu.memory_used == 3 * i * MIB
        assert gpu.memory_free == (81559 - 3 * i) * MIB
        assert gpu.utilization == 0.0
        assert gpu.processes == ()
        assert not gpu.mig and not gpu.mig_enabled
        assert gpu.visible_id == gpu.uuid  # never the index: NVML and CUDA can count differently


def test_free_memory_is_never_negative_when_used_exceeds_total(machine):
    machine({"gpus": [{"memory_total_mib": 100, "memory_used_mib": 150}]})
    assert nvml.discover(window=0)[0].memory_free == 0


def test_utilization_is_averaged_over_the_window_not_read_once(machine):
    machine({"gpus": [{"utilization": [0, 100, 0, 100, 0]}, {"utilization": [100, 0]}]})
    gpus = nvml.discover(window=0, samples=5)
    assert gpus[0].utilization == pytest.approx(40.0)
    assert gpus[1].utilization == pytest.approx(60.0)  # 100, 0, 100, 0, 100: the readings cycle


def test_utilization_sampling_really_spreads_its_readings_over_the_window(machine):
    machine({"gpus": [{"utilization": [50]}]})
    start = time.monotonic()
    gpus = nvml.discover(window=0.2, samples=3)
    elapsed = time.monotonic() - start
    assert 0.15 <= elapsed < 2.0
    assert gpus[0].utilization == pytest.approx(50.0)


def test_unsupported_utilization_is_none_and_the_other_gpus_are_still_measured(machine):
    machine({"gpus": [{"utilization": [30, 50]}, {"utilization": None}, {"utilization": [80]}]})
    gpus = nvml.discover(window=0, samples=2)
    assert gpus[1].utilization is None
    assert gpus[0].utilization == pytest.approx(40.0)
    assert gpus[2].utilization == pytest.approx(80.0)


def test_a_process_of_this_container_is_reported_with_its_owner(machine):
    machine({"gpus": [{"processes": [{"pid": os.getpid(), "memory_mib": 1024}]}]})
    (process,) = nvml.discover(window=0)[0].processes
    assert process.pid == os.getpid()
    assert process.memory == 1024 * MIB
    assert process.user == getpass.getuser()


def test_a_process_of_another_container_has_no_user_but_keeps_its_memory(machine):
    machine({"gpus": [{"processes": [{"pid": NOT_HERE_PID, "memory_mib": 2048}, {"pid": os.getpid(), "memory_mib": None}]}]})
    other, mine = nvml.discover(window=0)[0].processes
    assert (other.pid, other.user, other.memory) == (NOT_HERE_PID, None, 2048 * MIB)
    assert mine.memory is None
    assert mine.user == getpass.getuser()


def test_mig_devices_follow_their_parent_and_are_addressed_by_mig_uuid(machine):
    machine({"gpus": [{}, {"pci_bus_id": "00000000:AB:00.0", "mig": [{"slot": 0}, {"slot": 2}]}, {}]})
    gpus = nvml.discover(window=0)
    assert [gpu.id for gpu in gpus] == ["0", "1", "1.0", "1.2", "2"]
    parent, *children = gpus[1:4]
    assert parent.mig_enabled and not parent.mig
    assert len({child.uuid for child in children}) == 2
    for child in children:
        assert child.mig and not child.mig_enabled
        assert child.index == 1
        assert child.uuid.startswith("MIG-")
        assert child.visible_id == child.uuid
        assert child.pci_bus_id == "00000000:AB:00.0"
        assert child.utilization is None
    assert not gpus[0].mig_enabled and not gpus[4].mig_enabled


def test_each_gpu_has_its_compute_capability_and_a_mig_device_its_gpus(machine, monkeypatch):
    machine({"gpus": [{"compute_capability": [8, 0], "mig": [{"slot": 0}]}, {}, {"compute_capability": None}]})
    assert [gpu.compute_capability for gpu in nvml.discover(window=0)] == [(8, 0), (8, 0), (9, 0), None]
    monkeypatch.delattr(ScriptedNvml, "nvmlDeviceGetCudaComputeCapability")  # a pynvml without the function
    assert {gpu.compute_capability for gpu in nvml.discover(window=0)} == {None}


def test_mig_devices_carry_their_own_memory_and_processes(machine):
    machine(
        {
            "gpus": [
                {
                    "memory_used_mib": 0,
                    "mig": [
                        {
                            "slot": 1,
                            "memory_total_mib": 19968,
                            "memory_used_mib": 500,
                            "processes": [{"pid": NOT_HERE_PID, "memory_mib": 500}],
                        }
                    ],
                }
            ]
        }
    )
    child = by_id(nvml.discover(window=0))["0.1"]
    assert (child.memory_total, child.memory_used) == (19968 * MIB, 500 * MIB)
    assert [p.pid for p in child.processes] == [NOT_HERE_PID]


def test_a_machine_without_driver_raises_no_gpu_driver(machine):
    machine({"driver": False, "gpus": [{}]})
    with pytest.raises(nvml.NoGpuDriver):
        nvml.discover(window=0)


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists(), reason="this machine has an NVIDIA driver")
def test_real_nvml_without_a_driver_raises_no_gpu_driver(monkeypatch):
    monkeypatch.delenv(nvml.SCRIPTED_GPUS_VAR, raising=False)
    with pytest.raises(nvml.NoGpuDriver):
        nvml.discover(window=0)


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"gpus": [{"name": "x", "colour": "green"}]}),
        json.dumps({"gpus": [{"mig": [{"slot": 0, "colour": "green"}]}]}),
        json.dumps([{"name": "x"}]),
        json.dumps({"gpus": [{"mig": [{}]}]}),
        json.dumps({"gpus": [{"processes": [{"memory_mib": 1}]}]}),
        json.dumps({"gpus": [{"processes": [5]}]}),
        json.dumps({"gpus": [{"memory_total_mib": "80"}]}),
        json.dumps({"gpus": [{"utilization": "busy"}]}),
        '{"gpus": [{"memory_total_mib": Infinity}]}',
        json.dumps({"gpus": [{"processes": [{"pid": -4}]}]}),
        json.dumps({"gpus": [{"ecc_uncorrected": -1}]}),
        json.dumps({"gpus": [{"ecc_uncorrected": True}]}),
        json.dumps({"gpus": [{"retired_pages_pending": "yes"}]}),
        json.dumps({"gpus": [{"remapped_rows": {"pending": True, "spare": 3}}]}),
        json.dumps({"gpus": [{"remapped_rows": {"failure": 1}}]}),
        json.dumps({"gpus": [{"throttle": ["too_hot"]}]}),
        json.dumps({"gpus": [{"throttle": "hw_thermal"}]}),
        json.dumps({"gpus": [{"pcie_width": 0}]}),
        json.dumps({"gpus": [{"mig": [{"slot": 0, "ecc_uncorrected": 1}]}]}),
        json.dumps({"gpus": [{"compute_capability": "9.0"}]}),
    ],
    ids=[
        "not-json",
        "unknown-gpu-key",
        "unknown-mig-key",
        "top-level-list",
        "mig-without-slot",
        "process-without-pid",
        "process-not-an-object",
        "memory-as-text",
        "utilization-not-a-list",
        "infinite-memory",
        "negative-pid",
        "negative-ecc",
        "ecc-as-bool",
        "pending-as-text",
        "unknown-remapped-rows-key",
        "remapped-rows-flag-not-bool",
        "unknown-throttle-reason",
        "throttle-not-a-list",
        "no-pcie-lanes",
        "health-of-a-mig-device",
        "capability-as-text",
    ],
)
def test_a_malformed_script_is_one_line_naming_the_file_and_the_fix(machine, content):
    path = machine(content)
    with pytest.raises(scripted_nvml.BadScript) as excinfo:
        nvml.discover(window=0)
    message = one_line_error(excinfo)
    assert str(path) in message
    assert "fix the file or unset LAUNCHER_SCRIPTED_GPUS" in message


def test_a_missing_script_is_a_bad_script_too(tmp_path, monkeypatch):
    path = tmp_path / "absent.json"
    monkeypatch.setenv(nvml.SCRIPTED_GPUS_VAR, str(path))
    with pytest.raises(scripted_nvml.BadScript) as excinfo:
        nvml.discover(window=0)
    assert str(path) in one_line_error(excinfo)


def test_names_and_uuids_given_as_bytes_by_an_older_pynvml_are_decoded(machine, monkeypatch):
    machine({"gpus": [{"name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-abc", "pci_bus_id": "00000000:07:00.0"}]})
    for method in ("nvmlDeviceGetName", "nvmlDeviceGetUUID"):
        original = getattr(ScriptedNvml, method)
        monkeypatch.setattr(ScriptedNvml, method, lambda self, device, _f=original: _f(self, device).encode())
    gpu = nvml.discover(window=0)[0]
    assert (gpu.name, gpu.uuid) == ("NVIDIA A100-SXM4-40GB", "GPU-abc")
    assert isinstance(gpu.name, str) and isinstance(gpu.uuid, str)


def test_undecodable_bytes_are_replaced_rather_than_raising():
    assert nvml._text(b"GPU-\xff") == "GPU-\ufffd"
    assert nvml._text("GPU-1") == "GPU-1"


@pytest.mark.skipif(not Path("/proc/driver/nvidia/version").exists(), reason="needs an NVIDIA driver (run on a GPU machine)")
def test_real_nvml_describes_every_gpu_of_this_machine(monkeypatch):
    monkeypatch.delenv(nvml.SCRIPTED_GPUS_VAR, raising=False)
    gpus = nvml.discover(window=0.2, samples=3)
    assert gpus, "a driver but no GPU"
    for gpu in gpus:
        assert gpu.uuid.startswith(("GPU-", "MIG-")) and gpu.name
        assert re.fullmatch(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]", gpu.pci_bus_id)
        assert 0 <= gpu.memory_used <= gpu.memory_total and gpu.memory_total > 0
        assert gpu.utilization is None or 0 <= gpu.utilization <= 100
        assert gpu.compute_capability is None or (5, 0) <= gpu.compute_capability < (20, 0)
    whole = [g for g in gpus if not g.mig]
    assert [g.index for g in whole] == list(range(len(whole)))  # NVML order, every index once


def test_a_lost_gpu_is_listed_with_its_error_and_the_others_are_read(machine):
    machine({"gpus": [{}, {"lost": True}, {"utilization": [7]}]})
    gpus = nvml.discover(window=0)
    assert [g.error for g in gpus] == [None, "GPU is lost", None]
    assert (gpus[1].id, gpus[1].utilization, gpus[1].memory_total) == ("1", None, 0)
    assert gpus[2].utilization == 7.0


def test_nvml_that_cannot_count_the_gpus_is_a_one_line_failure(machine, monkeypatch):
    machine({"gpus": [{}]})

    def count_fails(self):
        raise pynvml.NVMLError_Unknown()

    monkeypatch.setattr(scripted_nvml.ScriptedNvml, "nvmlDeviceGetCount", count_fails)
    with pytest.raises(nvml.NvmlFailure, match=r"NVML cannot count the GPUs \(Unknown Error\); check `nvidia-smi`"):
        nvml.discover(window=0)


# --- peer-to-peer links --------------------------------------------------------------


def test_peer_links_tell_nvlink_from_pcie_from_no_path(machine):
    machine(
        {
            "p2p": "pcie",
            "links": [{"gpus": [1, 0], "p2p": "nvlink"}, {"gpus": [2, 3], "p2p": "none"}],
            "gpus": [{}, {}, {}, {}],
        }
    )
    gpus = nvml.discover(window=0)
    links = nvml.peer_links(gpus)
    assert links == {
        ("0", "1"): "nvlink",
        ("0", "2"): "pcie",
        ("0", "3"): "pcie",
        ("1", "2"): "pcie",
        ("1", "3"): "pcie",
        ("2", "3"): "none",
    }
    assert nvml.peer_links([gpus[3], gpus[0]]) == {("3", "0"): "pcie"}  # keyed in the order given


def test_a_scripted_machine_joins_its_gpus_by_nvlink_unless_told(machine):
    machine({"gpus": [{}, {}]})
    assert nvml.peer_links(nvml.discover(window=0)) == {("0", "1"): "nvlink"}


def test_peer_links_nvml_cannot_judge_are_unknown_and_mig_devices_are_never_asked(machine, monkeypatch):
    machine({"p2p": "unsupported", "gpus": [{}, {}, {"mig": [{"slot": 0}]}]})
    gpus = [gpu for gpu in nvml.discover(window=0) if not gpu.mig_enabled]
    asked = []
    original = ScriptedNvml.nvmlDeviceGetP2PStatus
    monkeypatch.setattr(ScriptedNvml, "nvmlDeviceGetP2PStatus", lambda self, a, b, i: asked.append(i) or original(self, a, b, i))
    assert nvml.peer_links(gpus) == {("0", "1"): "unknown", ("0", "2.0"): "unknown", ("1", "2.0"): "unknown"}
    assert len(asked) == 1  # the one pair of whole GPUs


def test_peer_links_of_one_gpu_open_no_nvml(tmp_path, monkeypatch):
    monkeypatch.setenv(nvml.SCRIPTED_GPUS_VAR, str(tmp_path / "absent.json"))  # opening it would raise
    gpu = nvml.Gpu("0", 0, "GPU-0", "H100", "?", 1, 0, None, ())
    assert nvml.peer_links([gpu]) == {}


@pytest.mark.parametrize(
    "spec",
    [
        {"p2p": "infiniband", "gpus": [{}, {}]},
        {"links": [{"gpus": [0, 2], "p2p": "pcie"}], "gpus": [{}, {}]},
        {"links": [{"gpus": [0, 0], "p2p": "pcie"}], "gpus": [{}, {}]},
        {"links": [{"gpus": [0, 1]}], "gpus": [{}, {}]},
        {"links": {"gpus": [0, 1], "p2p": "pcie"}, "gpus": [{}, {}]},
        {"nvlink": True, "gpus": [{}, {}]},
    ],
    ids=["unknown-p2p", "link-to-a-missing-gpu", "link-to-itself", "link-without-kind", "links-not-a-list", "unknown-key"],
)
def test_a_malformed_link_script_is_a_bad_script(machine, spec):
    path = machine(spec)
    with pytest.raises(scripted_nvml.BadScript) as excinfo:
        nvml.discover(window=0)
    assert str(path) in one_line_error(excinfo)


@pytest.mark.skipif(not Path("/proc/driver/nvidia/version").exists(), reason="needs an NVIDIA driver (run on a GPU machine)")
def test_real_nvml_says_how_every_pair_of_gpus_reaches_the_other(monkeypatch):
    monkeypatch.delenv(nvml.SCRIPTED_GPUS_VAR, raising=False)
    whole = [gpu for gpu in nvml.discover(window=0) if not gpu.mig and gpu.error is None]
    links = nvml.peer_links(whole)
    assert len(links) == len(whole) * (len(whole) - 1) // 2
    assert set(links.values()) <= {"nvlink", "pcie", "none", "unknown"}


# --- health readings -----------------------------------------------------------------


def test_each_health_reading_comes_from_its_gpu(machine):
    machine(
        {
            "gpus": [
                {},
                {
                    "ecc_uncorrected": 3,
                    "retired_pages_pending": True,
                    "remapped_rows": {"pending": True, "failure": True},
                    "throttle": ["gpu_idle", "hw_thermal"],
                    "pcie_width": 8,
                    "pcie_max_width": 16,
                },
            ]
        }
    )
    healthy, sick = (gpu.health for gpu in nvml.discover(window=0))
    assert healthy == nvml.Health(0, False, False, False, frozenset(), 16, 16)
    assert sick == nvml.Health(3, True, True, True, frozenset({"gpu_idle", "hw_thermal"}), 8, 16)


def test_every_clock_reason_name_maps_to_its_own_pynvml_bit(machine):
    machine({"gpus": [{"throttle": [name]} for name in nvml.CLOCK_REASONS]})
    assert [gpu.health.clock_reasons for gpu in nvml.discover(window=0)] == [frozenset({n}) for n in nvml.CLOCK_REASONS]


def test_readings_nvml_does_not_support_are_none_not_errors(machine):
    keys = ("ecc_uncorrected", "retired_pages_pending", "remapped_rows", "throttle", "pcie_width", "pcie_max_width")
    machine({"gpus": [dict.fromkeys(keys)]})
    (gpu,) = nvml.discover(window=0)
    assert gpu.error is None and gpu.health == nvml.Health()


def test_a_lost_gpu_has_health_lost_and_an_unreadable_one_does_not(machine, monkeypatch):
    machine({"gpus": [{"lost": True}, {}]})
    original = ScriptedNvml.nvmlDeviceGetHandleByIndex

    def no_permission_for_gpu_1(self, index):
        if index == 1:
            raise pynvml.NVMLError_NoPermission()
        return original(self, index)

    monkeypatch.setattr(ScriptedNvml, "nvmlDeviceGetHandleByIndex", no_permission_for_gpu_1)
    lost, unreadable = nvml.discover(window=0)
    assert lost.health == nvml.Health(lost=True)
    assert unreadable.error == "Insufficient Permissions" and unreadable.health == nvml.Health()


def test_a_gpu_lost_between_its_handle_and_its_health_reading_is_listed_as_lost(machine, monkeypatch):
    machine({"gpus": [{}, {}]})

    def lost(self, device):
        raise pynvml.NVMLError_GpuIsLost()

    monkeypatch.setattr(ScriptedNvml, "nvmlDeviceGetRemappedRows", lost)
    assert [(gpu.error, gpu.health.lost) for gpu in nvml.discover(window=0)] == [("GPU is lost", True)] * 2


def test_clock_reasons_fall_back_to_the_throttle_name_of_an_older_pynvml_or_driver(machine, monkeypatch):
    machine({"gpus": [{"throttle": ["sw_thermal"]}]})

    def older_driver(self, device):
        raise pynvml.NVMLError_FunctionNotFound()

    monkeypatch.setattr(ScriptedNvml, "nvmlDeviceGetCurrentClocksEventReasons", older_driver)
    assert nvml.discover(window=0)[0].health.clock_reasons == {"sw_thermal"}
    monkeypatch.delattr(ScriptedNvml, "nvmlDeviceGetCurrentClocksEventReasons")  # an older pynvml
    assert nvml.discover(window=0)[0].health.clock_reasons == {"sw_thermal"}


def test_a_mig_device_carries_the_health_of_its_gpu(machine):
    machine({"gpus": [{"ecc_uncorrected": 1, "mig": [{"slot": 0}]}]})
    parent, child = nvml.discover(window=0)
    assert parent.health.ecc_uncorrected == child.health.ecc_uncorrected == 1


def test_the_scripted_machine_reads_its_file_again_only_when_the_file_changes(machine, tmp_path):
    path = machine({"gpus": [{}]})
    scripted = ScriptedNvml.from_file(str(path))
    first = scripted.nvmlDeviceGetHandleByIndex(0)
    assert scripted.nvmlDeviceGetHandleByIndex(0) is first  # unchanged: not read again
    replacement = tmp_path / "next.json"
    replacement.write_text(json.dumps({"gpus": [{"ecc_uncorrected": 2}]}))
    os.replace(replacement, path)
    assert scripted.nvmlDeviceGetTotalEccErrors(scripted.nvmlDeviceGetHandleByIndex(0), 1, 0) == 2
    path.write_text("{broken")
    with pytest.raises(scripted_nvml.BadScript, match="fix the file or unset LAUNCHER_SCRIPTED_GPUS"):
        scripted.nvmlDeviceGetCount()


def test_the_health_reader_reads_the_run_gpus_again_and_again_and_says_lost(machine, tmp_path):
    path = machine({"gpus": [{}, {"throttle": ["hw_slowdown"]}]})
    gpus = nvml.discover(window=0)
    reader = nvml.HealthReader(gpus[1:])
    try:
        assert reader.read() == {"1": nvml.Health(0, False, False, False, frozenset({"hw_slowdown"}), 16, 16)}
        replacement = tmp_path / "next.json"
        replacement.write_text(json.dumps({"gpus": [{}, {"lost": True}]}))
        os.replace(replacement, path)
        assert reader.read() == {"1": nvml.Health(lost=True)}
    finally:
        reader.close()


@pytest.mark.skipif(not Path("/proc/driver/nvidia/version").exists(), reason="needs an NVIDIA driver (run on a GPU machine)")
def test_real_nvml_gives_health_readings_of_the_right_kind_for_every_gpu(monkeypatch):
    monkeypatch.delenv(nvml.SCRIPTED_GPUS_VAR, raising=False)
    gpus = [gpu for gpu in nvml.discover(window=0) if gpu.error is None]
    for gpu in gpus:
        health = gpu.health
        assert health.ecc_uncorrected is None or health.ecc_uncorrected >= 0
        assert health.clock_reasons is None or health.clock_reasons <= set(nvml.CLOCK_REASONS)
        assert all(lanes is None or lanes in (1, 2, 4, 8, 12, 16, 32) for lanes in (health.pcie_width, health.pcie_max_width))
        assert not health.lost
    reader = nvml.HealthReader([gpu for gpu in gpus if not gpu.mig_enabled])
    try:
        again = reader.read()
    finally:
        reader.close()
    assert {gpu_id: h.ecc_uncorrected for gpu_id, h in again.items()} == {
        g.id: g.health.ecc_uncorrected for g in gpus if not g.mig_enabled
    }
