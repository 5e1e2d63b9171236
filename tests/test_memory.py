"""pretrain/memory.py: the per-GPU memory estimate, the DDP/FSDP choice, the pre-flight check,
and the launcher refusing a config that cannot fit before any worker starts."""

from __future__ import annotations

import dataclasses
import io
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT, cache_leftovers, launcher_env, one_line_error
from launcher import nvml
from launcher.cli import prepare_training
from launcher.placement import Placement
from launcher.printer import Printer
from pretrain import config as cfg
from pretrain.config import ConfigError
from pretrain.memory import (GIB, HOST_MEMORY_ENV, HOST_OVERHEAD_BYTES, LOGIT_COPIES, OVERHEAD_BYTES, PINNED_ROUNDING, activation_bytes,
                             check_fits,
                             choose_parallelism, estimate, export_copy_bytes, host_estimate, host_memory_bytes, logits_bytes,
                             parameter_count, plan_parallelism)

GPU_80 = 80 * GIB


def with_training(config: cfg.Config, **changes: object) -> cfg.Config:
    return dataclasses.replace(config, training=dataclasses.replace(config.training, **changes))


def with_model(config: cfg.Config, **changes: object) -> cfg.Config:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **changes))


def small() -> cfg.Config:
    return with_model(cfg.small(), vocab_size=32768)  # what the trained BPE tokenizer gives it


# --- parameters -----------------------------------------------------------------------

@pytest.mark.parametrize("shape", [
    {},                                                     # the debug preset's shape
    {"n_kv_heads": 4},                                      # no grouping
    {"n_heads": 8, "n_kv_heads": 1, "ffn_dim": 100},        # multi-query, an odd FFN width
    {"n_layers": 3, "dim": 48, "n_heads": 2, "n_kv_heads": 2, "vocab_size": 1000},
])
def test_the_parameter_count_from_the_config_is_the_real_models(shape):
    from pretrain.model import Transformer
    model = dataclasses.replace(cfg.debug().model, **({"vocab_size": 257} | shape))
    assert parameter_count(model) == Transformer(model, max_seq_len=8).num_params()


def test_the_production_preset_has_llama_3_8b_parameters():
    assert parameter_count(cfg.production().model) == 8_030_261_248


def test_the_parameter_count_needs_a_vocabulary():
    with pytest.raises(ValueError, match="vocab_size is null"):
        parameter_count(cfg.debug().model)


# --- the estimate ---------------------------------------------------------------------

def test_llama_3_8b_with_ddp_does_not_fit_one_80_gib_gpu():
    assert estimate(cfg.production(), 1, "ddp").total > GPU_80
    # AdamW's fp32 moments alone are 8 bytes per parameter
    assert estimate(cfg.production(), 1, "ddp").optimizer == 8 * 8_030_261_248


def test_production_on_eight_80_gib_gpus_fits_with_fsdp_and_activation_checkpointing():
    config = with_training(cfg.production(), activation_checkpointing=True)
    assert estimate(config, 8, "fsdp").total < 0.9 * GPU_80
    check_fits(config, 8, GPU_80, "fsdp")  # no error


def test_the_small_preset_fits_one_80_gib_gpu():
    assert estimate(small(), 1, "ddp").total < 0.5 * GPU_80
    check_fits(small(), 1, GPU_80, "ddp")


def test_under_fsdp_the_estimate_shrinks_with_more_gpus_and_under_ddp_it_does_not():
    config = cfg.production()
    fsdp = [estimate(config, n, "fsdp").total for n in (2, 4, 8, 16)]
    assert fsdp == sorted(fsdp, reverse=True) and len(set(fsdp)) == 4
    assert len({estimate(config, n, "ddp").total for n in (1, 2, 8, 16)}) == 1


def test_one_process_is_estimated_unwrapped_whatever_the_mode():
    assert estimate(cfg.production(), 1, "fsdp") == dataclasses.replace(estimate(cfg.production(), 1, "ddp"),
                                                                          mode="fsdp")


