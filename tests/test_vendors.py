"""Which GPU vendor the launcher reads (launcher/gpus/vendors.py): detected from the machine (a scripted
one says its own), chosen with --gpu-vendor where there are both, refused in one line where the choice
cannot be made or the vendor asked for is not there."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from conftest import one_line_error
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
    assert vendors.present() == ["nvidia"] and vendors.backend(None) is nvml
    script(tmp_path, monkeypatch, {"vendor": "amd", "gpus": [{}]})
    assert vendors.present() == ["amd"] and vendors.backend(None) is vendors.module("amd")


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
