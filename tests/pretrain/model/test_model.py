"""Tests of the Llama-style transformer in pretrain/model/transformer.py (CPU, tiny shapes, a few seconds)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ModelConfig
from pretrain.model.transformer import (
    RMSNorm,
    Transformer,
    apply_rotary,
    rotary_tables,
)
from pretrain.model.fused_layout import split_fused
from pretrain.model.loss import cross_entropy_loss

TINY = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=257, rope_theta=10000.0, init_std=0.02)
SEQ_LEN = 32


@pytest.fixture
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(TINY, max_seq_len=SEQ_LEN)


def random_tokens(batch: int = 2, length: int = SEQ_LEN, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (batch, length), generator=generator)


def test_parameter_names_follow_the_llama_layout_with_qkv_and_gate_up_fused(model: Transformer) -> None:
    d, hd, f, v = TINY.dim, TINY.dim // TINY.n_heads, TINY.ffn_dim, TINY.vocab_size
    kv = TINY.n_kv_heads * hd
    expected = {"tok_embed.weight": (v, d), "norm.weight": (d,), "output.weight": (v, d)}
    for i in range(2):
        expected |= {
            f"layers.{i}.attention.wqkv.weight": (d + 2 * kv, d),  # wq's rows, then wk's, then wv's
            f"layers.{i}.attention.wo.weight": (d, d),
            f"layers.{i}.feed_forward.w13.weight": (2 * f, d),  # w1's rows, then w3's
            f"layers.{i}.feed_forward.w2.weight": (d, f),
            f"layers.{i}.attention_norm.weight": (d,),
            f"layers.{i}.ffn_norm.weight": (d,),
        }
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == expected


def test_output_projection_is_not_tied_to_the_embedding(model: Transformer) -> None:
    assert model.output.weight.data_ptr() != model.tok_embed.weight.data_ptr()


def test_state_dict_holds_only_parameters_and_round_trips_without_the_rotary_tables(model: Transformer) -> None:
    state = model.state_dict()
    assert set(state) == {name for name, _ in model.named_parameters()}
    assert {name for name, _ in model.named_buffers()} == {"rope_cos", "rope_sin"}
    torch.manual_seed(123)
    fresh = Transformer(TINY, max_seq_len=SEQ_LEN)
    fresh.load_state_dict(state, strict=True)
    tokens = random_tokens()
    torch.testing.assert_close(fresh(tokens).out, model(tokens).out, rtol=0, atol=0)


def test_forward_gives_float32_logits_of_shape_batch_time_vocab(model: Transformer) -> None:
    logits = model(random_tokens(batch=3, length=17)).out
    assert logits.shape == (3, 17, TINY.vocab_size)
    assert logits.dtype == torch.float32


def test_num_params_equals_the_hand_counted_formula(model: Transformer) -> None:
    d, f, v, n_layers = TINY.dim, TINY.ffn_dim, TINY.vocab_size, TINY.n_layers
    kv = TINY.n_kv_heads * (d // TINY.n_heads)
    per_layer = d * d + 2 * kv * d + d * d + 3 * d * f + 2 * d  # wqkv (wq, wk + wv), wo, w13 (w1 + w3) + w2, two norms
    expected = v * d + n_layers * per_layer + d + v * d  # embedding, layers, final norm, output
    assert model.num_params() == expected == 106_944


def test_changing_a_token_changes_logits_at_and_after_it_but_never_before(model: Transformer) -> None:
    tokens = random_tokens(batch=1)
    t = 11
    changed = tokens.clone()
    changed[0, t] = (tokens[0, t] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, after = model(tokens).out, model(changed).out
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    assert (after[0, t] - before[0, t]).abs().max() > 1e-3
    assert (after[0, t + 1 :] - before[0, t + 1 :]).abs().amax(dim=-1).min() > 1e-4


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_grouped_query_attention_equals_attention_over_repeated_key_value_heads(n_kv_heads: int) -> None:
    cfg = dataclasses.replace(TINY, n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    attention = Transformer(cfg, max_seq_len=SEQ_LEN).layers[0].attention
    B, T, H, hd = 2, 9, cfg.n_heads, cfg.dim // cfg.n_heads
    x = torch.randn(B, T, cfg.dim)
    cos, sin = rotary_tables(hd, T, cfg.rope_theta)
    with torch.no_grad():
        actual = attention(x, cos, sin)
        # Reference: copy each K/V head to the n_heads // n_kv_heads query heads of its group,
        # then ordinary causal softmax attention written out by hand.
        wq, wk, wv = attention.wqkv.weight.split([H * hd, n_kv_heads * hd, n_kv_heads * hd])
        q = apply_rotary((x @ wq.T).view(B, T, H, hd), cos, sin).transpose(1, 2)
        k = apply_rotary((x @ wk.T).view(B, T, n_kv_heads, hd), cos, sin).transpose(1, 2)
        v = (x @ wv.T).view(B, T, n_kv_heads, hd).transpose(1, 2)
        k = k.repeat_interleave(H // n_kv_heads, dim=1)  # (B, H, T, hd)
        v = v.repeat_interleave(H // n_kv_heads, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)  # (B, H, T, T)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, cfg.dim)
        expected = attention.wo(y)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_fp32_attention_with_repeated_key_value_heads_matches_the_gqa_kernel_path_in_value_and_gradient(n_kv_heads: int) -> None:
    cfg = dataclasses.replace(TINY, n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    attention = Transformer(cfg, max_seq_len=SEQ_LEN).layers[0].attention
    reference = copy.deepcopy(attention).double()  # not fp32, so it keeps enable_gqa: the GQA path
    x = torch.randn(2, SEQ_LEN, cfg.dim)
    cos, sin = rotary_tables(cfg.dim // cfg.n_heads, SEQ_LEN, cfg.rope_theta)
    actual = attention(x, cos, sin)
    expected = reference(x.double(), cos.double(), sin.double())
    weights = torch.randn_like(expected)
    (actual * weights.float()).sum().backward()
    (expected * weights).sum().backward()
    # float32 rounding: each output sums dim products, each within eps of exact, relative to the output's scale.
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=cfg.dim * eps * expected.abs().max().item())
    for name in ("wqkv", "wo"):
        grad, grad64 = getattr(attention, name).weight.grad, getattr(reference, name).weight.grad
        torch.testing.assert_close(grad.double(), grad64, rtol=0, atol=cfg.dim * eps * grad64.abs().max().item())


def test_fp32_attention_repeats_key_value_heads_while_bf16_keeps_enable_gqa_and_weights_stay_grouped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    attention = Transformer(TINY, max_seq_len=SEQ_LEN).layers[0].attention
    head_dim = TINY.dim // TINY.n_heads
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.dtype, k.shape[1], v.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    x = torch.randn(2, SEQ_LEN, TINY.dim)
    cos, sin = rotary_tables(head_dim, SEQ_LEN, TINY.rope_theta)
    attention(x, cos, sin)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attention(x, cos, sin)
    # fp32: every query head gets its own K/V copy (the memory-efficient kernel's input on CUDA);
    # bf16: the K/V heads as stored, grouped by enable_gqa (flash's input).
    assert calls == [(torch.float32, TINY.n_heads, TINY.n_heads, False), (torch.bfloat16, TINY.n_kv_heads, TINY.n_kv_heads, True)]
    # The repeat happens on activations only: checkpoints keep Llama's grouped wk/wv (inside wqkv).
    assert {name: tuple(p.shape) for name, p in attention.state_dict().items()} == {
        "wqkv.weight": ((TINY.n_heads + 2 * TINY.n_kv_heads) * head_dim, TINY.dim),
        "wo.weight": (TINY.dim, TINY.n_heads * head_dim),
    }


def test_rotary_attention_score_depends_only_on_the_relative_position() -> None:
    hd, theta = 16, 10000.0
    cos, sin = rotary_tables(hd, 64, theta)
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, hd, generator=generator).unbind(0)

    def score(m: int, n: int) -> float:
        # A sequence of length 64 with q placed at position m and k at position n.
        seq = torch.zeros(1, 64, 2, hd)
        seq[0, m, 0], seq[0, n, 1] = q, k
        rotated = apply_rotary(seq, cos, sin)
        return float(rotated[0, m, 0] @ rotated[0, n, 1])

    for m, n, shift in [(5, 2, 7), (3, 3, 40), (0, 9, 20), (30, 1, 33)]:
        assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-4)
    # ... and it does depend on the relative position (an identity "rotation" would pass the above).
    assert abs(score(5, 2) - score(5, 3)) > 1e-2
    assert score(0, 0) == pytest.approx(float(q @ k), abs=1e-5)


def test_rotary_turns_adjacent_channel_pairs_by_position_times_frequency_as_in_meta_llama() -> None:
    hd, theta, position = 8, 10000.0, 3
    cos, sin = rotary_tables(hd, 4, theta)
    x = torch.zeros(1, 4, 1, hd)
    x[0, position, 0] = torch.tensor([1.0, 0.0] * (hd // 2))  # unit vector (1, 0) in every pair
    rotated = apply_rotary(x, cos, sin)[0, position, 0].view(hd // 2, 2)
    for i in range(hd // 2):
        angle = position * theta ** (-2 * i / hd)
        torch.testing.assert_close(rotated[i], torch.tensor([math.cos(angle), math.sin(angle)]))


def test_weights_are_normal_with_init_std_and_residual_projections_are_scaled_down(model: Transformer) -> None:
    std = TINY.init_std
    residual_std = std / math.sqrt(2 * TINY.n_layers)  # 0.01
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        wanted = residual_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else std
        assert p.std().item() == pytest.approx(wanted, rel=0.06), name
        assert abs(p.mean().item()) < 0.1 * wanted, name


def separate_layout_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The weights the model drew from seed before queries/keys/values and gate/up were fused:
    every weight whole, in module order (wq, wk, wv, wo; w1, w2, w3), wo and w2 scaled down."""
    generator = torch.Generator().manual_seed(seed)
    std, residual_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
    d, f, kv = cfg.dim, cfg.ffn_dim, cfg.n_kv_heads * (cfg.dim // cfg.n_heads)

    def draw(rows: int, cols: int, scale: float) -> torch.Tensor:
        return torch.empty(rows, cols).normal_(mean=0.0, std=scale, generator=generator)

    weights = {"tok_embed.weight": draw(cfg.vocab_size, d, std)}
    for i in range(cfg.n_layers):
        block = f"layers.{i}."
        weights |= {block + "attention.wq.weight": draw(d, d, std), block + "attention.wk.weight": draw(kv, d, std)}
        weights |= {block + "attention.wv.weight": draw(kv, d, std), block + "attention.wo.weight": draw(d, d, residual_std)}
        weights |= {block + "feed_forward.w1.weight": draw(f, d, std), block + "feed_forward.w2.weight": draw(d, f, residual_std)}
        weights[block + "feed_forward.w3.weight"] = draw(f, d, std)
    weights["output.weight"] = draw(cfg.vocab_size, d, std)
    return weights


def test_a_seed_gives_the_weights_the_separate_layout_drew_from_it_now_in_the_fused_ones() -> None:
    state = Transformer(TINY, max_seq_len=SEQ_LEN, seed=7).state_dict()
    assert "layers.0.attention.wqkv.weight" in state and "layers.1.feed_forward.w13.weight" in state
    separate = {name: value for name, value in split_fused(state, TINY).items() if not name.endswith("norm.weight")}
    expected = separate_layout_weights(TINY, seed=7)
    assert separate.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(separate[name], value), name


def test_a_block_runs_one_matmul_for_queries_keys_and_values_and_one_for_gate_and_up(model: Transformer) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    widths: list[int] = []  # the output width of every matmul the block's forward runs

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                widths.append(out.shape[-1])
            return out

    block, head_dim = model.layers[0], TINY.dim // TINY.n_heads
    cos, sin = rotary_tables(head_dim, SEQ_LEN, TINY.rope_theta)
    with torch.no_grad(), Matmuls():
        block(torch.randn(2, SEQ_LEN, TINY.dim), cos, sin)
    qkv = (TINY.n_heads + 2 * TINY.n_kv_heads) * head_dim
    assert widths == [qkv, TINY.dim, 2 * TINY.ffn_dim, TINY.dim]  # wqkv, wo, w13, w2


def test_the_fused_gate_and_up_projection_computes_swiglu_of_the_separate_w1_and_w3(model: Transformer) -> None:
    fused = {name: p.detach() for name, p in model.named_parameters()}
    assert "layers.0.feed_forward.w13.weight" in fused
    w = split_fused(fused, TINY)  # w13's rows: w1's, then w3's
    x = torch.randn(2, 5, TINY.dim)
    gate, up = x @ w["layers.0.feed_forward.w1.weight"].T, x @ w["layers.0.feed_forward.w3.weight"].T
    expected = (F.silu(gate) * up) @ w["layers.0.feed_forward.w2.weight"].T
    with torch.no_grad():
        torch.testing.assert_close(model.layers[0].feed_forward(x), expected, rtol=1e-5, atol=1e-6)


def test_input_longer_than_max_seq_len_raises_value_error_naming_both_lengths(model: Transformer) -> None:
    model(random_tokens(batch=1, length=SEQ_LEN))  # exactly max_seq_len is fine
    with pytest.raises(ValueError, match=rf"\b{SEQ_LEN + 1}\b.*max_seq_len {SEQ_LEN}\b"):
        model(random_tokens(batch=1, length=SEQ_LEN + 1))


def test_loss_at_initialisation_is_close_to_log_vocab_size(model: Transformer) -> None:
    tokens = random_tokens(batch=4, length=SEQ_LEN + 1)
    with torch.no_grad():
        loss = cross_entropy_loss(model(tokens[:, :-1]).out, tokens[:, 1:])
    assert loss.item() == pytest.approx(math.log(TINY.vocab_size), abs=0.1)


def test_one_optimizer_step_on_a_fixed_batch_lowers_the_loss(model: Transformer) -> None:
    tokens = random_tokens(batch=4, length=SEQ_LEN + 1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = cross_entropy_loss(model(inputs).out, targets)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        new_loss = cross_entropy_loss(model(inputs).out, targets)
    assert new_loss.item() < loss.item() - 0.05


def test_every_parameter_gets_a_gradient_so_ddp_needs_no_unused_parameter_search(model: Transformer) -> None:
    tokens = random_tokens(batch=2, length=9)
    cross_entropy_loss(model(tokens[:, :-1]).out, tokens[:, 1:]).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bf16_autocast_forward_on_cpu_gives_a_finite_float32_loss_near_the_fp32_one(model: Transformer) -> None:
    tokens = random_tokens(batch=2, length=SEQ_LEN + 1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        fp32_loss = cross_entropy_loss(model(inputs).out, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(inputs).out
        loss = cross_entropy_loss(logits, targets)
    assert logits.dtype == torch.bfloat16  # autocast really ran the projections in bf16
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(fp32_loss.item(), abs=0.02)
    loss.backward()
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters())


def test_cross_entropy_loss_is_the_float32_mean_negative_log_likelihood_of_the_targets() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11, generator=generator)).to(torch.bfloat16)
    targets = torch.randint(0, 11, (2, 5), generator=generator)
    loss = cross_entropy_loss(logits, targets)
    log_probs = F.log_softmax(logits.double(), dim=-1)
    expected = -log_probs.gather(-1, targets.unsqueeze(-1)).mean()
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_rms_norm_gives_unit_rms_in_the_input_dtype() -> None:
    norm = RMSNorm(64, eps=1e-5)
    x = (5 * torch.randn(3, 7, 64)).to(torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    rms = y.float().pow(2).mean(dim=-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=0, atol=1e-2)
    with torch.no_grad():
        norm.weight.fill_(2.0)
    torch.testing.assert_close(norm(x).float(), 2 * y.float(), rtol=1e-2, atol=1e-2)
