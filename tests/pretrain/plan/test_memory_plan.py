"""pretrain/plan/parallelism.py: the launcher's plan: the mode, recomputation and CPU offload it chooses,
and the launcher refusing a config that cannot fit before any worker starts. What a run keeps in
host memory alone: test_host_memory.py."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest

from support.processes import ROOT, cache_leftovers, launcher_env, one_line_error
from launcher.gpus import nvml
from launcher.prepare import prepare_training
from launcher.gpus.placement import Placement
from launcher.supervise.printer import Printer
from support.memory_configs import GPU_80, scripted_gpu, small, with_model, with_training
from pretrain import config as cfg
from pretrain.config import ConfigError
from pretrain.plan.gpu_memory import GIB, estimate
from pretrain.plan.host_memory import HOST_MEMORY_ENV, PINNED_ROUNDING, export_copy_bytes, host_estimate
from pretrain.plan.parallelism import plan_parallelism, undecided
from pretrain.model import recompute


# --- the launcher ---------------------------------------------------------------------


def test_the_launcher_resolves_fsdp_for_workers_and_says_why():
    config, line = plan_parallelism(with_training(cfg.production(), activation_checkpointing=True), 8, GPU_80)
    assert config.training.parallelism == "fsdp"
    assert line.startswith("parallelism: FSDP over 8 GPUs (estimated ") and " GiB of 80.0 GiB per GPU; DDP would need ~" in line


def test_on_cpu_workers_the_launcher_runs_ddp_unless_fsdp_was_chosen_and_checks_no_memory():
    config, line = plan_parallelism(cfg.production(), 2, None)
    assert (config.training.parallelism, line) == ("ddp", "parallelism: DDP over 2 CPU workers")
    config, line = plan_parallelism(with_training(cfg.production(), parallelism="fsdp"), 2, None)
    assert (config.training.parallelism, line) == ("fsdp", "parallelism: FSDP over 2 CPU workers")
    assert plan_parallelism(cfg.production(), 1, None)[1] == "parallelism: none, one CPU worker"


def gpu(memory_gib: float) -> nvml.Gpu:
    return scripted_gpu(int(memory_gib * GIB))


def test_prepare_training_writes_the_concrete_mode_into_the_workers_config(tmp_path):
    config = cfg.resolve(preset="debug", sets=[f"data.cache_dir={tmp_path / 'cache'}"])
    console = io.StringIO()
    prepared = prepare_training(config, Placement("cuda", 2, gpus=(gpu(80), gpu(40))), Printer(console, None))
    assert prepared.training.parallelism == "ddp"
    (line,) = [line for line in console.getvalue().splitlines() if "parallelism" in line]
    assert line.startswith("launcher: parallelism: DDP over 2 GPUs (estimated ")
    # the smaller GPU decides; the debug preset's hooks leave nothing to recompute
    assert line.endswith(" GiB of 40.0 GiB per GPU); activation checkpointing: none; loss: one piece")


def test_prepare_training_on_cpu_keeps_ddp_without_a_memory_check(tmp_path):
    config = cfg.resolve(preset="debug", sets=[f"data.cache_dir={tmp_path / 'cache'}"])
    console = io.StringIO()
    prepared = prepare_training(config, Placement("cpu", 2), Printer(console, None))
    assert prepared.training.parallelism == "ddp"
    assert "launcher: parallelism: DDP over 2 CPU workers\n" in console.getvalue()  # nothing recomputed: nothing more to say
    t = prepared.training  # concrete for the workers: the debug run recomputes nothing
    assert (t.activation_checkpointing, t.loss_chunk_tokens, t.reshard_after_forward) == ("none", 0, True)


def launch(tmp_path, *args: str, host_gib: float) -> subprocess.CompletedProcess:
    """The launcher with the production preset, this machine's host memory set to host_gib."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            f"data.cache_dir={tmp_path / 'cache'}",
            *args,
        ],
        cwd=ROOT,
        env=launcher_env(**{HOST_MEMORY_ENV: str(host_gib)}),
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_refused_before_anything(result: subprocess.CompletedProcess, tmp_path) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "GPU0:" not in result.stdout and "CPU0:" not in result.stdout  # no worker started
    assert not (tmp_path / "run").exists()  # nothing written
    assert cache_leftovers(tmp_path) == []  # refused before the dataset was prepared (or downloaded)


