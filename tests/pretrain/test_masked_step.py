"""The step's one host synchronization sits after the update is issued: the optimizer steps masked
by the ranks' all-reduced finite flags (found_inf, as torch's GradScaler gives it), and the host
reads the flags only then (pretrain/step.py train_step, pretrain/numerics/debug.py
agree_on_step). A non-finite step still changes no weight, moment, step count or momentum buffer,
and its gradients stay as the backward made them for the report and the dump; an optimizer that
takes no such flag is stepped only after the read, as before. Two ranks, under DDP and FSDP2:
masked_step_worker.py."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.checkpointing import make_trainer, resolved
from support.processes import run_gloo_ranks
from pretrain import registry, train
from pretrain import step as step_module  # train_step's loss, patched
from pretrain.model.loss import Loss
from pretrain.numerics import debug
from pretrain.numerics.debug import NumericalFailure
from pretrain.optim import muon as muon_module
from pretrain.optim import optimizers
from pretrain.optim.muon import Muon, svd_orthogonalize

CHECKS = ("debug.check_finite=true", "debug.trace_nonfinite=false")
OPTIMIZERS = ("adamw", "muon")


class Order(TorchDispatchMode):
    """The aten ops dispatched inside, and "read" where a tensor is read to the host (.tolist(),
    which on a CPU copies without dispatching, as benchmarks/efficiency_counters.py notes)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.events.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@contextmanager
def recorded_order(monkeypatch) -> Iterator[list[str]]:
    order = Order()
    tolist = torch.Tensor.tolist

    def read(self: torch.Tensor, *args: object) -> object:
        order.events.append("read")
        return tolist(self, *args)

    monkeypatch.setattr(torch.Tensor, "tolist", read)
    with order:
        yield order.events
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)


def spoil(monkeypatch, how: str) -> None:
    """From now on every loss is bad: "loss", the cross-entropy Inf with finite gradients; or
    "gradients", NaN everywhere."""
    original = step_module.next_token_loss

    def spoiled(*args: Any, **kwargs: Any) -> Loss:
        loss = original(*args, **kwargs)
        if how == "loss":
            return loss._replace(cross_entropy=loss.cross_entropy + float("inf"))
        return loss._replace(total=loss.total * float("nan"), cross_entropy=loss.cross_entropy * float("nan"))

    monkeypatch.setattr(step_module, "next_token_loss", spoiled)


def state_of(trainer) -> tuple[dict, dict]:
    """Copies of the weights and the optimizer's state (moments, step counts, momentum buffers)."""
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return weights, copy.deepcopy(trainer.optimizer.state_dict()["state"])


def assert_same(first: object, second: object) -> None:
    if isinstance(first, dict):
        assert isinstance(second, dict) and first.keys() == second.keys()
        for key in first:
            assert_same(first[key], second[key])
    elif isinstance(first, tuple):
        assert isinstance(second, tuple) and len(first) == len(second)
        for a, b in zip(first, second, strict=True):
            assert_same(a, b)
    else:
        assert torch.equal(torch.as_tensor(first), torch.as_tensor(second))


# --- where the read sits ------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_update_is_issued_before_the_host_reads_the_finite_flags(tmp_path, monkeypatch, optimizer):
    trainer = make_trainer(tmp_path / "cache", tmp_path / "run", *CHECKS, f"training.optimizer={optimizer}")
    assert optimizers.takes_found_inf(trainer.optimizer, trainer.runtime.device)
    train.train_step(trainer, 0)  # the optimizer's state exists: the step below is an ordinary one
    with recorded_order(monkeypatch) as events:
        train.train_step(trainer, 1)
    assert events.count("read") == 1
    read = events.index("read")
    assert "_fused_adamw_" in events[:read]  # AdamW, and Muon's AdamW half
    # The read is the last thing the step does on the device: clipping and the whole update are
    # queued before it (zero_grad's profiler label after it is no device work).
    assert [e for e in events[read + 1 :] if not e.startswith("_record_function")] == []


def test_an_optimizer_without_a_device_flag_is_stepped_only_after_the_read(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path / "cache", tmp_path / "run", *CHECKS)
    groups = optimizers.decay_groups(trainer.model, 0.1)
    trainer.optimizer = torch.optim.AdamW(groups, lr=1e-3, foreach=True)  # no found_inf input
    assert not optimizers.takes_found_inf(trainer.optimizer, trainer.runtime.device)
    with recorded_order(monkeypatch) as events:
        train.train_step(trainer, 0)
    read = events.index("read")
    assert "_foreach_lerp_" not in events[:read] and "_foreach_lerp_" in events[read:]


def test_parameters_in_host_memory_of_a_gpu_run_take_no_device_flag(tmp_path):
    trainer = make_trainer(tmp_path / "cache", tmp_path / "run", *CHECKS)
    # As under CPU offload: the flag would have to be copied to the host, a synchronization of its own.
    assert not optimizers.takes_found_inf(trainer.optimizer, torch.device("cuda", 0))


# --- what a non-finite step leaves ------------------------------------------------------------