def test_activation_checkpointing_loss_chunks_and_bf16_shrink_their_parts():
    config = with_training(cfg.production(), use_amp=False, activation_checkpointing=False)
    base = estimate(config, 8, "fsdp")
    checkpointed = estimate(with_training(config, activation_checkpointing=True), 8, "fsdp")
    assert checkpointed.activations < base.activations / 5
    assert (checkpointed.weights, checkpointed.optimizer) == (base.weights, base.optimizer)
    unchunked = estimate(with_training(config, loss_chunk_tokens=0), 8, "fsdp")
    assert unchunked.logits == 4 * base.logits  # 8192 tokens instead of 2048
    assert estimate(with_training(config, use_amp=True), 8, "fsdp").activations < base.activations


def test_the_batch_scales_the_activations_and_nothing_else():
    # both batches are longer than a loss chunk (2048 tokens), so the loss keeps the same input
    one, four = (estimate(with_training(small(), batch_size=n), 1, "ddp") for n in (4, 16))
    assert four.activations == 4 * one.activations
    assert (four.weights, four.gradients, four.optimizer, four.logits) == (one.weights, one.gradients,
                                                                          one.optimizer, one.logits)


def test_under_fsdp_gradient_accumulation_adds_no_full_gradient():
    # parallel.gradient_sync reduce-scatters every micro-batch: beyond its shard a GPU holds the
    # head's gradients and one block's in flight, not all 8B parameters' (~30 GiB in fp32).
    config = with_training(cfg.production(), activation_checkpointing=True)
    one, eight = (estimate(with_training(config, grad_accum_nums=n), 8, "fsdp") for n in (1, 8))
    assert one == eight
    assert eight.gradients - 4 * 8_030_261_248 / 8 < 3 * GIB


# --- activations, against what autograd saves -----------------------------------------

def tiny(use_amp: bool, loss_chunk_tokens: int, n_layers: int = 2) -> cfg.Config:
    """3 x 16 tokens: 48 rows, a length no parameter has (so autocast's weight copies are told apart)."""
    base = cfg.debug()
    config = with_model(base, n_layers=n_layers, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=61,
                        max_seq_len=16)
    config = dataclasses.replace(config, data=dataclasses.replace(base.data, context_length=16))
    return with_training(config, batch_size=3, use_amp=use_amp, loss_chunk_tokens=loss_chunk_tokens,
                         activation_checkpointing=False)


def saved_bytes(config: cfg.Config) -> int:
    """Bytes of the distinct storages autograd saves in one forward pass with targets (under
    bf16 autocast when use_amp), less the constants (parameters, rotary tables) and autocast's
    bf16 copies of the weights (matmuls may save them transposed), which the estimate counts
    as weights."""
    import torch
    from pretrain.model import Transformer
    torch.manual_seed(0)
    model = Transformer(config.model, max_seq_len=16)
    weight_shapes = {shape for p in model.parameters() for shape in (tuple(p.shape), tuple(p.shape)[::-1])}
    constants = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in constants and tuple(tensor.shape) not in weight_shapes:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, 61, (3, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()  # two tensors, as the loader gives them
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.training.use_amp):
            loss = model(inputs, targets, config.training.loss_chunk_tokens)
    del loss
    return sum(saved.values())


@pytest.mark.parametrize("use_amp", [False, True])
@pytest.mark.parametrize("loss_chunk_tokens", [0, 16])
def test_the_activation_estimate_is_what_autograd_saves(use_amp, loss_chunk_tokens):
    config = tiny(use_amp, loss_chunk_tokens)
    one_block_less = tiny(use_amp, loss_chunk_tokens, n_layers=1)
    per_block = activation_bytes(config) - activation_bytes(one_block_less)
    assert saved_bytes(config) - saved_bytes(one_block_less) == per_block
    # a loss in one piece also keeps its fp32 log-probabilities: one of the logits part's copies
    # (the logits and the gradient are the others); a chunked one recomputes them in the backward
    logits = 0 if loss_chunk_tokens else logits_bytes(config) // LOGIT_COPIES
    assert saved_bytes(config) == pytest.approx(activation_bytes(config) + logits, rel=1e-3)


def test_describe_gives_the_total_and_every_part_in_gib():
    text = estimate(cfg.production(), 1, "ddp").describe()
    assert text.startswith("~") and " GiB per GPU: weights " in text
    assert ", gradients 29.9, optimizer 59.8, activations " in text and text.endswith(" GiB")


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        estimate(small(), 2, "auto")