def test_production_on_one_80_gib_gpu_and_too_little_host_memory_stops_before_anything_with_one_line(scripted_gpus, tmp_path):
    scripted_gpus([{"memory_total_mib": 80 * 1024}])
    offload_host = host_estimate(cfg.production(), 1, "fsdp", on_gpus=True).total
    result = launch(tmp_path, host_gib=offload_host / GIB / 2)
    assert_refused_before_anything(result, tmp_path)
    assert result.stderr.startswith("launcher: error: preset production needs ~")
    assert "GiB per GPU on one GPU (weights " in result.stderr
    # CPU offload would fit the GPU, but not this host; the preset already checkpoints
    # activations: only more GPUs (sharding 8B parameters) help.
    assert (
        f"but the GPU has 80.0 GiB (a run plans on 90% of it), and CPU offload would need ~{offload_host / GIB:.1f} "
        "GiB of host memory per GPU (" in result.stderr
    )
    assert f"but this machine has {offload_host / GIB / 2:.1f} GiB available; try " in result.stderr
    assert result.stderr.endswith(" or more GPUs (FSDP shards the model over them)\n")


def test_production_on_cpu_workers_is_refused_in_seconds_with_the_host_memory_estimate(tmp_path):
    # with what keeps the least: full checkpointing and the loss in chunks
    least = with_training(cfg.production(), activation_checkpointing="full", loss_chunk_tokens=2048)
    per_worker = host_estimate(least, 2, "ddp", on_gpus=False)
    started = time.monotonic()
    result = launch(tmp_path, "--device", "cpu", host_gib=64)
    assert time.monotonic() - started < 30  # no worker built a model to find out
    assert_refused_before_anything(result, tmp_path)
    assert result.stderr == (
        f"launcher: error: preset production needs ~{per_worker.total / GIB:.1f} GiB of host memory per CPU worker "
        f"({per_worker.parts()}) x 2 workers = {2 * per_worker.total / GIB:.1f} GiB but this machine has 64.0 GiB "
        "available (a run plans on 90% of it); use --preset small or --debug\n"
    )


def test_cpu_workers_that_do_not_fit_are_told_what_would():
    # without the local tier, which this tight host would not keep (tests/pretrain/checkpoint/test_async_checkpoint.py)
    config = with_training(small(), activation_checkpointing="none", loss_chunk_tokens=0, local_checkpoint_interval=0)
    needed = host_estimate(config, 2, "ddp", on_gpus=False).total
    fsdp = host_estimate(config, 2, "fsdp", on_gpus=False).total
    assert fsdp < needed
    with pytest.raises(ConfigError) as error:  # two DDP workers do not fit, two FSDP workers or one would
        plan_parallelism(config, 2, None, int(2 * fsdp / 0.9) + GIB)
    assert one_line_error(error).endswith("; use --set training.parallelism=fsdp or --nproc 1")
    config, line = plan_parallelism(config, 2, None, int(2 * needed / 0.9) + GIB)
    assert line == "parallelism: DDP over 2 CPU workers"


def test_cpu_workers_keep_a_tenth_of_the_host_memory_spare():
    config = with_training(small(), activation_checkpointing="none", loss_chunk_tokens=0)
    needed = 2 * host_estimate(config, 2, "ddp", on_gpus=False).total
    plan_parallelism(config, 2, None, int(needed / 0.9) + 1)
    with pytest.raises(ConfigError, match="a run plans on 90% of it"):
        plan_parallelism(config, 2, None, int(needed / 0.9) - 1)


def test_cpu_workers_recompute_nothing_unless_the_host_memory_needs_it():
    def planned(host: int | None) -> tuple[str, int]:
        t = plan_parallelism(small(), 2, None, host)[0].training
        return (t.activation_checkpointing, t.loss_chunk_tokens)

    assert planned(None) == ("none", 0)
    workers = {  # two workers' host memory
        choice: 2
        * host_estimate(
            with_training(small(), activation_checkpointing=choice[0], loss_chunk_tokens=choice[1]), 2, "ddp", on_gpus=False
        ).total
        for choice in (("none", 0), ("selective", 0))
    }
    assert planned(int(workers[("none", 0)] / 0.9) + 1) == ("none", 0)
    assert planned(int(workers[("none", 0)] / 0.9) - 1) != ("none", 0)
    assert planned(int(workers[("selective", 0)] / 0.9) + 1) == ("selective", 0)
    no_local_tier = with_training(small(), local_checkpoint_interval=0)  # which this tight host would not keep
    _, line = plan_parallelism(no_local_tier, 2, None, int(workers[("selective", 0)] / 0.9) + 1)
    assert line == "parallelism: DDP over 2 CPU workers; activation checkpointing: selective (+0% FLOPs); loss: one piece"


# --- CPU offload ------------------------------------------------------------------------


