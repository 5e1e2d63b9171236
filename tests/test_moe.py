"""The mixture of experts block (pretrain/moe.py): routing, capacity, the load-balancing loss, and
training the debug model with it on 2 CPU workers."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from helpers import run_debug_training
from pretrain import config as cfg
from pretrain.moe import AUX_LOSS, MixtureOfExperts, Route, capacity, load_balance_loss
from pretrain.model import Transformer


def moe_config(**moe) -> cfg.ModelConfig:
    base = cfg.resolve(preset="debug").model
    return dataclasses.replace(base, vocab_size=64, moe=cfg.MoEConfig(**({"num_experts": 4, "top_k": 2} | moe)))


def test_every_token_goes_to_its_top_k_experts_when_capacity_allows():
    torch.manual_seed(0)
    probs = torch.randn(50, 4).softmax(-1)
    route = Route(probs, top_k=2, slots=100)
    per_token = torch.bincount(route.token, minlength=50)
    assert per_token.tolist() == [2] * 50
    chosen = {(int(t), int(e)) for t, e in zip(route.token, route.expert, strict=True)}
    assert chosen == {(t, int(e)) for t in range(50) for e in probs[t].topk(2).indices}
    weights = torch.zeros(50).index_add(0, route.token, route.weight)
    assert torch.allclose(weights, torch.ones(50))  # renormalised over the k chosen


def test_no_expert_takes_more_than_its_capacity_and_second_choices_are_dropped_first():
    probs = torch.tensor([[0.7, 0.2, 0.05, 0.05]] * 10)  # every token: expert 0 first, 1 second
    route = Route(probs, top_k=2, slots=capacity(10, 4, 2, 0.5))  # 0.5 x 10 x 2 / 4 = 3 slots
    counts = torch.bincount(route.expert, minlength=4)
    assert counts.tolist() == [3, 3, 0, 0]
    assert route.token[route.expert == 0].tolist() == [0, 1, 2]  # first come, first served
    assert sorted(set(route.slot.tolist())) == [0, 1, 2]


def test_the_load_balancing_loss_is_one_for_uniform_routing_and_grows_as_it_collapses():
    uniform = load_balance_loss(torch.full((8, 4), 0.25), torch.tensor([[0, 1], [2, 3]] * 4), 4)
    assert uniform.item() == pytest.approx(1.0)
    collapsed = load_balance_loss(torch.tensor([[0.97, 0.01, 0.01, 0.01]] * 8), torch.zeros(8, 1, dtype=torch.long), 4)
    assert collapsed.item() == pytest.approx(4 * 0.97)
    half = load_balance_loss(torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 8), torch.tensor([[0], [1]] * 4), 4)  # 2 of 4 used
    assert half.item() == pytest.approx(2.0)
    assert uniform < half < collapsed


def test_the_block_runs_every_expert_in_batched_weights_and_returns_its_weighted_loss():
    torch.manual_seed(0)
    block = MixtureOfExperts(moe_config(aux_loss_weight=0.5))
    assert block.w1.shape == (4, 128, block.w1.shape[-1]) and block.w2.shape[0] == 4
    for weight in (block.w1, block.w2, block.w3):
        torch.nn.init.normal_(weight, std=0.02)
    out, aux = block(torch.randn(2, 16, 128))
    assert out.shape == (2, 16, 128) and set(aux) == {AUX_LOSS}
    assert 0.5 <= aux[AUX_LOSS].item() <= 0.5 * 4
    out.sum().backward()
    assert all(p.grad is not None for p in block.parameters())  # every expert's weights, one tensor each


def test_in_eval_mode_no_assignment_is_dropped_so_a_row_does_not_depend_on_its_batch():
    torch.manual_seed(0)
    block = MixtureOfExperts(moe_config(capacity_factor=0.25))  # in training most assignments are dropped
    for weight in (block.w1, block.w2, block.w3):
        torch.nn.init.normal_(weight, std=0.02)
    row, others = torch.randn(1, 16, 128), torch.randn(3, 16, 128)
    batch = torch.cat([others[:1], row, others[1:]])
    block.train()
    assert not torch.allclose(block(row)[0][0], block(batch)[0][1], atol=1e-6)  # capacity is shared by the batch
    block.eval()
    with torch.no_grad():
        assert torch.allclose(block(row)[0][0], block(batch)[0][1], atol=1e-5)
    probs = block.router(batch.reshape(-1, 128)).softmax(dim=-1)
    chosen = probs.topk(2, dim=-1).indices.reshape(-1)
    assert Route(probs, 2, slots=None).slots == torch.bincount(chosen, minlength=4).max() > capacity(64, 4, 2, 0.25)


def test_the_model_draws_the_expert_weights_from_its_seed():
    model = Transformer(moe_config(), 32, seed=3)
    again = Transformer(moe_config(), 32, seed=3)
    w1 = model.layers[0].feed_forward.w1
    assert torch.equal(w1, again.layers[0].feed_forward.w1) and 0.015 < w1.std().item() < 0.025


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["model.moe.num_experts=2", "model.moe.top_k=3"], "model.moe.top_k: 3 is more than model.moe.num_experts (2)"),
        (["model.moe.capacity_factor=0"], "model.moe.capacity_factor: must be positive (got 0.0)"),
        (["model.moe.topk=1"], "model.moe.topk: unknown key; did you mean model.moe.top_k?"),
    ],
)
def test_bad_moe_settings_are_one_line(sets, message):
    with pytest.raises(cfg.ConfigError) as refused:
        cfg.resolve(preset="debug", sets=sets)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
def test_the_moe_debug_model_trains_on_two_cpu_workers_logging_its_balance_loss(tmp_path):
    moe = ["--set", "model.moe.num_experts=4", "--set", "model.moe.top_k=2"]
    result = run_debug_training(tmp_path, ["-m", "launcher", "--device", "cpu"], tmp_path / "run", *moe)
    steps = re.findall(r"CPU0:INFO \| \[CPU 0\] Step \[\d+/10\] \| Loss: (\d+\.\d+) \| Aux Loss: (\d+\.\d+)", result.stdout)
    losses = [float(loss) for loss, _ in steps]
    assert len(losses) == 10 and losses[-1] < losses[0] - 1.0, losses
    # 2 layers x weight 0.01 x a balance loss of at least 1
    assert all(float(aux) >= 0.02 - 1e-4 for _, aux in steps)
    assert '"layers.1.moe_load_balance"' in (tmp_path / "run" / "metrics.jsonl").read_text()  # per layer
