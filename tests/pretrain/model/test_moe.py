"""The mixture of experts block (pretrain/model/moe.py): routing, capacity, the load-balancing loss,
static shapes (the same results as the boolean-indexing algorithm it replaced, no host sync, no
graph break or recompile under torch.compile), the dropped assignments it counts, the capacity
factor's settings (null: dropless, tests/pretrain/model/test_moe_dropless.py), a capacity-routed checkpoint
resuming dropless, and training the debug model with it on 2 CPU workers."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from support.checkpointing import assert_same_tensors, make_trainer
from support.processes import ROOT, launcher_env
from support.runs import run_debug_training
from pretrain import config as cfg
from pretrain.checkpoint import save_restore
from pretrain.train import train_step
from pretrain.model.transformer import Transformer
from pretrain.model.moe import AUX_LOSS, DROPPED, MixtureOfExperts, Route, capacity, load_balance_loss

aten = torch.ops.aten


def moe_config(**moe) -> cfg.ModelConfig:
    base = cfg.resolve(preset="debug").model
    return dataclasses.replace(base, vocab_size=64, moe=cfg.MoEConfig(**({"num_experts": 4, "top_k": 2} | moe)))


def tiny_block(seed: int = 0, **moe) -> MixtureOfExperts:
    """dim 32, 4 experts of width 64, top-2; expert weights large enough to matter."""
    torch.manual_seed(seed)
    config = dataclasses.replace(moe_config(**moe), dim=32, ffn_dim=64, n_heads=2, n_kv_heads=2)
    block = MixtureOfExperts(config)
    for weight in (block.w1, block.w2, block.w3):
        nn.init.normal_(weight, std=0.1)
    return block


def reference_forward(block: MixtureOfExperts, x: Tensor) -> tuple[Tensor, Tensor]:
    """The algorithm before static shapes, kept as the reference: only the assignments within
    capacity are kept, by boolean indexing, and eval's capacity is what the busiest expert got."""
    batch, seq, dim = x.shape
    tokens = x.reshape(-1, dim)
    n = tokens.size(0)
    probs = block.router(tokens).float().softmax(dim=-1)
    weights, experts = probs.topk(block.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    expert, weight = experts.T.reshape(-1), weights.T.reshape(-1)
    token = torch.arange(n).repeat(block.top_k)
    onehot = F.one_hot(expert, block.num_experts)
    slot = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1
    slots = capacity(n, block.num_experts, block.top_k, block.capacity_factor) if block.training else int(slot.max()) + 1
    keep = slot < slots
    token, expert, weight, slot = token[keep], expert[keep], weight[keep], slot[keep]
    buffer = tokens.new_zeros(block.num_experts, slots, dim)
    buffer[expert, slot] = tokens[token]
    hidden = F.silu(torch.bmm(buffer, block.w1.to(buffer.dtype))) * torch.bmm(buffer, block.w3.to(buffer.dtype))
    outputs = torch.bmm(hidden, block.w2.to(buffer.dtype))
    weighted = outputs[expert, slot] * weight.to(outputs.dtype).unsqueeze(-1)
    out = tokens.new_zeros(tokens.shape).index_add(0, token, weighted.to(tokens.dtype))
    share = F.one_hot(experts.reshape(-1), block.num_experts).float().mean(dim=0)
    aux = block.aux_loss_weight * block.num_experts * (share * probs.mean(dim=0)).sum()
    return out.view(batch, seq, dim), aux


def static_forward_before_dropless(block: MixtureOfExperts, x: Tensor) -> tuple[Tensor, Tensor]:
    """The block's forward as it was before dropless (capacity routing in training, capacity N in
    eval), verbatim: a capacity factor must keep it bit for bit."""
    batch, seq, dim = x.shape
    tokens = x.reshape(-1, dim)
    n = tokens.size(0)
    probs = block.router(tokens).float().softmax(dim=-1)
    slots = capacity(n, block.num_experts, block.top_k, block.capacity_factor) if block.training else n
    route = Route(probs, block.top_k, slots)
    dtype = tokens.dtype if not torch.is_autocast_enabled("cpu") else torch.get_autocast_dtype("cpu")
    rows = tokens.new_zeros(block.num_experts * (slots + 1), dim, dtype=dtype)
    rows = rows.index_put((route.row,), tokens.to(dtype)[route.token])
    buffer = rows.view(block.num_experts, slots + 1, dim)
    hidden = F.silu(torch.bmm(buffer, block.w1)) * torch.bmm(buffer, block.w3)
    outputs = torch.bmm(hidden, block.w2).view(-1, dim)
    weighted = outputs[route.row] * route.weight.to(outputs.dtype).unsqueeze(-1)
    out = tokens.new_zeros(tokens.shape).index_add(0, route.token, weighted.to(tokens.dtype))
    aux = block.aux_loss_weight * load_balance_loss(probs, route.experts_per_token, block.num_experts)
    return out.view(batch, seq, dim), aux


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.25])
def test_with_a_capacity_factor_training_routes_bit_for_bit_as_before_dropless(capacity_factor, amp):
    block = tiny_block(capacity_factor=capacity_factor)
    x, grad_out = torch.randn(3, 8, 32), torch.randn(3, 8, 32)
    results = []
    for forward in (block.forward, lambda x: static_forward_before_dropless(block, x)):
        block.zero_grad()
        inputs = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out, aux = forward(inputs)
        aux = aux[AUX_LOSS] if isinstance(aux, dict) else aux
        ((out.float() * grad_out).sum() + aux).backward()
        results.append((out, aux, inputs.grad, *(p.grad.clone() for p in block.parameters())))
    for mine, before in zip(*results, strict=True):
        assert torch.equal(mine, before)


