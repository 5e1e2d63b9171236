"""The host memory checkpoints take (pretrain/plan/checkpoint_memory.py, planned in
pretrain/plan/host_memory.py plan_checkpoints): training.async_checkpoint's staged copy and the
local tier's copies in /dev/shm, decided by the launcher's plan or by a worker alone."""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from support.checkpointing import make_trainer, resolved
from launcher.gpus.placement import Placement
from launcher.prepare import prepare_training
from launcher.supervise.printer import Printer
from pretrain import config as cfg
from pretrain.build import asynchronous_checkpoints
from pretrain.checkpoint.tiers import base_of
from pretrain.config import ConfigError
from pretrain.distributed.runtime import Runtime
from pretrain.observe.progress import PROGRESS_VAR
from pretrain.plan import host_memory
from pretrain.plan.checkpoint_memory import local_tier_bytes, size, staged_bytes, state_bytes
from pretrain.plan.gpu_memory import GIB
from pretrain.plan.host_memory import export_copy_bytes, host_estimate, plan_checkpoints
from pretrain.plan.parallelism import plan_parallelism


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_async_checkpoint_takes_true_false_or_auto_only():
    with pytest.raises(ConfigError, match='training.async_checkpoint: "yes" \\(a string\\) is not one of true, false, "auto"'):
        cfg.resolve(preset="debug", sets=['training.async_checkpoint="yes"'])


def planned(*sets: str, world_size: int = 2) -> cfg.Config:
    config = cfg.resolve(preset="small", sets=["model.vocab_size=50304", *sets])
    return plan_parallelism(config, world_size, None)[0]


def test_auto_is_asynchronous_where_the_host_has_room_for_the_staged_copy_else_synchronous_with_a_warning():
    config = planned()
    staged = staged_bytes(config, 2, "ddp", 2)
    assert staged == state_bytes(config)  # DDP: rank 0 stages the whole state
    roomy, line = plan_checkpoints(config, 2, 64 * GIB, on_gpus=False)
    assert roomy.training.async_checkpoint is True and line.startswith("checkpoints: asynchronous, staged in ")
    tight, line = plan_checkpoints(config, 2, 5 * GIB, on_gpus=False)
    assert tight.training.async_checkpoint is False
    assert line.startswith("warning: checkpoints written synchronously: the staged copy needs ")


def test_true_without_room_for_the_staged_copy_is_refused_in_one_line():
    config = planned("training.async_checkpoint=true")
    with pytest.raises(ConfigError) as error:
        plan_checkpoints(config, 2, 5 * GIB, on_gpus=False)
    assert "\n" not in str(error.value) and "set training.async_checkpoint=false" in str(error.value)


