"""pretrain/plan/gpu_memory.py: the per-GPU memory estimate, the DDP/FSDP choice and the pre-flight check.
Host memory: test_host_memory.py; CPU offload and the launcher's plan: test_memory_plan.py."""

from __future__ import annotations

import dataclasses
import re

import pytest

from support.processes import one_line_error
from support.memory_configs import GPU_80, small, with_model, with_training
from pretrain import config as cfg
from pretrain.config import ConfigError
from pretrain.model.loss import next_token_loss
from pretrain.plan.gpu_memory import (
    GIB,
    LOGIT_COPIES,
    activation_bytes,
    block_parameter_count,
    check_fits,
    choose_parallelism,
    estimate,
    logits_bytes,
    parameter_count,
)


# --- parameters -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        {},  # the debug preset's shape
        {"n_kv_heads": 4},  # no grouping
        {"n_heads": 8, "n_kv_heads": 1, "ffn_dim": 100},  # multi-query, an odd FFN width
        {"n_layers": 3, "dim": 48, "n_heads": 2, "n_kv_heads": 2, "vocab_size": 1000},
    ],
)
def test_the_parameter_count_from_the_config_is_the_real_models(shape):
    from pretrain.model.transformer import Transformer

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
    assert estimate(cfg.production(), 1, "fsdp") == dataclasses.replace(estimate(cfg.production(), 1, "ddp"), mode="fsdp")


def test_activation_checkpointing_loss_chunks_and_bf16_shrink_their_parts():
    config = with_training(cfg.production(), use_amp=False, activation_checkpointing=False, loss_chunk_tokens=2048, compile=False)
    base = estimate(config, 8, "fsdp")
    selective = estimate(with_training(config, activation_checkpointing="selective"), 8, "fsdp")
    checkpointed = estimate(with_training(config, activation_checkpointing=True), 8, "fsdp")
    assert checkpointed.activations < base.activations / 5
    assert checkpointed.activations < selective.activations < base.activations * 0.6
    assert (checkpointed.weights, checkpointed.optimizer) == (base.weights, base.optimizer)
    unchunked = estimate(with_training(config, loss_chunk_tokens=0), 8, "fsdp")
    assert unchunked.logits == 4 * base.logits  # 8192 tokens instead of 2048
    assert estimate(with_training(config, use_amp=True), 8, "fsdp").activations < base.activations


def test_before_the_plan_auto_counts_as_none_and_a_null_loss_chunk_as_one_piece():
    planned = with_training(cfg.production(), activation_checkpointing="none", loss_chunk_tokens=0)
    assert estimate(cfg.production(), 8, "fsdp") == estimate(planned, 8, "fsdp")


def test_blocks_kept_gathered_after_forward_add_every_blocks_bf16_weights_and_the_fp32_embedding_under_fsdp():
    config = cfg.production()
    resharded, kept = (estimate(with_training(config, reshard_after_forward=r), 8, "fsdp") for r in (True, False))
    blocks = 2 * (32 - 2) * block_parameter_count(config.model)  # bf16, two in flight already
    assert kept.weights - resharded.weights == blocks + 4 * 128256 * 4096
    assert dataclasses.replace(kept, weights=0) == dataclasses.replace(resharded, weights=0)
    assert estimate(with_training(config, reshard_after_forward=False), 8, "ddp") == estimate(config, 8, "ddp")


def test_the_batch_scales_the_activations_and_nothing_else():
    # both batches are longer than a loss chunk (2048 tokens), so the loss keeps the same input
    one, four = (estimate(with_training(small(), batch_size=n, loss_chunk_tokens=2048), 1, "ddp") for n in (4, 16))
    assert four.activations == 4 * one.activations
    assert (four.weights, four.gradients, four.optimizer, four.logits) == (one.weights, one.gradients, one.optimizer, one.logits)


def test_under_fsdp_gradient_accumulation_adds_no_full_gradient():
    # parallel.gradient_sync reduce-scatters every micro-batch: beyond its shard a GPU holds the
    # head's gradients and one block's in flight, not all 8B parameters' (~30 GiB in fp32).
    config = with_training(cfg.production(), activation_checkpointing=True)
    one, eight = (estimate(with_training(config, grad_accum_nums=n), 8, "fsdp") for n in (1, 8))
    assert one == eight
    assert eight.gradients - 4 * 8_030_261_248 / 8 < 3 * GIB


# --- activations, against what autograd saves -----------------------------------------