class HostSyncs(TorchDispatchMode):
    """Records the ops that make a CUDA device wait for the host: reading a value (.item(),
    int(tensor)), sizes that depend on values (nonzero, masked_select, unique), and indexing
    with a boolean mask. On the CPU they cost nothing, but the counts are what a GPU would pay."""

    SYNCING = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique2, aten.unique_consecutive, aten.bincount}
    INDEXING = {aten.index, aten.index_put, aten.index_put_}

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        boolean_index = packet in self.INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1])
        if packet in self.SYNCING or boolean_index or (packet == aten.repeat_interleave and "output_size" not in (kwargs or {})):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_every_token_goes_to_its_top_k_experts_when_capacity_allows():
    torch.manual_seed(0)
    probs = torch.randn(50, 4).softmax(-1)
    route = Route(probs, top_k=2, capacity=100)
    assert route.kept.all() and torch.bincount(route.token, minlength=50).tolist() == [2] * 50
    chosen = {(int(t), int(e)) for t, e in zip(route.token, route.expert, strict=True)}
    assert chosen == {(t, int(e)) for t in range(50) for e in probs[t].topk(2).indices}
    weights = torch.zeros(50).index_add(0, route.token, route.weight)
    assert torch.allclose(weights, torch.ones(50))  # renormalised over the k chosen
    assert route.row.unique().numel() == 100  # each assignment its own row of the buffer


def test_no_expert_takes_more_than_its_capacity_and_second_choices_are_dropped_first():
    probs = torch.tensor([[0.7, 0.2, 0.05, 0.05]] * 10)  # every token: expert 0 first, 1 second
    route = Route(probs, top_k=2, capacity=capacity(10, 4, 2, 0.5))  # 0.5 x 10 x 2 / 4 = 3 slots
    assert route.expert.shape == route.row.shape == route.weight.shape == (20,)  # every assignment, kept or not
    assert torch.bincount(route.expert[route.kept], minlength=4).tolist() == [3, 3, 0, 0]
    assert route.token[route.kept & (route.expert == 0)].tolist() == [0, 1, 2]  # first come, first served
    assert route.token[route.kept & (route.expert == 1)].tolist() == [0, 1, 2]
    assert route.row[route.kept].tolist() == [0, 1, 2, 4, 5, 6]  # expert e's rows start at e x (3 + 1)
    assert set(route.row[~route.kept].tolist()) == {3, 7}  # the rest go to their expert's overflow row
    assert (route.weight[~route.kept] == 0).all() and (route.weight[route.kept] > 0).all()


