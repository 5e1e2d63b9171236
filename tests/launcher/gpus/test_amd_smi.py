"""AMD GPU discovery (launcher/gpus/amd.py) run against scripted AMD machines
(launcher/gpus/scripted_amdsmi.py): what each GPU and compute partition is, utilization sampled
over a window, processes and their owners, health readings and what they mean, links, and the
errors for a missing amdsmi, a user without access to /dev/kfd, and a malformed script."""

from __future__ import annotations

import getpass
import json
import os
from pathlib import Path

import pytest

from support.processes import one_line_error
from launcher.gpus import amd, amd_common, health, scripted_amdsmi, scripted_common
from launcher.gpus.devices import Health, NoGpuDriver
from launcher.gpus.scripted_amdsmi import ScriptedAmdSmi

MIB = 1 << 20
NOT_HERE_PID = 4_000_000  # above any pid_max: a process of another container
HEALTHY = Health(0, False, None, None, frozenset(), 16, 16, pages_unretirable=0)


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Script the AMD machine discovery sees: write its JSON and point the seam at it."""

    def make(spec: object, name: str = "machine.json") -> Path:
        path = tmp_path / name
        if isinstance(spec, dict):
            spec = {"vendor": "amd"} | spec
        path.write_text(spec if isinstance(spec, str) else json.dumps(spec))
        monkeypatch.setenv(amd.SCRIPTED_GPUS_VAR, str(path))
        return path

    return make


def eight_mi300x_two_busy() -> dict:
    busy = {"utilization": [100, 96], "memory_used_mib": 150000, "processes": [{"pid": NOT_HERE_PID, "memory_mib": 150000}]}
    return {"gpus": [busy if i in (2, 5) else {} for i in range(8)]}


def test_eight_mi300x_are_eight_whole_amd_devices_in_amd_smi_order(machine):
    machine(eight_mi300x_two_busy())
    gpus = amd.discover(window=0, samples=4)
    assert [gpu.id for gpu in gpus] == [str(i) for i in range(8)]
    assert {gpu.vendor for gpu in gpus} == {"amd"}
    assert len({gpu.uuid for gpu in gpus}) == 8 and all(gpu.uuid.startswith("GPU-") for gpu in gpus)
    assert len({gpu.pci_bus_id for gpu in gpus}) == 8
    for i, gpu in enumerate(gpus):
        assert gpu.index == i and gpu.name == "AMD Instinct MI300X"
        assert gpu.memory_total == 196592 * MIB
        assert not gpu.mig and not gpu.mig_enabled and gpu.error is None
        assert gpu.health == HEALTHY
    assert [gpu.id for gpu in gpus if gpu.utilization] == ["2", "5"]
    assert gpus[2].utilization == pytest.approx(98.0)
    assert gpus[2].memory_used == 150000 * MIB
    assert [(p.pid, p.memory, p.user) for p in gpus[5].processes] == [(NOT_HERE_PID, 150000 * MIB, None)]


def test_a_whole_gpus_uuid_is_rocrs_gpu_form_of_its_unique_id(machine):
    machine({"gpus": [{"unique_id": "0x8D1457E2C20F59D2", "uuid": "d2ff74a1-0000-1000-8014-57e2c20f59d2"}]})
    (gpu,) = amd.discover(window=0)
    assert gpu.uuid == "GPU-8d1457e2c20f59d2"


def test_a_gpu_without_a_unique_id_keeps_amd_smis_uuid(machine):
    machine({"gpus": [{"unique_id": "N/A", "uuid": "d2ff74a1-0000-1000-8014-57e2c20f59d2"}]})
    assert amd.discover(window=0)[0].uuid == "d2ff74a1-0000-1000-8014-57e2c20f59d2"


def test_utilization_is_averaged_over_the_window_and_na_is_unknown(machine):
    machine({"gpus": [{"utilization": [0, 100, 0, 100, 0]}, {"utilization": None}, {"utilization": [80]}]})
    gpus = amd.discover(window=0, samples=5)
    assert [gpu.utilization for gpu in gpus] == [pytest.approx(40.0), None, pytest.approx(80.0)]


def test_a_process_of_this_container_is_reported_with_its_owner(machine):
    machine({"gpus": [{"processes": [{"pid": os.getpid(), "memory_mib": 1024}]}]})
    (process,) = amd.discover(window=0)[0].processes
    assert (process.pid, process.memory, process.user) == (os.getpid(), 1024 * MIB, getpass.getuser())


def test_a_gpu_in_cpx_mode_is_listed_whole_then_each_partition_as_a_device(machine):
    machine(
        {
            "gpus": [
                {},
                {
                    "pci_bus_id": "0000:26:00.0",
                    "partition": {"compute": "CPX", "memory": "NPS4"},
                    "partitions": [{"memory_used_mib": 1000, "utilization": [60], "processes": [{"pid": NOT_HERE_PID}]}],
                },
                {},
            ]
        }
    )
    gpus = amd.discover(window=0)
    assert [gpu.id for gpu in gpus] == ["0", "1", *(f"1.{slot}" for slot in range(8)), "2"]
    parent, partitions = gpus[1], gpus[2:10]
    assert parent.mig_enabled and not parent.mig and parent.name == "AMD Instinct MI300X (CPX/NPS4)"
    assert parent.memory_total == sum(p.memory_total for p in partitions) and parent.memory_used == 1000 * MIB
    assert len({p.uuid for p in partitions}) == 8 and parent.uuid not in {p.uuid for p in partitions}
    for partition in partitions:
        assert partition.mig and not partition.mig_enabled and partition.index == 1
        assert partition.pci_bus_id == "0000:26:00.0"
    assert partitions[0].utilization == 60.0 and partitions[1].utilization == 0.0
    assert [p.pid for p in partitions[0].processes] == [NOT_HERE_PID]


@pytest.mark.parametrize("mode, count", [("DPX", 2), ("QPX", 4)])
def test_each_compute_partition_mode_makes_as_many_devices_as_it_has_partitions(machine, mode, count):
    machine({"gpus": [{"partition": {"compute": mode}}]})
    assert [gpu.id for gpu in amd.discover(window=0)] == ["0", *(f"0.{slot}" for slot in range(count))]


def test_a_partition_carries_the_health_of_its_gpu(machine):
    machine({"gpus": [{"ecc_uncorrected": 1, "partition": {"compute": "DPX"}}]})
    assert [gpu.health.ecc_uncorrected for gpu in amd.discover(window=0)] == [1, 1, 1]


# --- ROCr's device numbers and a partition's memory ---------------------------------------


def test_the_runtime_index_is_rocrs_kfd_node_order_not_amd_smis_order(machine):
    machine({"gpus": [{"kfd_nodes": [4]}, {"kfd_nodes": [2]}, {"kfd_nodes": [3]}]})
    assert [(gpu.id, gpu.runtime_index) for gpu in amd.discover(window=0)] == [("0", 2), ("1", 0), ("2", 1)]


def test_every_compute_partition_is_a_rocr_device_of_its_own_and_a_partitioned_gpu_is_none(machine):
    machine({"gpus": [{"kfd_nodes": [9]}, {"partition": {"compute": "DPX"}, "kfd_nodes": [3, 2]}, {}]})
    gpus = amd.discover(window=0)
    assert [(gpu.id, gpu.runtime_index) for gpu in gpus] == [("0", 3), ("1", None), ("1.0", 1), ("1.1", 0), ("2", 2)]


def test_a_lost_gpu_still_counts_among_rocrs_devices(machine):
    machine({"gpus": [{}, {"lost": True}, {}, {}]})
    assert [gpu.runtime_index for gpu in amd.discover(window=0)] == [0, None, 2, 3]


@pytest.mark.parametrize(
    "nodes, indices",
    [
        ([5, 3, 4], [2, 0, 1]),
        ([2, None, 4], [0, None, 2]),  # the unreadable one fills the gap
        ([2, 3, None], [0, 1, None]),  # after every other, in AMD SMI's order too
        ([None, 3, 4], [None, None, None]),  # node 2 or node 5: the others' numbers depend on it
        ([2, None, None, 4], [None, None, None, None]),  # two unreadable, one gap
        ([None, None], [None, None]),
    ],
)
def test_runtime_indices_are_known_only_where_every_unreadable_devices_place_is(nodes, indices):
    assert amd_common.runtime_indices(nodes) == indices


def test_cpx_partitions_sharing_one_nps1_pool_each_get_an_eighth_of_it(machine):
    whole = 196592
    machine({"gpus": [{"partition": {"compute": "CPX", "memory": "NPS1"}, "partitions": [{"memory_total_mib": whole}] * 8}]})
    parent, *partitions = amd.discover(window=0)
    assert {p.memory_total for p in partitions} == {whole * MIB // 8}
    assert parent.memory_total == whole * MIB


def test_cpx_partitions_in_nps4_share_each_quarter_by_two_and_unequal_reports_are_taken_as_they_are(machine):
    quarter = 196592 // 4
    machine({"gpus": [{"partition": {"compute": "CPX", "memory": "NPS4"}, "partitions": [{"memory_total_mib": quarter}] * 8}]})
    gpus = amd.discover(window=0)
    assert {gpu.memory_total for gpu in gpus if gpu.index == 0 and gpu.mig} == {quarter * MIB // 2}
    machine({"gpus": [{"partition": {"compute": "DPX"}, "partitions": [{"memory_total_mib": 1000}, {"memory_total_mib": 3000}]}]})
    assert [gpu.memory_total for gpu in amd.discover(window=0)] == [4000 * MIB, 1000 * MIB, 3000 * MIB]


# --- an older amdsmi ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "missing",
    [
        "amdsmi_get_gpu_kfd_info",
        "amdsmi_get_gpu_compute_partition",
        "amdsmi_get_gpu_memory_partition",
        "amdsmi_get_gpu_bad_page_info",
        "amdsmi_get_pcie_info",
        "amdsmi_get_gpu_process_list",
        "amdsmi_get_gpu_total_ecc_count",
    ],
)
def test_an_amdsmi_without_an_optional_function_reads_it_as_unknown(machine, monkeypatch, missing):
    machine({"gpus": [{}, {"partition": {"compute": "DPX"}}]})
    monkeypatch.delattr(ScriptedAmdSmi, missing)
    gpus = amd.discover(window=0)
    assert [gpu.id for gpu in gpus] == ["0", "1", "1.0", "1.1"] and all(gpu.error is None for gpu in gpus)
    if missing == "amdsmi_get_gpu_kfd_info":
        assert {gpu.runtime_index for gpu in gpus} == {None}
    reader = amd.HealthReader(gpus)
    try:
        assert set(reader.read()) == {gpu.id for gpu in gpus}
    finally:
        reader.close()


def test_an_older_amdsmis_no_bad_pages_sentence_is_no_bad_pages_and_an_unknown_status_is_unknown(machine, monkeypatch):
    machine({"gpus": [{}]})
    monkeypatch.setattr(ScriptedAmdSmi, "amdsmi_get_gpu_bad_page_info", lambda self, handle: "No bad pages found.")
    (gpu,) = amd.discover(window=0)
    assert (gpu.health.retired_pages_pending, gpu.health.pages_unretirable) == (False, 0)
    pages = [{"page_address": 4096, "page_size": 4096, "status": "PENDING"}, {"page_address": 8192, "status": "N/A"}]
    monkeypatch.setattr(ScriptedAmdSmi, "amdsmi_get_gpu_bad_page_info", lambda self, handle: pages)
    (gpu,) = amd.discover(window=0)
    assert (gpu.health.retired_pages_pending, gpu.health.pages_unretirable) == (None, None)
    pages.pop()
    (gpu,) = amd.discover(window=0)
    assert (gpu.health.retired_pages_pending, gpu.health.pages_unretirable) == (True, 0)


# --- health -----------------------------------------------------------------------------


def test_each_health_reading_comes_from_its_gpu_and_amd_throttle_names_become_clock_reasons(machine):
    machine(
        {
            "gpus": [
                {},
                {
                    "ecc_uncorrected": 3,
                    "bad_pages": {"pending": 2, "retired": 5, "unreservable": 1},
                    "throttle": ["ppt", "socket_thermal", "prochot"],
                    "pcie_width": 8,
                    "pcie_max_width": 16,
                },
            ]
        }
    )
    healthy, sick = (gpu.health for gpu in amd.discover(window=0))
    assert healthy == HEALTHY
    assert sick == Health(
        3, True, None, None, frozenset({"sw_power_cap", "hw_thermal", "hw_slowdown"}), 8, 16, pages_unretirable=1
    )


def test_a_busy_gpu_at_its_power_cap_is_healthy_and_hot_memory_is_a_thermal_slowdown(machine):
    machine({"gpus": [{"throttle": ["ppt"]}, {"throttle": ["hbm_thermal"]}, {"throttle": ["vr_thermal"]}]})
    capped, hot, regulator = (health.assess(gpu.health) for gpu in amd.discover(window=0))
    assert capped.healthy
    assert hot.slowed == ("clocks: thermal slowdown",)
    assert regulator.slowed == ("clocks: hardware slowdown",)


def test_retired_bad_pages_are_healthy_and_a_pending_one_needs_a_reset(machine):
    machine({"gpus": [{"bad_pages": {"retired": 40}}, {"bad_pages": {"pending": 1}}, {"bad_pages": {"unreservable": 2}}]})
    retired, pending, unreservable = (health.assess(gpu.health) for gpu in amd.discover(window=0))
    assert retired.healthy
    assert pending.failing == ("retired pages pending",)
    assert unreservable.failing == ("2 bad pages that could not be retired",)


def test_readings_amd_smi_does_not_support_are_none_not_errors(machine):
    machine({"gpus": [dict.fromkeys(("ecc_uncorrected", "bad_pages", "throttle", "pcie_width", "pcie_max_width"))]})
    (gpu,) = amd.discover(window=0)
    assert gpu.error is None and gpu.health == Health()


def test_an_amdsmi_without_violation_status_has_unknown_clock_reasons(machine, monkeypatch):
    machine({"gpus": [{"throttle": ["socket_thermal"]}]})
    monkeypatch.delattr(ScriptedAmdSmi, "amdsmi_get_violation_status")  # before ROCm 6.3
    assert amd.discover(window=0)[0].health.clock_reasons is None


def test_a_lost_gpu_is_listed_with_its_error_and_health_lost_and_the_others_are_read(machine):
    machine({"gpus": [{}, {"lost": True}, {"utilization": [7]}]})
    gpus = amd.discover(window=0)
    assert [gpu.error is None for gpu in gpus] == [True, False, True]
    assert "AMDSMI_STATUS_IO" in gpus[1].error and gpus[1].health == Health(lost=True)
    assert (gpus[1].id, gpus[1].memory_total) == ("1", 0)
    assert gpus[2].utilization == 7.0


def test_the_health_reader_reads_the_run_gpus_again_and_says_lost(machine, tmp_path):
    path = machine({"gpus": [{}, {"throttle": ["prochot"]}]})
    gpus = amd.discover(window=0)
    reader = amd.HealthReader(gpus[1:])
    try:
        assert reader.read() == {"1": Health(0, False, None, None, frozenset({"hw_slowdown"}), 16, 16, pages_unretirable=0)}
        replacement = tmp_path / "next.json"
        replacement.write_text(json.dumps({"vendor": "amd", "gpus": [{}, {"lost": True}]}))
        os.replace(replacement, path)
        assert reader.read() == {"1": Health(lost=True)}
    finally:
        reader.close()


def test_the_health_reader_sees_a_pending_bad_page_appear_mid_run_as_news(machine, tmp_path):
    path = machine({"gpus": [{}]})
    (gpu,) = amd.discover(window=0)
    reader = amd.HealthReader([gpu])
    try:
        before = reader.read()["0"]
        path.write_text(json.dumps({"vendor": "amd", "gpus": [{"bad_pages": {"pending": 1, "unreservable": 1}}]}))
        now = reader.read()["0"]
    finally:
        reader.close()
    assert health.changes(before, now) == [
        f"retired pages pending: {health.FAILING}",
        f"1 new bad page that could not be retired: {health.FAILING}",
    ]


# --- links ------------------------------------------------------------------------------


def test_peer_links_tell_xgmi_from_pcie_from_no_path(machine):
    machine(
        {"p2p": "pcie", "links": [{"gpus": [1, 0], "p2p": "xgmi"}, {"gpus": [2, 3], "p2p": "none"}], "gpus": [{}, {}, {}, {}]}
    )
    gpus = amd.discover(window=0)
    assert amd.peer_links(gpus) == {
        ("0", "1"): "xgmi",
        ("0", "2"): "pcie",
        ("0", "3"): "pcie",
        ("1", "2"): "pcie",
        ("1", "3"): "pcie",
        ("2", "3"): "none",
    }
    assert amd.peer_links([gpus[3], gpus[0]]) == {("3", "0"): "pcie"}


def test_a_scripted_amd_machine_joins_its_gpus_by_xgmi_and_partitions_are_unknown(machine):
    machine({"gpus": [{}, {}, {"partition": {"compute": "DPX"}}]})
    gpus = [gpu for gpu in amd.discover(window=0) if not gpu.mig_enabled]
    assert amd.peer_links(gpus) == {
        ("0", "1"): "xgmi",
        ("0", "2.0"): "unknown",
        ("0", "2.1"): "unknown",
        ("1", "2.0"): "unknown",
        ("1", "2.1"): "unknown",
        ("2.0", "2.1"): "unknown",
    }


def test_links_amd_smi_cannot_judge_are_unknown(machine):
    machine({"p2p": "unsupported", "gpus": [{}, {}]})
    assert amd.peer_links(amd.discover(window=0)) == {("0", "1"): "unknown"}


# --- errors -----------------------------------------------------------------------------


def test_a_machine_without_amdsmi_raises_no_gpu_driver_and_is_not_available(machine):
    machine({"driver": False, "gpus": [{}]})
    assert not amd.available()
    with pytest.raises(NoGpuDriver, match="cannot import amdsmi"):
        amd.discover(window=0)


def test_amdsmi_refused_dev_kfd_is_one_line_naming_the_groups_to_join(machine):
    machine({"init_error": "no_perm", "gpus": [{}]})
    assert amd.available()  # installed: the launch must say why it cannot use it, not fall back
    with pytest.raises(amd.AmdSmiPermission) as excinfo:
        amd.discover(window=0)
    message = one_line_error(excinfo)
    assert "permission denied" in message and "render and video groups" in message and "/dev/kfd" in message
    assert "--device cpu" in message
    with pytest.raises(amd.AmdSmiPermission):
        amd.HealthReader([])


def test_amdsmi_without_the_amdgpu_driver_is_no_gpu_driver(machine):
    machine({"init_error": "driver_not_loaded", "gpus": [{}]})
    with pytest.raises(NoGpuDriver, match="no amdgpu driver"):
        amd.discover(window=0)


def test_peer_links_without_access_are_unknown_not_an_error(machine):
    machine({"init_error": "no_perm", "gpus": [{}, {}]})
    gpus = [amd.Gpu(str(i), i, f"GPU-{i}", "MI300X", "?", 1, 0, None, (), vendor="amd") for i in range(2)]
    assert amd.peer_links(gpus) == {("0", "1"): "unknown"}


@pytest.mark.parametrize(
    "spec",
    [
        {"gpus": [{"name": "x", "colour": "green"}]},
        {"gpus": [{"partition": {"compute": "CPX", "colour": "green"}}]},
        {"gpus": [{"partition": {"compute": "CPX"}, "partitions": [{"slot": 0}]}]},
        {"gpus": [{"partition": {"compute": "XPX"}}]},
        {"gpus": [{"partitions": [{}]}]},
        {"gpus": [{"bad_pages": {"pending": -1}}]},
        {"gpus": [{"bad_pages": {"spare": 1}}]},
        {"gpus": [{"throttle": ["hw_thermal"]}]},
        {"gpus": [{"remapped_rows": None}]},
        {"gpus": [{"pcie_width": 0}]},
        {"init_error": "busy", "gpus": [{}]},
        {"p2p": "nvlink", "gpus": [{}, {}]},
        {"xgmi": True, "gpus": [{}]},
        {"gpus": [{"partition": {"compute": "DPX"}, "kfd_nodes": [2]}]},
    ],
    ids=[
        "unknown-gpu-key",
        "unknown-partition-key",
        "unknown-partition-entry-key",
        "unknown-compute-mode",
        "partitions-of-an-spx-gpu",
        "negative-pending-pages",
        "unknown-bad-page-kind",
        "nvidia-throttle-name",
        "nvidia-only-health-key",
        "no-pcie-lanes",
        "unknown-init-error",
        "nvlink-on-amd",
        "unknown-machine-key",
        "a-kfd-node-per-partition",
    ],
)
def test_a_malformed_amd_script_is_one_line_naming_the_file_and_the_fix(machine, spec):
    path = machine(spec)
    with pytest.raises(scripted_common.BadScript) as excinfo:
        amd.discover(window=0)
    message = one_line_error(excinfo)
    assert str(path) in message and "fix the file or unset LAUNCHER_SCRIPTED_GPUS" in message


def test_the_scripted_vendor_is_read_from_the_file_and_nvidia_by_default(tmp_path):
    nvidia, amd_file, other = (tmp_path / f"{name}.json" for name in ("nvidia", "amd", "other"))
    nvidia.write_text(json.dumps({"gpus": []}))
    amd_file.write_text(json.dumps({"vendor": "amd", "gpus": []}))
    other.write_text(json.dumps({"vendor": "intel", "gpus": []}))
    assert scripted_common.scripted_vendor(str(nvidia)) == "nvidia"
    assert scripted_common.scripted_vendor(str(amd_file)) == "amd"
    with pytest.raises(scripted_common.BadScript, match="vendor must be one of nvidia, amd"):
        scripted_common.scripted_vendor(str(other))


def test_an_amd_file_is_refused_by_the_nvidia_reader_and_an_nvidia_one_by_the_amd_reader(machine, tmp_path):
    from launcher.gpus.scripted_nvml import ScriptedNvml

    amd_file = machine({"gpus": [{}]})
    with pytest.raises(scripted_common.BadScript, match="not read through NVML"):
        ScriptedNvml.from_file(str(amd_file))
    nvidia_file = tmp_path / "nvidia.json"
    nvidia_file.write_text(json.dumps({"gpus": [{}]}))
    with pytest.raises(scripted_common.BadScript, match='needs "vendor": "amd"'):
        scripted_amdsmi.ScriptedAmdSmi.from_file(str(nvidia_file))


def test_amdsmi_library_is_the_scripted_machine_only_for_an_amd_file(machine, monkeypatch):
    machine({"gpus": [{}]})
    assert isinstance(amd.amdsmi_library(), ScriptedAmdSmi)
    monkeypatch.delenv(amd.SCRIPTED_GPUS_VAR)
    try:
        import amdsmi  # noqa: F401
    except ImportError:
        with pytest.raises(NoGpuDriver, match="cannot import amdsmi"):
            amd.amdsmi_library()
