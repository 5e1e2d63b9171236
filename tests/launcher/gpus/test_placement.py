"""Where workers run (launcher/gpus/placement.py) on scripted machines, and the GPU paths end to
end: `python -m launcher gpus`, real launchers racing for GPUs, train_gpu.sh and
train_auto_gpu.sh."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from support.processes import ROOT, launcher_env, wait_until
from launcher.gpus import amd, claims, nvml, vendors
from launcher.gpus.devices import VISIBILITY_VARIABLES, Gpu
from launcher.gpus.request import GIB, DeviceError
from launcher.gpus.placement import GpuOptions, Placement, place, runtime_ids
from launcher.supervise.printer import Printer

PRINT_GPU = (
    "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['GPU_RANK'], os.environ['CUDA_DEVICE_ORDER'], flush=True)"
)
JOINED = {
    "nvidia": "joined by NVLink: each worker sees only its own GPU (NCCL reaches the others over it)",
    "amd": "joined by XGMI: each worker sees only its own GPU (RCCL reaches the others over it)",
}


def print_gpu(vendor: str) -> str:
    """A worker that prints what makes its GPU visible (the vendor's variable), its GPU_RANK and
    CUDA_DEVICE_ORDER: PRINT_GPU on NVIDIA."""
    variable = "ROCR_VISIBLE_DEVICES" if vendor == "amd" else "CUDA_VISIBLE_DEVICES"
    return PRINT_GPU.replace("CUDA_VISIBLE_DEVICES", variable)


@pytest.fixture(autouse=True)
def no_sampling_wait(monkeypatch):
    for backend in (nvml, amd):
        monkeypatch.setattr(backend, "UTILIZATION_WINDOW", 0.0)  # in this process only; launchers still wait 1 s
    for variable in VISIBILITY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def machine() -> list[Gpu]:
    """The scripted machine's devices, as the launcher reads them."""
    return vendors.backend(None).discover(window=0)


def uuid(index: int) -> str:
    """The UUID a scripted machine gives GPU `index` by default."""
    return f"GPU-{index:08x}-0000-0000-0000-000000000000"


def placed(**options) -> tuple[Placement, str]:
    console = io.StringIO()
    placement = place(GpuOptions(**options), Printer(console, None))
    return placement, console.getvalue()


def labels(placement: Placement) -> list[str]:
    return [placement.label(rank) for rank in range(placement.world_size)]


# --- CPU, and no GPU ------------------------------------------------------------------


def test_cpu_runs_never_read_nvml(monkeypatch, tmp_path):
    monkeypatch.setenv("LAUNCHER_SCRIPTED_GPUS", str(tmp_path / "missing.json"))  # reading it would fail
    assert labels(placed(device="cpu")[0]) == ["CPU0", "CPU1"]
    assert labels(placed(device="cuda", gpus="none", nproc=3)[0]) == ["CPU0", "CPU1", "CPU2"]


def test_without_a_driver_the_debug_preset_falls_back_to_cpu_workers_and_says_so(scripted_gpus, vendor):
    scripted_gpus([], driver=False)
    placement, said = placed(device="auto", cpu_fallback=True)
    assert (placement.device, placement.world_size) == ("cpu", 2)
    assert said == ("launcher: no NVIDIA or AMD GPU found; running 2 CPU worker processes (gloo); --nproc N changes the count\n")
    assert placed(device="auto", gpus="ALL", cpu_fallback=True)[0].device == "cpu"


@pytest.mark.parametrize(
    "options",
    [
        {"device": "auto"},
        {"device": "cuda", "cpu_fallback": True},
        {"device": "auto", "gpus": "0", "cpu_fallback": True},
        {"device": "auto", "gpus": "auto:1", "cpu_fallback": True},
        {"device": "auto", "device_id": 0, "cpu_fallback": True},
    ],
)
def test_without_a_driver_the_production_preset_or_a_gpu_request_is_an_error(scripted_gpus, options):
    scripted_gpus([], driver=False)
    with pytest.raises(DeviceError, match=r"^no NVIDIA or AMD GPU found; use --device cpu$"):
        placed(**options)


def test_a_broken_driver_is_an_error_even_where_cpu_would_do(scripted_gpus, monkeypatch):
    scripted_gpus([{}])
    import pynvml
    from launcher.gpus import scripted_nvml

    def mismatch(self):
        raise pynvml.NVMLError_LibRmVersionMismatch()

    monkeypatch.setattr(scripted_nvml.ScriptedNvml, "nvmlInit", mismatch)
    with pytest.raises(nvml.NvmlFailure, match=r"NVML cannot start \(RM has detected an NVML/RM version mismatch"):
        placed(device="auto", cpu_fallback=True)


def test_a_cuda_visible_devices_that_hides_every_gpu_means_cpu_or_an_error(scripted_gpus, monkeypatch):
    scripted_gpus([{}, {}])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert placed(device="auto", cpu_fallback=True)[0].device == "cpu"
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES= hides every GPU; unset it or use --device cpu"):
        placed(device="cuda")


# --- choosing -------------------------------------------------------------------------


def test_all_runs_one_worker_per_free_gpu_and_says_which_were_skipped(scripted_gpus, vendor):
    scripted_gpus([{}, {"utilization": [97]}, {}, {"memory_used_mib": 60000}])
    placement, said = placed(device="cuda")
    assert labels(placement) == ["GPU0", "GPU2"]
    assert said.splitlines() == [
        "launcher: using GPUs 0, 2; skipped 2:",
        "launcher:   GPU 1: busy: utilization 97% > 10%",
        f"launcher:   GPU 3: busy: {machine()[3].memory_free / GIB:.1f} GiB free < 90%",
        f"launcher: GPUs 0, 2 are {JOINED[vendor]}",
    ]
    placement.release()


def test_auto_says_using_gpu_n_and_shows_the_table_behind_the_choice(scripted_gpus, vendor):
    scripted_gpus([{"utilization": [40]}, {"utilization": [0, 20, 0, 20, 0]}, {"utilization": [3]}])
    placement, said = placed(gpus="auto:1")
    lines = said.splitlines()
    assert lines[0] == "launcher: Using GPU 2 (lowest utilization)"  # 3% beats 8% on average
    assert lines[1].split()[1:3] == ["GPU", "NAME"] and len(lines) == 5
    assert lines[2].endswith("busy: utilization 40% > 10%") and lines[4].endswith("chosen")
    placement.release()


def test_nproc_on_a_gpu_machine_takes_the_n_freest(scripted_gpus, vendor):
    scripted_gpus([{"utilization": [5]}, {}, {"utilization": [9]}, {}])
    placement, said = placed(nproc=3)
    assert labels(placement) == ["GPU0", "GPU1", "GPU3"] and "Using GPUs 0, 1, 3" in said
    placement.release()


def test_device_id_pins_that_gpu_even_when_it_is_busy_with_a_warning(scripted_gpus, vendor):
    scripted_gpus([{}, {}, {"utilization": [60]}])
    placement, said = placed(device_id=2)
    assert labels(placement) == ["GPU2"]
    assert said.startswith("launcher: warning: GPU 2 is busy (utilization 60% > 10%); using it anyway")
    placement.release()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"gpus": "0", "nproc": 2}, "--nproc sets the number of CPU workers; with --gpus 0 the GPUs decide it"),
        ({"gpus": "0,1", "device_id": 1}, "system.device_id pins GPU 1 but --gpus is 0,1; drop one of them"),
        ({"gpus": "7"}, "--gpus names GPU 7, which does not exist; GPUs here: 0, 1 "),
        ({"device": "cpu", "gpus": "0"}, "--device cpu conflicts with --gpus 0"),
        ({"device_id": 1, "nproc": 2}, "system.device_id pins one GPU but --nproc is 2"),
        ({"nproc": 0}, r"--nproc must be at least 1 \(got 0\)"),
        ({"gpus": "auto:3"}, r"--gpus auto:3 needs 3, but 2 of 2 GPU\(s\) are free"),
        ({"gpus": "0", "min_free_memory": "lots"}, "--min-free-memory 'lots' is not a percentage"),
    ],
)
def test_contradictory_or_impossible_options_are_one_line_errors(scripted_gpus, vendor, options, message):
    scripted_gpus([{}, {}])
    with pytest.raises(DeviceError, match=message) as error:
        placed(**options)
    assert "\n" not in str(error.value)


