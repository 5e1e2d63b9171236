"""GPU selection policies (launcher/gpus/selection.py; the request and criteria it reads:
launcher/gpus/request.py) and the GPU table (launcher/gpus/table.py), on GPUs described directly,
with claims replaced by a dictionary. A test that takes the `vendor` fixture (tests/conftest.py)
runs on NVIDIA GPUs and again on AMD ones. The launcher's own visibility variables
(CUDA_VISIBLE_DEVICES; ROCm's masks): tests/launcher/gpus/test_gpu_visibility_limits.py."""

from __future__ import annotations

import pytest

from support.gpu_selection import GIB, Claims, choose, gpu, ids, made_by, mig_machine  # noqa: F401  made_by: autouse
from launcher.gpus import selection as devices
from launcher.gpus.request import Criteria, DeviceError, GpuRequest, parse_max_utilization, parse_min_free_memory, parse_request
from launcher.gpus.selection import select
from launcher.gpus.table import render
from launcher.gpus.devices import Gpu, GpuProcess

# --- parsing --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, request_",
    [
        ("all", GpuRequest("all")),
        ("ALL", GpuRequest("all")),
        ("none", GpuRequest("none")),
        ("auto", GpuRequest("auto", count=1)),
        ("auto:3", GpuRequest("auto", count=3)),
        ("0,3", GpuRequest("list", ids=("0", "3"))),
        (" 2 ", GpuRequest("list", ids=("2",))),
        ("0.1,GPU-ab12", GpuRequest("list", ids=("0.1", "GPU-ab12"))),
    ],
)
def test_gpu_requests_are_parsed(text, request_):
    assert parse_request(text) == request_


@pytest.mark.parametrize(
    "text, message",
    [
        ("auto:0", "the count after auto: must be a whole number of at least 1"),
        ("auto:x", "the count after auto: must be a whole number of at least 1"),
        ("0,,3", "is not all, auto:N, none, or a list of GPU ids like 0,3"),
        ("gpu0", "is not all, auto:N, none, or a list of GPU ids like 0,3"),
        ("", "is not all, auto:N, none, or a list of GPU ids like 0,3"),
        ("1,1", "names GPU 1 twice"),
    ],
)
def test_bad_gpu_requests_are_one_line_errors(text, message):
    with pytest.raises(DeviceError, match=message) as error:
        parse_request(text)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "text, value",
    [
        ("90%", 0.9),
        ("0%", 0.0),
        ("20GiB", 20 * GIB),
        ("20", 20 * GIB),
        ("500MiB", 500 * 2**20),
        ("16GB", 16e9),
        ("1.5g", 1.5 * GIB),
    ],
)
def test_min_free_memory_is_a_share_or_an_amount(text, value):
    assert parse_min_free_memory(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["lots", "150%", "20TB", "-1GiB"])
def test_bad_min_free_memory_is_refused(text):
    with pytest.raises(DeviceError, match="--min-free-memory"):
        parse_min_free_memory(text)


def test_max_utilization_is_a_percentage_from_0_to_100():
    assert parse_max_utilization("25%") == 25 and parse_max_utilization("0") == 0
    for bad in ("101", "-5", "busy", "nan"):
        with pytest.raises(DeviceError, match="--max-utilization"):
            parse_max_utilization(bad)


# --- verdicts -------------------------------------------------------------------------


def test_a_gpu_is_busy_over_the_utilization_limit_or_under_the_free_memory_floor(vendor):
    judge = lambda g: devices.judge(g, Criteria(min_free_memory=0.9, max_utilization=10), None, lambda _: None)  # noqa: E731
    assert judge(gpu(0, util=10)).state == "free"  # the limit itself is allowed
    assert judge(gpu(0, util=11)).reasons == ("utilization 11% > 10%",)
    assert judge(gpu(0, used_gib=9)).reasons == ("71.0 GiB free < 90%",)
    assert judge(gpu(0, used_gib=8)).state == "free"
    assert len(judge(gpu(0, util=50, used_gib=70)).reasons) == 2