def test_the_load_balancing_loss_is_one_for_uniform_routing_and_grows_as_it_collapses():
    uniform = load_balance_loss(torch.full((8, 4), 0.25), torch.tensor([[0, 1], [2, 3]] * 4), 4)
    assert uniform.item() == pytest.approx(1.0)
    collapsed = load_balance_loss(torch.tensor([[0.97, 0.01, 0.01, 0.01]] * 8), torch.zeros(8, 1, dtype=torch.long), 4)
    assert collapsed.item() == pytest.approx(4 * 0.97)
    half = load_balance_loss(torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 8), torch.tensor([[0], [1]] * 4), 4)  # 2 of 4 used
    assert half.item() == pytest.approx(2.0)
    assert uniform < half < collapsed


@pytest.mark.parametrize(
    ("training", "capacity_factor", "over_capacity"),
    [(True, 4.0, False), (True, 0.5, True), (False, 0.25, True)],
    ids=["training-nothing-dropped", "training-over-capacity", "eval"],
)
def test_static_routing_gives_the_reference_outputs_and_gradients(training, capacity_factor, over_capacity):
    block = tiny_block(capacity_factor=capacity_factor).train(training)
    x = torch.randn(3, 8, 32)
    grad_out = torch.randn(3, 8, 32)
    results = []
    for forward in (block.forward, lambda x: reference_forward(block, x)):
        block.zero_grad()
        inputs = x.clone().requires_grad_()
        out, aux = forward(inputs)
        aux = aux[AUX_LOSS] if isinstance(aux, dict) else aux
        ((out * grad_out).sum() + aux).backward()
        results.append((out, aux, inputs.grad, *(p.grad.clone() for p in block.parameters())))
    route = Route(block.router(x.reshape(-1, 32)).softmax(-1), 2, capacity(24, 4, 2, capacity_factor))
    assert bool((~route.kept).any()) == over_capacity  # the case this run covers (eval keeps them all)
    static, reference = results
    assert torch.equal(static[1], reference[1])  # the load-balancing loss
    for mine, theirs in zip(static, reference, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_the_block_runs_every_expert_in_batched_weights_and_returns_its_weighted_loss():
    torch.manual_seed(0)
    block = MixtureOfExperts(moe_config(aux_loss_weight=0.5))
    assert block.w1.shape == (4, 128, block.w1.shape[-1]) and block.w2.shape[0] == 4
    for weight in (block.w1, block.w2, block.w3):
        torch.nn.init.normal_(weight, std=0.02)
    out, aux = block(torch.randn(2, 16, 128))
    assert out.shape == (2, 16, 128) and set(aux) == {AUX_LOSS, DROPPED}
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
        chosen = block.router(batch.reshape(-1, 128)).topk(2, dim=-1).indices.reshape(-1)
    assert torch.bincount(chosen, minlength=4).max() > capacity(64, 4, 2, 0.25)  # training would have dropped some


@pytest.mark.parametrize(
    ("capacity_factor", "matmul"), [(1.25, aten.bmm), (None, aten._grouped_mm)], ids=["capacity", "dropless"]
)
def test_under_mixed_precision_the_activations_are_cast_to_the_weights_never_the_weights_up(capacity_factor, matmul):
    block = tiny_block(capacity_factor=capacity_factor).eval()  # eval: neither drops anything
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(block(x)[0], reference_forward(block, x)[0], rtol=1e-6, atol=1e-7)  # fp32: nothing cast to bf16
    bf16 = tiny_block(capacity_factor=capacity_factor).to(torch.bfloat16)  # as FSDP gathers the weights under use_amp
    bf16.router.float()  # the stream stays fp32
    seen: list[tuple[torch.dtype, ...]] = []

    class Dtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket == matmul:
                seen.append((args[0].dtype, args[1].dtype))
            return func(*args, **(kwargs or {}))

    with Dtypes():
        out = bf16(x)[0]
    assert out.dtype == torch.float32 and seen == [(torch.bfloat16, torch.bfloat16)] * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert block(x)[0].dtype == torch.float32  # the residual stream's dtype comes back


def test_the_block_counts_the_assignments_its_capacity_dropped_and_none_when_dropless():
    x = torch.randn(3, 8, 32)
    block = tiny_block(capacity_factor=0.5)
    route = Route(block.router(x.reshape(-1, 32)).softmax(-1), 2, capacity(24, 4, 2, 0.5))
    dropped = block(x)[1][DROPPED]
    assert dropped.dtype == torch.int64 and dropped.item() == int((~route.kept).sum()) > 0
    assert block.eval()(x)[1][DROPPED].item() == 0  # eval is dropless
    assert tiny_block(capacity_factor=None)(x)[1][DROPPED].item() == 0


def test_a_forward_and_backward_make_no_host_sync_in_training_or_eval():
    block = tiny_block(capacity_factor=0.5)
    x = torch.randn(2, 8, 32)
    with HostSyncs() as syncs:
        out, aux = block(x)
        (out.sum() + aux[AUX_LOSS]).backward()
        with torch.no_grad():
            block.eval()(x)
    assert syncs.ops == []
    with HostSyncs() as reference:  # what the counter would see in the algorithm before
        reference_forward(block.train(), x)
    assert "aten._local_scalar_dense.default" in reference.ops and "aten.index.Tensor" in reference.ops


class Checkpointed(nn.Module):
    """The block's forward under activation checkpointing, as pretrain/distributed/parallel.py wraps a transformer block."""

    def __init__(self, block: MixtureOfExperts) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        if not torch.is_grad_enabled():
            return self.block(x)
        return checkpoint(self.block, x, use_reentrant=False)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "activation-checkpointing"])