def test_under_fsdp_each_rank_stages_its_shard_and_false_stages_nothing():
    config = planned("training.parallelism=fsdp")
    assert staged_bytes(config, 8, "fsdp", 8) == -(-state_bytes(config) // 8) * 8
    assert staged_bytes(config, 16, "fsdp", 8) == -(-state_bytes(config) // 16) * 8  # this host's 8 of 16
    off, line = plan_checkpoints(planned("training.async_checkpoint=false"), 2, 1 * GIB, on_gpus=False)
    assert off.training.async_checkpoint is False and line == "checkpoints: synchronous (training.async_checkpoint=false)"


def planned_on_nodes(*sets: str) -> cfg.Config:
    config = cfg.resolve(preset="small", sets=["model.vocab_size=50304", *sets])
    return plan_parallelism(config, 4, None, None, 2)[0]


def test_under_hsdp_each_rank_stages_its_shard_of_its_nodes_copy_and_the_local_tier_is_off_on_several_nodes():
    config = planned_on_nodes("training.parallelism=hsdp", "training.local_checkpoint_interval=5")
    assert config.training.parallelism == "hsdp"  # CPU workers keep it on several nodes: 2 x 2 here
    state = state_bytes(config)
    assert staged_bytes(config, 16, "hsdp", 8) == -(-state // 8) * 8  # the whole state on every host
    assert staged_bytes(config, 16, "fsdp", 8) == -(-state // 16) * 8  # FSDP: this host's 8 of 16 shards
    assert local_tier_bytes(config, 16, "hsdp", 8) == local_tier_bytes(config, 16, "fsdp", 8) == 0  # the sharded format
    assert local_tier_bytes(config, 8, "hsdp", 8) == 2 * state  # one node: every shard, twice
    assert export_copy_bytes(config, 16, "hsdp", offload=False) == export_copy_bytes(config, 16, "fsdp", offload=False) > 0
    _, line = plan_checkpoints(config, 4, 64 * GIB, 2, on_gpus=False)
    assert line == f"checkpoints: asynchronous, staged in {size(-(-state // 2) * 2)} of host memory"


def test_the_local_tier_in_dev_shm_is_counted_last_and_given_up_where_the_host_has_no_room_for_it():
    def plan(host: int, *sets: str) -> tuple[cfg.Config, str]:
        config = cfg.resolve(preset="small", sets=["model.vocab_size=50304", "training.checkpoint_interval=20", *sets])
        return plan_parallelism(config, 2, None, host)

    planned_alone = plan(64 * GIB, "training.local_checkpoint_interval=5")[0]  # room for everything
    local = local_tier_bytes(planned_alone, 2, "ddp", 2)  # two copies of the state
    need = 2 * host_estimate(planned_alone, 2, "ddp", on_gpus=False).total  # the workers
    tight = int((need + local // 2) / 0.9)  # room for one local checkpoint, not two
    config, line = plan(tight, "training.local_checkpoint_interval=5")
    assert config.training.local_checkpoint_interval == 0 and config.training.activation_checkpointing == "none"
    assert line.endswith(
        "; no local checkpoints (two local checkpoints in /dev/shm need 3.4 GiB of host memory, 1.7 GiB is left)"
    )
    with pytest.raises(ConfigError, match="training.local_checkpoint_dir /dev/shm/mine: two local checkpoints in /dev/shm need "):
        plan(tight, "training.local_checkpoint_interval=5", 'training.local_checkpoint_dir="/dev/shm/mine"')
    on_disk = plan(tight, "training.local_checkpoint_interval=5", 'training.local_checkpoint_dir="/mnt/nvme"')[0]
    roomy = plan(tight + local, "training.local_checkpoint_interval=5")[0]
    assert on_disk.training.local_checkpoint_interval == roomy.training.local_checkpoint_interval == 5
    # ... and the staged copy comes after it
    assert plan_checkpoints(roomy, 2, tight + local, on_gpus=False)[0].training.async_checkpoint is False


def test_a_worker_alone_decides_auto_from_its_hosts_memory_and_refuses_true_without_room(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_HOST_MEMORY_GIB", "0.001")
    trainer = make_trainer(cache, tmp_path / "run")  # "auto", a host without room
    assert trainer.config.training.async_checkpoint is False and not trainer.checkpoints.asynchronous
    with pytest.raises(ConfigError, match="training.async_checkpoint=true: the staged copy needs "):
        make_trainer(cache, tmp_path / "run2", "training.async_checkpoint=true")
    monkeypatch.setenv("LAUNCHER_HOST_MEMORY_GIB", "64")
    assert make_trainer(cache, tmp_path / "run3").checkpoints.asynchronous


def test_a_worker_the_launcher_started_does_not_check_again_the_true_the_launcher_decided(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_HOST_MEMORY_GIB", "0.001")  # the workers hold the host's memory by now
    monkeypatch.setenv(PROGRESS_VAR, "@progress@")  # a worker of the launcher
    assert make_trainer(cache, tmp_path / "run", "training.async_checkpoint=true").checkpoints.asynchronous


@pytest.fixture
def own_local_tier(tmp_path):
    """The run's own local checkpoints in /dev/shm, as a restart finds them: (run dir, their bytes)."""
    config, run_dir = cfg.resolve(preset="debug", sets=["training.local_checkpoint_interval=5"]), tmp_path / "run"
    base = base_of(config, run_dir)
    assert str(base).startswith("/dev/shm/")
    (base / "step_5").mkdir(parents=True)
    (base / "step_5" / "model.pt").write_bytes(b"\0" * (8 << 20))
    yield run_dir, 8 << 20
    shutil.rmtree(base, ignore_errors=True)


def test_a_worker_alone_counts_its_runs_own_local_checkpoints_in_dev_shm_as_available(cache, monkeypatch, own_local_tier):
    run_dir, held = own_local_tier
    config, _ = resolved(cache, "training.local_checkpoint_interval=5")
    config = plan_parallelism(config, 1, None)[0]
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")
    host = {}

    def plan(config, world_size, host_memory, local_ranks, on_gpus):
        host["bytes"] = host_memory
        return config, "checkpoints: asynchronous"

    monkeypatch.setattr(host_memory, "plan_checkpoints", plan)
    monkeypatch.setenv("LAUNCHER_HOST_MEMORY_GIB", "1")
    asynchronous_checkpoints(config, runtime, 1, run_dir)
    assert host["bytes"] == GIB + held


def test_the_launchers_plan_counts_this_nodes_ranks_and_the_runs_own_local_checkpoints(tmp_path, monkeypatch, own_local_tier):
    run_dir, held = own_local_tier
    seen = {}

    def plan(config, world_size, host_memory, local_ranks=None, on_gpus=True):
        seen.update(world_size=world_size, host=host_memory, local_ranks=local_ranks)
        return config, "checkpoints: asynchronous"

    monkeypatch.setattr(host_memory, "plan_checkpoints", plan)
    monkeypatch.setenv("LAUNCHER_HOST_MEMORY_GIB", "64")
    node = SimpleNamespace(world_size=4, nproc=2, smallest_gpu_memory=None)  # 2 nodes of 2 CPU workers
    config = cfg.resolve(preset="debug", sets=[f"data.cache_dir={tmp_path / 'cache'}", "training.local_checkpoint_interval=5"])
    prepare_training(config, Placement("cpu", 2), Printer(io.StringIO(), None), node, run_dir=run_dir)
    assert seen == {"world_size": 4, "host": 64 * GIB + held, "local_ranks": 2}
