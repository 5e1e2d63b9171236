"""The residual stream's dtype (pretrain/model/transformer.py): bf16 under autocast, with the norms'
statistics in float32 and nothing float32 the size of an activation kept for the backward pass
(RMSNorm's and the cross-entropy's own backward passes); an fp32 run computes what it computed
before, and compiles without graph breaks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from pretrain import config as cfg
from pretrain.model import loss as loss_module
from pretrain.model import transformer as model_module
from pretrain.model.loss import cross_entropy_sum, next_token_loss
from pretrain.model.transformer import RMSNorm, Transformer, rms_norm

TINY = cfg.ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97)


def old_rms_norm(self: RMSNorm, x: Tensor) -> Tensor:
    """RMSNorm.forward as it was: autograd through the float32 formula."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
    return (xf * self.weight.float()).to(x.dtype)


def old_cross_entropy_sum(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def batch(config: cfg.ModelConfig, rows: int = 2, length: int = 16, seed: int = 0) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, config.vocab_size or 2, (rows, length + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_and_grads(model: Transformer, x: Tensor, y: Tensor, amp: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = next_token_loss(model, x, y).total
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_the_norm_and_the_cross_entropy_give_the_float32_formulas_values_and_gradients():
    x = torch.randn(3, 5, 16, dtype=torch.float64).float().requires_grad_()
    weight = (1 + 0.1 * torch.randn(16)).requires_grad_()
    norm = RMSNorm(16, 1e-5)
    norm.weight.data.copy_(weight.detach())
    new = rms_norm(x, weight, 1e-5)
    assert torch.equal(new, old_rms_norm(norm, x))  # the same float32 operations, in the same order
    upstream = torch.randn_like(new)
    new_grads = torch.autograd.grad(new, (x, weight), upstream)
    old_grads = torch.autograd.grad(old_rms_norm(norm, x), (x, norm.weight), upstream)
    for got, expected in zip(new_grads, old_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)

    logits = (3 * torch.randn(10, 50)).requires_grad_()
    targets = torch.randint(0, 50, (10,))
    new_loss, old_loss = cross_entropy_sum(logits, targets), old_cross_entropy_sum(logits, targets)
    torch.testing.assert_close(new_loss, old_loss, rtol=1e-6, atol=0)
    (new_grad,) = torch.autograd.grad(new_loss, logits)
    (old_grad,) = torch.autograd.grad(old_loss, logits)
    torch.testing.assert_close(new_grad, old_grad, rtol=1e-6, atol=1e-7)


def test_the_debug_preset_in_float32_keeps_an_fp32_stream_and_the_old_formulas_loss_and_gradients(monkeypatch):
    config = cfg.resolve(preset="debug")
    assert config.training.use_amp is False
    shape = dataclasses.replace(config.model, vocab_size=257)  # the byte tokenizer's (resolving the data sets it)
    model = Transformer(shape, max_seq_len=config.data.context_length, seed=0)
    x, y = batch(shape, length=config.data.context_length)
    stream = []
    model.layers[0].register_forward_pre_hook(lambda module, args: stream.append(args[0].dtype))
    loss, grads = loss_and_grads(model, x, y)
    assert stream == [torch.float32]  # an fp32 run casts nothing
    monkeypatch.setattr(RMSNorm, "forward", old_rms_norm)
    monkeypatch.setattr(loss_module, "cross_entropy_sum", old_cross_entropy_sum)
    old_loss, old_grads = loss_and_grads(model, x, y)
    torch.testing.assert_close(loss, old_loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, old_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_under_autocast_the_residual_stream_is_bf16_and_the_loss_and_gradients_are_close_to_float32():
    model = Transformer(TINY, max_seq_len=16, seed=1)
    x, y = batch(TINY)
    stream = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda module, args: stream.append(args[0].dtype))
    fp32_loss, fp32_grads = loss_and_grads(model, x, y)
    stream.clear()
    bf16_loss, bf16_grads = loss_and_grads(model, x, y, amp=True)
    assert stream == [torch.bfloat16] * TINY.n_layers
    assert bf16_loss.dtype == torch.float32
    torch.testing.assert_close(bf16_loss, fp32_loss, rtol=2e-2, atol=0)
    for name, grad in bf16_grads.items():
        assert grad.dtype == torch.float32, name  # master weights' gradients stay fp32
        cosine = F.cosine_similarity(grad.flatten(), fp32_grads[name].flatten(), dim=0)
        assert cosine > 0.98, (name, float(cosine))


def test_the_bf16_forward_keeps_almost_nothing_in_float32_for_the_backward_pass():
    import sys

    from support.processes import ROOT

    sys.path.insert(0, str(ROOT))
    from benchmarks import efficiency_forward as counters

    model = Transformer(TINY, max_seq_len=16, seed=1)

    def forward_at(rows: int) -> Tensor:
        x, y = batch(TINY, rows=rows)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return next_token_loss(model, x, y).total

    saved = counters.activation_bytes_per_token(forward_at, tokens_per_row=16)
    total = sum(saved.values())
    # float32 left: each norm's 1 / rms, attention's log-sum-exp per head, the loss's per token
    assert saved["bfloat16"] > 0.8 * total, saved
    assert saved.get("float32", 0) <= 0.05 * total, saved


@pytest.mark.parametrize("chunk_tokens", [0, 8])
def test_the_compiled_bf16_model_has_no_graph_break_and_matches_eager(chunk_tokens, monkeypatch):
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda function, mode=None, **_: compile_(function, backend="aot_eager"))
    loss_module.compiled_loss_sum.cache_clear()
    torch._dynamo.reset()
    counters.clear()
    model = Transformer(TINY, max_seq_len=16, seed=1)
    x, y = batch(TINY)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = next_token_loss(model, x, y, chunk_tokens).total
    eager.backward()
    eager_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for block in model.layers:
        block.compile()
    model.compile_loss_head = True
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            compiled = next_token_loss(model, x, y, chunk_tokens).total
        compiled.backward()
    finally:
        loss_module.compiled_loss_sum.cache_clear()
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] >= 2  # the blocks' and the head's
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=0)
    for name, p in model.named_parameters():
        cosine = F.cosine_similarity(p.grad.flatten(), eager_grads[name].flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))


def test_the_eager_cross_entropy_backward_in_slabs_equals_the_whole(monkeypatch):
    logits = torch.randn(10, 50).requires_grad_()
    targets = torch.randint(0, 50, (10,))
    (whole,) = torch.autograd.grad(cross_entropy_sum(logits, targets), logits)
    monkeypatch.setattr(loss_module, "BACKWARD_SLAB_ELEMENTS", 120)  # 2 rows at a time
    (slabs,) = torch.autograd.grad(cross_entropy_sum(logits, targets), logits)
    torch.testing.assert_close(slabs, whole, rtol=0, atol=0)


def test_the_model_module_names_an_autocast_dtype_only_where_autocast_is_on():
    assert model_module._autocast_dtype("cpu") is None
    assert model_module._autocast_dtype("meta") is None  # a device autocast has no mode for
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model_module._autocast_dtype("cpu") == torch.bfloat16