# --- choosing -------------------------------------------------------------------------

def test_an_explicit_parallelism_is_kept():
    assert choose_parallelism(with_training(small(), parallelism="fsdp"), 2, GPU_80) == "fsdp"
    assert choose_parallelism(with_training(cfg.production(), parallelism="ddp"), 8, GPU_80) == "ddp"


def test_auto_chooses_ddp_when_it_fits_and_fsdp_when_it_does_not():
    assert choose_parallelism(small(), 8, GPU_80) == "ddp"
    assert choose_parallelism(cfg.production(), 8, GPU_80) == "fsdp"


def test_auto_chooses_ddp_for_one_rank_and_on_cpu():
    assert choose_parallelism(cfg.production(), 1, GPU_80) == "ddp"
    assert choose_parallelism(cfg.production(), 8, None) == "ddp"


def test_auto_keeps_a_tenth_of_the_gpu_spare_for_ddp():
    needed = estimate(small(), 2, "ddp").total
    assert choose_parallelism(small(), 2, int(needed / 0.9) + 1) == "ddp"
    assert choose_parallelism(small(), 2, int(needed / 0.9) - 1) == "fsdp"


# --- the pre-flight check -------------------------------------------------------------

def refusal(config: cfg.Config, world_size: int, mode: str, memory: int = GPU_80) -> str:
    with pytest.raises(ConfigError) as error:
        check_fits(config, world_size, memory, mode)
    return one_line_error(error)


def test_a_config_that_does_not_fit_says_the_estimate_the_gpu_and_what_would_help():
    config = with_training(cfg.production(), activation_checkpointing=False)
    message = refusal(config, 8, "ddp", int(79.6 * GIB))
    needed = estimate(config, 8, "ddp")
    assert message.startswith(f"preset production needs ~{needed.total / GIB:.1f} GiB per GPU with DDP (weights ")
    assert message.endswith("but the GPU has 79.6 GiB (a run plans on 90% of it); try --set training.parallelism=fsdp "
                            "or --set training.activation_checkpointing=true")


def suggested_gpus(message: str) -> int:
    """N of "try N or more GPUs" in a refusal."""
    found = re.search(r"(\d+) or more GPUs", message)
    assert found, message
    return int(found.group(1))


def test_suggestions_leave_out_what_is_already_on():
    config = with_training(cfg.production(), activation_checkpointing=True)
    message = refusal(config, 2, "fsdp", 40 * GIB)
    assert "activation_checkpointing" not in message and "parallelism=fsdp" not in message
    gpus = suggested_gpus(message)
    assert "with FSDP" in message and message.endswith(f"; try {gpus} or more GPUs (FSDP shards the model over them)")


def test_the_gpus_suggested_are_the_fewest_over_which_fsdp_fits():
    config = with_training(cfg.production(), activation_checkpointing=True)
    gpus = suggested_gpus(refusal(config, 2, "fsdp", 40 * GIB))
    # with the margin every decision keeps: 90% of each GPU
    assert estimate(config, gpus, "fsdp").total <= 0.9 * 40 * GIB < estimate(config, gpus - 1, "fsdp").total


def test_a_larger_batch_is_suggested_to_shrink_with_more_accumulation():
    config = with_training(cfg.production(), batch_size=8, activation_checkpointing=True)
    message = refusal(config, 8, "fsdp", 40 * GIB)
    assert message.endswith("; try a smaller training.batch_size with a larger training.grad_accum_nums "
                            "or more GPUs (FSDP shards the model over them)")  # activations: no count of GPUs fits
    derived = with_training(config, global_batch_size=512)  # accumulation follows from it
    assert "; try a smaller training.batch_size or " in refusal(derived, 8, "fsdp", 40 * GIB)


def test_a_loss_computed_in_one_piece_is_suggested_to_be_chunked():
    config = with_training(small(), loss_chunk_tokens=0, activation_checkpointing=True, batch_size=4)
    message = refusal(config, 1, "ddp", 2 * GIB)
    assert "try --set training.loss_chunk_tokens=2048, a smaller training.batch_size" in message
    unchunked = with_training(config, loss_chunk_tokens=4096)  # the whole micro-batch of 4 x 1024 tokens
    assert "try --set training.loss_chunk_tokens=2048, " in refusal(unchunked, 1, "ddp", 2 * GIB)
    chunked = with_training(config, loss_chunk_tokens=1024)
    assert "loss_chunk_tokens" not in refusal(chunked, 1, "ddp", 2 * GIB)


