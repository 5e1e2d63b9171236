"""Muon (pretrain/optim/muon.py): orthogonalized updates for the hidden matrices, AdamW for the rest."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from support.processes import run_gloo_ranks
from support.runs import run_debug_training
from pretrain import config as cfg
from pretrain.config import ModelConfig
from pretrain import registry
from pretrain.optim import muon, muon_sharing
from pretrain.model.fused_layout import split_fused
from pretrain.model.transformer import Transformer
from pretrain.optim.muon import (
    Muon,
    MuonError,
    build_muon,
    compiled_newton_schulz,
    is_hidden_matrix,
    newton_schulz,
    orthogonalizer,
    svd_orthogonalize,
)
from pretrain.optim.muon_sharing import balanced_owners, newton_schulz_flops

CALLS: list[tuple[tuple[int, ...], int]] = []


def probe_orthogonalize(grad: torch.Tensor, steps: int) -> torch.Tensor:
    """An orthogonalizer a study might register: records its calls, then does the exact one."""
    CALLS.append((tuple(grad.shape), steps))
    return svd_orthogonalize(grad, steps)


def counted_newton_schulz(grad: torch.Tensor, steps: int) -> torch.Tensor:
    CALLS.append((tuple(grad.shape), steps))
    return newton_schulz(grad, steps)


def singular_values(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(matrix.float())


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48)])
def test_newton_schulz_brings_every_singular_value_near_one(shape):
    """A matrix with singular values over 1.5 decades: five iterations of a quintic whose slope at
    0 is 3.44 lift the smallest (0.03 of the largest, about 0.02 once normalised) by 3.44^5 = 484."""
    torch.manual_seed(0)
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k))
    grad = u @ torch.diag(torch.logspace(-1.5, 0, k)) @ v.T
    values = singular_values(newton_schulz(grad, 5))
    # Keller Jordan's quintic lands in about [0.7, 1.2]; bfloat16 adds a little either way
    assert len(values) == k and values.min() > 0.6 and values.max() < 1.25, values


def test_the_svd_orthogonalizer_is_exactly_orthogonal():
    torch.manual_seed(0)
    q = svd_orthogonalize(torch.randn(40, 24), 0)
    assert torch.allclose(q.T @ q, torch.eye(24), atol=1e-5)


def muon_on(param: torch.Tensor, orthogonalize=newton_schulz, lr: float = 0.1) -> Muon:
    return Muon([{"params": [param], "use_muon": True, "lr": lr, "momentum": 0.0}], orthogonalize)


def test_a_muon_step_on_a_matrix_moves_it_by_an_orthogonal_update():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(32, 16))
    before = param.detach().clone()
    param.grad = torch.randn(32, 16) @ torch.diag(torch.logspace(-2, 1, 16))
    muon_on(param, svd_orthogonalize, lr=0.1).step()
    update = (before - param.detach()) / (0.1 * (32 / 16) ** 0.5)
    assert torch.allclose(singular_values(update), torch.ones(16), atol=1e-4)


def test_the_orthogonalizer_named_in_the_config_gets_each_shape_s_matrices_in_one_stacked_call(monkeypatch):
    monkeypatch.setitem(registry.ORTHOGONALIZERS, "probe", "test_muon:probe_orthogonalize")
    config = cfg.resolve(preset="debug", sets=["training.optimizer=muon", "training.muon_orthogonalize=probe"])
    model = Transformer(dataclasses.replace(config.model, vocab_size=64), 32)
    optimizer = build_muon(model, config.training, torch.device("cpu"))
    model(torch.randint(0, 64, (2, 16))).out.float().pow(2).mean().backward()
    CALLS.clear()
    optimizer.step()
    # the fused wqkv and w13 as the matrices they stack: wq, wk, wv; w1, w3
    separate = split_fused(dict(model.named_parameters()), model.cfg)
    hidden = Counter(tuple(p.shape) for n, p in separate.items() if n.startswith("layers.") and p.ndim == 2)
    stacked = {(count, *shape) for shape, count in hidden.items()}
    assert sorted(CALLS) == sorted((shape, config.training.muon_ns_steps) for shape in stacked)


def test_stacks_over_the_size_limit_are_split_into_several_calls_with_the_same_update(monkeypatch):
    torch.manual_seed(0)
    weights, grad = torch.randn(5, 64, 32), torch.randn(5, 64, 32)
    moved = []
    for limit in (2**28, 2 * 64 * 32):  # everything in one call; then at most two matrices a call
        monkeypatch.setattr(muon_sharing, "STACK_ELEMENTS", limit)
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for param, g in zip(params, grad, strict=True):
            param.grad = g.clone()
        CALLS.clear()
        Muon([{"params": params, "use_muon": True, "lr": 0.1}], counted_newton_schulz).step()
        moved.append(torch.stack([p.detach() for p in params]))
    assert CALLS == [((2, 64, 32), 5), ((2, 64, 32), 5), ((1, 64, 32), 5)]
    assert torch.allclose(moved[0], moved[1], atol=1e-6)


@pytest.mark.parametrize("orthogonalize", [newton_schulz, svd_orthogonalize], ids=["newton-schulz", "svd"])
def test_muon_moves_the_fused_projections_as_it_moved_the_separate_matrices(orthogonalize):
    """wqkv and w13 stack wq, wk, wv and w1, w3 by rows: two steps (momentum, weight decay) give
    each part the weights Muon gives it as a matrix of its own, orthogonalized and scaled by its shape."""
    training = cfg.resolve(preset="debug", sets=["training.optimizer=muon", "training.weight_decay=0.1"]).training
    model_config = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=48, vocab_size=64)  # wk, wv: 8 rows
    model = Transformer(model_config, 16, seed=0)
    fused = build_muon(model, training, torch.device("cpu"))
    fused.orthogonalize = orthogonalize
    hidden = {n: p for n, p in model.named_parameters() if is_hidden_matrix(n, p)}
    assert {"layers.0.attention.wqkv.weight", "layers.0.feed_forward.w13.weight"} <= hidden.keys()
    separate = {n: torch.nn.Parameter(w.detach().clone()) for n, w in split_fused(hidden, model_config).items()}
    group = next(g for g in fused.param_groups if g["use_muon"])
    settings = {key: group[key] for key in ("lr_scale", "momentum", "weight_decay", "ns_steps")}
    alone = Muon([{"params": list(separate.values()), "use_muon": True, **settings}], orthogonalize)
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        for name, grad in split_fused({n: p.grad for n, p in hidden.items()}, model_config).items():
            separate[name].grad = grad.clone()
        for optimizer in (fused, alone):
            for g in optimizer.param_groups:
                g["lr"] = 0.01
            optimizer.step()
    moved = split_fused({n: p.detach() for n, p in hidden.items()}, model_config)
    assert moved.keys() == separate.keys()
    for name, param in separate.items():
        torch.testing.assert_close(moved[name], param.detach(), rtol=0, atol=1e-7, msg=name)


def test_parts_that_do_not_add_up_to_the_parameter_are_a_one_line_error():
    param = torch.nn.Parameter(torch.zeros(12, 4))
    with pytest.raises(MuonError) as refused:
        Muon([{"params": [param], "use_muon": True}], newton_schulz, {id(param): "wqkv"}, row_splits={id(param): [8, 2]})
    assert str(refused.value) == "wqkv has 12 rows, but its parts' rows [8, 2] add up to 10"


def test_muon_s_adamw_half_updates_as_torch_adamw():
    """Fused (on CPU too) and foreach: the same numbers as torch.optim.AdamW's per-tensor loop."""
    torch.manual_seed(0)
    weights = [torch.randn(8, 6), torch.randn(6)]
    for fused in (True, False):
        ours = [torch.nn.Parameter(w.clone()) for w in weights]
        theirs = [torch.nn.Parameter(w.clone()) for w in weights]
        hyper = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8}
        muon = Muon([{"params": [ours[0]], "weight_decay": 0.1}, {"params": [ours[1]]}], svd_orthogonalize)
        for group in muon.param_groups:
            group.update(hyper)
            group["fused"] = group["fused"] and fused
        adamw = torch.optim.AdamW(
            [{"params": [theirs[0]], "weight_decay": 0.1}, {"params": [theirs[1]], "weight_decay": 0.0}], **hyper, foreach=False
        )
        for step in range(3):
            generator = torch.Generator().manual_seed(step)
            for a, b in zip(ours, theirs, strict=True):
                a.grad = torch.randn(a.shape, generator=generator)
                b.grad = a.grad.clone()
            muon.step()
            adamw.step()
        for a, b in zip(ours, theirs, strict=True):
            assert torch.allclose(a, b, atol=1e-6), (fused, a - b)
        assert all(state["step"].item() == 3 for state in muon.state.values())