def test_compiled_the_block_has_no_graph_break_and_one_graph_for_training_and_one_for_eval(checkpointed):
    torch._dynamo.reset()
    counters.clear()
    block = tiny_block(capacity_factor=0.5)
    model = Checkpointed(block) if checkpointed else block
    compiles = CompileCounterWithBackend("aot_eager")  # dynamo decides breaks and recompiles, not the code generator
    model.compile(backend=compiles)
    batches = torch.randn(3, 2, 8, 32)  # new values each step: routing and the dropped assignments change
    for step in range(2):
        for x in batches:
            out, aux = model.train()(x.clone().requires_grad_())
            (out.sum() + aux[AUX_LOSS]).backward()
        with torch.no_grad():
            for x in batches[step:]:
                eager, _ = block.eval()(x)
                assert torch.allclose(model.eval()(x)[0], eager, atol=1e-6)
    assert dict(counters["graph_break"]) == {}
    assert compiles.frame_count == 2  # the first training step's and the first evaluation's
    torch._dynamo.reset()


def test_the_model_draws_the_expert_weights_from_its_seed():
    model = Transformer(moe_config(), 32, seed=3)
    again = Transformer(moe_config(), 32, seed=3)
    w1 = model.layers[0].feed_forward.w1
    assert torch.equal(w1, again.layers[0].feed_forward.w1) and 0.015 < w1.std().item() < 0.025


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["model.moe.num_experts=2", "model.moe.top_k=3"], "model.moe.top_k: 3 is more than model.moe.num_experts (2)"),
        (
            ["model.moe.capacity_factor=0"],
            "model.moe.capacity_factor: must be a positive number, or null for dropless routing (got 0.0)",
        ),
        (
            ["model.moe.capacity_factor=-1"],
            "model.moe.capacity_factor: must be a positive number, or null for dropless routing (got -1.0)",
        ),
        (["model.moe.capacity_factor=NaN"], "model.moe.capacity_factor: expected a finite number, got nan"),
        (["model.moe.capacity_factor=Infinity"], "model.moe.capacity_factor: expected a finite number, got inf"),
        (["model.moe.topk=1"], "model.moe.topk: unknown key; did you mean model.moe.top_k?"),
    ],
)
def test_bad_moe_settings_are_one_line(sets, message):
    with pytest.raises(cfg.ConfigError) as refused:
        cfg.resolve(preset="debug", sets=sets)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_capacity_factor_that_is_not_finite_and_positive_is_refused_by_the_section_itself():
    for value in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(cfg.ConfigError, match=r"^model.moe.capacity_factor: must be a positive number, or null"):
            cfg.MoEConfig(num_experts=4, capacity_factor=value)


