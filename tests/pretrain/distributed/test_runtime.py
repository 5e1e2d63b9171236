"""Which GPU a training process takes, under the launcher, under torchrun, or alone
(CUDA faked: this machine has none)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain import config as cfg
from pretrain.distributed import runtime
from pretrain.distributed.runtime import Runtime, RuntimeSetupError, choose_device

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = ("GPU_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "LAUNCHER_CUDA_DEVICE_INDEX")


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n, **env): pretend n GPUs are visible and the process environment is env."""

    def fake(count: int, **env: str) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        for name in CONTRACT:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return fake


def config(*sets: str) -> cfg.Config:
    return cfg.resolve(preset="debug", sets=["system.device=cuda", *sets])


def test_under_the_launcher_a_worker_takes_the_one_gpu_it_was_given(gpus):
    gpus(1, GPU_RANK="5", LOCAL_RANK="3", LOCAL_WORLD_SIZE="8", RANK="3", WORLD_SIZE="8")
    assert choose_device(config()) == torch.device("cuda", 0)


def test_under_the_launcher_a_worker_seeing_the_nodes_gpus_takes_the_one_it_is_told(gpus):
    gpus(4, GPU_RANK="6", LOCAL_RANK="2", LOCAL_WORLD_SIZE="4", RANK="2", WORLD_SIZE="4", LAUNCHER_CUDA_DEVICE_INDEX="2")
    assert choose_device(config()) == torch.device("cuda", 2)
    gpus(4, GPU_RANK="6", LOCAL_RANK="2", LOCAL_WORLD_SIZE="4", RANK="2", WORLD_SIZE="4", LAUNCHER_CUDA_DEVICE_INDEX="0")
    assert choose_device(config()) == torch.device("cuda", 0)  # the index, not LOCAL_RANK, says which


def test_a_device_index_beyond_the_visible_gpus_is_one_line_naming_them(gpus, monkeypatch):
    gpus(2, GPU_RANK="3", LOCAL_RANK="2", LOCAL_WORLD_SIZE="3", RANK="2", WORLD_SIZE="3", LAUNCHER_CUDA_DEVICE_INDEX="2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b")
    with pytest.raises(RuntimeSetupError) as error:
        choose_device(config())
    assert str(error.value) == (
        "LAUNCHER_CUDA_DEVICE_INDEX=2 names no GPU: 2 GPU(s) are visible (CUDA_VISIBLE_DEVICES=GPU-a,GPU-b); "
        "unset it, or start this through the launcher"
    )
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")  # ROCm: the launcher's AMD workers see ROCR's mask
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "GPU-8d1457e2c20f59d2,3")
    with pytest.raises(RuntimeSetupError, match=r"visible \(ROCR_VISIBLE_DEVICES=GPU-8d1457e2c20f59d2,3\); unset it"):
        choose_device(config())


def test_a_worker_makes_its_gpu_current_before_joining_the_nccl_group(gpus, monkeypatch):
    gpus(2, GPU_RANK="5", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", RANK="1", WORLD_SIZE="2", LAUNCHER_CUDA_DEVICE_INDEX="1")
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda **kw: calls.append(("init", kw["backend"], kw["device_id"])))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # restored after the test
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
    started = runtime.init_runtime(config("training.cpu_offload=false"))
    cuda_1 = torch.device("cuda", 1)
    assert calls == [("set_device", cuda_1), ("init", "nccl", cuda_1)]
    assert (started.device, started.label) == (cuda_1, "GPU 5")