def test_the_matrices_are_shared_within_1_1_over_w_of_the_flops_on_2_to_8_ranks():
    for preset in ("small", "production"):
        config = cfg.resolve(preset=preset, sets=["training.optimizer=muon"])
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(config.model, vocab_size=64), 32)
        separate = split_fused(dict(model.named_parameters()), model.cfg)  # the matrices orthogonalized
        keys = [(tuple(p.shape), 5) for n, p in separate.items() if is_hidden_matrix(n, p)]
        costs = [newton_schulz_flops(shape, steps) for shape, steps in keys]
        for world in range(2, 9):
            owners = balanced_owners(costs, world)
            loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == rank) for rank in range(world)]
            assert max(loads) <= 1.1 * sum(costs) / world, (preset, world, loads)


def test_muon_takes_the_blocks_matrices_and_leaves_embeddings_norms_and_output_to_adamw():
    config = cfg.resolve(preset="debug", sets=["training.optimizer=muon"])
    model = Transformer(dataclasses.replace(config.model, vocab_size=64), 32)
    optimizer = build_muon(model, config.training, torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in optimizer.param_groups if not g["use_muon"] for p in g["params"]}
    assert muon == {n for n in names.values() if n.startswith("layers.") and not n.endswith("norm.weight")}
    assert {"tok_embed.weight", "output.weight", "norm.weight", "layers.0.ffn_norm.weight"} <= adamw
    scale = next(g["lr_scale"] for g in optimizer.param_groups if g["use_muon"])
    assert scale == pytest.approx(config.training.muon_learning_rate / config.training.learning_rate)


