"""Muon (pretrain/muon.py): orthogonalized updates for the hidden matrices, AdamW for the rest."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from helpers import run_debug_training
from pretrain import config as cfg
from pretrain import registry
from pretrain.model import Transformer
from pretrain.muon import Muon, MuonError, build_muon, newton_schulz, svd_orthogonalize

CALLS: list[tuple[tuple[int, ...], int]] = []


def probe_orthogonalize(grad: torch.Tensor, steps: int) -> torch.Tensor:
    """An orthogonalizer a study might register: records its calls, then does the exact one."""
    CALLS.append((tuple(grad.shape), steps))
    return svd_orthogonalize(grad, steps)


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


def test_the_orthogonalizer_named_in_the_config_is_the_one_called(monkeypatch):
    monkeypatch.setitem(registry.ORTHOGONALIZERS, "probe", "test_muon:probe_orthogonalize")
    config = cfg.resolve(preset="debug", sets=["training.optimizer=muon", "training.muon_orthogonalize=probe"])
    model = Transformer(dataclasses.replace(config.model, vocab_size=64), 32)
    optimizer = build_muon(model, config.training, torch.device("cpu"))
    model(torch.randint(0, 64, (2, 16))).out.float().pow(2).mean().backward()
    CALLS.clear()
    optimizer.step()
    hidden = [tuple(p.shape) for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2]
    assert sorted(CALLS) == sorted((shape, config.training.muon_ns_steps) for shape in hidden)


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


STEP = r"CPU0:INFO \| \[CPU 0\] Step \[\d+/{total}\] \| Loss: (\d+\.\d+)"
LAUNCHER_ON_CPU = ["-m", "launcher", "--device", "cpu"]


@pytest.mark.slow
def test_muon_trains_the_debug_model_on_two_cpu_workers(tmp_path):
    result = run_debug_training(tmp_path, LAUNCHER_ON_CPU, tmp_path / "run", "--set", "training.optimizer=muon")
    losses = [float(x) for x in re.findall(STEP.format(total=10), result.stdout)]
    assert len(losses) == 10 and losses[-1] < losses[0] - 1.0, losses


@pytest.mark.slow
def test_muon_under_fsdp_gives_the_losses_of_muon_under_ddp(tmp_path):
    def losses(parallelism: str) -> list[float]:
        options = ["--max-steps", "4", "--set", "training.optimizer=muon", "--set", f"training.parallelism={parallelism}"]
        result = run_debug_training(tmp_path, LAUNCHER_ON_CPU, tmp_path / parallelism, *options)
        return [float(x) for x in re.findall(STEP.format(total=4), result.stdout)]

    ddp, fsdp = losses("ddp"), losses("fsdp")
    assert len(ddp) == 4
    # the same updates, but each rank orthogonalizes a gathered matrix in bfloat16: equal to 1e-3
    assert fsdp == pytest.approx(ddp, abs=1e-3)