def test_under_torchrun_each_rank_of_a_node_takes_the_gpu_of_its_local_rank(gpus):
    gpus(4, LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", RANK="5", WORLD_SIZE="8")
    assert choose_device(config()) == torch.device("cuda", 1)
    gpus(4, LOCAL_RANK="3", LOCAL_WORLD_SIZE="4", RANK="3", WORLD_SIZE="4")
    assert choose_device(config()) == torch.device("cuda", 3)


def test_alone_device_id_pins_the_process_to_that_gpu(gpus):
    gpus(4)
    assert choose_device(config("system.device_id=2")) == torch.device("cuda", 2)
    assert choose_device(config("system.device_id=null")) == torch.device("cuda", 0)
    gpus(4, LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", RANK="0", WORLD_SIZE="1")  # torchrun --nproc-per-node 1
    assert choose_device(config("system.device_id=3")) == torch.device("cuda", 3)


def test_a_local_rank_beyond_the_visible_gpus_is_one_line_naming_the_fix(gpus):
    gpus(4, LOCAL_RANK="4", LOCAL_WORLD_SIZE="8", RANK="4", WORLD_SIZE="8")
    with pytest.raises(RuntimeSetupError) as error:
        choose_device(config())
    assert str(error.value) == (
        "LOCAL_RANK 4 has no GPU of its own: 4 GPU(s) are visible; start at most 4 processes per node (torchrun --nproc-per-node)"
    )


def test_device_id_with_several_ranks_on_a_node_is_refused_rather_than_shared(gpus):
    gpus(4, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", RANK="1", WORLD_SIZE="2")
    with pytest.raises(
        RuntimeSetupError,
        match=r"^system.device_id pins one GPU but 2 processes run on this "
        r"node \(LOCAL_WORLD_SIZE\); set system.device_id=null",
    ):
        choose_device(config("system.device_id=0"))


def test_a_device_id_that_does_not_exist_is_refused(gpus):
    gpus(2)
    with pytest.raises(RuntimeSetupError, match=r"^system.device_id 2 does not exist; 2 GPU\(s\) are visible$"):
        choose_device(config("system.device_id=2"))


# --- CUDA_DEVICE_ORDER ---------------------------------------------------------------

ORDER_WHEN_TORCH_LOADS = """\
import importlib.abc, os, sys
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("order when torch loads:", os.environ.get("CUDA_DEVICE_ORDER"), flush=True)
            print("allocator when torch loads:", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), flush=True)
            print("hip allocator when torch loads:", os.environ.get("PYTORCH_HIP_ALLOC_CONF"), flush=True)
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, Watch())
import pretrain_main
import gc
print("collector after the imports:", "on" if gc.isenabled() else "off", gc.get_freeze_count(), "frozen", flush=True)
"""


def seen_by_torch(**env: str) -> list[str]:
    return list(_entry_point_lines(tuple(sorted(env.items()))))


@functools.cache  # one process per environment, shared by the tests that read its lines
def _entry_point_lines(env: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    unset = ("CUDA_DEVICE_ORDER", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    environment = {k: v for k, v in os.environ.items() if k not in unset} | dict(env)
    result = subprocess.run(
        [sys.executable, "-c", ORDER_WHEN_TORCH_LOADS], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return tuple(result.stdout.strip().splitlines())


def order_seen_by_torch(**env: str) -> str:
    return seen_by_torch(**env)[0]


@pytest.mark.slow
def test_the_entry_point_numbers_gpus_in_pci_order_before_torch_loads():
    assert order_seen_by_torch() == "order when torch loads: PCI_BUS_ID"


@pytest.mark.slow
def test_a_device_order_the_user_set_is_kept():
    assert order_seen_by_torch(CUDA_DEVICE_ORDER="FASTEST_FIRST") == "order when torch loads: FASTEST_FIRST"


@pytest.mark.slow
def test_the_entry_point_asks_for_expandable_segments_unless_the_user_chose_an_allocator():
    assert seen_by_torch()[1] == "allocator when torch loads: expandable_segments:True"
    assert (
        seen_by_torch(PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512")[1] == "allocator when torch loads: max_split_size_mb:512"
    )


@pytest.mark.slow
def test_the_entry_point_leaves_a_rocm_allocator_setting_alone():
    # ROCm's torch reads PYTORCH_CUDA_ALLOC_CONF first: a default there would override this one.
    seen = seen_by_torch(PYTORCH_HIP_ALLOC_CONF="max_split_size_mb:512")
    assert seen[1:3] == ["allocator when torch loads: None", "hip allocator when torch loads: max_split_size_mb:512"]


@pytest.mark.slow
def test_the_entry_point_freezes_what_its_imports_made_so_that_collections_in_training_skip_it():
    # pretrain/run/startup_gc.py: torch alone is ~175,000 objects; the collector is back on for the run.
    words = seen_by_torch()[-1].split()
    assert words[:4] == ["collector", "after", "the", "imports:"] and words[4] == "on" and words[-1] == "frozen"
    assert int(words[5]) > 150_000


def _ended_together(monkeypatch, barrier_error: RuntimeError) -> list[str]:
    """shutdown after a run that ended together, its final barrier raising barrier_error."""
    calls: list[str] = []

    def barrier() -> None:
        calls.append("barrier")
        raise barrier_error

    monkeypatch.setattr(runtime.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime.dist, "barrier", barrier)
    monkeypatch.setattr(runtime.dist, "destroy_process_group", lambda: calls.append("destroy"))
    runtime.shutdown(Runtime(rank=0, world_size=2, device=torch.device("cpu"), label="CPU0"), peers_alive=True)
    return calls


def test_a_peer_that_closes_its_connection_after_the_final_barrier_ends_no_run_in_error(monkeypatch):
    # Seen in a two-node Ctrl-C: rank 1 passed the barrier and exited before gloo on rank 0 took its last message.
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2978")
    assert _ended_together(monkeypatch, gone) == ["barrier"]  # no error, and no destroy on a broken group


def test_any_other_error_in_the_final_barrier_is_raised(monkeypatch):
    with pytest.raises(RuntimeError, match="out of memory"):
        _ended_together(monkeypatch, RuntimeError("CUDA out of memory"))