def test_an_absolute_free_memory_floor_ignores_the_total(vendor):
    criteria = Criteria(min_free_memory=parse_min_free_memory("20GiB"))
    assert devices.judge(gpu(0, used_gib=59), criteria, None, lambda _: None).state == "free"
    assert devices.judge(gpu(0, used_gib=61), criteria, None, lambda _: None).reasons == ("19.0 GiB free < 20 GiB",)


def test_unknown_utilization_is_neither_zero_nor_busy(vendor):
    verdict = devices.judge(gpu(0, util=None), Criteria(), None, lambda _: None)
    assert verdict.state == "free" and verdict.describe() == "free (utilization unknown)"
    busy = devices.judge(gpu(0, util=None, used_gib=79), Criteria(), None, lambda _: None)
    assert busy.state == "busy" and "utilization" not in busy.describe()


# --- all ------------------------------------------------------------------------------


def test_all_takes_every_free_gpu_and_records_why_the_others_were_skipped(vendor):
    gpus = [gpu(0), gpu(1, util=97), gpu(2), gpu(3, used_gib=70)]
    selection = choose(gpus, "all")
    assert ids(selection) == ["0", "2"]
    assert [v.state for v in selection.verdicts] == ["chosen", "busy", "chosen", "busy"]


def test_eight_idle_gpus_are_all_taken_in_nvml_order(vendor):
    assert ids(choose([gpu(i) for i in range(8)], "all")) == [str(i) for i in range(8)]


def test_all_with_nothing_free_is_an_error_with_the_table_of_reasons(vendor):
    gpus = [gpu(0, util=90), gpu(1, used_gib=79)]
    with pytest.raises(DeviceError) as error:
        choose(gpus, "all", Claims({gpus[0].uuid: 4242}))
    assert str(error.value).startswith("none of the 2 GPU(s) is free")
    assert "loosen --max-utilization or --min-free-memory" in str(error.value)
    table = render(error.value.verdicts).splitlines()
    assert "claimed by launcher pid 4242 (bob)" in table[1] and "GiB free < 90%" in table[2]


def test_a_gpu_claimed_by_another_launcher_is_skipped_by_all(vendor):
    gpus = [gpu(0), gpu(1)]
    selection = choose(gpus, "all", Claims({gpus[0].uuid: 77}))
    assert ids(selection) == ["1"] and selection.verdicts[0].state == "claimed"


def test_all_losing_the_race_for_some_gpus_runs_on_the_rest(vendor):
    gpus = [gpu(0), gpu(1), gpu(2)]
    table = Claims()
    table.holder = lambda uuid: None  # type: ignore[method-assign]  # the look found nothing held
    table.held[gpus[0].uuid] = 99  # ...then another launcher won GPU 0
    selection = select(gpus, parse_request("all"), Criteria(), claim=table.claim, holder=table.holder)
    assert ids(selection) == ["1", "2"] and selection.verdicts[0].state == "claimed"


def test_losing_the_race_for_a_gpu_moves_on_to_the_next_free_one(vendor):
    """The table saw GPU 0 free, but another launcher claimed it first."""
    gpus = [gpu(0), gpu(1)]
    table = Claims()
    table.holder = lambda uuid: None  # type: ignore[method-assign]  # the look found nothing held
    table.held[gpus[0].uuid] = 99  # ...then the other launcher won
    selection = select(gpus, parse_request("auto:1"), Criteria(), claim=table.claim, holder=table.holder)
    assert ids(selection) == ["1"]
    assert selection.verdicts[0].describe() == "claimed by launcher pid 99 (bob) since 09:00"


# --- auto:N ---------------------------------------------------------------------------


def test_auto_takes_the_lowest_utilization_then_the_most_free_memory(vendor):
    gpus = [gpu(0, util=5), gpu(1, util=0, used_gib=5), gpu(2, util=0, used_gib=2), gpu(3, util=1)]
    assert ids(choose(gpus, "auto:1")) == ["2"]
    assert ids(choose(gpus, "auto:2")) == ["1", "2"]  # ranks in NVML order
    assert ids(choose(gpus, "auto:3")) == ["1", "2", "3"]


def test_auto_ranks_unknown_utilization_after_every_measured_one(vendor):
    gpus = [gpu(0, util=None), gpu(1, util=8)]
    assert ids(choose(gpus, "auto:1")) == ["1"]


