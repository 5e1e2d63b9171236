"""The launcher's own visibility variables (launcher/gpus/selection.py: visibility_limits, visible_ids):
CUDA_VISIBLE_DEVICES on NVIDIA; on AMD, ROCR_VISIBLE_DEVICES (ROCr's device numbers, partitions
included), then HIP's mask (HIP_VISIBLE_DEVICES, else CUDA_VISIBLE_DEVICES), as ROCm applies them; and
AMD partitions beside whole GPUs. GPUs described directly (tests/support/gpu_selection.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from support.gpu_selection import GIB, choose, gpu, ids, made_by  # noqa: F401  made_by: autouse
from launcher.gpus import selection as devices
from launcher.gpus.devices import Gpu
from launcher.gpus.request import DeviceError


# --- CUDA_VISIBLE_DEVICES -------------------------------------------------------------


def test_cuda_visible_devices_limits_the_choice_by_index():
    gpus = [gpu(i) for i in range(4)]
    assert ids(choose(gpus, "all", visible="3,1")) == ["1", "3"]
    assert choose(gpus, "all", visible="3,1").verdicts[0].describe() == "not in CUDA_VISIBLE_DEVICES"
    with pytest.raises(DeviceError, match="GPU 2 is not in CUDA_VISIBLE_DEVICES; choose among 1, 3"):
        choose(gpus, "2", visible="3,1")


def test_cuda_visible_devices_limits_the_choice_by_uuid_and_mig_uuid():
    gpus = [gpu(i) for i in range(3)] + [gpu(3, mig_enabled=True), gpu(0, mig_of=3, total_gib=10)]
    assert ids(choose(gpus, "all", visible=f"{gpus[2].uuid},GPU-00")) == ["0", "2"]
    assert ids(choose(gpus, "all", visible="MIG-30")) == ["3.0"]
    assert ids(choose(gpus, "all", visible="3")) == ["3.0"]  # a GPU in MIG mode: its MIG devices


def test_cuda_visible_devices_stops_at_minus_one_like_cuda():
    gpus = [gpu(i) for i in range(3)]
    assert devices.visible_ids(gpus, "2,-1,0") == {"2"}
    assert devices.visible_ids(gpus, "") == set() and devices.visible_ids(gpus, "NoDevFiles") == set()
    assert devices.visible_ids(gpus, None) is None


def test_cuda_visible_devices_naming_a_missing_gpu_is_an_error():
    with pytest.raises(DeviceError, match=r"CUDA_VISIBLE_DEVICES=0,5 names GPU 5, which does not exist"):
        devices.visible_ids([gpu(0), gpu(1)], "0,5")


# --- AMD: ROCR_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES, partitions --------------------


@pytest.mark.parametrize("vendor", ["amd"])
def test_rocr_visible_devices_then_hip_visible_devices_limit_the_choice_and_cuda_visible_devices_is_ignored(vendor):
    gpus = [gpu(i) for i in range(6)]
    environ = {"ROCR_VISIBLE_DEVICES": f"5,{gpus[1].uuid},3", "HIP_VISIBLE_DEVICES": "2,0", "CUDA_VISIBLE_DEVICES": "1"}
    limits = devices.visibility_limits(gpus, environ)
    # HIP reads HIP_VISIBLE_DEVICES where it is set, else CUDA_VISIBLE_DEVICES: never both.
    assert [name for name, _ in limits] == ["ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"]
    # ROCR leaves 5, 1, 3; HIP's 2,0 counts among those: 3, 5.
    assert devices.visible_ids(gpus, limits[:1]) == {"5", "1", "3"}
    assert ids(choose(gpus, "all", visible=limits)) == ["3", "5"]
    hidden = choose(gpus, "all", visible=limits).verdicts[0].describe()
    assert hidden == "not in ROCR_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES"
    assert devices.visible_ids(gpus, devices.visibility_limits(gpus, {"HIP_VISIBLE_DEVICES": "4"})) == {"4"}
    with pytest.raises(DeviceError, match=r"^HIP_VISIBLE_DEVICES=3 names device 3, but only 2 are left to it"):
        devices.visible_ids(gpus, (("ROCR_VISIBLE_DEVICES", "0,1"), ("HIP_VISIBLE_DEVICES", "3")))


@pytest.mark.parametrize("vendor", ["amd"])
def test_hip_takes_cuda_visible_devices_where_its_own_mask_is_empty_and_an_empty_one_as_no_filter(vendor):
    gpus = [gpu(i) for i in range(4)]
    rocr_then_cuda = {"ROCR_VISIBLE_DEVICES": "3,1,2", "HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": "1"}
    assert devices.visibility_limits(gpus, rocr_then_cuda) == (("ROCR_VISIBLE_DEVICES", "3,1,2"), ("CUDA_VISIBLE_DEVICES", "1"))
    assert devices.visible_ids(gpus, devices.visibility_limits(gpus, rocr_then_cuda)) == {"1"}  # 1 among 3, 1, 2
    # An empty CUDA_VISIBLE_DEVICES hides nothing from HIP (a CPU worker's hides nothing on ROCm either);
    # a set but empty ROCR_VISIBLE_DEVICES leaves ROCr no device.
    assert devices.visible_ids(gpus, devices.visibility_limits(gpus, {"CUDA_VISIBLE_DEVICES": ""})) is None
    assert devices.visible_ids(gpus, devices.visibility_limits(gpus, {"ROCR_VISIBLE_DEVICES": ""})) == set()


@pytest.mark.parametrize("vendor", ["amd"])
def test_rocr_visible_devices_indices_are_rocrs_device_numbers_partitions_included(vendor):
    # GPU 0 in a partition mode (partitions 0.0, 0.1), then GPU 1 whole: ROCr numbers 0.0, 0.1, 1 as 0, 1, 2.
    machine = [gpu(0, mig_enabled=True, util=None), gpu(0, mig_of=0, total_gib=40), gpu(1, mig_of=0, total_gib=40), gpu(1)]
    assert devices.visible_ids(machine, (("ROCR_VISIBLE_DEVICES", "2,0"),)) == {"1", "0.0"}
    assert ids(choose(machine, "1", visible=(("ROCR_VISIBLE_DEVICES", "2"),))) == ["1"]
    with pytest.raises(DeviceError, match=r"^ROCR_VISIBLE_DEVICES=3 names device 3, but ROCr numbers 3 device\(s\) here"):
        devices.visible_ids(machine, (("ROCR_VISIBLE_DEVICES", "3"),))
    # Where the AMD reader knows ROCr's numbers (KFD node order), they are the ones counted by.
    numbered = [replace(device, runtime_index=number) for device, number in zip(machine, [None, 2, 0, 1], strict=True)]
    assert devices.visible_ids(numbered, (("ROCR_VISIBLE_DEVICES", "0"),)) == {"0.1"}
    assert devices.visible_ids(numbered, (("ROCR_VISIBLE_DEVICES", "1"),)) == {"1"}
    assert devices.runtime_numbers(numbered) == {"0.0": 2, "0.1": 0, "1": 1}


@pytest.mark.parametrize("vendor", ["amd"])
def test_an_amd_uuid_names_its_gpu_in_either_case_as_rocr_upper_cases_both(vendor):
    gpus = [gpu(i) for i in range(3)]  # UUIDs GPU-00ff-0000, GPU-11ff-0000, ...
    assert devices.visible_ids(gpus, (("ROCR_VISIBLE_DEVICES", "gpu-11FF"),)) == {"1"}
    assert ids(choose(gpus, gpus[2].uuid.upper())) == ["2"]


def test_on_nvidia_only_cuda_visible_devices_limits_the_choice():
    gpus = [gpu(i) for i in range(3)]
    limits = devices.visibility_limits(
        gpus, {"ROCR_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "2"}
    )
    assert limits == (("CUDA_VISIBLE_DEVICES", "2"),)


@pytest.mark.parametrize("vendor", ["amd"])
def test_amd_partitions_are_kept_apart_from_whole_gpus_but_several_run_together(vendor):
    partitions = [gpu(0, mig_enabled=True, util=None)] + [gpu(slot, total_gib=24, mig_of=0) for slot in range(4)]
    assert ids(choose(partitions, "all")) == ["0.0", "0.1", "0.2", "0.3"]  # RCCL takes partitions as GPUs
    assert ids(choose(partitions, "auto:2")) == ["0.0", "0.1"]
    assert ids(choose(partitions, "0.1,0.3")) == ["0.1", "0.3"]
    assert choose(partitions, "all").verdicts[0].describe() == "partition mode: use its partitions"
    beside = partitions + [gpu(1)]
    assert ids(choose(beside, "all")) == ["1"]  # a 24 GiB slice would pace a whole GPU
    with pytest.raises(DeviceError, match=r"^GPU 0 is in a compute partition mode, .*choose them \(0.0, 0.1, 0.2, 0.3\)"):
        choose(beside, "0")


def test_a_gpu_is_made_visible_by_its_vendors_variable_and_the_id_its_runtime_takes():
    nvidia = gpu(0)
    assert (nvidia.visibility_variable, nvidia.visible_id) == ("CUDA_VISIBLE_DEVICES", nvidia.uuid)
    amd = Gpu("2", 2, "GPU-8d1457e2c20f59d2", "AMD Instinct MI300X", "0000:45:00.0", GIB, 0, 0.0, (), vendor="amd")
    assert (amd.visibility_variable, amd.visible_id) == ("ROCR_VISIBLE_DEVICES", "GPU-8d1457e2c20f59d2")
    partition = Gpu(
        "2.1", 2, "00ff74a1-0000-1000-8001-000000000000", "AMD Instinct MI300X", "?", GIB, 0, 0.0, (), mig=True, vendor="amd"
    )
    assert partition.visible_id == "2.1"  # no ROCr UUID: placement gives its ROCr index (test_placement.py)