def test_the_chosen_gpus_stay_claimed_until_released(scripted_gpus, vendor):
    scripted_gpus([{}, {}])
    first, second = (gpu.uuid for gpu in machine())
    placement, _ = placed(gpus="1")
    assert claims.holder_of(second).pid == os.getpid() and claims.holder_of(first) is None
    with pytest.raises(DeviceError, match="GPU 1 is claimed by launcher pid"):
        placed(gpus="1")
    other, _ = placed(gpus="auto:1")
    assert labels(other) == ["GPU0"]  # the other one
    other.release()
    placement.release()
    assert claims.holder_of(second) is None


def test_a_mig_device_runs_alone_under_its_uuid_and_all_says_why_it_left_the_other_out(scripted_gpus):
    scripted_gpus([{"mig": [{"slot": 0, "uuid": "MIG-one"}, {"slot": 1, "uuid": "MIG-two"}]}])
    placement, said = placed(device="cuda")
    assert labels(placement) == ["GPU0.0"]
    assert [g.visible_id for g in placement.gpus] == ["MIG-one"]
    assert said.splitlines() == [
        "launcher: using GPU 0.0; skipped 1:",
        "launcher:   GPU 0.1: MIG device: one per run (NCCL does not support MIG)",
    ]
    placement.release()


@pytest.mark.parametrize("options", [{"gpus": "0.0,0.1"}, {"gpus": "auto:2"}, {"nproc": 2, "device": "cuda"}])
def test_several_mig_devices_in_one_run_are_refused(scripted_gpus, options):
    scripted_gpus([{"mig": [{"slot": 0, "uuid": "MIG-one"}, {"slot": 1, "uuid": "MIG-two"}]}])
    with pytest.raises(DeviceError, match="a run uses at most one MIG device: NCCL does not support MIG"):
        placed(**options)
    assert claims.holder_of("MIG-one") is None and claims.holder_of("MIG-two") is None


