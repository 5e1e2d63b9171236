"""`--nproc N` where there is no GPU: N CPU workers for the debug preset and generic commands,
as the launcher's own fallback line says; on a GPU machine it still means auto:N."""

from __future__ import annotations

import io
import re

import pytest

from support.runs import run_launcher
from launcher.gpus import nvml
from launcher.gpus.request import DeviceError
from launcher.gpus.placement import GpuOptions, place
from launcher.supervise.printer import Printer


@pytest.fixture(autouse=True)
def no_sampling_wait(monkeypatch):
    monkeypatch.setattr(nvml, "UTILIZATION_WINDOW", 0.0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def placed(**options):
    console = io.StringIO()
    placement = place(GpuOptions(**options), Printer(console, None))
    return placement, console.getvalue()


@pytest.mark.parametrize("nproc", [1, 3])
def test_nproc_without_a_driver_runs_that_many_cpu_workers_and_says_so(scripted_gpus, nproc):
    scripted_gpus([], driver=False)
    placement, said = placed(device="auto", nproc=nproc, cpu_fallback=True)
    assert (placement.device, placement.world_size) == ("cpu", nproc)
    process = "process" if nproc == 1 else "processes"
    assert said == (
        f"launcher: no NVIDIA or AMD GPU found; running {nproc} CPU worker {process} (gloo); --nproc N changes the count\n"
    )


def test_nproc_on_a_gpu_machine_still_means_the_n_freest_gpus(scripted_gpus):
    scripted_gpus([{"utilization": [50]}, {}, {}])
    placement, said = placed(device="auto", nproc=2, cpu_fallback=True)
    assert placement.device == "cuda" and [g.id for g in placement.gpus] == ["1", "2"]
    assert said.startswith("launcher: Using GPUs 1, 2 (lowest utilization)")
    placement.release()


@pytest.mark.parametrize(
    "options",
    [
        {"device": "auto", "nproc": 2},  # the production preset
        {"device": "cuda", "nproc": 2, "cpu_fallback": True},
    ],
)
def test_nproc_without_a_driver_is_still_an_error_where_gpus_are_required(scripted_gpus, options):
    scripted_gpus([], driver=False)
    with pytest.raises(DeviceError, match=r"^no NVIDIA or AMD GPU found; use --device cpu$"):
        placed(**options)


@pytest.mark.slow
def test_debug_with_nproc_1_trains_on_one_cpu_worker_on_a_machine_without_a_gpu(tmp_path):
    # No scripted GPUs: this machine's real NVML, which finds no driver here.
    result = run_launcher(
        "--debug",
        "--nproc",
        "1",
        "--max-steps",
        "2",
        "--run-dir",
        str(tmp_path / "r"),
        "--set",
        f"data.cache_dir={tmp_path / 'cache'}",
        timeout=300,
    )
    if "no NVIDIA or AMD GPU found" not in result.stdout + result.stderr:
        pytest.skip("this machine has a GPU")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    assert "launcher: no NVIDIA or AMD GPU found; running 1 CPU worker process (gloo)" in result.stdout
    workers = {m for m in re.findall(r"^(CPU\d+):", result.stdout, re.M)}
    assert workers == {"CPU0"}
    assert "CPU0:INFO | [CPU 0] Step [1/2]" in result.stdout
