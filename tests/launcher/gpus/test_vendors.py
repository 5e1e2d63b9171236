"""Which GPU vendor the launcher reads (launcher/gpus/vendors.py): detected from the machine (a scripted
one says its own), chosen with --gpu-vendor where there are both, refused in one line where the choice
cannot be made or the vendor asked for is not there."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.processes import ROOT, launcher_env, one_line_error
from launcher import cli
from launcher.gpus import nvml, vendors
from launcher.gpus.placement import GpuOptions, place
from launcher.gpus.vendors import VendorError
from launcher.supervise.printer import Printer

AMD_STUB = SimpleNamespace(name="the AMD backend", available=lambda: True)


@pytest.fixture
def real_machine(monkeypatch):
    """No scripted machine: the vendors present are what stand_in(nvidia=..., amd=...) says,
    and the AMD backend is a stub (the module itself is tested on scripted AMD machines)."""
    monkeypatch.delenv(nvml.SCRIPTED_GPUS_VAR, raising=False)
    monkeypatch.setattr(vendors, "_amd", lambda: AMD_STUB)

    def stand_in(nvidia: bool, amd: bool) -> None:
        monkeypatch.setattr(vendors, "nvidia_present", lambda: nvidia)
        monkeypatch.setattr(vendors, "amd_present", lambda: amd)

    return stand_in


def test_a_machine_with_both_vendors_is_refused_in_one_line_naming_gpu_vendor(real_machine):
    real_machine(nvidia=True, amd=True)
    for start in (lambda: vendors.backend(None), lambda: cli.run(["gpus"]), lambda: cli.run(["--", "true"])):
        with pytest.raises(VendorError) as error:
            start()
        assert "--gpu-vendor nvidia|amd" in one_line_error(error) and "both NVIDIA" in str(error.value)
        assert error.value.exit_code == 2


@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
def test_gpu_vendor_chooses_the_backend_on_a_machine_with_both(real_machine, vendor):
    real_machine(nvidia=True, amd=True)
    assert vendors.backend(vendor) is {"nvidia": nvml, "amd": AMD_STUB}[vendor]


@pytest.mark.parametrize("nvidia, amd, expected", [(True, False, "nvidia"), (False, True, "amd"), (False, False, "nvidia")])
def test_the_one_vendor_present_is_used_and_none_leaves_nvml_to_say_there_is_no_driver(real_machine, nvidia, amd, expected):
    real_machine(nvidia=nvidia, amd=amd)
    assert vendors.backend(None) is {"nvidia": nvml, "amd": AMD_STUB}[expected]


def test_gpu_vendor_amd_without_amd_smi_names_the_fix(real_machine):
    real_machine(nvidia=True, amd=False)
    with pytest.raises(VendorError) as error:
        vendors.backend("amd")
    message = one_line_error(error)
    assert message.startswith("--gpu-vendor amd, but AMD SMI finds no AMD GPU driver; install ROCm's amdsmi")
    assert "amd-smi" in message and message.endswith("or use --device cpu")


def test_gpu_vendor_nvidia_without_nvml_names_the_fix(real_machine):
    real_machine(nvidia=False, amd=True)
    with pytest.raises(VendorError, match=r"^--gpu-vendor nvidia, but NVML finds no NVIDIA GPU driver; install the NVIDIA"):
        vendors.backend("nvidia")


def test_cpu_workers_never_ask_which_vendor_is_there(real_machine):
    real_machine(nvidia=True, amd=True)  # refused if it were asked
    placement = place(GpuOptions(device="cpu"), Printer(io.StringIO(), None))
    assert placement.device == "cpu"


def test_the_gpu_vendor_option_takes_only_the_two_vendors(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--gpu-vendor", "intel"])
    assert "invalid choice: 'intel'" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["--gpu-vendor", "amd"]).gpu_vendor == "amd"


# --- scripted machines ----------------------------------------------------------------


def script(tmp_path, monkeypatch, machine: dict) -> None:
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(machine))
    monkeypatch.setenv(nvml.SCRIPTED_GPUS_VAR, str(path))


def test_a_scripted_machine_is_nvidia_unless_it_says_amd(tmp_path, monkeypatch):
    script(tmp_path, monkeypatch, {"gpus": [{}]})
    assert vendors.backend(None) is nvml
    script(tmp_path, monkeypatch, {"vendor": "amd", "gpus": [{}]})
    assert vendors.backend(None) is vendors.module("amd")


def test_asking_a_scripted_machine_for_the_other_vendor_is_one_line(tmp_path, monkeypatch):
    script(tmp_path, monkeypatch, {"gpus": [{}]})
    with pytest.raises(VendorError) as error:
        vendors.backend("amd")
    assert "on this scripted machine" in one_line_error(error)


def test_nvml_that_cannot_find_its_library_means_no_nvidia_driver(tmp_path, monkeypatch):
    script(tmp_path, monkeypatch, {"driver": False, "gpus": []})
    assert not vendors.nvidia_present()
    script(tmp_path, monkeypatch, {"gpus": [{}]})
    assert vendors.nvidia_present()


@pytest.mark.parametrize("vendor, machine", [("amd", {"driver": False}), ("amd", {"init_error": "driver_not_loaded"})])
def test_gpu_vendor_amd_on_a_scripted_machine_without_its_driver_is_the_vendor_line_from_the_real_launcher(
    tmp_path, vendor, machine
):
    path = tmp_path / "machine.json"
    path.write_text(json.dumps({"vendor": vendor, "gpus": [{}]} | machine))
    result = launch(["--gpu-vendor", vendor, "--nproc", "2", "--", "true"], LAUNCHER_SCRIPTED_GPUS=str(path))
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "--gpu-vendor amd, but AMD SMI finds no AMD GPU driver on this scripted machine (" in lines[0]
    assert lines[0].endswith("or use --device cpu") and "no NVIDIA or AMD GPU found" not in lines[0]


def test_launcher_gpus_with_gpu_vendor_amd_on_a_machine_without_its_driver_says_so_in_one_line(tmp_path):
    path = tmp_path / "machine.json"
    path.write_text(json.dumps({"vendor": "amd", "driver": False, "gpus": [{}]}))
    result = launch(["gpus", "--gpu-vendor", "amd"], LAUNCHER_SCRIPTED_GPUS=str(path))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "--gpu-vendor amd, but AMD SMI finds no AMD GPU driver" in lines[0]
    assert not lines[0].endswith("--device cpu")  # the listing has no training launch to move to the CPU


# --- detection on a real machine: the kernel's view, then AMD SMI ---------------------

CPU_NODE = "cpu_cores_count 64\nsimd_count 0\ngfx_target_version 0\n"
GPU_NODE = "cpu_cores_count 0\nsimd_count 1216\ngfx_target_version 90402\n"


def system_root(tmp_path: Path, *nodes: str, kfd: bool = True) -> Path:
    """A fake / with /dev/kfd (unless kfd is false) and these KFD topology nodes."""
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    if kfd:
        (root / "dev/kfd").touch()
    for at, properties in enumerate(nodes):
        node = root / vendors.KFD_NODES / str(at)
        node.mkdir(parents=True)
        (node / "properties").write_text(properties)
    return root


def failing_amd_smi(tmp_path: Path) -> Path:
    """A directory holding an amd-smi command that fails as one without a driver does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    command = bin_dir / "amd-smi"
    command.write_text("#!/bin/sh\necho 'AMD SMI: amdgpu driver not loaded' >&2\nexit 1\n")
    command.chmod(0o755)
    return bin_dir


