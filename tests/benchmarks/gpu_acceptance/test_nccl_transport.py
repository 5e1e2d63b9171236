"""The GPU acceptance's nccl-transport check without a GPU: NCCL_DEBUG=INFO lines read into the
transport NCCL used, the bus bandwidth, the comparison of NVML's processes by GPU (which holds
inside containers), and the check's launches run with stand-in workers on a scripted machine."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.gpu_acceptance import checks_nccl
from benchmarks.gpu_acceptance.context import Context
from benchmarks.gpu_acceptance.workers_runtime import HOLDING
from benchmarks.gpu_acceptance.nccl_transport import bus_bandwidth, run_contexts, smi_processes, transport, transport_kind

NVLINK_LOG = """\
GPU0:node1:4101:4190 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
GPU0:node1:4101:4190 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
GPU1:node1:4102:4191 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/CUMEM/read
GPU1:node1:4102:4191 [1] NCCL INFO 16 coll channels, 0 nvls channels, 16 p2p channels, 16 p2p channels per peer
"""
SHM_LOG = """\
GPU0:node1:37105:37384 [0] NCCL INFO Could not enable P2P between dev 0(=80) and dev 1(=90)
GPU0:node1:37105:37384 [0] NCCL INFO Channel 00 : 0[80] -> 1[90] via direct shared memory
GPU1:node1:37106:37385 [1] NCCL INFO Channel 00 : 1[90] -> 0[80] via SHM/direct/direct
"""


@pytest.mark.parametrize(
    "via, kind",
    [
        ("P2P/CUMEM/read", "P2P/CUMEM"),
        ("P2P/IPC", "P2P/IPC"),
        ("P2P/direct pointer", "P2P/direct pointer"),
        ("SHM/direct/direct", "SHM"),
        ("direct shared memory", "SHM"),
        ("NET/IB/0/GDRDMA", "NET/IB"),
        ("NET/Socket/0", "NET/Socket"),
    ],
)
def test_each_way_nccl_names_a_connection_maps_to_its_transport(via, kind):
    assert transport_kind(via) == kind


def test_peer_to_peer_connections_are_counted_under_the_launchers_prefixes():
    seen = transport(NVLINK_LOG)
    assert seen.connections == {"P2P/CUMEM": 3} and not seen.nvls and seen.peer_to_peer
    assert seen.describe() == "P2P/CUMEM (3 connections)"


def test_a_fall_back_to_shared_memory_is_not_peer_to_peer_and_says_p2p_was_refused():
    seen = transport(SHM_LOG)
    assert seen.connections == {"SHM": 2} and not seen.peer_to_peer
    assert seen.describe() == "SHM (2 connections); NCCL could not enable P2P"


def test_nvls_channels_and_send_receive_connections_are_recognised():
    log = (
        "h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0\n"
        "h:1:2 [0] NCCL INFO 24 coll channels, 16 nvls channels, 32 p2p channels, 32 p2p channels per peer\n"
    )
    seen = transport(log)
    assert seen.nvls and seen.peer_to_peer and seen.describe() == "NVLS + NET/IB (1 connection)"
    assert transport("no nccl here").describe().startswith("no connection lines")


def test_bus_bandwidth_is_nccl_tests_all_reduce_formula():
    assert bus_bandwidth(10**9, 0.01, 2) == pytest.approx(100.0)  # 2 ranks: the algorithm bandwidth
    assert bus_bandwidth(10**9, 0.01, 8) == pytest.approx(175.0)  # x 2 (8 - 1) / 8


def test_one_new_process_per_run_gpu_is_clean_whatever_else_runs():
    before = {"GPU-a": {900}, "GPU-c": {901}}  # someone else's, before the run
    during = {"GPU-a": {900, 4101}, "GPU-b": {4102}, "GPU-c": {901, 905}}  # 905: someone else's, on no run GPU
    contexts = run_contexts(before, during, ["GPU-a", "GPU-b"])
    assert contexts.ok is True and contexts.elsewhere == {}
    assert contexts.describe([4101, 4102]).endswith("none on a second GPU; host pids are the workers' own")
    assert contexts.describe([17, 18]).endswith("host pids differ from the workers' (a container)")


@pytest.mark.parametrize(
    "during, holder",
    [
        ({"GPU-a": {4101}, "GPU-b": {4101, 4102}}, {4101: ("GPU-a", "GPU-b")}),  # a worker on its peer's GPU
        ({"GPU-a": {4101}, "GPU-b": {4102}, "GPU-c": {4102}}, {4102: ("GPU-b", "GPU-c")}),  # on a GPU outside the run
    ],
)
def test_a_run_process_on_a_second_gpu_is_caught_without_knowing_our_pids(during, holder):
    contexts = run_contexts({}, during, ["GPU-a", "GPU-b"])
    assert contexts.ok is False and contexts.elsewhere == holder
    assert "holds contexts on" in contexts.describe()


def test_nvml_listing_none_of_the_run_is_undecided_not_a_pass():
    contexts = run_contexts({"GPU-a": {900}}, {"GPU-a": {900}}, ["GPU-a", "GPU-b"])
    assert contexts.ok is None and contexts.describe() == "NVML lists no process of the run (not visible from this container)"
    assert run_contexts({}, {"GPU-a": {4101}}, ["GPU-a", "GPU-b"]).ok is False  # one worker missing


def test_nvidia_smi_rows_become_pids_per_gpu():
    rows = [["GPU-a", "4101"], ["GPU-a", "4102"], ["MIG-b", "7"], ["No running processes found"]]
    assert smi_processes(rows) == {"GPU-a": {4101, 4102}, "MIG-b": {7}}


# --- the check's launches, with stand-in workers ------------------------------------------

STAND_IN = """\
import json, os, pathlib, sys, time
rank, shared = int(os.environ["RANK"]), "," in os.environ["CUDA_VISIBLE_DEVICES"]
print("h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via " + ("P2P/IPC" if shared else "SHM/direct/direct"), flush=True)
result = {{"rank": rank, "pid": 4101 + rank, "device": "cuda:" + os.environ["LAUNCHER_CUDA_DEVICE_INDEX"],
          "visible": 2, "bytes": 10**9, "seconds": 0.02 if shared else 0.04, "ranks": 2, "other_contexts": [],
          "compiled": "yes"}}
