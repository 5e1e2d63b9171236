"""pretrain/model/loss.py: the next-token loss outside the model, chunked or not, with the blocks'
auxiliary losses added to what the backward pass starts from."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn

from pretrain import registry
from pretrain.config import ModelConfig
from pretrain.model.feed_forward import SwiGLU
from pretrain.model.loss import chunked_cross_entropy, cross_entropy_loss, next_token_loss
from pretrain.model.transformer import Transformer

TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97)


def tokens(batch: int = 2, length: int = 12, seed: int = 0) -> Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


class SwiGLUWithAuxLoss(SwiGLU):
    """SwiGLU that also returns an auxiliary loss: the mean square of its output, times 0.5."""

    def forward(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:  # type: ignore[override]
        out = super().forward(x)
        return out, {"square": 0.5 * out.float().pow(2).mean()}


@pytest.fixture
def aux_ffn(monkeypatch) -> ModelConfig:
    """TINY with a feed-forward block registered under "swiglu_aux" for this test."""
    swiglu = registry.FEED_FORWARDS["swiglu"]
    kind = dataclasses.replace(swiglu, module=f"{__name__}:SwiGLUWithAuxLoss", llama_layout=False)
    monkeypatch.setitem(registry.FEED_FORWARDS, "swiglu_aux", kind)
    return dataclasses.replace(TINY, ffn="swiglu_aux")


@pytest.mark.parametrize("chunk_tokens", [1, 5, 24, 1000])
def test_the_chunked_loss_and_its_gradients_are_the_whole_batchs(chunk_tokens):
    hidden = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    output = nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (24,), generator=torch.Generator().manual_seed(2))
    whole_input, chunked_input = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    whole = chunked_cross_entropy(whole_input, output, targets, 0)
    whole.backward()
    whole_weight_grad = output.weight.grad.clone()
    output.weight.grad = None
    chunked = chunked_cross_entropy(chunked_input, output, targets, chunk_tokens)
    chunked.backward()
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(chunked_input.grad, whole_input.grad)
    torch.testing.assert_close(output.weight.grad, whole_weight_grad)


def test_the_model_returns_logits_and_the_loss_is_their_cross_entropy():
    model = Transformer(TINY, max_seq_len=16, seed=3)
    x, y = tokens()[:, :-1], tokens()[:, 1:]
    logits, aux_losses = model(x)
    assert logits.shape == (2, 11, 97) and aux_losses == {}
    loss = next_token_loss(model, x, y, chunk_tokens=4)
    torch.testing.assert_close(loss.cross_entropy, cross_entropy_loss(logits, y))
    assert loss.total is loss.cross_entropy and loss.aux_losses == {}


def test_a_feed_forward_blocks_auxiliary_losses_are_named_by_layer_and_added_to_the_total(aux_ffn):
    model = Transformer(aux_ffn, max_seq_len=16, seed=3)
    x, y = tokens()[:, :-1], tokens()[:, 1:]
    loss = next_token_loss(model, x, y)
    assert sorted(loss.aux_losses) == ["layers.0.square", "layers.1.square"]
    assert all(value > 0 for value in loss.aux_losses.values())
    torch.testing.assert_close(loss.total, loss.cross_entropy + sum(loss.aux_losses.values()))
    loss.total.backward()
    # The auxiliary loss trains too: w2's gradient differs from the cross-entropy's alone.
    with_aux = model.layers[0].feed_forward.w2.weight.grad.clone()
    model.zero_grad()
    next_token_loss(model, x, y).cross_entropy.backward()
    assert not torch.allclose(with_aux, model.layers[0].feed_forward.w2.weight.grad)


def test_the_compiled_loss_head_equals_the_chunked_one_with_no_graph_break():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    hidden = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    output = nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (24,), generator=torch.Generator().manual_seed(2))
    results = []
    for compiled, chunk_tokens in ((False, 5), (True, 0)):
        output.weight.grad = None
        given = hidden.clone().requires_grad_()
        loss = chunked_cross_entropy(given, output, targets, chunk_tokens, compiled=compiled)
        loss.backward()
        results.append((loss.detach(), given.grad, output.weight.grad.clone()))
    for chunked, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, chunked)
    assert counters["stats"]["unique_graphs"] >= 1, "the head was not compiled"
    assert dict(counters["graph_break"]) == {}


def test_a_model_with_compiled_blocks_compiles_its_loss_head(monkeypatch):
    from pretrain.model import loss as loss_module

    calls = []
    monkeypatch.setattr(
        loss_module, "compiled_loss_sum", lambda: lambda *args: calls.append(1) or loss_module._projected_loss_sum(*args)
    )
    model = Transformer(TINY, max_seq_len=16, seed=3)
    x, y = tokens()[:, :-1], tokens()[:, 1:]
    plain = next_token_loss(model, x, y).cross_entropy
    assert calls == []
    model.compile_loss_head = True
    torch.testing.assert_close(next_token_loss(model, x, y).cross_entropy, plain)
    assert calls == [1]