def broken_amdsmi(tmp_path: Path, error: str) -> Path:
    """A directory holding an amdsmi package whose import raises `error` (as a ROCm install missing
    libamd_smi.so raises OSError)."""
    package = tmp_path / "site" / "amdsmi"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"raise {error}('libamd_smi.so: cannot open shared object file')\n")
    return package.parent


def launch(args: list[str], pythonpath: str = "", path: str | None = None, **extra: str) -> subprocess.CompletedProcess:
    """The real launcher, on this machine's own GPUs (none scripted unless extra says)."""
    env = launcher_env(**extra)
    if "LAUNCHER_SCRIPTED_GPUS" not in extra:
        env.pop("LAUNCHER_SCRIPTED_GPUS", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, str(ROOT)]))
    if path is not None:
        env["PATH"] = path + os.pathsep + env["PATH"]
    argv = [sys.executable, "-m", "launcher", *args]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_kernel_shows_an_amd_gpu_only_with_dev_kfd_and_a_gpu_node_in_the_kfd_topology(tmp_path):
    assert vendors.kernel_shows_amd_gpu(system_root(tmp_path / "a", CPU_NODE, GPU_NODE))
    assert not vendors.kernel_shows_amd_gpu(system_root(tmp_path / "b", CPU_NODE))  # amdgpu found no GPU
    assert not vendors.kernel_shows_amd_gpu(system_root(tmp_path / "c", CPU_NODE, GPU_NODE, kfd=False))
    assert not vendors.kernel_shows_amd_gpu(tmp_path / "nothing")