def test_one_gpu_is_told_to_add_gpus_and_fsdp_where_auto_would_not_choose_it():
    config = with_training(cfg.production(), activation_checkpointing=False)
    message = refusal(config, 1, "ddp")
    assert message.endswith(
        "on one GPU (" + estimate(config, 1, "ddp").parts() + ") but the GPU has 80.0 GiB (a run plans on 90% of it); "
        f"try --set training.activation_checkpointing=true or {suggested_gpus(message)} or more GPUs "
        "(FSDP shards the model over them)")
    pinned = with_training(config, parallelism="ddp")
    assert refusal(pinned, 1, "ddp").endswith(" or more GPUs with --set training.parallelism=fsdp")


# --- the launcher ---------------------------------------------------------------------

def test_the_launcher_resolves_fsdp_for_workers_and_says_why():
    config, line = plan_parallelism(with_training(cfg.production(), activation_checkpointing=True), 8, GPU_80)
    assert config.training.parallelism == "fsdp"
    assert line.startswith("parallelism: FSDP over 8 GPUs (estimated ") and " GiB of 80.0 GiB per GPU; DDP would " \
                                                                              "need ~" in line


def test_on_cpu_workers_the_launcher_runs_ddp_unless_fsdp_was_chosen_and_checks_no_memory():
    config, line = plan_parallelism(cfg.production(), 2, None)
    assert (config.training.parallelism, line) == ("ddp", "parallelism: DDP over 2 CPU workers")
    config, line = plan_parallelism(with_training(cfg.production(), parallelism="fsdp"), 2, None)
    assert (config.training.parallelism, line) == ("fsdp", "parallelism: FSDP over 2 CPU workers")
    assert plan_parallelism(cfg.production(), 1, None)[1] == "parallelism: none, one CPU worker"


def gpu(memory_gib: float) -> nvml.Gpu:
    return nvml.Gpu(id="0", index=0, uuid="GPU-0", name="scripted", pci_bus_id="0", memory_total=int(memory_gib * GIB),
                    memory_used=0, utilization=0.0, processes=())


def test_prepare_training_writes_the_concrete_mode_into_the_workers_config(tmp_path):
    config = cfg.resolve(preset="debug", sets=[f"data.cache_dir={tmp_path / 'cache'}"])
    console = io.StringIO()
    prepared = prepare_training(config, Placement("cuda", 2, gpus=(gpu(80), gpu(40))), Printer(console, None))
    assert prepared.training.parallelism == "ddp"
    (line,) = [line for line in console.getvalue().splitlines() if "parallelism" in line]
    assert line.startswith("launcher: parallelism: DDP over 2 GPUs (estimated ")
    assert line.endswith(" GiB of 40.0 GiB per GPU)")  # the smaller GPU decides


def test_prepare_training_on_cpu_keeps_ddp_without_a_memory_check(tmp_path):
    config = cfg.resolve(preset="debug", sets=[f"data.cache_dir={tmp_path / 'cache'}"])
    console = io.StringIO()
    prepared = prepare_training(config, Placement("cpu", 2), Printer(console, None))
    assert prepared.training.parallelism == "ddp"
    assert "launcher: parallelism: DDP over 2 CPU workers\n" in console.getvalue()


def launch(tmp_path, *args: str, host_gib: float) -> subprocess.CompletedProcess:
    """The launcher with the production preset, this machine's host memory set to host_gib."""
    return subprocess.run([sys.executable, "-m", "launcher", "--run-dir", str(tmp_path / "run"),
                           "--set", f"data.cache_dir={tmp_path / 'cache'}", *args], cwd=ROOT,
                          env=launcher_env(**{HOST_MEMORY_ENV: str(host_gib)}), capture_output=True, text=True,
                          timeout=120)