# --- end to end: real launchers -------------------------------------------------------


def launcher(processes, *args: str, **env: str) -> subprocess.Popen:
    """A launcher the test owns: killed, with all it started, when the test ends."""
    return processes(
        [sys.executable, "-m", "launcher", *args],
        cwd=ROOT,
        env=launcher_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_two_launchers_started_at_once_with_auto_1_get_different_gpus(processes, scripted_gpus, vendor, tmp_path):
    scripted_gpus([{}, {}])
    gpus = machine()
    release = tmp_path / "release"  # the workers hold their GPUs until the test has looked
    worker = f"{print_gpu(vendor)}; import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.02)"
    racers = [launcher(processes, "--gpus", "auto:1", "--", sys.executable, "-c", worker) for _ in range(2)]
    try:
        assert wait_until(lambda: sum(claims.holder_of(gpu.uuid) is not None for gpu in gpus) == 2, timeout=15)
        third = launcher(processes, "--gpus", "auto:1", "--", "true")
        _, refusal = third.communicate(timeout=30)
        assert third.returncode == 2
        assert refusal.startswith("launcher: error: --gpus auto:1 needs 1, but none of the 2 GPU(s) is free")
        assert refusal.count("claimed by launcher pid") == 2
    finally:
        release.touch()
    outputs = [racer.communicate(timeout=30)[0] for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0]
    chosen = sorted(line for out in outputs for line in out.splitlines() if line.startswith("GPU"))
    assert chosen == [f"GPU{i}:{gpus[i].visible_id} {i} PCI_BUS_ID" for i in range(2)]
    assert all("Using GPU" in out for out in outputs)


def test_a_worker_on_a_mig_device_gets_its_uuid_and_is_prefixed_gpu_dot_slot(scripted_gpus):
    scripted_gpus([{"mig": [{"slot": 0, "uuid": "MIG-one"}, {"slot": 1, "uuid": "MIG-two"}]}])
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--gpus", "0.1", "--", sys.executable, "-c", PRINT_GPU],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("GPU")] == ["GPU0.1:MIG-two 0.1 PCI_BUS_ID"]


def test_a_launcher_asked_for_two_mig_devices_refuses_in_one_line_and_starts_nothing(scripted_gpus, tmp_path):
    scripted_gpus([{"mig": [{"slot": 0, "uuid": "MIG-one"}, {"slot": 1, "uuid": "MIG-two"}]}])
    started = tmp_path / "started"
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--gpus", "0.0,0.1", "--", "touch", str(started)],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "launcher: error: --gpus 0.0,0.1 names 2 MIG devices (0.0, 0.1), but a run uses at most one MIG device: "
        "NCCL does not support MIG, and the MIG devices of one GPU share its PCI bus id, which NCCL refuses "
        "as a duplicate GPU; name one of them, or use whole GPUs"
    ]
    assert not started.exists()