@pytest.mark.parametrize("how", ["loss", "gradients"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_skipped_step_leaves_the_weights_and_the_optimizer_state_exactly_as_they_were(tmp_path, monkeypatch, optimizer, how):
    trainer = make_trainer(
        tmp_path / "cache", tmp_path / "run", *CHECKS, "debug.on_nonfinite=skip", f"training.optimizer={optimizer}"
    )
    train.train_step(trainer, 0)  # moments, step counts and momentum buffers to leave alone
    before = state_of(trainer)
    spoil(monkeypatch, how)
    train.train_step(trainer, 1)
    assert trainer.skipped_steps == 1
    assert_same(state_of(trainer), before)
    monkeypatch.undo()
    train.train_step(trainer, 2)  # a good step after it updates again
    assert trainer.skipped_steps == 1 and trainer.skips_in_a_row == 0
    assert not torch.equal(trainer.model.get_parameter("output.weight"), before[0]["output.weight"])


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_skipped_first_step_leaves_no_optimizer_state_behind(tmp_path, monkeypatch, optimizer):
    trainer = make_trainer(
        tmp_path / "cache", tmp_path / "run", *CHECKS, "debug.on_nonfinite=skip", f"training.optimizer={optimizer}"
    )
    spoil(monkeypatch, "gradients")
    train.train_step(trainer, 0)
    assert trainer.skipped_steps == 1 and trainer.optimizer.state_dict()["state"] == {}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_stopped_steps_dump_holds_the_gradients_the_backward_made_not_clipped_ones(tmp_path, monkeypatch, optimizer):
    trainer = make_trainer(
        tmp_path / "cache",
        tmp_path / "run",
        *CHECKS,
        "training.max_grad_norm=0.001",  # clipping would scale every gradient far down
        f"training.optimizer={optimizer}",
    )
    train.train_step(trainer, 0)
    spoil(monkeypatch, "loss")  # the loss is Inf, the gradients finite: clipping could touch them
    seen: dict[str, float] = {}
    inspect_all, agree_on_step = debug.inspect_all, debug.agree_on_step

    def inspected(model: torch.nn.Module) -> debug.TensorFindings:
        seen["dumped"] = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
        return inspect_all(model)

    def agreed(*args: Any, **kwargs: Any) -> debug.StepAgreement:
        agreement = agree_on_step(*args, **kwargs)
        assert agreement.nonfinite is not None
        seen["reported"] = agreement.nonfinite.grad_norm  # the norm before clipping
        return agreement

    monkeypatch.setattr(debug, "inspect_all", inspected)
    monkeypatch.setattr(debug, "agree_on_step", agreed)
    with pytest.raises(NumericalFailure, match="step 1: Inf loss"):
        train.train_step(trainer, 1)
    assert seen["reported"] > 0.01 and seen["dumped"] == pytest.approx(seen["reported"], rel=1e-6)


# --- the optimizers themselves -----------------------------------------------------------------


def tiny_muon(orthogonalize=svd_orthogonalize) -> tuple[Muon, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    matrix, vector, embedding, other = (torch.nn.Parameter(torch.randn(*s)) for s in ((8, 4), (4,), (6, 4), (4, 6)))
    groups = [
        {"params": [matrix, other], "use_muon": True, "lr": 0.1, "weight_decay": 0.1},
        {"params": [embedding], "lr": 0.1, "weight_decay": 0.1},
        {"params": [vector], "lr": 0.1},
    ]
    return Muon(groups, orthogonalize), [matrix, vector, embedding, other]


def set_grads(params: list[torch.nn.Parameter], seed: int, bad: bool = False) -> None:
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=generator) for p in params]
    if bad:
        grads[0][0, 0] = float("nan")
        grads[2][1, 1] = float("inf")
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad


@pytest.mark.parametrize("orthogonalize", ["newton_schulz", "svd"])
def test_muon_told_to_skip_changes_no_weight_momentum_moment_or_gradient(orthogonalize):
    muon, params = tiny_muon(registry.load(registry.ORTHOGONALIZERS[orthogonalize]))
    set_grads(params, 1)
    muon.step()
    weights, state = [p.detach().clone() for p in params], copy.deepcopy(muon.state_dict()["state"])
    set_grads(params, 2, bad=True)
    grads = [p.grad.clone() for p in params]
    optimizers.step_unless(muon, torch.ones(()))  # an SVD of a NaN momentum would raise: it never sees one
    assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))
    assert_same(muon.state_dict()["state"], state)
    assert all(torch.allclose(p.grad, g, rtol=0, atol=0, equal_nan=True) for p, g in zip(params, grads, strict=True))
    assert not hasattr(muon, "found_inf")


@pytest.mark.parametrize("make", ["adamw", "muon", "muon in chunks of one matrix"])
def test_an_update_told_not_to_skip_is_the_plain_steps_bit_for_bit(make, monkeypatch):
    if make == "muon in chunks of one matrix":
        monkeypatch.setattr(muon_module, "MASK_CHUNK_BYTES", 1)  # every matrix a chunk of its own

    def build() -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
        if make.startswith("muon"):
            return tiny_muon(registry.load(registry.ORTHOGONALIZERS["newton_schulz"]))
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
        return torch.optim.AdamW(params, lr=0.1, fused=True), params

    (plain, first), (masked, second) = build(), build()
    for seed in range(3):
        set_grads(first, seed)
        set_grads(second, seed)
        plain.step()
        optimizers.step_unless(masked, torch.zeros(()))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert_same(plain.state_dict()["state"], masked.state_dict()["state"])


# --- two ranks -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("masked")
    resolved(out / "cache")  # the dataset, prepared once before the ranks read it
    return run_gloo_ranks("masked_step_worker.py", out, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_when_one_ranks_loss_is_not_finite_both_ranks_skip_the_same_steps_and_change_nothing(two_ranks, optimizer, parallelism):
    for rank in two_ranks:
        seen = rank[f"{optimizer} {parallelism}"]
        assert seen["mode"] == parallelism
        changes = [(c["weights"], c["state"]) for c in seen["changed"]]
        # step 1: rank 1's loss alone was Inf (rank 0 saw nothing itself); step 2: its gradients were NaN
        assert changes == [(True, True), (False, False), (False, False), (True, True)]
        assert seen["skipped"] == [0, 1, 2, 2]
        assert all(order == ["step", "read"] for order in seen["order"])
