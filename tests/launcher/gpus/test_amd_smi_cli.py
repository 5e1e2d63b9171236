"""The amd-smi JSON reader (launcher/gpus/amd_smi_cli.py), used where ROCm's amdsmi package is
missing but its command is installed: on outputs of an 8 x MI300X box built from AMD's documented
shapes, not recorded on hardware (tests/launcher/gpus/data/amd_smi/, two GPUs busy, one failing), and through a
stand-in amd-smi command on PATH for how it is run, how often, and how its failures read."""

from __future__ import annotations

import copy
import json
import os
import stat
import sys
import threading
from pathlib import Path

import pytest

from support.processes import one_line_error
from launcher.gpus import amd, amd_smi_cli, health
from launcher.gpus.devices import Gpu, Health, NoGpuDriver

MIB = 1 << 20
RECORDED = Path(__file__).parent / "data" / "amd_smi"


def recorded(name: str) -> object:
    return json.loads((RECORDED / f"{name}.json").read_text())


def runner(outputs: dict[str, object] | None = None, calls: list[list[str]] | None = None):
    """amd-smi as tests/launcher/gpus/data/amd_smi/ has it: each command's output by its first argument (`metric --usage` too)."""
    outputs = outputs or {}

    def run(args: list[str]) -> object:
        if calls is not None:
            calls.append(args)
        return copy.deepcopy(outputs[args[0]]) if args[0] in outputs else recorded(args[0])

    return run


def test_the_recorded_mi300x_box_reads_as_eight_amd_gpus_two_busy_one_failing():
    calls: list[list[str]] = []
    gpus = amd_smi_cli.discover(window=0, samples=3, runner=runner(calls=calls))
    assert [gpu.id for gpu in gpus] == [str(i) for i in range(8)]
    listed = amd_smi_cli.records(recorded("list"))
    for gpu, entry in zip(gpus, listed, strict=True):
        assert gpu.vendor == "amd" and gpu.name == "AMD Instinct MI300X" and not gpu.mig
        assert gpu.pci_bus_id == entry["bdf"]
        assert gpu.memory_total == 196592 * MIB
        assert gpu.uuid.startswith("GPU-") and len(gpu.uuid) == len("GPU-") + 16
    assert gpus[0].uuid == "GPU-8d1457e2c20f59d2"  # the asic_serial, as ROCr names the GPU
    assert [gpu.id for gpu in gpus if gpu.utilization] == ["2", "5"]
    assert (gpus[2].utilization, gpus[5].utilization) == (100.0, 97.0)
    assert gpus[2].memory_used == 171304 * MIB
    assert [(p.pid, p.memory) for p in gpus[5].processes] == [(318530, 61440 * MIB), (318531, 27080 * MIB)]
    assert gpus[0].processes == ()  # "No running processes detected"
    verdicts = [health.assess(gpu.health) for gpu in gpus]
    assert [gpu.id for gpu, verdict in zip(gpus, verdicts, strict=True) if not verdict.healthy] == ["7"]
    assert verdicts[7].failing == ("1 uncorrectable ECC error (volatile)", "retired pages pending")
    assert verdicts[7].slowed == ("clocks: thermal slowdown",)
    assert gpus[2].health.clock_reasons == {"sw_power_cap"}  # busy at its power cap: healthy
    assert gpus[0].health == Health(0, False, None, None, frozenset(), 16, 16, pages_unretirable=0)
    assert calls.count(["metric", "--usage"]) == 2  # the first reading is the full metric's


def test_every_command_runs_as_an_argument_list_with_json():
    calls: list[list[str]] = []
    amd_smi_cli.discover(window=0, samples=1, runner=runner(calls=calls))
    assert sorted(call[0] for call in calls) == ["bad-pages", "list", "metric", "process", "static"]


def test_the_bare_list_output_of_an_older_amd_smi_reads_the_same():
    bare = {name: amd_smi_cli.records(recorded(name)) for name in ("static", "metric")}
    assert amd_smi_cli.discover(0, 1, runner(bare)) == amd_smi_cli.discover(0, 1, runner())