def assert_refused_before_anything(result: subprocess.CompletedProcess, tmp_path) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "GPU0:" not in result.stdout and "CPU0:" not in result.stdout  # no worker started
    assert not (tmp_path / "run").exists()  # nothing written
    assert cache_leftovers(tmp_path) == []  # refused before the dataset was prepared (or downloaded)


def test_production_on_one_80_gib_gpu_and_too_little_host_memory_stops_before_anything_with_one_line(
        scripted_gpus, tmp_path):
    scripted_gpus([{"memory_total_mib": 80 * 1024}])
    offload_host = host_estimate(cfg.production(), 1, "fsdp", on_gpus=True).total
    result = launch(tmp_path, host_gib=offload_host / GIB / 2)
    assert_refused_before_anything(result, tmp_path)
    assert result.stderr.startswith("launcher: error: preset production needs ~")
    assert "GiB per GPU on one GPU (weights " in result.stderr
    # CPU offload would fit the GPU, but not this host; the preset already checkpoints
    # activations: only more GPUs (sharding 8B parameters) help.
    assert f"but the GPU has 80.0 GiB (a run plans on 90% of it), and CPU offload would need ~{offload_host / GIB:.1f} " \
           "GiB of host memory per GPU (" \
        in result.stderr
    assert f"but this machine has {offload_host / GIB / 2:.1f} GiB available; try " in result.stderr
    assert result.stderr.endswith(" or more GPUs (FSDP shards the model over them)\n")


def test_production_on_cpu_workers_is_refused_in_seconds_with_the_host_memory_estimate(tmp_path):
    per_worker = host_estimate(cfg.production(), 2, "ddp", on_gpus=False)
    started = time.monotonic()
    result = launch(tmp_path, "--device", "cpu", host_gib=64)
    assert time.monotonic() - started < 30  # no worker built a model to find out
    assert_refused_before_anything(result, tmp_path)
    assert result.stderr == (
        f"launcher: error: preset production needs ~{per_worker.total / GIB:.1f} GiB of host memory per CPU worker "
        f"({per_worker.parts()}) x 2 workers = {2 * per_worker.total / GIB:.1f} GiB but this machine has 64.0 GiB "
        "available (a run plans on 90% of it); use --preset small or --debug\n")


def test_the_host_memory_of_cpu_workers_is_the_gpu_estimate_without_the_cuda_allowance():
    gpu, host = estimate(small(), 2, "ddp"), host_estimate(small(), 2, "ddp", on_gpus=False)
    assert host.total == gpu.total - OVERHEAD_BYTES + HOST_OVERHEAD_BYTES
    assert (host.weights, host.activations) == (gpu.weights, gpu.activations)


def test_cpu_workers_that_do_not_fit_are_told_what_would():
    needed = host_estimate(small(), 2, "ddp", on_gpus=False).total
    fsdp = host_estimate(small(), 2, "fsdp", on_gpus=False).total
    assert fsdp < needed
    with pytest.raises(ConfigError) as error:  # two DDP workers do not fit, two FSDP workers or one would
        plan_parallelism(small(), 2, None, int(2 * fsdp / 0.9) + GIB)
    assert one_line_error(error).endswith("; use --set training.parallelism=fsdp or --nproc 1")
    config, line = plan_parallelism(small(), 2, None, int(2 * needed / 0.9) + GIB)
    assert line == "parallelism: DDP over 2 CPU workers"


def test_cpu_workers_keep_a_tenth_of_the_host_memory_spare():
    needed = 2 * host_estimate(small(), 2, "ddp", on_gpus=False).total
    plan_parallelism(small(), 2, None, int(needed / 0.9) + 1)
    with pytest.raises(ConfigError, match="a run plans on 90% of it"):
        plan_parallelism(small(), 2, None, int(needed / 0.9) - 1)


