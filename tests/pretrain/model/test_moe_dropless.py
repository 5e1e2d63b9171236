"""Dropless experts (pretrain/model/moe_dropless.py; model.moe.capacity_factor null): every token
reaches its top_k experts, through grouped matmuls in bf16 and the every-token buffer in fp32,
with the outputs and gradients of a per-expert Python loop, no host sync, and no graph break or
recompile under torch.compile, with activation checkpointing too."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from test_moe import AUX_LOSS, Checkpointed, HostSyncs, moe_config, tiny_block
from pretrain import config as cfg
from pretrain import registry
from pretrain.model.moe import DROPPED, MixtureOfExperts, place_experts
from pretrain.model import moe_dropless
from pretrain.model.moe_dropless import ExpertsKernel, Sorted, grouped_mm_runs
from pretrain.plan import activations
from support.grouped_kernels import nan_for_empty_groups

aten = torch.ops.aten

PATHS = ["bf16-grouped", "fp32-fallback"]


def precision(path: str) -> contextlib.AbstractContextManager:
    """bf16 runs the experts as grouped matmuls (autocast, as training.use_amp does); fp32 the fallback."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if path == "bf16-grouped" else contextlib.nullcontext()


def loop_reference(block: MixtureOfExperts, x: Tensor) -> tuple[Tensor, Tensor]:
    """Every token through each of its top_k experts, one expert and one choice at a time (boolean
    indexing: the sizes come from the routing), weighted by the renormalised probabilities."""
    tokens = x.reshape(-1, x.size(-1))
    probs = block.router(tokens).float().softmax(dim=-1)
    weights, experts = probs.topk(block.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else tokens.dtype
    out = torch.zeros_like(tokens)
    for expert in range(block.num_experts):
        for choice in range(block.top_k):
            mine = experts[:, choice] == expert
            h = tokens[mine].to(dtype)
            w1, w3, w2 = (w[expert].to(dtype) for w in (block.w1, block.w3, block.w2))
            y = (F.silu(h @ w1) * (h @ w3)) @ w2
            index = mine.nonzero().squeeze(-1)
            out = out.index_add(0, index, (y * weights[mine, choice].to(y.dtype).unsqueeze(-1)).to(out.dtype))
    share = F.one_hot(experts.reshape(-1), block.num_experts).float().mean(dim=0)
    aux = block.aux_loss_weight * block.num_experts * (share * probs.mean(dim=0)).sum()
    return out.view(x.shape), aux


class Matmuls(TorchDispatchMode):
    """The matmul ops run inside."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (aten._grouped_mm, aten.bmm, aten.mm):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_sorted_assignments_keep_each_experts_tokens_in_order_and_end_at_device_offsets():
    experts = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])  # (N=4, k=2)
    weights = torch.arange(8, dtype=torch.float32).view(4, 2)
    route = Sorted(experts, weights, num_experts=4)
    assert route.token.tolist() == [0, 1, 3, 1, 2, 0, 2, 3]  # expert 0's tokens, then 1's, then 2's
    assert route.weight.tolist() == [1.0, 2.0, 6.0, 3.0, 5.0, 0.0, 4.0, 7.0]  # each row's own probability
    assert route.offsets.dtype == torch.int32 and route.offsets.tolist() == [3, 5, 8, 8]  # expert 3: none


KERNELS = {  # compute capability -> (grouped, host sync, empty experts' gradients zeroed)
    (9, 0): (True, False, False),  # H100, H200: CUTLASS, offsets read on the device
    (10, 0): (True, False, True),  # B200: CUTLASS, pytorch/pytorch#172439
    (8, 0): (True, True, False),  # A100: torch's loop over the experts, offsets copied to the host
    (8, 9): (True, True, False),  # L4, L40S
    (12, 0): (True, True, False),  # consumer Blackwell: torch's fast path is 9.x and 10.x only
    (7, 0): (False, False, False),  # V100: no bf16 grouped matmul
}


def test_every_gpu_that_trains_in_bf16_runs_grouped_matmuls_and_the_kernel_says_where_they_sync_or_need_zeroing():
    for capability, (grouped, sync, zeroed) in KERNELS.items():
        kernel = moe_dropless.experts_kernel(torch.device("cuda", 0), capability)
        assert (kernel.grouped, kernel.host_sync, kernel.zero_empty_gradients) == (grouped, sync, zeroed), capability
    for device in ("cpu", "meta"):
        assert moe_dropless.experts_kernel(torch.device(device)) == ExpertsKernel(grouped=True)
    a100 = moe_dropless.experts_kernel(torch.device("cuda", 0), (8, 0))
    assert grouped_mm_runs(torch.bfloat16, a100, dim=32, ffn_dim=64)  # 1x the FLOPs: no every-token buffer
    assert not grouped_mm_runs(torch.float32, a100, dim=32, ffn_dim=64) and not grouped_mm_runs(torch.float16, a100, 32, 64)


@pytest.mark.parametrize("widths", [(32, 100), (36, 64)], ids=["ffn_dim-100", "dim-36"])
def test_widths_that_are_not_multiples_of_8_take_the_buffer_as_the_plan_counts_instead_of_crashing(widths):
    kernel = ExpertsKernel(grouped=True)
    assert grouped_mm_runs(torch.bfloat16, kernel, 32, 64) and not grouped_mm_runs(torch.bfloat16, kernel, *widths)
    config = cfg.resolve(preset="debug", sets=["model.moe.num_experts=4", "model.moe.top_k=2", "model.ffn_dim=100"])
    assert config.model.ffn_dim == 100  # a valid config: what used to raise "strides should be multiple of 16 bytes"
    dim, ffn_dim = widths
    torch.manual_seed(0)
    block = MixtureOfExperts(
        dataclasses.replace(moe_config(capacity_factor=None), dim=dim, ffn_dim=ffn_dim, n_heads=2, n_kv_heads=2)
    )
    for weight in (block.w1, block.w2, block.w3):
        nn.init.normal_(weight, std=0.1)
    seen = Matmuls()
    with precision("bf16-grouped"), seen:
        out, aux = block(torch.randn(2, 8, dim))
    (out.float().sum() + aux[AUX_LOSS]).backward()
    assert [op for op in seen.ops if op != "mm"] == ["bmm"] * 3 and aux[DROPPED].item() == 0
    routed = activations.as_routed(config.model, activations.BF16)
    assert registry.expert_rows_per_token(routed) == 4.0  # the plan counts the buffer's row for every token per expert
    aligned = activations.as_routed(dataclasses.replace(config.model, ffn_dim=96), activations.BF16)
    assert registry.expert_rows_per_token(aligned) == 2.0  # grouped: top_k rows a token


@pytest.mark.parametrize("zeroed", [True, False], ids=["zeroed", "as-the-kernel-gives-them"])
def test_on_blackwell_an_empty_experts_gradient_is_zeroed_after_the_grouped_matmul(monkeypatch, zeroed):
    nan_for_empty_groups(monkeypatch)
    block = tiny_block(capacity_factor=None)
    block.kernel = ExpertsKernel(grouped=True, zero_empty_gradients=zeroed)
    with torch.no_grad():  # expert 3 never chosen: positive inputs, and its router row far below the others
        block.router.weight[3] = -10.0
    x, grads = torch.rand(2, 8, 32), []
    for forward in (block.forward, lambda x: loop_reference(block, x)):
        block.zero_grad()
        with precision("bf16-grouped"):
            out, aux = forward(x)
        out.float().sum().backward()
        grads.append([w.grad.clone() for w in (block.w1, block.w3, block.w2)])
    mine, loop = grads
    assert all(bool((w[3] == 0).all()) for w in loop)  # expert 3 had no row
    if zeroed:
        for got, want in zip(mine, loop, strict=True):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    else:
        assert all(bool(w[3].isnan().all()) for w in mine)


def test_zeroing_empty_experts_gradients_replaces_nan_and_leaves_the_others_and_the_forward_alone():
    weight = torch.randn(3, 2, 2, requires_grad=True)
    out = moe_dropless.zero_empty_gradients(weight, torch.tensor([5, 0, 1]))
    assert torch.equal(out, weight)
    grad = torch.ones(3, 2, 2)
    grad[1] = float("nan")
    out.backward(grad)
    assert weight.grad is not None and weight.grad[1].eq(0).all() and weight.grad[[0, 2]].eq(1).all()


def test_a_placed_blocks_compiled_forward_asks_cuda_nothing_and_warns_nothing(monkeypatch):
    asked = []

    def capability(device=None):
        asked.append(device)
        return (10, 0)  # B200: the zeroing's autograd Function is traced too

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    block = tiny_block(capacity_factor=None)
    assert place_experts(nn.Sequential(block), torch.device("cuda", 0)) == block.kernel
    assert len(asked) == 1 and block.kernel is not None and block.kernel.zero_empty_gradients
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught, precision("bf16-grouped"):
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(block)(torch.randn(2, 8, 32))
    assert len(asked) == 1  # nothing asked while tracing
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert not [w for w in caught if "capability" in str(w.message).lower() or "cuda" in str(w.message).lower()]
    code = "\n".join(graph.code for graph in explained.graphs)
    assert "grouped_mm" in code and "capability" not in code
    torch._dynamo.reset()


@pytest.mark.parametrize("capability", [(9, 4), (9, 5), (9, 0), (11, 0)], ids=["mi300x", "mi355x", "mi250x", "rdna3"])
def test_on_rocm_grouped_matmuls_count_as_syncing_with_the_host_and_zero_empty_experts_gradients(monkeypatch, capability):
    # ROCm's torch reports gfx942 as capability 9.4, which CUDA's rule would take for Hopper's
    # sync-free CUTLASS kernel; ROCm's _grouped_mm is torch's loop over the experts (or CK's kernel).
    monkeypatch.setattr(torch.version, "hip", "7.0.51831")
    kernel = moe_dropless.experts_kernel(torch.device("cuda", 0), capability)
    assert kernel == ExpertsKernel(grouped=True, host_sync=True, zero_empty_gradients=True)


def test_placing_dropless_experts_on_an_amd_gpu_logs_the_sync_line_naming_its_architecture(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "7.0.51831")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    props = types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("pretrain")
    logger.addHandler(handler)
    try:
        kernel = place_experts(nn.Sequential(tiny_block(capacity_factor=None)), torch.device("cuda", 0))
    finally:
        logger.removeHandler(handler)
    assert kernel is not None and kernel.host_sync
    [line] = [r.getMessage() for r in records]
    assert "ROCm gfx942" in line and "host sync" in line and "model.moe.capacity_factor" in line


@pytest.mark.parametrize(
    ("capability", "factor", "warned"),
    [((8, 0), None, True), ((9, 0), None, False), ((8, 0), 1.25, False)],
    ids=["a100-dropless", "h100-dropless", "a100-capacity"],
)
def test_placing_experts_on_a_gpu_whose_grouped_matmul_syncs_logs_one_line_naming_capacity_routing(
    monkeypatch, capability, factor, warned
):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    model = nn.Sequential(tiny_block(capacity_factor=factor), tiny_block(capacity_factor=factor))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("pretrain")
    logger.addHandler(handler)  # the logger may not propagate (the CLI's setup): caplog would miss it
    try:
        kernel = place_experts(model, torch.device("cuda", 0))
    finally:
        logger.removeHandler(handler)
    assert kernel is not None and kernel.grouped and all(block.kernel == kernel for block in model)
    lines = [r.getMessage() for r in records]
    assert len(lines) == (1 if warned else 0)
    if warned:
        assert "host sync" in lines[0] and "model.moe.capacity_factor" in lines[0] and "8.0" in lines[0]
    assert place_experts(nn.Linear(2, 2), torch.device("cpu")) is None


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_dropless_gives_the_per_expert_loop_outputs_and_gradients_with_every_token_at_its_experts(path, training):
    block = tiny_block(capacity_factor=None).train(training)
    with torch.no_grad():  # routing collapsed onto expert 0: a capacity would drop most of it
        block.router.weight[0] += 3 * block.router.weight[1:].abs().sum(0)
    x, grad_out = torch.randn(3, 8, 32), torch.randn(3, 8, 32)
    results, seen = [], Matmuls()
    for forward in (block.forward, lambda x: loop_reference(block, x)):
        block.zero_grad()
        inputs = x.clone().requires_grad_()
        with precision(path), seen if forward == block.forward else contextlib.nullcontext():
            out, aux = forward(inputs)
        dropped = aux[DROPPED] if isinstance(aux, dict) else None
        aux = aux[AUX_LOSS] if isinstance(aux, dict) else aux
        ((out.float() * grad_out).sum() + aux).backward()
        results.append((out, aux, inputs.grad, *(p.grad.clone() for p in block.parameters())))
        if dropped is not None:
            assert dropped.dtype == torch.int64 and dropped.item() == 0
    expected = ["_grouped_mm"] * 3 if path == "bf16-grouped" else ["bmm"] * 3
    assert [op for op in seen.ops if op != "mm"] == expected  # the router is the one mm
    mine, theirs = results
    assert len(mine) == 7  # out, aux, the input's gradient, the router's, w1's, w3's, w2's
    tolerance = {"rtol": 2e-2, "atol": 2e-3} if path == "bf16-grouped" else {"rtol": 1e-5, "atol": 1e-6}
    for got, want in zip(mine, theirs, strict=True):
        torch.testing.assert_close(got.float(), want.float(), **tolerance)
    torch.testing.assert_close(mine[0].float(), theirs[0].float(), **tolerance)


@pytest.mark.parametrize("path", PATHS)
def test_a_dropless_forward_and_backward_make_no_host_sync(path):
    block = tiny_block(capacity_factor=None)
    x = torch.randn(2, 8, 32)
    with HostSyncs() as syncs, precision(path):
        out, aux = block(x)
        (out.float().sum() + aux[AUX_LOSS]).backward()
        with torch.no_grad():
            block.eval()(x)
    assert syncs.ops == []


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "activation-checkpointing"])
def test_compiled_dropless_has_no_graph_break_and_one_graph_for_training_and_one_for_eval(path, checkpointed):
    torch._dynamo.reset()
    counters.clear()
    block = tiny_block(capacity_factor=None)
    model = Checkpointed(block) if checkpointed else block
    compiles = CompileCounterWithBackend("aot_eager")
    model.compile(backend=compiles)
    batches = torch.randn(3, 2, 8, 32)  # new values each step: how many rows each expert gets changes
    for step in range(2):
        for x in batches:
            with precision(path):
                out, aux = model.train()(x.clone().requires_grad_())
            (out.float().sum() + aux[AUX_LOSS]).backward()
        with torch.no_grad(), precision(path):
            for x in batches[step:]:
                eager, _ = block.eval()(x)
                torch.testing.assert_close(model.eval()(x)[0], eager, rtol=1e-2, atol=1e-3)
    assert dict(counters["graph_break"]) == {}
    assert compiles.frame_count == 2  # the first training step's and the first evaluation's
    torch._dynamo.reset()