def test_readings_amd_smi_says_n_a_are_unknown():
    metric = recorded("metric")
    for record in amd_smi_cli.records(metric):
        record.update(ecc="N/A", pcie="N/A", throttle="N/A", usage="N/A")
    pages = [{"gpu": i, "retired": "N/A", "pending": "N/A", "un_res": "N/A"} for i in range(8)]
    gpus = amd_smi_cli.discover(0, 1, runner({"metric": metric, "bad-pages": pages}))
    assert {gpu.utilization for gpu in gpus} == {None}
    assert {gpu.health for gpu in gpus} == {Health(pcie_max_width=16)}


def test_a_cpx_gpu_is_listed_whole_then_its_partitions():
    listing = amd_smi_cli.records(recorded("list"))
    static = recorded("static")
    parts = []
    for slot in range(8):  # GPU 1 in CPX: amd-smi numbers its 8 partitions 1..8, the others after
        parts.append(dict(listing[1], gpu=1 + slot, partition_id=slot, uuid=f"{slot:02x}ff74a1-cpx"))
    cpx_listing = [listing[0], *parts, *(dict(e, gpu=e["gpu"] + 7) for e in listing[2:])]
    renumber = {0: 0, **{1 + slot: 1 for slot in range(8)}, **{i + 7: i for i in range(2, 8)}}

    def spread(payload: object) -> list[dict]:
        by_gpu = amd_smi_cli.by_gpu(payload)
        return [dict(by_gpu[source], gpu=number) for number, source in renumber.items()]

    cpx_static = spread(static)
    cpx_static[1]["partition"] = {"compute_partition": "CPX", "memory_partition": "NPS1", "partition_id": 0}
    outputs = {
        "list": cpx_listing,
        "static": cpx_static,
        "metric": spread(recorded("metric")),
        "process": spread(recorded("process")),
        "bad-pages": spread(recorded("bad-pages")),
    }
    gpus = amd_smi_cli.discover(0, 1, runner(outputs))
    assert [gpu.id for gpu in gpus] == ["0", "1", *(f"1.{slot}" for slot in range(8)), *map(str, range(2, 8))]
    parent, first = gpus[1], gpus[2]
    assert parent.mig_enabled and parent.name == "AMD Instinct MI300X (CPX/NPS1)" and parent.uuid == ""
    assert first.mig and first.index == 1 and first.uuid == "00ff74a1-cpx"
    assert gpus[-1].health.ecc_uncorrected == 1  # the failing GPU 7 is still 7
    # NPS1: the 8 partitions share the GPU's one pool, which each reports whole
    assert {gpu.memory_total for gpu in gpus[2:10]} == {196592 * MIB // 8}
    assert parent.memory_total == 196592 * MIB


def test_the_runtime_index_is_the_kfd_node_order_amd_smi_list_gives():
    assert [gpu.runtime_index for gpu in amd_smi_cli.discover(0, 1, runner())] == list(range(8))
    listing = amd_smi_cli.records(recorded("list"))
    listing[0]["node_id"], listing[7]["node_id"] = listing[7]["node_id"], listing[0]["node_id"]
    listing[3]["node_id"] = "N/A"  # a lost GPU: still one of ROCr's devices
    gpus = amd_smi_cli.discover(0, 1, runner({"list": listing}))
    assert [gpu.runtime_index for gpu in gpus] == [7, 1, 2, None, 4, 5, 6, 0]


def test_the_health_reader_reads_metric_and_bad_pages_and_says_a_vanished_gpu_is_lost():
    gpus = amd_smi_cli.discover(0, 1, runner())
    metric = recorded("metric")
    outputs: dict[str, object] = {"metric": metric}
    reader = amd_smi_cli.HealthReader(gpus[6:], runner(outputs))
    assert reader.read()["7"].ecc_uncorrected == 1 and reader.read()["6"] == gpus[6].health
    outputs["metric"] = {"gpu_data": [r for r in amd_smi_cli.records(metric) if r["gpu"] != 6]}
    assert reader.read()["6"] == Health(lost=True)
    reader.close()


def test_peer_links_come_from_the_topology_link_types():
    gpus = amd_smi_cli.discover(0, 1, runner())
    links = amd_smi_cli.peer_links(gpus, runner())
    assert len(links) == 28 and set(links.values()) == {"xgmi"}
    topology = recorded("topology")
    for record in topology:
        for link in record["links"]:
            if {record["gpu"], link["gpu"]} == {0, 1}:
                link["link_type"], link["link_status"] = "PCIE", "DISABLED"
            elif {record["gpu"], link["gpu"]} == {0, 2}:
                link["link_type"] = "PCIE"
    links = amd_smi_cli.peer_links(gpus[:3], runner({"topology": topology}))
    assert links == {("0", "1"): "none", ("0", "2"): "pcie", ("1", "2"): "xgmi"}


# --- running the command -------------------------------------------------------------------


@pytest.fixture
def fake_amd_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An amd-smi on PATH that answers from the recordings, or as told: (stdout file, stderr, exit)."""

    def make(behaviour: str = "recorded") -> Path:
        log = tmp_path / "argv.log"
        script = tmp_path / "bin" / "amd-smi"
        script.parent.mkdir(exist_ok=True)
        script.write_text(
            f"#!{sys.executable}\n"
            "import json, pathlib, sys\n"
            f"pathlib.Path({str(log)!r}).open('a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
            f"behaviour = {behaviour!r}\n"
            "if behaviour == 'denied':\n"
            "    sys.stderr.write('AMD-SMI: Permission Denied - Command requires elevation\\n'); sys.exit(1)\n"
            "if behaviour == 'garbled':\n"
            "    print('ERROR:root:Unable to detect any GPU devices'); sys.exit(3)\n"
            f"print(pathlib.Path({str(RECORDED)!r}, sys.argv[1] + '.json').read_text())\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv(amd.SCRIPTED_GPUS_VAR, raising=False)
        return log

    return make


def test_amd_smi_runs_with_an_argument_list_and_json(fake_amd_smi):
    log = fake_amd_smi()
    assert amd_smi_cli.run(["static"]) == recorded("static")
    assert [json.loads(line) for line in log.read_text().splitlines()] == [["static", "--json"]]


def test_amd_smi_refused_the_gpus_is_one_permission_line(fake_amd_smi):
    fake_amd_smi("denied")
    with pytest.raises(amd.AmdSmiPermission) as excinfo:
        amd_smi_cli.run(["list"])
    message = one_line_error(excinfo)
    assert "`amd-smi list --json` cannot open the GPUs" in message and "render and video groups" in message


def test_amd_smi_printing_no_json_is_one_failure_line(fake_amd_smi):
    fake_amd_smi("garbled")
    with pytest.raises(amd.AmdSmiFailure, match=r"`amd-smi list --json` printed no JSON \(exit 3"):
        amd_smi_cli.run(["list"])


def test_amd_smi_missing_is_no_gpu_driver(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NoGpuDriver):
        amd_smi_cli.run(["list"])


def without_amdsmi() -> None:
    try:
        import amdsmi  # noqa: F401
    except ImportError:
        return
    pytest.skip("this machine has the amdsmi package")


def test_discovery_through_amd_smi_runs_six_processes_and_samples_twice(fake_amd_smi):
    log = fake_amd_smi()
    without_amdsmi()
    amd.discover(window=0)
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(run[0] for run in runs) == ["bad-pages", "list", "metric", "metric", "process", "static"]
    assert ["metric", "--usage", "--json"] in runs


def test_the_health_watch_through_amd_smi_waits_its_longer_interval_between_readings(fake_amd_smi):
    fake_amd_smi()
    without_amdsmi()
    gpus = amd.discover(window=0, samples=1)
    waits: list[float | None] = []

    class StopAfterOneWait(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(timeout)
            self.set()
            return True

    watch = health.HealthWatch(gpus[:1], ["GPU0"], lambda line: None, interval=0.01)
    watch._stop = StopAfterOneWait()
    with watch:
        watch._thread.join(timeout=30)
    assert watch.polls == 1 and waits == [amd_smi_cli.HEALTH_INTERVAL_S]


def test_without_the_amdsmi_package_discovery_reads_the_amd_smi_command(fake_amd_smi):
    fake_amd_smi()
    try:
        import amdsmi  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("this machine has the amdsmi package")
    gpus = amd.discover(window=0, samples=1)
    assert len(gpus) == 8 and all(isinstance(gpu, Gpu) and gpu.vendor == "amd" for gpu in gpus)
    assert amd.available()
    assert amd.peer_links(gpus[:2]) == {("0", "1"): "xgmi"}
    reader = amd.HealthReader(gpus)
    try:
        assert not health.assess(reader.read()["7"]).healthy
    finally:
        reader.close()