def test_offload_keeps_only_what_is_in_flight_on_the_gpu_and_the_shards_on_the_host():
    production = cfg.production()
    on_gpu, plain = estimate(production, 1, "fsdp", offload=True), estimate(production, 1, "ddp")
    assert on_gpu.optimizer == 0 and (on_gpu.activations, on_gpu.logits) == (plain.activations, plain.logits)
    # Only two blocks and the head are ever on the GPU: a deeper model needs no more there.
    deeper = with_model(production, n_layers=64)
    assert estimate(deeper, 1, "fsdp", offload=True).weights == on_gpu.weights
    assert estimate(deeper, 1, "fsdp", offload=True).gradients == on_gpu.gradients
    assert estimate(deeper, 1, "ddp").weights > 1.5 * plain.weights  # the embedding and head do not double
    host = host_estimate(production, 1, "fsdp", on_gpus=True)
    pinned = int(4 * 8_030_261_248 * PINNED_ROUNDING)  # the caching host allocator's power-of-two blocks
    assert (host.weights, host.gradients, host.optimizer) == (pinned, pinned, 8 * 8_030_261_248)
    assert host_estimate(production, 4, "fsdp", on_gpus=True).optimizer == 2 * 8_030_261_248  # sharded over 4


def test_production_on_one_80_gib_gpu_offloads_when_the_host_has_the_memory():
    production = with_training(cfg.production(), compile=False, local_checkpoint_interval=0)  # no room for it here
    # rank 0's shards, and the largest tensor (the embedding), twice: exporting gathers and converts one at a time
    export = export_copy_bytes(production, 1, "fsdp", offload=True)
    assert export == 2 * 4 * 128_256 * 4096
    assert export_copy_bytes(production, 1, "ddp", offload=False) == 0  # a replica converts what it holds
    needed = host_estimate(production, 1, "fsdp", on_gpus=True).total + export
    config, line = plan_parallelism(production, 1, GPU_80, int(needed / 0.9) + GIB)
    assert (config.training.parallelism, config.training.cpu_offload) == ("fsdp", True)
    assert (config.training.activation_checkpointing, config.training.loss_chunk_tokens) == ("none", 0)
    assert line.startswith("parallelism: FSDP with CPU offload over 1 GPU (estimated ")
    assert f" GiB of 80.0 GiB per GPU and {needed / GIB:.1f} GiB of host memory of " in line
    least = with_training(production, activation_checkpointing="full", loss_chunk_tokens=2048)  # what fits best
    assert line.endswith(
        f"; without offload ~{estimate(least, 1, 'ddp').total / GIB:.1f} GiB per GPU); "
        "activation checkpointing: none; loss: one piece"
    )
    with pytest.raises(ConfigError, match="and CPU offload would need"):
        plan_parallelism(production, 1, GPU_80, int(needed / 0.9) - GIB)


def test_the_ranks_on_one_host_share_its_memory_under_offload():
    per_rank = host_estimate(cfg.production(), 2, "fsdp", on_gpus=True).total
    enough_for_one = int((per_rank + export_copy_bytes(cfg.production(), 2, "fsdp", offload=True)) / 0.9) + GIB
    assert plan_parallelism(cfg.production(), 2, 40 * GIB, enough_for_one, local_ranks=1)[0].training.cpu_offload
    with pytest.raises(ConfigError, match=r"x 2 \+ 3\.9 for the export's largest tensor = "):
        plan_parallelism(cfg.production(), 2, 40 * GIB, enough_for_one)  # both ranks on this host


def test_eight_80_gib_gpus_run_production_with_fsdp_and_no_offload_whatever_the_host():
    config, line = plan_parallelism(cfg.production(), 8, GPU_80, 1024 * GIB)
    assert (config.training.parallelism, config.training.cpu_offload) == ("fsdp", False)
    assert line.startswith("parallelism: FSDP over 8 GPUs (")


def test_offload_off_or_unknown_host_memory_refuses_as_before():
    off = with_training(cfg.production(), cpu_offload=False)
    for config, host in ((off, 1024 * GIB), (cfg.production(), None)):
        with pytest.raises(ConfigError) as error:
            plan_parallelism(config, 1, GPU_80, host)
        assert "offload" not in one_line_error(error)


