"""pretrain/model/loss.py: the next-token loss outside the model, chunked or not, with the blocks'
auxiliary losses added to what the backward pass starts from."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from pretrain import registry
from pretrain.config import ModelConfig
from pretrain.model.feed_forward import SwiGLU
from pretrain.model.loss import chunked_cross_entropy, cross_entropy_loss, next_token_loss
from pretrain.model.transformer import Transformer

REPO = Path(__file__).resolve().parents[3]

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


def test_a_model_with_compiled_blocks_compiles_its_final_norm_with_the_loss_head_in_its_compile_mode(monkeypatch):
    from pretrain.model import loss as loss_module

    compile_ = torch.compile
    graphs, modes = [], []

    def recording_backend(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return gm.forward

    def compile_recording(function, mode=None):
        modes.append(mode)
        return compile_(function, backend=recording_backend)

    monkeypatch.setattr(torch, "compile", compile_recording)
    loss_module.compiled_loss_sum.cache_clear()
    torch._dynamo.reset()
    model = Transformer(TINY, max_seq_len=16, seed=3)
    norm_calls = []
    model.norm.register_forward_hook(lambda *_: norm_calls.append(1))
    x, y = tokens()[:, :-1], tokens()[:, 1:]
    plain = next_token_loss(model, x, y).cross_entropy
    assert norm_calls == [1] and graphs == []  # eager: the norm runs as a module (the NaN tracer's hooks see it)
    model.compile_loss_head, model.compile_mode = True, "max-autotune-no-cudagraphs"
    try:
        torch.testing.assert_close(next_token_loss(model, x, y).cross_entropy, plain)
    finally:
        loss_module.compiled_loss_sum.cache_clear()
    assert norm_calls == [1], "the final norm ran outside the compiled head"
    assert modes == ["max-autotune-no-cudagraphs"]
    assert len(graphs) == 1 and "rsqrt" in graphs[0]  # the norm's statistics inside the compiled graph


@pytest.mark.slow
def test_the_compiled_loss_heads_backward_holds_no_more_than_one_copy_of_the_logits() -> None:
    """The compiled head keeps the logits in bf16 and writes their gradient in bf16, with no float32
    (tokens, vocab) buffer between (a scatter in the backward made inductor allocate one: 4 bf16
    copies). Measured as the process's peak memory growth, in a process of its own."""
    script = textwrap.dedent(
        """
        import resource, torch
        from pretrain.model.loss import compiled_loss_sum
        torch.set_num_threads(1)
        head = compiled_loss_sum(None)
        def run(n, vocab, dim=32):
            hidden = torch.randn(n, dim, requires_grad=True)
            weight = (torch.randn(vocab, dim) * 0.02).requires_grad_()
            norm = torch.ones(dim, requires_grad=True)
            targets = torch.randint(0, vocab, (n,))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return head(hidden, norm, 1e-5, weight, targets, n)
        run(64, 256).backward()  # compiles (dynamic shapes may compile once more)
        run(128, 512).backward()
        n, vocab = 1024, 32768
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run(n, vocab).backward()
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
        print(grown * 1024 / (n * vocab * 2))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    copies = float(result.stdout.strip().splitlines()[-1])
    assert copies < 1.6, f"the compiled head's forward and backward grew the peak by {copies:.2f} bf16 copies of the logits"


def test_every_layers_auxiliary_loss_joins_the_total_in_a_few_ops_not_one_add_per_layer() -> None:
    """next_token_loss runs outside the compiled blocks: an add per MoE layer would be that many
    uncompiled kernels a step (the efficiency benchmark's per-row notes list them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    aux = {f"layers.{i}.moe_load_balance": torch.tensor(float(i)) for i in range(12)}
    cross_entropy, tokens = torch.tensor(1.0), torch.zeros(1, 1, dtype=torch.long)

    class Stub(nn.Module):
        def forward(self, tokens: Tensor, head) -> tuple[Tensor, dict[str, Tensor]]:
            return cross_entropy, aux

    with Ops() as ops:
        loss = next_token_loss(Stub(), tokens, tokens)
    assert loss.total.item() == 1.0 + sum(range(12))
    assert len(ops.names) <= 3, ops.names