def tiny(use_amp: bool, loss_chunk_tokens: int, n_layers: int = 2, checkpointing: str = "none") -> cfg.Config:
    """3 x 16 tokens: 48 rows, a length no parameter has (so autocast's weight copies are told apart)."""
    base = cfg.debug()
    config = with_model(base, n_layers=n_layers, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=61, max_seq_len=16)
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(base.data, context_length=16),
        debug=dataclasses.replace(base.debug, trace_nonfinite=False),  # which would turn checkpointing off
    )
    return with_training(  # eager, as autograd's saved tensors are counted (compiled: compiled_saved_bytes)
        config,
        batch_size=3,
        use_amp=use_amp,
        loss_chunk_tokens=loss_chunk_tokens,
        activation_checkpointing=checkpointing,
        compile=False,
    )


def saved_bytes(config: cfg.Config) -> int:
    """Bytes of the distinct storages autograd saves in one forward pass with targets (under
    bf16 autocast when use_amp), less the constants (parameters, rotary tables) and autocast's
    bf16 copies of the weights (matmuls may save them transposed), which the estimate counts
    as weights."""
    import torch
    from pretrain.model.transformer import Transformer

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
            loss = next_token_loss(model, inputs, targets, config.training.loss_chunk_tokens).total
    del loss
    return sum(saved.values())


@pytest.mark.parametrize("use_amp", [False, True])
@pytest.mark.parametrize("loss_chunk_tokens", [0, 16])
def test_the_activation_estimate_is_what_autograd_saves(use_amp, loss_chunk_tokens):
    config = tiny(use_amp, loss_chunk_tokens)
    one_block_less = tiny(use_amp, loss_chunk_tokens, n_layers=1)
    per_block = activation_bytes(config) - activation_bytes(one_block_less)
    assert saved_bytes(config) - saved_bytes(one_block_less) == per_block
    # a loss in one piece also keeps the logits, in the compute dtype (the fp32 log-softmax is
    # recomputed from them and the logsumexp): a third of what the logits part counts for the
    # backward's peak in fp32; a chunked one recomputes them in the backward
    tokens, compute = 3 * 16, 2 if use_amp else 4
    logits = 0 if loss_chunk_tokens else tokens * config.model.vocab_size * compute
    assert logits <= logits_bytes(config) // LOGIT_COPIES
    assert saved_bytes(config) == pytest.approx(activation_bytes(config) + logits, rel=1e-3)