print("GPU_CHECK_RESULT " + json.dumps(result), flush=True)
print({holding!r}, flush=True)
while not pathlib.Path(sys.argv[-1]).exists():
    time.sleep(0.02)
"""


def test_the_check_launches_both_ways_and_holds_the_pcie_choice_to_the_faster_way(tmp_path, monkeypatch):
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps({"p2p": "pcie", "gpus": [{}, {}]}))
    monkeypatch.setenv("LAUNCHER_SCRIPTED_GPUS", str(machine))
    monkeypatch.setenv("LAUNCHER_CLAIMS_NAMESPACE", f"nccl-transport-{tmp_path.name}")
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(textwrap.dedent(STAND_IN.format(holding=HOLDING)))
    monkeypatch.setattr(checks_nccl, "worker_argv", lambda name, *args: [sys.executable, str(stand_in), *args])
    readings = iter([{}, {"GPU-a": {4101}, "GPU-b": {4102}}, {}, {"GPU-a": {4101}, "GPU-b": {4101, 4102}}])
    monkeypatch.setattr(checks_nccl, "_gpu_processes", lambda: next(readings))
    monkeypatch.setattr(checks_nccl, "_pair", lambda indices: (["GPU-a", "GPU-b"], "pcie", True))
    own, node = checks_nccl.check_nccl_transport(Context(quick=True, sets=[], gpus=[0, 1], tmp=tmp_path))
    assert own.check == "NCCL all-reduce, GPUs 0,1 (pcie), each worker sees only its own GPU"
    assert own.result.startswith("SHM (2 connections); bus bandwidth 25.0 GB/s (256 MiB fp32); workers on cuda:0, cuda:0")
    assert own.result.endswith("other GPUs with a context in a worker: none; torch.compile: yes") and own.met == "yes"
    assert node.check.endswith("each worker sees both GPUs (training's choice)")
    assert "P2P/IPC (2 connections); bus bandwidth 50.0 GB/s" in node.result and "workers on cuda:0, cuda:1" in node.result
    assert "pid 4101 holds contexts on GPU-a, GPU-b" in node.result and node.met == "no"


def test_on_one_gpu_the_check_says_skipped():
    (row,) = checks_nccl.check_nccl_transport(Context(quick=True, sets=[], gpus=[0], tmp=Path("/nonexistent")))
    assert (row.result, row.met) == ("skipped: one GPU", "n.a.")