def test_muon_on_a_vector_is_a_one_line_error():
    with pytest.raises(MuonError) as refused:
        Muon([{"params": [torch.nn.Parameter(torch.zeros(8))], "use_muon": True}], newton_schulz, {})
    assert "Muon updates matrices only" in str(refused.value) and "(8,)" in str(refused.value)


def test_an_unknown_orthogonalizer_is_refused_naming_the_choices():
    with pytest.raises(cfg.ConfigError) as refused:
        cfg.resolve(preset="debug", sets=["training.muon_orthogonalize=newton_shulz"])
    assert "training.muon_orthogonalize" in str(refused.value) and "newton_schulz" in str(refused.value)


SMALL_BY_8 = ["model.dim=96", "model.ffn_dim=256", "model.vocab_size=6288"]
"""`small` at the widths benchmarks/efficiency.py's CPU runs take (RUN_WIDTH_DIVISOR 8; heads and depth kept)."""
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]


@pytest.fixture
def compiles(monkeypatch) -> CompileCounterWithBackend:
    """torch.compile, on the CPU as on CUDA, through a counter of the graphs dynamo compiles
    (aot_eager behind it: dynamo decides the recompiles, not the code generator)."""
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(muon, "COMPILED_ON", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


def recorded_calls(optimizer) -> list[tuple[int, ...]]:
    """The shapes of the stacks optimizer's orthogonalize is called with, from now on."""
    shapes, orthogonalize = [], optimizer.orthogonalize

    def recording(stack: torch.Tensor, steps: int) -> torch.Tensor:
        shapes.append(tuple(stack.shape))
        return orthogonalize(stack, steps)

    optimizer.orthogonalize = recording
    return shapes


@pytest.mark.parametrize("sets", [[], MOE], ids=["small", "small with MoE"])
def test_muon_s_compiled_newton_schulz_compiles_once_for_every_matrix_of_small_and_matches_eager(sets, compiles):
    """The real optimizer's steps on `small` (widths / 8): the stacks of every shape, in the
    optimizer's order (wqkv's and w13's parts, wo, w2; with MoE the router and the 3-D expert
    stacks), wide and tall, all through one compiled graph; the weights move as the eager step moves them."""
    config = cfg.resolve(preset="small", sets=["training.optimizer=muon", "training.compile=true", *SMALL_BY_8, *sets])
    models = [Transformer(config.model, 16, seed=0) for _ in range(2)]
    compiled = build_muon(models[0], config.training, torch.device("cpu"))
    with pytest.MonkeyPatch.context() as eager_build:
        eager_build.setattr(muon, "COMPILED_ON", ("cuda",))
        eager = build_muon(models[1], config.training, torch.device("cpu"))
    assert compiled.orthogonalize is not newton_schulz and eager.orthogonalize is newton_schulz
    shapes = recorded_calls(compiled)
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        for optimizer in (compiled, eager):
            for group in optimizer.param_groups:
                group["lr"] = 0.01
            optimizer.step()
    separate = split_fused(dict(models[0].named_parameters()), config.model)  # wqkv and w13 as their parts
    hidden = {tuple(p.shape[-2:]) for n, p in separate.items() if is_hidden_matrix(n, p)}
    assert {shape[-2:] for shape in shapes} == hidden and any(m > n for m, n in hidden) and any(m < n for m, n in hidden)
    assert any(len(shape) == 4 for shape in shapes) == bool(sets), shapes  # (k, experts, m, n) stacks
    assert compiles.frame_count == 1, f"{compiles.frame_count} graphs for the stacks {sorted(set(shapes))}"
    step = 0.01 * config.training.muon_learning_rate / config.training.learning_rate  # a Muon step's size (lr * lr_scale)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * step, msg=name)  # 1% of one step, well within bf16


def test_compiled_newton_schulz_keeps_one_graph_for_single_matrices_squares_and_stacks_of_experts(compiles):
    """Shapes a sharded run passes in any order: a stack of one matrix first (an owner's only
    matrix of its shape), a square, tall and wide stacks, 4-D expert stacks, a matrix of one row;
    in fp32 (a gradient here) and bf16 (rows sent by other ranks)."""
    orthogonalize = compiled_newton_schulz()
    torch.manual_seed(0)
    shapes = [(1, 48, 48), (6, 48, 48), (6, 16, 48), (3, 128, 48), (2, 4, 48, 128), (2, 4, 128, 48), (2, 1, 48), (40, 24)]
    for shape, dtype in [(shape, dtype) for shape in shapes for dtype in (torch.float32, torch.bfloat16)]:
        grad = torch.randn(shape).to(dtype)
        result = orthogonalize(grad, 5)
        assert result.shape == grad.shape and result.dtype == torch.bfloat16
        torch.testing.assert_close(result, newton_schulz(grad, 5), rtol=0, atol=0, msg=f"{shape} {dtype}")
    assert compiles.frame_count == 1


def exact_newton_schulz(grad: torch.Tensor, steps: int) -> torch.Tensor:
    """The same iterations in float64: what bf16 rounding departs from."""
    a, b, c = muon.NS_COEFFICIENTS
    x = grad.double().mT if grad.size(-2) > grad.size(-1) else grad.double()
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if grad.size(-2) > grad.size(-1) else x


@pytest.mark.slow  # inductor's C++ compile: about 15 s on 2 loaded cores
def test_inductor_s_newton_schulz_is_as_close_to_exact_arithmetic_as_eager_bf16(monkeypatch):
    """What a GPU runs (inductor, which fuses the element-wise work in fp32) departs from the float64
    iteration by bf16 rounding, as eager does (about 1.5% here), tall and wide; one graph for both."""
    counter = CompileCounterWithBackend("inductor")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
    torch._dynamo.reset()
    orthogonalize = compiled_newton_schulz()
    torch.manual_seed(0)
    for shape in [(3, 64, 24), (3, 24, 64)]:
        grad = torch.randn(shape)
        exact = exact_newton_schulz(grad, 5)
        compiled, eager = orthogonalize(grad, 5).double(), newton_schulz(grad, 5).double()
        assert (compiled - exact).norm() <= 1.25 * (eager - exact).norm() and (eager - exact).norm() < 0.03 * exact.norm()
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_the_svd_orthogonalizer_is_compiled_as_it_is(monkeypatch):
    compiled = []
    monkeypatch.setattr(muon, "COMPILED_ON", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "compile", lambda function, **options: compiled.append(function) or function)
    assert orthogonalizer("svd", torch.device("cpu"), True) is svd_orthogonalize and compiled == [svd_orthogonalize]
    assert orthogonalizer("newton_schulz", torch.device("cpu"), True) is not newton_schulz
    assert compiled[1:] == [muon.newton_schulz_iterations]
    assert orthogonalizer("newton_schulz", torch.device("cpu"), False) is newton_schulz


STEP = r"CPU0:INFO \| \[CPU 0\] Step \[\d+/{total}\] \| Loss: (\d+\.\d+)"
LAUNCHER_ON_CPU = ["-m", "launcher", "--device", "cpu"]


@pytest.mark.slow
def test_muon_trains_the_debug_model_on_two_cpu_workers(tmp_path):
    result = run_debug_training(tmp_path, LAUNCHER_ON_CPU, tmp_path / "run", "--set", "training.optimizer=muon")
    losses = [float(x) for x in re.findall(STEP.format(total=10), result.stdout)]
    assert len(losses) == 10 and losses[-1] < losses[0] - 1.0, losses


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request, tmp_path_factory) -> list[dict]:
    """What each rank of tests/support/workers/muon_worker.py saw under DDP, FSDP2 and FSDP2 with CPU offload."""
    return run_gloo_ranks("muon_worker.py", tmp_path_factory.mktemp("muon"), timeout=180, world_size=request.param)