def live_bytes(config: cfg.Config) -> int:
    """Bytes of the distinct storages alive after one forward pass with targets of the model with
    selective checkpointing, less the constants: what the checkpoints keep (their inputs, the
    outputs of the ops they save, the RNG state) lives in Python objects, which gc finds; what
    autograd saves outside them (the head's) does not, and cancels between two depths anyway."""
    import gc

    import torch
    from pretrain.model.transformer import Transformer
    from pretrain.distributed.parallel import checkpoint_activations

    torch.manual_seed(0)
    model = Transformer(config.model, max_seq_len=16)
    for block in model.layers:
        checkpoint_activations(block, "selective")
    constants = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    tokens = torch.randint(0, 61, (3, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    gc.collect()
    before = {id(found) for found in gc.get_objects() if type(found) is torch.Tensor}  # other tests' leftovers
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.training.use_amp):
        loss = next_token_loss(model, inputs, targets, 0).total
    storages = {}
    for found in gc.get_objects():
        if type(found) is torch.Tensor and id(found) not in before and found.untyped_storage().data_ptr() not in constants:
            storages[found.untyped_storage().data_ptr()] = found.untyped_storage().nbytes()
    del loss
    return sum(storages.values())


@pytest.mark.parametrize("use_amp", [False, True])
def test_the_selective_estimate_is_what_the_checkpoints_keep(use_amp):
    config = tiny(use_amp, 0, checkpointing="selective")
    one_block_less = tiny(use_amp, 0, n_layers=1, checkpointing="selective")
    kept = activation_bytes(config) - activation_bytes(one_block_less)  # one block more, kept until its backward
    measured = live_bytes(config) - live_bytes(one_block_less)
    assert 0 <= measured - kept <= 8192  # and the CPU RNG state each checkpoint keeps (5 KB), whatever the tokens
    # what none keeps: a norm's output is kept once per fused matmul, so selective drops less than it did
    assert kept < 0.7 * (saved_bytes(tiny(use_amp, 0)) - saved_bytes(tiny(use_amp, 0, n_layers=1)))


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
    config = with_training(cfg.production(), activation_checkpointing=False, loss_chunk_tokens=2048)
    message = refusal(config, 8, "ddp", int(79.6 * GIB))
    needed = estimate(config, 8, "ddp")
    assert message.startswith(f"preset production needs ~{needed.total / GIB:.1f} GiB per GPU with DDP (weights ")
    assert message.endswith(
        "but the GPU has 79.6 GiB (a run plans on 90% of it); try --set training.parallelism=fsdp "
        "or --set training.activation_checkpointing=full"
    )


def test_the_checkpointing_suggested_is_the_least_that_fits():
    config = with_training(cfg.production(), activation_checkpointing="none", loss_chunk_tokens=0, compile=False)
    assert "--set training.activation_checkpointing=selective, --set training.loss_chunk_tokens=2048" in refusal(
        config, 8, "fsdp"
    )
    deeper = with_training(with_model(config, n_layers=64), activation_checkpointing="selective")
    assert "--set training.activation_checkpointing=full, " in refusal(deeper, 8, "fsdp")
    kept = with_training(config, activation_checkpointing="selective", reshard_after_forward=False)
    assert "2048, --set training.reshard_after_forward=true, or " in refusal(kept, 8, "fsdp", 70 * GIB)


def suggested_gpus(message: str) -> int:
    """N of "try N or more GPUs" in a refusal."""
    found = re.search(r"(\d+) or more GPUs", message)
    assert found, message
    return int(found.group(1))


def test_suggestions_leave_out_what_is_already_on():
    config = with_training(cfg.production(), activation_checkpointing=True, loss_chunk_tokens=2048)
    message = refusal(config, 2, "fsdp", 40 * GIB)
    assert "activation_checkpointing" not in message and "parallelism=fsdp" not in message
    gpus = suggested_gpus(message)
    assert "with FSDP" in message and message.endswith(f"; try {gpus} or more GPUs (FSDP shards the model over them)")


def test_the_gpus_suggested_are_the_fewest_over_which_fsdp_fits():
    config = with_training(cfg.production(), activation_checkpointing=True, loss_chunk_tokens=2048)
    gpus = suggested_gpus(refusal(config, 2, "fsdp", 40 * GIB))
    # with the margin every decision keeps: 90% of each GPU
    assert estimate(config, gpus, "fsdp").total <= 0.9 * 40 * GIB < estimate(config, gpus - 1, "fsdp").total


def test_a_larger_batch_is_suggested_to_shrink_with_more_accumulation():
    config = with_training(cfg.production(), batch_size=8, activation_checkpointing=True, loss_chunk_tokens=2048)
    message = refusal(config, 8, "fsdp", 40 * GIB)
    assert message.endswith(
        "; try a smaller training.batch_size with a larger training.grad_accum_nums "
        "or more GPUs (FSDP shards the model over them)"
    )  # activations: no count of GPUs fits
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
    config = with_training(cfg.production(), activation_checkpointing=False, loss_chunk_tokens=2048)
    message = refusal(config, 1, "ddp")
    assert message.endswith(
        "on one GPU (" + estimate(config, 1, "ddp").parts() + ") but the GPU has 80.0 GiB (a run plans on 90% of it); "
        f"try --set training.activation_checkpointing=full or {suggested_gpus(message)} or more GPUs "
        "(FSDP shards the model over them)"
    )
    pinned = with_training(config, parallelism="ddp")
    assert refusal(pinned, 1, "ddp").endswith(" or more GPUs with --set training.parallelism=fsdp")


def test_the_estimate_knows_that_tracing_nonfinite_turns_activation_checkpointing_and_compile_off():
    production = with_training(cfg.production(), activation_checkpointing="full")
    traced = dataclasses.replace(production, debug=dataclasses.replace(production.debug, trace_nonfinite=True))
    unchecked = with_training(production, activation_checkpointing=False, compile=False)
    assert activation_bytes(traced) == activation_bytes(unchecked) > 5 * activation_bytes(production)


@pytest.mark.parametrize("checkpointing", ["auto", "selective", "full"])
def test_a_traced_run_that_does_not_fit_is_told_that_the_tracing_costs_the_checkpointing(checkpointing):
    production = with_training(cfg.production(), activation_checkpointing=checkpointing)
    traced = dataclasses.replace(production, debug=dataclasses.replace(production.debug, trace_nonfinite=True))
    message = refusal(traced, 8, "fsdp")
    assert "--set debug.trace_nonfinite=false (its hooks turn activation checkpointing off)" in message
    assert "training.activation_checkpointing=" not in message  # the hooks would turn that off too