def test_amd_smi_without_an_amd_gpu_is_not_amd_and_nvml_is_left_to_discovery(tmp_path, monkeypatch):
    monkeypatch.delenv(nvml.SCRIPTED_GPUS_VAR, raising=False)
    monkeypatch.setenv("PATH", f"{failing_amd_smi(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(vendors, "SYSTEM_ROOT", system_root(tmp_path, CPU_NODE))

    def started_twice() -> bool:
        raise AssertionError("NVML started only to ask, where AMD is not there to choose from")

    monkeypatch.setattr(vendors, "nvidia_present", started_twice)
    assert not vendors.amd_present()
    assert vendors.backend(None) is nvml and vendors.backend("nvidia") is nvml


@pytest.mark.parametrize("error", ["OSError", "KeyError", "ImportError"])
def test_an_amdsmi_that_cannot_be_imported_is_not_installed(tmp_path, monkeypatch, error):
    monkeypatch.setattr(vendors, "SYSTEM_ROOT", system_root(tmp_path, CPU_NODE, GPU_NODE))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no amd-smi command either
    monkeypatch.syspath_prepend(str(broken_amdsmi(tmp_path, error)))
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    assert vendors.kernel_shows_amd_gpu() and not vendors.amd_present()
    monkeypatch.setenv("PATH", str(failing_amd_smi(tmp_path)))
    assert vendors.amd_present()  # the kernel shows a GPU and the command is there: discovery says the rest


def test_a_cpu_only_machine_with_amd_smi_installed_runs_cpu_workers(tmp_path):
    result = launch(
        ["--nproc", "2", "--", "true"],
        pythonpath=str(broken_amdsmi(tmp_path, "OSError")),
        path=str(failing_amd_smi(tmp_path)),
    )
    assert result.returncode == 0, result.stderr
    assert "no NVIDIA or AMD GPU found; running 2 CPU worker processes (gloo)" in result.stdout + result.stderr


def test_an_nvidia_machine_with_an_amd_gpu_and_amd_smi_is_both_vendors_through_the_launcher(tmp_path, monkeypatch):
    monkeypatch.delenv(nvml.SCRIPTED_GPUS_VAR, raising=False)
    monkeypatch.setattr(vendors, "SYSTEM_ROOT", system_root(tmp_path, CPU_NODE, GPU_NODE))
    monkeypatch.setenv("PATH", f"{failing_amd_smi(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(vendors, "nvidia_present", lambda: True)  # NVML itself is not faked here
    with pytest.raises(VendorError) as error:
        cli.run(["--", "true"])
    assert "both NVIDIA" in one_line_error(error) and "--gpu-vendor nvidia|amd" in str(error.value)
    monkeypatch.setattr(vendors, "SYSTEM_ROOT", system_root(tmp_path / "cpu", CPU_NODE))
    assert vendors.backend(None) is nvml  # the same machine without the AMD GPU: NVIDIA's
