"""Which GPUs each worker sees (launcher/gpus/visibility.py) on scripted machines: its own where
NVLink joins the run's GPUs, every run GPU of the node in local-rank order where some pair
reaches over PCIe only, and the environment a worker gets from it."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from support.processes import ROOT, launcher_env
from launcher.gpus import amd, claims, nvml, vendors
from launcher.gpus.devices import VISIBILITY_VARIABLES
from launcher.launch import make_workers
from launcher.gpus.request import DeviceError
from launcher.gpus.visibility import VISIBILITY_VAR
from launcher.gpus.placement import GpuOptions, Placement, place
from launcher.supervise.printer import Printer
from launcher.processes.worker import CUDA_DEVICE_INDEX_VAR
from pretrain.distributed import runtime

PRINT_DEVICES = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['LAUNCHER_CUDA_DEVICE_INDEX'], flush=True)"


@pytest.fixture(autouse=True)
def no_sampling_wait(monkeypatch):
    for backend in (nvml, amd):
        monkeypatch.setattr(backend, "UTILIZATION_WINDOW", 0.0)
    for variable in VISIBILITY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv(VISIBILITY_VAR, raising=False)


@pytest.fixture
def linked(tmp_path, monkeypatch, request):
    """linked(4, p2p="pcie", links=[(0, 1, "nvlink")], gpus={1: {...}}): a scripted machine of idle
    H100s whose pairs reach each other so, here and in the launchers a test starts; in a test that
    takes the `vendor` fixture, MI300Xs on its AMD run, with XGMI for NVLink."""
    vendor = request.getfixturevalue("vendor") if "vendor" in request.fixturenames else "nvidia"

    def make(count: int, p2p: str = "nvlink", links: tuple = (), gpus: dict | None = None) -> str:
        path = tmp_path / "machine.json"
        specs = [(gpus or {}).get(i, {}) for i in range(count)]
        kind = {"nvlink": "xgmi"} if vendor == "amd" else {}
        machine = {
            "vendor": vendor,
            "p2p": kind.get(p2p, p2p),
            "links": [{"gpus": [a, b], "p2p": kind.get(link, link)} for a, b, link in links],
            "gpus": specs,
        }
        path.write_text(json.dumps(machine))
        monkeypatch.setenv(nvml.SCRIPTED_GPUS_VAR, str(path))
        return str(path)

    return make


def uuid(index: int) -> str:
    return f"GPU-{index:08x}-0000-0000-0000-000000000000"


def placed(**options) -> tuple[Placement, list[str]]:
    console = io.StringIO()
    placement = place(GpuOptions(**options), Printer(console, None))
    placement.release()
    return placement, console.getvalue().splitlines()


def seen(placement: Placement) -> list[tuple[str | None, int]]:
    """(CUDA_VISIBLE_DEVICES, cuda index) of each local rank."""
    return [(placement.visible_devices(r), placement.cuda_device_index(r)) for r in range(placement.world_size)]


# --- the launcher's choice -------------------------------------------------------------


def visible(index: int) -> str:
    """What the scripted machine's GPU `index` is made visible by (its UUID on NVIDIA: uuid())."""
    return vendors.backend(None).discover(window=0)[index].visible_id


def test_gpus_joined_by_nvlink_keep_one_gpu_per_worker_and_say_so(linked, vendor):
    linked(4)
    placement, said = placed(device="cuda")
    assert seen(placement) == [(visible(i), 0) for i in range(4)]
    link, library = {"nvidia": ("NVLink", "NCCL"), "amd": ("XGMI", "RCCL")}[vendor]
    assert said[-1] == (
        f"launcher: GPUs 0, 1, 2, 3 are joined by {link}: each worker sees only its own GPU "
        f"({library} reaches the others over it)"
    )


def test_gpus_over_pcie_only_are_all_seen_by_every_worker_in_local_rank_order(linked, vendor):
    linked(4, p2p="pcie", gpus={1: {"utilization": [90]}})  # GPU 1 busy: the run is 0, 2, 3
    placement, said = placed(device="cuda")
    every = ",".join(visible(i) for i in (0, 2, 3))
    assert seen(placement) == [(every, 0), (every, 1), (every, 2)]
    assert [placement.label(r) for r in range(3)] == ["GPU0", "GPU2", "GPU3"]  # labels stay the GPUs' own
    assert said[-1] == (
        "launcher: GPU pairs 0-2, 0-3, 2-3 reach each other over PCIe only: each worker sees the 3 run GPUs of this "
        "node and uses cuda:LOCAL_RANK (NCCL's peer-to-peer over PCIe needs to see the peer)"
    )


def test_one_pair_over_pcie_among_nvlink_pairs_shows_every_worker_the_run_gpus(linked, vendor):
    linked(4, links=[(1, 2, "pcie")])
    placement, said = placed(gpus="3,1,2")
    every = ",".join(visible(i) for i in (1, 2, 3))
    assert seen(placement) == [(every, 0), (every, 1), (every, 2)]
    assert "GPUs 1 and 2 reach each other over PCIe only" in said[-1]


def test_one_gpu_sees_itself_and_nothing_is_said(linked):
    linked(2, p2p="pcie")
    placement, said = placed(gpus="1")
    assert seen(placement) == [(uuid(1), 0)] and said == []


@pytest.mark.parametrize(
    "p2p, line",
    [
        ("none", "GPUs 0 and 1 have no peer-to-peer path, so NCCL goes through host memory; each worker sees only its own GPU"),
        ("unsupported", "NVML cannot say how GPUs 0 and 1 reach each other: each worker sees only its own GPU"),
    ],
)
def test_gpus_with_no_peer_path_or_none_nvml_can_name_keep_one_gpu_per_worker(linked, p2p, line):
    linked(2, p2p=p2p)
    placement, said = placed(device="cuda")
    assert seen(placement) == [(uuid(0), 0), (uuid(1), 0)]
    assert said[-1] == f"launcher: {line}"