def test_offload_asked_for_is_used_even_where_the_model_fits_and_needs_fsdp():
    config, line = plan_parallelism(with_training(small(), cpu_offload=True), 1, GPU_80, 1024 * GIB)
    assert (config.training.parallelism, config.training.cpu_offload) == ("fsdp", True)
    with pytest.raises(ConfigError, match="training.cpu_offload=true needs FSDP but training.parallelism is ddp"):
        plan_parallelism(with_training(small(), cpu_offload=True, parallelism="ddp"), 2, GPU_80, 1024 * GIB)
    with pytest.raises(
        ConfigError,
        match="of host memory per GPU with CPU offload .* use --set "
        "training.cpu_offload=false with more GPUs or --preset small or --debug",
    ):
        plan_parallelism(with_training(cfg.production(), cpu_offload=True), 1, GPU_80, 8 * GIB)


def test_a_launch_with_a_known_vocabulary_that_fits_nowhere_is_refused_before_the_data(scripted_gpus, tmp_path):
    scripted_gpus([{"memory_total_mib": 80 * 1024}])
    result = launch(
        tmp_path,
        "--debug",
        "--set",
        "model.vocab_size=128256",
        "--set",
        "model.dim=65536",
        "--set",
        "model.n_heads=64",
        "--set",
        "model.n_kv_heads=64",
        "--set",
        "model.ffn_dim=131072",
        host_gib=16,
    )
    assert_refused_before_anything(result, tmp_path)
    assert result.stderr.startswith("launcher: error: preset debug needs ~")


def deep_debug(tmp_path) -> cfg.Config:
    """The debug preset made 40 layers deep and wide: ~9 GiB of fp32 weights, gradients and AdamW
    state, of which FSDP with offload keeps two blocks on the GPU."""
    sets = [
        f"data.cache_dir={tmp_path / 'cache'}",
        "model.n_layers=40",
        "model.dim=1024",
        "model.n_heads=8",
        "model.n_kv_heads=2",
        "model.ffn_dim=4096",
        "training.batch_size=1",
        "debug.trace_nonfinite=false",
        "training.activation_checkpointing=true",
    ]
    return cfg.resolve(preset="debug", sets=sets)


def test_the_launcher_offloads_a_model_too_large_for_its_one_gpu_when_the_host_has_room(tmp_path, monkeypatch):
    monkeypatch.setenv(HOST_MEMORY_ENV, "64")
    console = io.StringIO()
    prepared = prepare_training(deep_debug(tmp_path), Placement("cuda", 1, gpus=(gpu(3),)), Printer(console, None))
    assert (prepared.training.parallelism, prepared.training.cpu_offload) == ("fsdp", True)
    (line,) = [line for line in console.getvalue().splitlines() if "parallelism" in line]
    assert line.startswith("launcher: parallelism: FSDP with CPU offload over 1 GPU (estimated ")
    assert " GiB of 3.0 GiB per GPU and " in line and " GiB of host memory of 64.0 GiB available; without offload ~" in line


def test_the_launcher_refuses_a_model_too_large_for_its_gpu_and_its_host_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(HOST_MEMORY_ENV, "4")
    with pytest.raises(ConfigError) as error:
        prepare_training(deep_debug(tmp_path), Placement("cuda", 1, gpus=(gpu(3),)), Printer(io.StringIO(), None))
    assert "but the GPU has 3.0 GiB (a run plans on 90% of it), and CPU offload would need ~" in one_line_error(error)
    assert "but this machine has 4.0 GiB available; try " in one_line_error(error)


# --- recomputation and FSDP's resharding ---------------------------------------------------


def planned_choice(config: cfg.Config, world_size: int, gpu_bytes: int) -> tuple[str, int]:
    t = plan_parallelism(config, world_size, gpu_bytes)[0].training
    return (t.activation_checkpointing, t.loss_chunk_tokens)