def test_a_killed_launcher_gives_its_gpu_back(processes, scripted_gpus):
    scripted_gpus([{"uuid": "GPU-solo"}])
    holder = launcher(processes, "--gpus", "0", "--", sys.executable, "-c", "import time; time.sleep(60)")
    assert wait_until(lambda: claims.holder_of("GPU-solo") is not None, timeout=15)
    holder.kill()  # SIGKILL: no cleanup code of the launcher runs
    holder.wait(timeout=10)
    # Killed while starting its worker, the launcher may leave a child between fork and exec,
    # which holds a copy of the claim's socket until it execs (the socket is close-on-exec) or
    # dies with its parent: the name is free once that child is past that point, within moments.
    assert wait_until(lambda: claims.holder_of("GPU-solo") is None, timeout=5)


def test_launcher_gpus_prints_the_table_with_a_verdict_for_each_gpu(scripted_gpus, vendor):
    scripted_gpus([{}, {"utilization": [80], "processes": [{"pid": 4_000_000, "memory_mib": 2048}]}, {"utilization": None}])
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "gpus", "--max-utilization", "90"],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and lines[0].startswith("GPU ")
    assert lines[1].endswith("free") and lines[2].endswith("free")  # 80% is under --max-utilization 90
    assert "4000000 (not visible here) 2.0 GiB" in lines[2]
    assert lines[3].endswith("free (utilization unknown)")
    assert time.monotonic() - started >= 0.9  # utilization sampled over a second, not read once


@pytest.mark.parametrize("args", [["--help"], ["gpus", "--help"]])
def test_the_help_of_the_launcher_and_of_gpus_shows_the_gpu_options(args):
    result = subprocess.run(
        [sys.executable, "-m", "launcher", *args], cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert "--min-free-memory AMOUNT" in result.stdout and "(default: 90%)" in result.stdout


def test_launcher_gpus_without_a_driver_is_a_one_line_error(scripted_gpus):
    scripted_gpus([], driver=False)
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "gpus"], cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout) == (2, "")
    (line,) = result.stderr.splitlines()
    # --device cpu is for training runs; the gpus command has nothing to run on a CPU
    assert line.startswith("launcher: error: no NVIDIA or AMD GPU driver") and "no GPU to show" in line and "--device" not in line


