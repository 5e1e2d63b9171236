"""pretrain/plan/activations.py under torch.compile: what a compiled block keeps (against the
partitioner's own choice, on CPU), and the whole estimate of a compiled and an eager `small`
against the peaks one H200 measured (benchmarks/results/2026-11-25-h200.json). The eager counts
are checked against autograd in test_memory.py."""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import pytest
import torch

from support.processes import ROOT
from support.memory_configs import with_model, with_training
from pretrain import config as cfg
from pretrain.plan import activations
from pretrain.plan.gpu_memory import GIB, estimate
from pretrain.plan.parallelism import plan_parallelism

H200_RESULTS = ROOT / "benchmarks" / "results" / "2026-11-25-h200.json"
H200_GIB = 140.4  # the GPU's memory as NVML reports it, which the acceptance's launcher planned on
WITHIN = 1.3
"""The estimate of a run may exceed its measured peak by this much at most (issue 38)."""


def measured_peak_gib(how: str) -> float:
    """The allocated peak of `small` on one H200, compiled or not (the acceptance's row)."""
    rows = json.loads(H200_RESULTS.read_text(encoding="utf-8"))
    rows = rows["rows"] if isinstance(rows, dict) else rows
    (row,) = [r for r in rows if r["check"] == f"memory estimate vs measured, `small`, {how}, 1 GPU"]
    found = re.search(r"allocated peak ([\d.]+) GiB", row["result"])
    assert found, row["result"]
    return float(found.group(1))


def planned_small_estimate(compile: bool) -> float:
    """GiB the launcher's plan estimates for the acceptance's `small` run on one H200 (GPT-2's
    vocabulary padded to 50,304 rows, as the acceptance sets it on the byte fallback)."""
    config = with_training(with_model(cfg.small(), vocab_size=50304), compile=compile)
    planned, _ = plan_parallelism(config, 1, int(H200_GIB * GIB))
    return estimate(planned, 1, planned.training.parallelism).total / GIB


@pytest.mark.parametrize("how", ["compiled", "not compiled"])
def test_small_on_one_h200_is_estimated_at_or_above_its_measured_peak_and_within_1_3_x(how):
    peak, estimated = measured_peak_gib(how), planned_small_estimate(how == "compiled")
    assert peak <= estimated <= WITHIN * peak, f"{how}: estimate {estimated:.1f} GiB, measured peak {peak} GiB"


def test_a_compiled_run_is_estimated_below_the_same_run_eager():
    assert planned_small_estimate(True) < 0.7 * planned_small_estimate(False)