def test_auto_asking_for_more_than_are_free_fails_and_releases_what_it_claimed(vendor):
    table = Claims()
    with pytest.raises(DeviceError, match=r"--gpus auto:3 needs 3, but 2 of 3 GPU\(s\) are free") as error:
        choose([gpu(0), gpu(1), gpu(2, util=50)], "auto:3", table)
    assert sorted(table.released) == sorted([gpu(0).uuid, gpu(1).uuid]) and not table.held
    assert [v.gpu.id for v in error.value.verdicts] == ["0", "1", "2"]


# --- explicit lists -------------------------------------------------------------------


def test_an_explicit_list_is_used_as_given_and_a_busy_gpu_in_it_is_a_warning(vendor):
    selection = choose([gpu(0), gpu(1, util=97), gpu(2), gpu(3)], "3,1")
    assert ids(selection) == ["1", "3"]
    assert selection.warnings == ["GPU 1 is busy (utilization 97% > 10%); using it anyway as --gpus names it (--strict refuses)"]


def test_strict_refuses_a_busy_gpu_in_the_list_and_claims_nothing(vendor):
    table = Claims()
    with pytest.raises(DeviceError, match="GPU 1 is busy .*; --strict refuses busy GPUs"):
        choose([gpu(0), gpu(1, util=97)], "0,1", table, strict=True)
    assert not table.held


def test_a_gpu_that_does_not_exist_lists_the_gpus_there_are(vendor):
    with pytest.raises(DeviceError, match=r"--gpus names GPU 7, which does not exist; GPUs here: 0, 1 "):
        choose([gpu(0), gpu(1)], "7")


def test_a_listed_gpu_claimed_by_another_launcher_is_an_error_naming_the_holder(vendor):
    gpus = [gpu(0), gpu(1)]
    table = Claims({gpus[1].uuid: 31337})
    with pytest.raises(DeviceError, match="GPU 1 is claimed by launcher pid 31337 .*; choose another GPU or wait"):
        choose(gpus, "0,1", table)
    assert table.released == [gpus[0].uuid]  # GPU 0's claim was given back


def test_gpus_can_be_named_by_uuid_or_unique_uuid_prefix(vendor):
    gpus = [gpu(0), gpu(1), gpu(11)]
    assert ids(choose(gpus, f"{gpus[1].uuid}")) == ["1"]
    assert ids(choose(gpus, "GPU-00")) == ["0"]
    with pytest.raises(DeviceError, match="matches 2 GPUs; give more of the UUID"):
        choose(gpus, "GPU-1")


def test_one_gpu_named_by_id_and_by_uuid_is_refused(vendor):
    gpus = [gpu(0), gpu(1)]
    with pytest.raises(DeviceError, match="names one GPU twice"):
        choose(gpus, f"1,{gpus[1].uuid}")


# --- MIG ------------------------------------------------------------------------------


def test_on_a_machine_of_mig_devices_all_takes_one_of_them_and_says_why_not_the_others():
    selection = choose(mig_machine()[:3], "all")
    assert ids(selection) == ["0.0"]
    assert [g.visible_id for g in selection.chosen] == ["MIG-00aa"]
    assert selection.verdicts[0].describe() == "MIG mode: use its MIG devices"
    assert selection.verdicts[2].describe() == "MIG device: one per run (NCCL does not support MIG)"
    assert ids(choose(mig_machine()[:3], "auto:1")) == ["0.0"]  # one alone still runs


def test_auto_n_over_mig_devices_only_is_refused_with_the_reason_and_the_fix():
    with pytest.raises(DeviceError) as error:
        choose(mig_machine()[:3], "auto:2")
    assert str(error.value) == (
        f"--gpus auto:2 needs 2 GPUs, but only MIG devices are usable here and "
        f"{devices.ONE_MIG_DEVICE}; use --gpus auto:1, or whole GPUs"
    )
    assert "NCCL does not support MIG" in devices.ONE_MIG_DEVICE and "PCI bus id" in devices.ONE_MIG_DEVICE