def test_no_free_gpu_prints_the_error_then_the_table_of_reasons(scripted_gpus):
    scripted_gpus([{"utilization": [99]}, {"memory_used_mib": 80000}])
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--", "true"], cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    first, *table = result.stderr.splitlines()
    assert first.startswith("launcher: error: none of the 2 GPU(s) is free (free: utilization <= 10%")
    assert table[1].endswith("busy: utilization 99% > 10%") and "GiB free < 90%" in table[2]


# --- the shell scripts ----------------------------------------------------------------


def shell(script: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    # PYTHON: the scripts' setup uses the interpreter running these tests, which has everything.
    return subprocess.run(
        ["bash", str(ROOT / script), *args],
        cwd=cwd,
        env=launcher_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_train_gpu_sh_runs_one_worker_on_the_gpu_named(scripted_gpus, vendor):
    scripted_gpus([{}, {}, {}, {}])
    result = shell("train_gpu.sh", "3", "--", sys.executable, "-c", print_gpu(vendor))
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("GPU")] == [
        f"GPU3:{machine()[3].visible_id} 3 PCI_BUS_ID"
    ]


def test_the_gpu_scripts_work_from_another_directory(scripted_gpus, tmp_path):
    scripted_gpus([{"utilization": [50]}, {"utilization": [2]}])
    pinned = shell("train_gpu.sh", "0", "--", sys.executable, "-c", PRINT_GPU, cwd=tmp_path)
    freest = shell("train_auto_gpu.sh", "--", sys.executable, "-c", PRINT_GPU, cwd=tmp_path)
    assert pinned.returncode == 0 and f"GPU0:{uuid(0)} 0 PCI_BUS_ID" in pinned.stdout.splitlines(), pinned.stderr
    assert freest.returncode == 0 and f"GPU1:{uuid(1)} 1 PCI_BUS_ID" in freest.stdout.splitlines(), freest.stderr


def test_train_auto_gpu_sh_uses_the_freest_gpu_and_says_why(scripted_gpus):
    scripted_gpus([{"utilization": [50]}, {"utilization": [2]}, {"utilization": [30]}])
    result = shell("train_auto_gpu.sh", "--", sys.executable, "-c", PRINT_GPU)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "launcher: Using GPU 1 (lowest utilization)"
    assert any(line.endswith("chosen") and line.split()[1] == "1" for line in lines)
    assert f"GPU1:{uuid(1)} 1 PCI_BUS_ID" in lines


def test_the_gpu_scripts_without_a_driver_say_use_device_cpu(scripted_gpus):
    scripted_gpus([], driver=False)
    for result in (shell("train_gpu.sh", "0", "--debug"), shell("train_auto_gpu.sh", "--debug")):
        assert (result.returncode, result.stdout) == (2, "")
        assert result.stderr.splitlines()[-1] == "launcher: error: no NVIDIA or AMD GPU found; use --device cpu"


def test_the_gpu_scripts_refuse_a_second_gpus_option(scripted_gpus):
    scripted_gpus([{}, {}])
    for result in (shell("train_gpu.sh", "0", "--gpus", "1"), shell("train_auto_gpu.sh", "--gpus=1")):
        assert (result.returncode, result.stdout) == (2, "")
        assert "drop --gpus" in result.stderr and result.stderr.count("\n") == 1


def test_train_gpu_sh_without_a_gpu_prints_its_usage(scripted_gpus):
    result = shell("train_gpu.sh")
    assert result.returncode == 2 and result.stderr.startswith("usage: ./train_gpu.sh GPU")
    assert shell("train_gpu.sh", "--debug").returncode == 2


# --- the same launcher on AMD GPUs ------------------------------------------------------


def test_on_eight_gpus_two_busy_the_table_lists_all_eight_and_two_workers_get_two_different_free_ones(
    scripted_gpus, vendor, tmp_path
):
    busy = {1: {"utilization": [90]}, 3: {"memory_used_mib": 70000}}
    scripted_gpus([busy.get(i, {}) for i in range(8)])
    gpus = machine()
    table = subprocess.run(
        [sys.executable, "-m", "launcher", "gpus"], cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=60
    )
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    at = header.index("HEALTH")
    assert [row.split()[0] for row in rows] == [str(i) for i in range(8)]
    assert all(row.split()[1] == {"nvidia": "NVIDIA", "amd": "AMD"}[vendor] for row in rows)
    assert [row[at:].split()[0] for row in rows] == ["ok"] * 8
    assert [row.split()[-1] for i, row in enumerate(rows) if i not in busy] == ["free"] * 6
    assert "busy: utilization 90% > 10%" in rows[1] and "GiB free < 90%" in rows[3]
    variable = gpus[0].visibility_variable
    assert variable == {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "ROCR_VISIBLE_DEVICES"}[vendor]
    run = subprocess.run(
        [sys.executable, "-m", "launcher", "--nproc", "2", "--", "sh", "-c", f"echo ${variable}"],
        cwd=ROOT,
        env=launcher_env(PRETRAIN_RUNS_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert sorted(line for line in run.stdout.splitlines() if line.startswith("GPU")) == [
        f"GPU{i}:{gpus[i].visible_id}" for i in (0, 2)
    ]
    assert gpus[0].visible_id != gpus[2].visible_id


@pytest.mark.parametrize("vendor", ["amd"])
def test_an_amd_worker_sees_its_gpu_through_rocr_visible_devices_alone_and_the_launchers_own_limit_it(
    scripted_gpus, vendor, tmp_path
):
    scripted_gpus([{} for _ in range(4)])
    gpus = machine()
    own = f"{gpus[1].uuid},{gpus[3].uuid}"  # the launcher's ROCR_VISIBLE_DEVICES; HIP's 1 counts among those: GPU 3
    shown = "echo ROCR=$ROCR_VISIBLE_DEVICES HIP=${HIP_VISIBLE_DEVICES-unset} CUDA=${CUDA_VISIBLE_DEVICES-unset}"
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--", "sh", "-c", shown],
        cwd=ROOT,
        env=launcher_env(
            ROCR_VISIBLE_DEVICES=own, HIP_VISIBLE_DEVICES="1", CUDA_VISIBLE_DEVICES="0", PRETRAIN_RUNS_DIR=str(tmp_path)
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("GPU")] == [
        f"GPU3:ROCR={gpus[3].uuid} HIP=unset CUDA=unset"
    ]


@pytest.mark.parametrize("vendor", ["amd"])
def test_an_amd_partition_is_made_visible_by_its_rocr_index_and_a_whole_gpu_by_its_uuid(scripted_gpus, vendor):
    scripted_gpus([{"partition": {"compute": "CPX"}}, {}])  # GPU 0 in 8 partitions, then GPU 1 whole
    gpus = machine()
    placement, _ = placed(gpus="0.3,1")
    placement.release()
    assert placement.visibility_variable() == "ROCR_VISIBLE_DEVICES"
    # ROCr numbers the partitions 0-7, then GPU 1: 8 (it shares no unique id, so its UUID names it)
    assert [placement.visible_devices(rank) for rank in range(2)] == ["3", gpus[-1].visible_id]
    assert gpus[-1].visible_id.startswith("GPU-")


@pytest.mark.parametrize("vendor", ["amd"])
def test_an_amd_partition_is_given_rocrs_own_device_number_where_the_reader_knows_it(scripted_gpus, vendor):
    scripted_gpus([{"partition": {"compute": "CPX"}}, {}])
    gpus = machine()
    # ROCr numbers GPU 1 first here (its KFD node comes first), then GPU 0's partitions 1-8.
    numbered = [replace(gpu, runtime_index=0 if gpu.id == "1" else 1 + at) for at, gpu in enumerate(gpus)]
    assert runtime_ids(numbered)["0.3"] == str(1 + [gpu.id for gpu in gpus].index("0.3"))
    assert "1" not in runtime_ids(numbered)  # a whole GPU goes by its UUID