MODES = ("ddp", "fsdp", "fsdp_offload")


@pytest.mark.slow
def test_muon_shared_over_the_ranks_updates_as_one_process_does(ranks):
    for seen in ranks:
        assert [seen[mode]["sharing"] for mode in MODES] == ["replicated", "rows", "rows"]
        for mode in MODES:
            run = seen[mode]
            # Newton-Schulz computes in bf16 and its results travel in bf16: a bf16 rounding at most
            tolerance = [1e-2 * update for update in run["largest_update"]]
            assert all(d <= t for d, t in zip(run["hidden"], tolerance, strict=True)), (mode, run["hidden"])
            assert max(run["rest"]) < 1e-6, (mode, run["rest"])  # AdamW: the same kernel on the same numbers


@pytest.mark.slow
def test_each_matrix_is_orthogonalized_once_and_each_rank_does_at_most_1_1_over_w_of_the_work(ranks):
    world = len(ranks)
    for mode in MODES:
        counted = [seen[mode]["counted"] for seen in ranks]
        total = ranks[0][mode]["total_flops"]
        assert sum(c["matrices"] for c in counted) == 21  # 3 layers of 7, each on one rank only
        assert sum(c["flops"] for c in counted) == total
        shares = [c["flops"] / total for c in counted]
        assert shares == pytest.approx(ranks[0][mode]["share"])  # the assignment the optimizer reports
        assert max(shares) <= 1.1 / world, shares