def line_of(config: cfg.Config, world_size: int, checkpointing: str, chunk: int) -> int:
    """The smallest GPU (bytes) on which config with these choices fits under FSDP, blocks resharded."""
    fixed = with_training(config, activation_checkpointing=checkpointing, loss_chunk_tokens=chunk, reshard_after_forward=True)
    return -(-estimate(fixed, world_size, "fsdp").total * 10 // 9)


def test_at_each_memory_line_the_plan_picks_the_least_recomputation_that_fits():
    # production over 8 GPUs, each choice at its own line and one byte below it: fewest extra
    # FLOPs first (selective adds none, chunks +1.8%, full +25%), so none in chunks never comes
    # first: selective in one piece fits wherever it does.
    production = cfg.production()
    order = [("none", 0), ("selective", 0), ("selective", 2048), ("full", 0), ("full", 2048)]
    for choice, next_choice in zip(order, order[1:], strict=False):
        line = line_of(production, 8, *choice)
        assert planned_choice(production, 8, line) == choice
        assert planned_choice(production, 8, line - 1) == next_choice
    with pytest.raises(ConfigError, match="try 9 or more GPUs"):  # below the last line: nothing fits
        plan_parallelism(production, 8, line_of(production, 8, "full", 2048) - 1)


@pytest.mark.parametrize(
    ("compile", "recomputed"),
    [(None, "none"), (False, "selective")],  # null compiles on GPUs, whose partitioner keeps less than eager autograd
)
def test_production_on_eight_80_gib_gpus_executes_at_most_1_15_x_its_model_flops(compile, recomputed):
    config, line = plan_parallelism(with_training(cfg.production(), compile=compile), 8, GPU_80)
    t = config.training
    assert (t.parallelism, t.activation_checkpointing, t.loss_chunk_tokens) == ("fsdp", recomputed, 0)
    assert 1 + recompute.extra_flops_share(config) <= 1.15
    assert 1 + recompute.extra_flops_share(with_training(config, activation_checkpointing="full")) > 1.15  # full fails it
    kept = estimate(with_training(config, reshard_after_forward=False), 8, "fsdp").total
    assert t.reshard_after_forward is True and kept > 0.9 * GPU_80  # every block gathered would not fit
    checkpointing = "none" if recomputed == "none" else "selective (+0% FLOPs)"
    assert line.endswith(
        f"; activation checkpointing: {checkpointing}; loss: one piece; "
        f"blocks gathered again for the backward (keeping them would need ~{kept / GIB:.1f} GiB)"
    )


def test_small_on_one_80_gib_gpu_recomputes_nothing():
    config, line = plan_parallelism(small(), 1, GPU_80)
    assert (config.training.activation_checkpointing, config.training.loss_chunk_tokens) == ("none", 0)
    assert recompute.extra_flops_share(config) == 0
    assert line.endswith(" GiB of 80.0 GiB per GPU); activation checkpointing: none; loss: one piece")


def test_the_parallelism_line_says_what_each_recomputation_costs():
    forced = with_training(cfg.production(), activation_checkpointing="full", loss_chunk_tokens=2048)
    _, line = plan_parallelism(forced, 8, GPU_80)
    assert "; activation checkpointing: full (+25% FLOPs); loss: chunks of 2048 tokens (+1.8% FLOPs); blocks stay " in line
    full = recompute.checkpointing_flops_per_token(forced) / recompute.model_flops_per_token(forced)
    layer = recompute.block_forward_flops_per_token(forced.model, 8192)
    assert full == pytest.approx(32 * (layer - 2 * 4096 * 14336) / recompute.model_flops_per_token(forced))  # all but w2
    assert recompute.loss_flops_per_token(forced) == 2 * 4096 * 128256  # the output projection once more


def test_blocks_stay_gathered_from_forward_to_backward_where_their_bf16_weights_fit():
    config, line = plan_parallelism(cfg.production(), 8, 141 * GIB)  # an H200: nothing recomputed either
    t = config.training
    assert (t.activation_checkpointing, t.loss_chunk_tokens, t.reshard_after_forward) == ("none", 0, False)
    assert line.endswith("; blocks stay gathered from forward to backward (one all-gather fewer per micro-batch)")
    assert estimate(config, 8, "fsdp").total > estimate(with_training(config, reshard_after_forward=True), 8, "fsdp").total
    assert plan_parallelism(small(), 8, GPU_80)[0].training.reshard_after_forward is True  # DDP: nothing to keep


def test_what_the_config_sets_is_kept_and_what_it_leaves_open_is_made_concrete():
    chosen = with_training(cfg.production(), activation_checkpointing="full", loss_chunk_tokens=512, reshard_after_forward=True)
    t = plan_parallelism(chosen, 8, 141 * GIB)[0].training
    assert (t.activation_checkpointing, t.loss_chunk_tokens, t.reshard_after_forward) == ("full", 512, True)
    for gpu_bytes in (None, GPU_80):
        t = plan_parallelism(cfg.production(), 8, gpu_bytes)[0].training
        assert t.activation_checkpointing != "auto" and None not in (t.loss_chunk_tokens, t.reshard_after_forward, t.cpu_offload)
    assert undecided(cfg.production()) and not undecided(plan_parallelism(cfg.production(), 8, GPU_80)[0])


def test_a_worker_run_alone_plans_for_itself(monkeypatch):
    import torch

    from pretrain.build import parallel_mode
    from pretrain.distributed.runtime import Runtime

    config = with_model(cfg.debug(), vocab_size=257)
    planned, mode = parallel_mode(config, Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0"))
    t = planned.training
    assert mode == "single" and (t.activation_checkpointing, t.loss_chunk_tokens, t.cpu_offload) == ("none", 0, False)