def test_a_users_command_keeps_one_gpu_per_worker_over_pcie_and_says_how_to_share(linked):
    linked(2, p2p="pcie")
    placement, said = placed(device="cuda", own_command=True)
    assert seen(placement) == [(uuid(0), 0), (uuid(1), 0)]
    assert said[-1] == (
        "launcher: GPUs 0 and 1 reach each other over PCIe only, but a -- COMMAND worker sees only its own GPU (cuda:0), "
        "so NCCL goes through host memory; LAUNCHER_GPU_VISIBILITY=node shows each worker the 2 run GPUs of this node "
        "(then use cuda:LOCAL_RANK)"
    )


@pytest.mark.parametrize("own_command", [False, True])
def test_visibility_node_shows_every_worker_the_run_gpus_even_over_nvlink(linked, monkeypatch, own_command):
    linked(2)
    monkeypatch.setenv(VISIBILITY_VAR, "node")
    placement, said = placed(device="cuda", own_command=own_command)
    both = f"{uuid(0)},{uuid(1)}"
    assert seen(placement) == [(both, 0), (both, 1)]
    assert said[-1] == (
        "launcher: LAUNCHER_GPU_VISIBILITY=node: each worker sees the 2 run GPUs of this node and uses cuda:LOCAL_RANK"
    )


def test_visibility_own_keeps_one_gpu_per_worker_over_pcie_and_names_the_cost(linked, monkeypatch):
    linked(2, p2p="pcie")
    monkeypatch.setenv(VISIBILITY_VAR, "Own")
    placement, said = placed(device="cuda")
    assert seen(placement) == [(uuid(0), 0), (uuid(1), 0)]
    assert said[-1] == (
        "launcher: LAUNCHER_GPU_VISIBILITY=own: each worker sees only its own GPU; GPUs 0 and 1 reach each other "
        "over PCIe only, so NCCL goes through host memory"
    )


def test_a_mig_device_in_the_run_keeps_one_gpu_per_worker_over_pcie(linked):
    linked(3, p2p="pcie", gpus={2: {"mig": [{"slot": 0, "uuid": "MIG-one"}]}})
    placement, said = placed(gpus="0,1,2.0")
    assert seen(placement) == [(uuid(0), 0), (uuid(1), 0), ("MIG-one", 0)]
    assert said[-1] == (
        "launcher: GPUs 0 and 1 reach each other over PCIe only, but a MIG device is in the run: "
        "each worker sees only its own GPU"
    )


def test_an_unknown_visibility_is_one_line_and_claims_nothing(linked, monkeypatch):
    linked(2)
    monkeypatch.setenv(VISIBILITY_VAR, "all")
    with pytest.raises(DeviceError) as error:
        placed(device="cuda")
    assert str(error.value) == (
        "LAUNCHER_GPU_VISIBILITY='all' is not auto, own or node; unset it for the launcher's choice (docs/gpus.md)"
    )
    assert claims.holder_of(uuid(0)) is None


def test_visibility_node_beside_a_mig_device_is_refused_and_gives_the_gpus_back(linked, monkeypatch):
    linked(2, gpus={1: {"mig": [{"slot": 0, "uuid": "MIG-one"}]}})
    monkeypatch.setenv(VISIBILITY_VAR, "node")
    with pytest.raises(DeviceError, match=r"^LAUNCHER_GPU_VISIBILITY=node cannot show a MIG device beside other GPUs"):
        place(GpuOptions(gpus="0,1.0"), Printer(io.StringIO(), None))
    assert claims.holder_of(uuid(0)) is None and claims.holder_of("MIG-one") is None


# --- what the workers get ----------------------------------------------------------------


def test_training_workers_over_pcie_get_the_run_gpus_and_their_own_index(linked):
    linked(3, p2p="pcie")
    placement, _ = placed(gpus="0,2")
    workers = make_workers(placement, ["python3", "pretrain_main.py"], training=True, master_port=29500)
    both = f"{uuid(0)},{uuid(2)}"
    assert [(w.env["CUDA_VISIBLE_DEVICES"], w.env[CUDA_DEVICE_INDEX_VAR], w.env["LOCAL_RANK"]) for w in workers] == [
        (both, "0", "0"),
        (both, "1", "1"),
    ]
    assert [(w.env["GPU_RANK"], w.label) for w in workers] == [("0", "GPU0"), ("2", "GPU2")]


def test_cpu_workers_get_no_device_index(monkeypatch):
    monkeypatch.setenv(CUDA_DEVICE_INDEX_VAR, "3")  # left over from an outer launch
    workers = make_workers(Placement("cpu", 2), ["python3", "my_script.py"], master_port=29500)
    assert [CUDA_DEVICE_INDEX_VAR in w.env for w in workers] == [False, False]


def test_the_launcher_and_the_trainer_name_the_device_index_alike():
    assert runtime.CUDA_DEVICE_INDEX_VAR == CUDA_DEVICE_INDEX_VAR


def test_a_launched_command_sees_the_run_gpus_when_asked(linked):
    machine = linked(2, p2p="pcie")
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--gpus", "0,1", "--", sys.executable, "-c", PRINT_DEVICES],
        cwd=ROOT,
        env=launcher_env(LAUNCHER_SCRIPTED_GPUS=machine, LAUNCHER_GPU_VISIBILITY="node"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    both = f"{uuid(0)},{uuid(1)}"
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("GPU")) == [f"GPU0:{both} 0", f"GPU1:{both} 1"]