def test_a_list_naming_several_mig_devices_is_refused_before_any_is_claimed():
    table = Claims()
    for request in ("0.0,0.1", "0.1,MIG-00"):
        with pytest.raises(
            DeviceError,
            match=r"names 2 MIG devices \(0\.[01], 0\.[01]\), but a run uses at most "
            r"one MIG device: NCCL does not support MIG.*; name one of them, "
            r"or use whole GPUs$",
        ):
            choose(mig_machine(), request, claimed=table)
    assert table.released == []  # refused before claiming, so nothing to give back


def test_all_and_auto_never_mix_mig_devices_with_whole_gpus(vendor):
    slice_ = {"nvidia": "MIG device", "amd": "partition"}[vendor]
    for request in ("all", "auto:1"):
        selection = choose(mig_machine(), request)
        assert ids(selection) == ["1"]
        assert selection.verdicts[1].describe() == f"{slice_}: not mixed with whole GPUs; name it in --gpus"
    assert ids(choose(mig_machine(), "0.0,1")) == ["0.0", "1"]  # named, they mix


def test_naming_a_gpu_in_mig_mode_points_to_its_mig_devices():
    with pytest.raises(DeviceError, match=r"GPU 0 is in MIG mode, .*choose its MIG devices \(0.0, 0.1\)"):
        choose(mig_machine(), "0")
    assert ids(choose(mig_machine(), "MIG-01")) == ["0.1"]


# --- the table ------------------------------------------------------------------------


def test_the_table_shows_every_device_with_its_numbers_and_verdict(vendor):
    processes = (GpuProcess(pid=4121, memory=70 * GIB, user="bob"), GpuProcess(pid=77, memory=None, user=None))
    gpus = [gpu(0), gpu(1, util=97, used_gib=70.5, processes=processes), gpu(2, util=None)] + mig_machine()
    lines = render(choose(gpus[:3], "all").verdicts).splitlines()
    assert lines[0].split() == ["GPU", "NAME", "BUS", "ID", "MEMORY", "USED", "UTIL", "PROCESSES", "HEALTH", "VERDICT"]
    assert lines[1].split()[0] == "0" and lines[1].rstrip().endswith("chosen")
    assert "70.5 / 80.0 GiB" in lines[2] and "97%" in lines[2]
    assert "4121 (bob) 70.0 GiB, 77 (not visible here)" in lines[2]
    assert "busy: utilization 97% > 10%; 9.5 GiB free < 90%" in lines[2]
    assert " ? " in lines[3] and lines[3].rstrip().endswith("chosen (utilization unknown)")
    at = lines[0].index("VERDICT")  # columns line up under the header
    assert [line[at:].split()[0] for line in lines[1:]] == ["chosen", "busy:", "chosen"]


def test_the_table_indents_mig_devices_under_their_gpu_and_shows_na_utilization(vendor):
    lines = render(choose(mig_machine(), "all").verdicts).splitlines()
    assert lines[1].split()[0] == "0" and " n/a " in lines[1]
    assert lines[2].startswith("  0.0") and lines[3].startswith("  0.1")


def test_a_long_process_list_is_cut_to_three_and_a_count(vendor):
    many = tuple(GpuProcess(pid=100 + i, memory=GIB, user="ann") for i in range(5))
    line = render(choose([gpu(0, processes=many)], "all").verdicts).splitlines()[1]
    assert "102 (ann) 1.0 GiB, +2 more" in line and "103" not in line


def test_a_gpu_nvml_cannot_read_is_never_chosen_and_says_why(vendor):
    lost = Gpu.unreadable("1", 1, "GPU is lost", vendor=vendor)
    reader, check = {"nvidia": ("NVML", "`nvidia-smi`"), "amd": ("AMD SMI", "`amd-smi list`")}[vendor]
    selection = choose([gpu(0), lost, gpu(2)], "all")
    assert ids(selection) == ["0", "2"]
    assert selection.verdicts[1].describe() == f"{reader} cannot read it: GPU is lost"
    with pytest.raises(DeviceError, match=f"GPU 1: {reader} cannot read it: GPU is lost; check {check}"):
        choose([gpu(0), lost], "1")