def compiled_saved_bytes_per_token(config: cfg.Config) -> float:
    """Bytes per token that torch.compile's partitioner keeps for one block's backward pass: the
    forward graph's outputs beyond the block's own, less the weights and the rotary tables
    (min-cut partitioning with inductor's rules, as torch.compile's default backend uses; the
    graphs run as they are, nothing is built)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from pretrain.model.transformer import TransformerBlock, rotary_tables

    forward_graphs = []

    def forward(graph, inputs):
        forward_graphs.append(graph)
        return make_boxed_func(graph.forward)

    backend = aot_autograd(
        fw_compiler=forward,
        bw_compiler=lambda graph, inputs: make_boxed_func(graph.forward),
        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
    )
    torch.manual_seed(0)
    model, amp = config.model, config.training.use_amp
    block = TransformerBlock(model)
    batch, length = 3, 16
    cos, sin = rotary_tables(model.dim // model.n_heads, length, model.rope_theta, model.rope_scaling)
    x = torch.randn(batch, length, model.dim, dtype=torch.bfloat16 if amp else torch.float32, requires_grad=True)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        torch.compile(block, backend=backend)(x, cos.float(), sin.float())
    torch._dynamo.reset()
    (graph,) = forward_graphs
    (output,) = [node for node in graph.graph.nodes if node.op == "output"]
    weights = {tuple(p.shape) for p in block.parameters()} | {tuple(p.shape)[::-1] for p in block.parameters()}
    kept = 0
    for node in output.args[0][1:]:  # the block's output first, then what the backward reads
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or tuple(value.shape) in weights or tuple(value.shape) == tuple(cos.shape):
            continue
        kept += value.numel() * value.element_size()
    return kept / (batch * length)


@pytest.mark.parametrize("use_amp", [True, False])
def test_a_compiled_block_keeps_what_the_estimate_counts(use_amp):
    # widths no two of which are equal, so that a kept tensor's shape says what it is
    config = with_model(cfg.debug(), dim=128, n_heads=4, n_kv_heads=2, ffn_dim=320, vocab_size=61, max_seq_len=16)
    config = with_training(config, use_amp=use_amp, compile=True)
    counted = activations.compiled_bytes_per_token(config.model, activations.compute_bytes(config))
    assert compiled_saved_bytes_per_token(config) == counted
    assert counted < activations.eager_bytes_per_token(config.model, activations.compute_bytes(config))


def test_under_debug_tracing_the_estimate_counts_the_eager_model():
    config = with_training(cfg.small(), compile=True, activation_checkpointing="none", loss_chunk_tokens=0)
    traced = cfg.apply_overrides(config, {"debug": {"trace_nonfinite": True}}, "test")
    assert activations.compiled(config) and not activations.compiled(traced)
    eager = with_training(config, compile=False)
    assert activations.activation_bytes(traced) == activations.activation_bytes(eager)
    assert activations.logits_bytes(traced) == activations.logits_bytes(eager) > activations.logits_bytes(config)


def moe_tiny(use_amp: bool, capacity_factor: float | None, n_layers: int = 2) -> cfg.Config:
    """test_memory.py's tiny model with 4 experts, top-2."""
    from test_memory import tiny

    config = tiny(use_amp, 0, n_layers=n_layers)
    moe = cfg.MoEConfig(num_experts=4, top_k=2, capacity_factor=capacity_factor)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, moe=moe))


@pytest.mark.parametrize("use_amp", [True, False], ids=["bf16-grouped", "fp32-fallback"])
@pytest.mark.parametrize("capacity_factor", [None, 1.25], ids=["dropless", "capacity-1.25"])
def test_a_mixture_of_experts_block_keeps_what_the_estimate_counts(use_amp, capacity_factor):
    from test_memory import saved_bytes

    def per_block(count) -> int:
        return count(moe_tiny(use_amp, capacity_factor)) - count(moe_tiny(use_amp, capacity_factor, n_layers=1))

    estimated, saved = per_block(activations.activation_bytes), per_block(saved_bytes)
    # each expert's overflow row (capacity routing, and the fp32 fallback's buffer) is per batch, not per token
    assert estimated == pytest.approx(saved, rel=0.02)


def test_a_bf16_dropless_block_with_a_width_grouped_matmuls_cannot_take_keeps_the_buffer_the_estimate_counts():
    from test_memory import saved_bytes

    def unaligned(n_layers: int) -> cfg.Config:  # ffn_dim 100: not a multiple of 8, so the every-token buffer runs
        return with_model(moe_tiny(True, None, n_layers=n_layers), ffn_dim=100)

    estimated = activations.activation_bytes(unaligned(2)) - activations.activation_bytes(unaligned(1))
    assert estimated == pytest.approx(saved_bytes(unaligned(2)) - saved_bytes(unaligned(1)), rel=0.02)
    grouped = with_model(moe_tiny(True, None), ffn_dim=104)
    assert activations.registry.expert_rows_per_token(activations.as_routed(grouped.model, activations.BF16)) == 2.0


def test_dropless_is_estimated_at_top_k_rows_a_token_below_capacity_padding_and_the_fp32_fallback_above():
    dropless, padded = (moe_tiny(True, factor).model for factor in (None, 1.25))
    rows = [activations.registry.expert_rows_per_token(m) for m in (dropless, padded)]
    assert rows == [2.0, 2.5]  # top_k exactly, however unevenly routed; capacity pads every expert
    bf16 = [activations.eager_bytes_per_token(m, activations.BF16) for m in (dropless, padded)]
    assert bf16[0] < bf16[1]
    fallback = activations.as_routed(dropless, activations.FP32)  # every expert a row for every token
    assert activations.registry.expert_rows_per_token(fallback) == 4.0
    selective = activations.selective_feed_forward_per_token
    assert selective(dropless, activations.FP32) > selective(dropless, activations.BF16)
