"""The launcher's plan on several nodes (pretrain/plan/parallelism.py): hybrid sharding (HSDP,
sharded over the ranks of a node, replicated across nodes) where the model fits sharded within one
node, FSDP over every rank where only that fits, "hsdp" on one node run as FSDP with a warning, and
"hsdp" that a node cannot hold refused in one line naming the per-GPU estimate."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from support.processes import one_line_error
from launcher.gpus.placement import Placement
from launcher.prepare import prepare_training, training_command
from launcher.supervise.printer import Printer
from support.memory_configs import GPU_80, scripted_gpu, small, with_training
from pretrain import config as cfg
from pretrain.config import ConfigError
from pretrain.plan.gpu_memory import GIB, estimate, fits_gpu
from pretrain.plan.parallelism import plan_parallelism

HSDP_2X8 = "parallelism: HSDP over 16 GPUs (2 nodes x 8, sharded within each node, replicated across nodes) (estimated "
ONE_NODE = "; warning: training.parallelism=hsdp on one node is FSDP (no other node to replicate across)"


def hsdp(config: cfg.Config) -> cfg.Config:
    return with_training(config, parallelism="hsdp")


def test_hsdp_is_estimated_as_fsdp_over_the_ranks_of_one_node():
    for config in (cfg.production(), small()):
        over_a_node, fsdp = estimate(config, 8, "hsdp", shard_ranks=4), estimate(config, 4, "fsdp")
        assert (over_a_node.mode, over_a_node.world_size) == ("hsdp", 8)
        assert (over_a_node.parts(), over_a_node.total) == (fsdp.parts(), fsdp.total)
        assert over_a_node.total > estimate(config, 8, "fsdp").total  # half the shards of FSDP over all 8
        assert estimate(config, 8, "hsdp", shard_ranks=8).total == estimate(config, 8, "fsdp").total  # one node
    with pytest.raises(ValueError, match="mode hsdp needs shard_ranks"):
        estimate(small(), 8, "hsdp")


def test_auto_on_two_nodes_picks_hsdp_where_the_model_fits_sharded_within_one():
    config, line = plan_parallelism(cfg.production(), 16, GPU_80, None, 8)  # 8B on 2 nodes x 8 x 80 GiB
    t = config.training
    assert (t.parallelism, t.cpu_offload) == ("hsdp", False)
    needed = estimate(config, 16, "hsdp", shard_ranks=8).total
    assert needed == estimate(config, 8, "fsdp").total and fits_gpu(needed, GPU_80)
    ddp = estimate(config, 16, "ddp").total
    assert line.startswith(
        f"{HSDP_2X8}{needed / GIB:.1f} GiB of 80.0 GiB per GPU; DDP would need ~{ddp / GIB:.1f} GiB; "
        "FSDP over all 16 would send every all-gather across nodes); activation checkpointing: "
    )
    # one node of the same 8 GPUs: FSDP as before, and a model DDP fits stays DDP on two nodes
    assert plan_parallelism(cfg.production(), 8, GPU_80, None, 8)[0].training.parallelism == "fsdp"
    assert plan_parallelism(small(), 16, GPU_80, None, 8)[0].training.parallelism == "ddp"


def test_auto_takes_hsdp_with_more_recomputation_before_fsdp_across_nodes():
    # 2 nodes x 2: HSDP fits only with full checkpointing and the loss in chunks, FSDP over all 4
    # would fit with less; its all-gathers would cross nodes on every micro-batch
    config, line = plan_parallelism(cfg.production(), 4, GPU_80, None, 2)
    t = config.training
    assert (t.parallelism, t.activation_checkpointing, t.loss_chunk_tokens) == ("hsdp", "full", 2048)
    less = with_training(config, activation_checkpointing="selective", loss_chunk_tokens=0)
    assert fits_gpu(estimate(less, 4, "fsdp").total, GPU_80) and not fits_gpu(
        estimate(less, 4, "hsdp", shard_ranks=2).total, GPU_80
    )
    assert "(2 nodes x 2, sharded within each node, replicated across nodes)" in line


def test_auto_shards_over_every_rank_where_one_node_cannot_hold_the_shards():
    config, line = plan_parallelism(cfg.production(), 8, 40 * GIB, None, 2)  # 4 nodes x 2 x 40 GiB
    assert config.training.parallelism == "fsdp"
    least = with_training(cfg.production(), activation_checkpointing="full", loss_chunk_tokens=2048)
    assert not fits_gpu(estimate(least, 8, "hsdp", shard_ranks=2).total, 40 * GIB)
    kept = estimate(config, 8, "hsdp", shard_ranks=2).total
    assert line.startswith("parallelism: FSDP over 8 GPUs (estimated ")
    assert f", HSDP (sharded within a node) ~{kept / GIB:.1f} GiB); " in line


def test_hsdp_asked_on_several_nodes_is_kept_and_keeps_blocks_gathered_where_they_fit():
    config, line = plan_parallelism(hsdp(cfg.production()), 16, 141 * GIB, None, 8)  # H200s
    t = config.training
    assert (t.parallelism, t.activation_checkpointing, t.reshard_after_forward) == ("hsdp", "none", False)
    assert line.startswith(HSDP_2X8) and "DDP would need" not in line  # asked for: nothing to explain
    assert line.endswith("; blocks stay gathered from forward to backward (one all-gather fewer per micro-batch)")
    assert estimate(config, 16, "hsdp", shard_ranks=8).total > 0.9 * GPU_80  # on 80 GiB they would not fit
    assert plan_parallelism(hsdp(cfg.production()), 16, GPU_80, None, 8)[0].training.reshard_after_forward is True


def test_hsdp_on_one_node_runs_fsdp_and_the_line_warns():
    for local_ranks in (8, None):  # None: every rank on this host
        config, line = plan_parallelism(hsdp(cfg.production()), 8, GPU_80, None, local_ranks)
        assert config.training.parallelism == "fsdp"
        assert line.startswith("parallelism: FSDP over 8 GPUs (estimated ") and line.endswith(ONE_NODE)
    config, line = plan_parallelism(hsdp(small()), 2, None)
    assert (config.training.parallelism, line) == ("fsdp", f"parallelism: FSDP over 2 CPU workers{ONE_NODE}")


def test_hsdp_that_one_node_cannot_hold_is_refused_in_one_line_naming_the_per_gpu_estimate():
    least = with_training(hsdp(cfg.production()), activation_checkpointing="full", loss_chunk_tokens=2048)
    needed = estimate(least, 4, "hsdp", shard_ranks=2).total
    with pytest.raises(ConfigError) as error:  # 2 nodes x 2 x 40 GiB; never offloaded, whatever the host
        plan_parallelism(hsdp(cfg.production()), 4, 40 * GIB, 1024 * GIB, 2)
    assert one_line_error(error) == (
        f"preset production needs ~{needed / GIB:.1f} GiB per GPU with HSDP (sharded over the 2 GPUs of a node) "
        f"({estimate(least, 4, 'hsdp', shard_ranks=2).parts()}) but the GPU has 40.0 GiB (a run plans on 90% of it); "
        "try --set training.parallelism=fsdp (sharded over all 4 GPUs)"
    )


def test_cpu_offload_is_fsdp_over_every_rank_so_hsdp_with_it_is_refused_on_several_nodes():
    offloaded = with_training(hsdp(cfg.production()), cpu_offload=True)
    with pytest.raises(ConfigError) as error:
        plan_parallelism(offloaded, 4, 40 * GIB, 1024 * GIB, 2)
    assert one_line_error(error) == (
        "training.cpu_offload=true needs FSDP but training.parallelism is hsdp (offload shards over every rank, "
        "not within a node); set training.parallelism=fsdp or auto"
    )
    config, line = plan_parallelism(offloaded, 2, 40 * GIB, 1024 * GIB, 2)  # one node: FSDP, offloaded
    assert (config.training.parallelism, config.training.cpu_offload) == ("fsdp", True) and line.endswith(ONE_NODE)


def test_cpu_workers_on_several_nodes_keep_hsdp_when_asked_and_ddp_for_auto():
    config, line = plan_parallelism(hsdp(small()), 4, None, None, 2)
    assert config.training.parallelism == "hsdp"
    assert line == "parallelism: HSDP over 4 CPU workers (2 nodes x 2, sharded within each node, replicated across nodes)"
    assert plan_parallelism(small(), 4, None, None, 2)[1] == "parallelism: DDP over 4 CPU workers"


def test_prepare_training_gives_the_workers_hsdp_and_says_so(tmp_path):
    config = cfg.resolve(preset="debug", sets=[f"data.cache_dir={tmp_path / 'cache'}", "training.parallelism=hsdp"])
    console = io.StringIO()
    node = SimpleNamespace(world_size=4, nproc=2, smallest_gpu_memory=40 * GIB)  # what prepare_training reads of a Node
    placement = Placement("cuda", 2, gpus=(scripted_gpu(GPU_80), scripted_gpu(GPU_80)))
    prepared = prepare_training(config, placement, Printer(console, None), node=node)
    assert prepared.training.parallelism == "hsdp"
    (line,) = [line for line in console.getvalue().splitlines() if "parallelism: " in line]
    assert line.startswith(
        "launcher: parallelism: HSDP over 4 GPUs (2 nodes x 2, sharded within each node, replicated across nodes) (estimated "
    )
    assert " GiB of 40.0 GiB per GPU)" in line  # the job's smallest GPU
    training_command(prepared, tmp_path, Printer(io.StringIO(), None))
    assert json.loads((tmp_path / "config.json").read_text())["training"]["parallelism"] == "hsdp"


def test_a_worker_run_alone_with_hsdp_on_one_node_warns_once_on_rank_0_and_runs_fsdp(caplog):
    import logging

    import torch

    from pretrain.build import parallel_mode
    from pretrain.distributed.runtime import Runtime

    debug = cfg.resolve(preset="debug", sets=["model.vocab_size=257"])
    config = with_training(debug, parallelism="hsdp", async_checkpoint=False)  # deciding that would need the group
    logger = logging.getLogger("pretrain")
    propagate, logger.propagate = logger.propagate, True  # an earlier test's setup_logging may have cut it off
    try:
        with caplog.at_level(logging.WARNING, logger="pretrain"):
            # what parallel_mode decides needs no process group: two ranks of one node (ranks_per_node 2)
            planned, mode = parallel_mode(config, Runtime(0, 2, torch.device("cpu"), "CPU 0", ranks_per_node=2))
            parallel_mode(config, Runtime(1, 2, torch.device("cpu"), "CPU 1", ranks_per_node=2))
    finally:
        logger.propagate = propagate
    assert (planned.training.parallelism, mode) == ("fsdp", "fsdp")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["training.parallelism=hsdp on one node is FSDP (no other node to replicate across)"]