@pytest.mark.parametrize("value", ["0", "-1", "NaN"])
def test_the_launcher_refuses_a_bad_capacity_factor_in_one_line_with_exit_2(value, tmp_path):
    launch = [sys.executable, "-m", "launcher", "--debug", "--device", "cpu", "--run-dir", str(tmp_path / "r")]
    sets = ["--set", "model.moe.num_experts=4", "--set", f"model.moe.capacity_factor={value}"]
    result = subprocess.run(launch + sets, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "model.moe.capacity_factor" in result.stderr, result.stderr


def test_the_capacity_factor_is_null_by_default_and_from_a_file_or_set_and_a_number_keeps_capacity(tmp_path):
    assert cfg.resolve(preset="debug").model.moe.capacity_factor is None
    assert cfg.resolve(preset="debug", sets=["model.moe.capacity_factor=1.25"]).model.moe.capacity_factor == 1.25
    assert (
        cfg.resolve(
            preset="debug", sets=["model.moe.capacity_factor=2", "model.moe.capacity_factor=null"]
        ).model.moe.capacity_factor
        is None
    )
    path = tmp_path / "moe.json"
    path.write_text(json.dumps({"model": {"moe": {"num_experts": 4, "capacity_factor": None}}}))
    assert cfg.resolve(preset="debug", config_file=path).model.moe.capacity_factor is None
    saved = tmp_path / "saved.json"
    cfg.save(cfg.resolve(preset="debug", config_file=path), saved)  # a checkpoint's config.json says null
    assert cfg.load(saved).model.moe.capacity_factor is None


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_a_checkpoint_of_the_capacity_routing_resumes_dropless_with_its_weights(cache, tmp_path):
    moe = ["model.moe.num_experts=4", "model.moe.top_k=2"]
    capacity_run = make_trainer(cache, tmp_path / "capacity", *moe, "model.moe.capacity_factor=1.25")
    for step in range(2):
        train_step(capacity_run, step)
    path = save_restore.save(capacity_run, 2, capacity_run.run_dir)  # the format before dropless, 1.25 its default
    assert json.loads((path / "config.json").read_text())["model"]["moe"]["capacity_factor"] == 1.25
    dropless = make_trainer(cache, tmp_path / "dropless", *moe)
    assert dropless.config.model.moe.capacity_factor is None
    assert save_restore.restore(dropless, path) == 2
    assert_same_tensors(capacity_run.model.state_dict(), dropless.model.state_dict())
    train_step(dropless, 2)
    assert sum(int(count) for count in dropless.counts.values()) == 0 and len(dropless.counts) == 2  # per layer
    other = dataclasses.replace(dropless.config.model, moe=cfg.MoEConfig(num_experts=2, top_k=2))
    with pytest.raises(save_restore.CheckpointError, match="is for a different model: model.moe is"):
        save_restore.check_same_model(path, capacity_run.config.model, other)  # the experts themselves still may not change


@pytest.mark.slow
def test_the_moe_debug_model_trains_on_two_cpu_workers_logging_its_balance_loss(tmp_path):
    moe = ["--set", "model.moe.num_experts=4", "--set", "model.moe.top_k=2"]
    result = run_debug_training(tmp_path, ["-m", "launcher", "--device", "cpu"], tmp_path / "run", *moe)
    steps = re.findall(
        r"CPU0:INFO \| \[CPU 0\] Step \[\d+/10\] \| Loss: (\d+\.\d+) \| Aux Loss: (\d+\.\d+) \| Dropped: (\d+)", result.stdout
    )
    losses = [float(loss) for loss, _, _ in steps]
    assert len(losses) == 10 and losses[-1] < losses[0] - 1.0, losses
    # 2 layers x weight 0.01 x a balance loss of at least 1
    assert all(float(aux) >= 0.02 - 1e-4 for _, aux, _ in steps)
    assert [int(dropped) for _, _, dropped in steps] == [0] * 10  # dropless: no token-expert assignment dropped
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [record for record in records if record["kind"] == "train"]
    assert all(record["layers.1.moe_load_balance"] > 0 for record in train)  # per layer
    assert all(record["layers.0.moe_dropped"] == record["layers.1.moe_dropped"] == 0 for record in train)