def test_host_memory_comes_from_the_environment_when_set_and_bad_values_are_one_line(monkeypatch):
    monkeypatch.setenv(HOST_MEMORY_ENV, "12.5")
    assert host_memory_bytes() == int(12.5 * GIB)
    for bad in ("lots", "-1", "nan", "inf"):
        monkeypatch.setenv(HOST_MEMORY_ENV, bad)
        with pytest.raises(ConfigError, match=f"{HOST_MEMORY_ENV}=.* is not a positive number of GiB"):
            host_memory_bytes()
    monkeypatch.delenv(HOST_MEMORY_ENV)
    assert 0 < host_memory_bytes()


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
    # rank 0's shards, and the whole model it gathers in host memory to export it at the end
    export = export_copy_bytes(cfg.production(), 1, "fsdp", offload=True)
    assert export == 4 * 8_030_261_248
    needed = host_estimate(cfg.production(), 1, "fsdp", on_gpus=True).total + export
    config, line = plan_parallelism(cfg.production(), 1, GPU_80, int(needed / 0.9) + GIB)
    assert (config.training.parallelism, config.training.cpu_offload) == ("fsdp", True)
    assert line.startswith("parallelism: FSDP with CPU offload over 1 GPU (estimated ")
    assert f" GiB of 80.0 GiB per GPU and {needed / GIB:.1f} GiB of host memory of " in line
    assert line.endswith(f"; without offload ~{estimate(cfg.production(), 1, 'ddp').total / GIB:.1f} GiB per GPU)")
    with pytest.raises(ConfigError, match="and CPU offload would need"):
        plan_parallelism(cfg.production(), 1, GPU_80, int(needed / 0.9) - GIB)


def test_the_ranks_on_one_host_share_its_memory_under_offload():
    per_rank = host_estimate(cfg.production(), 2, "fsdp", on_gpus=True).total
    enough_for_one = int((per_rank + export_copy_bytes(cfg.production(), 2, "fsdp", offload=True)) / 0.9) + GIB
    assert plan_parallelism(cfg.production(), 2, 40 * GIB, enough_for_one, local_ranks=1)[0].training.cpu_offload
    with pytest.raises(ConfigError, match=r"x 2 \+ 29\.9 for the export's whole copy = "):
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
    with pytest.raises(ConfigError, match="of host memory per GPU with CPU offload .* use --set "
                                          "training.cpu_offload=false with more GPUs or --preset small or --debug"):
        plan_parallelism(with_training(cfg.production(), cpu_offload=True), 1, GPU_80, 8 * GIB)


def test_a_launch_with_a_known_vocabulary_that_fits_nowhere_is_refused_before_the_data(scripted_gpus, tmp_path):
    scripted_gpus([{"memory_total_mib": 80 * 1024}])
    result = launch(tmp_path, "--debug", "--set", "model.vocab_size=128256", "--set", "model.dim=65536",
                    "--set", "model.n_heads=64", "--set", "model.n_kv_heads=64", "--set", "model.ffn_dim=131072",
                    host_gib=16)
    assert_refused_before_anything(result, tmp_path)
    assert result.stderr.startswith("launcher: error: preset debug needs ~")


def test_the_launcher_can_estimate_without_importing_torch():
    probe = "import sys, pretrain.memory; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=launcher_env()).returncode == 0


def test_the_estimate_knows_that_tracing_nonfinite_turns_activation_checkpointing_off():
    production = cfg.production()
    traced = dataclasses.replace(production, debug=dataclasses.replace(production.debug, trace_nonfinite=True))
    unchecked = dataclasses.replace(production, training=dataclasses.replace(production.training,
                                                                             activation_checkpointing=False))
    assert activation_bytes(traced) == activation_bytes(unchecked) > 5 * activation_bytes(production)


def test_a_traced_run_that_does_not_fit_is_told_that_the_tracing_costs_the_checkpointing():
    production = cfg.production()
    traced = dataclasses.replace(production, debug=dataclasses.replace(production.debug, trace_nonfinite=True))
    with pytest.raises(ConfigError, match=r"--set debug.trace_nonfinite=false \(its hooks turn activation"):
        check_fits(traced, 8, 80 * GIB, "fsdp")


def deep_debug(tmp_path) -> cfg.Config:
    """The debug preset made 40 layers deep and wide: ~9 GiB of fp32 weights, gradients and AdamW
    state, of which FSDP with offload keeps two blocks on the GPU."""
    sets = [f"data.cache_dir={tmp_path / 'cache'}", "model.n_layers=40", "model.dim=1024", "model.n_heads=8",
            "model.n_kv_heads=2", "model.ffn_dim=4096", "training.batch_size=1", "debug.trace_nonfinite=false",
            "training.activation_checkpointing=true"]
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
