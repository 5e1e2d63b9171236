"""Numerical safety in one process: detection, the first bad module, the report, the dump,
skipping, and the checkpoint that replays the bad step (2 ranks: test_numerical_failure.py)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from torch import nn

from support.checkpointing import make_trainer
from pretrain.checkpoint import save_restore
from pretrain.numerics import debug
from pretrain.numerics.debug import FirstNonFinite, NonFinite, NpzWriter, NumericalFailure
from pretrain.distributed.runtime import Runtime
from pretrain.train import fit, train_step

ONE = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")
POISONED = "layers.1.feed_forward.w13.weight"
CHECKS = ("debug.check_finite=true",)


def poison(trainer, name: str = POISONED) -> None:
    with torch.no_grad():
        trainer.model.get_parameter(name)[3, 5] = float("nan")


# --- detection ------------------------------------------------------------------------


def test_a_finite_step_is_not_reported():
    assert debug.check_step(0, torch.tensor(2.5), torch.tensor(1.0), ONE) is None


def test_an_inf_only_the_hooks_saw_stops_nothing():
    assert debug.check_step(0, torch.tensor(2.5), torch.tensor(1.0), ONE, seen_by_hooks=True) is None


def test_a_nan_loss_is_a_nan_on_this_rank_which_reports_it():
    event = debug.check_step(7, torch.tensor(float("nan")), torch.tensor(1.0), ONE)
    assert (event.kind, event.what, event.step, event.affected_here, event.reporter) == ("NaN", "LOSS", 7, True, 0)


def test_an_infinite_gradient_norm_with_a_finite_loss_is_reported_as_inf():
    event = debug.check_step(3, torch.tensor(2.0), torch.tensor(float("inf")), ONE)
    assert (event.kind, event.what, event.affected_here) == ("Inf", "GRADIENT", False)


def test_what_the_hooks_saw_makes_this_rank_an_affected_one():
    assert debug.check_step(3, torch.tensor(2.0), torch.tensor(float("inf")), ONE, seen_by_hooks=True).affected_here


def test_bad_elements_are_counted_by_kind():
    assert debug.bad_count(torch.tensor([1.0, float("nan"), float("inf"), float("-inf")])) == "1 NaN, 2 Inf of 4"
    assert debug.bad_count(torch.ones(3)) is None
    assert debug.first_values(torch.tensor([1.0, float("nan")])) == "[1, nan]"
    assert debug.first_values(torch.arange(9.0)) == "[0, 1, 2, 3, 4, ...]"


# --- the first module -------------------------------------------------------------------


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


def test_the_hooks_name_the_innermost_module_whose_output_went_bad_first():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 1))
    with torch.no_grad():
        model[1][0].weight[0, 0] = float("nan")
    tracer = FirstNonFinite(model)
    model(torch.ones(2, 4, requires_grad=True)).sum().backward()
    assert tracer.first == "1.0, forward output"  # not the Sequential around it, not the last layer


class WithAuxLoss(nn.Module):
    """A block that returns its output and an auxiliary loss by name, as a feed-forward block may."""

    def forward(self, x):
        return x, {"balance": torch.log(x.sum() - x.sum())}  # log(0): -inf


def test_the_hooks_name_a_module_whose_auxiliary_loss_went_bad():
    model = nn.Sequential(nn.Linear(4, 4), WithAuxLoss())
    tracer = FirstNonFinite(model)
    model(torch.ones(2, 4))
    assert tracer.first == "1, forward output"


def test_the_hooks_name_the_module_whose_backward_made_a_gradient_infinite():
    model = nn.Sequential(nn.Linear(4, 4), Sqrt(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()  # sqrt(0) = 0 is finite; its derivative is not
    tracer = FirstNonFinite(model)
    model(torch.ones(2, 4, requires_grad=True)).sum().backward()
    assert tracer.first == "1, gradient of its input"
    tracer.reset()
    assert tracer.first is None
    tracer.remove()
    model(torch.ones(2, 4, requires_grad=True)).sum().backward()
    assert tracer.first is None  # removed hooks see nothing


def test_the_debug_preset_traces_and_the_others_do_not(tmp_path):
    assert make_trainer(tmp_path / "cache", tmp_path / "a").tracer is not None
    assert make_trainer(tmp_path / "cache", tmp_path / "b", "debug.trace_nonfinite=false").tracer is None


# --- the report and the dump ------------------------------------------------------------


def test_the_report_has_the_banner_the_numbers_and_the_tensors():
    findings = debug.TensorFindings([], [], [])
    debug.inspect("w", torch.tensor([1.0, 2.0]), torch.tensor([float("inf"), 0.0]), findings)
    debug.inspect("ok", torch.ones(2), torch.ones(2), findings)
    text = debug.report(NonFinite(0, 12.6087, float("inf"), True, 0), "GPU 6", findings, None, tracing=False)
    lines = text.splitlines()
    assert lines[:6] == [
        debug.RULE,
        "Inf GRADIENT DETECTED [GPU 6]",
        debug.RULE,
        "Step: 0",
        "Loss: 12.6087",
        "Gradient Norm: inf",
    ]
    assert "  w (2,) gradient: 1 Inf of 2; first values [inf, 0]" in lines
    assert "Total layers with NaN gradients: 1" in lines and "Affected layers: ['w']" in lines
    assert any(line.startswith("first non-finite: set debug.trace_nonfinite=true") for line in lines)


def test_a_dump_written_an_array_at_a_time_loads_without_pickle(tmp_path):
    writer = NpzWriter(tmp_path / "d.npz")
    writer.add("param/a.weight", torch.tensor([[1.0, float("nan")]]))
    writer.add("grad/a.weight", torch.tensor([[float("inf"), 0.0]]))
    writer.close()
    with np.load(tmp_path / "d.npz", allow_pickle=False) as dump:
        assert dump.files == ["param/a.weight", "grad/a.weight"]
        assert np.isnan(dump["param/a.weight"]).sum() == 1 and np.isinf(dump["grad/a.weight"]).sum() == 1


def test_a_dump_that_cannot_be_written_is_a_warning_not_a_crash(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert not debug.write_dump(nn.Linear(2, 2), blocker / "d.npz", ONE, 0, logging.getLogger("test"))
    assert "Tensor dump skipped" in caplog.text


def test_under_fsdp_the_reporter_takes_part_in_every_gather_even_when_the_dump_file_cannot_be_made(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(debug, "room_for_dump", lambda model, directory: (True, 0))  # room, yet no file
    monkeypatch.setattr(debug, "has_fsdp", lambda model: True)
    gathered = []
    monkeypatch.setattr(debug, "named_tensors", lambda model: (gathered.append(name) for name in ("a", "b")))
    assert not debug.write_dump(nn.Linear(2, 2), blocker / "d.npz", ONE, 0, logging.getLogger("test"))
    assert gathered == ["a", "b"]  # the peers' gathers were all matched


# --- in training --------------------------------------------------------------------------


def test_a_nan_weight_stops_the_step_with_a_report_a_dump_and_a_checkpoint_that_replays_it(tmp_path, capsys):
    trainer = make_trainer(tmp_path / "cache", tmp_path / "run", *CHECKS)
    train_step(trainer, 0)
    position = trainer.loader.state_dict()
    poison(trainer)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(NumericalFailure, match="step 1: NaN"):
        train_step(trainer, 1)
    assert all(torch.allclose(p, before[n], rtol=0, atol=0, equal_nan=True) for n, p in trainer.model.named_parameters())
    out = capsys.readouterr().out
    assert "NaN GRADIENT DETECTED [CPU 0]" in out
    assert "first non-finite: layers.1.feed_forward.w13, forward output" in out

    with np.load(tmp_path / "run" / "debug" / "nan_debug_step_1.npz", allow_pickle=False) as dump:
        assert np.isnan(dump[f"param/{POISONED}"]).sum() == 1 and np.isnan(dump["grad/output.weight"]).all()
    saved = tmp_path / "run" / "checkpoints" / "nan_grad_step_1"
    assert save_restore.read_state(saved)["steps_done"] == 1
    assert save_restore.read_state(saved)["loader"] == position  # the failed step's own batches

    again = make_trainer(tmp_path / "cache", tmp_path / "run", *CHECKS)
    assert save_restore.restore(again, saved) == 1
    with pytest.raises(NumericalFailure, match="step 1: NaN"):
        train_step(again, 1)


def test_the_hooks_work_inside_the_checkpointed_chunks_of_the_loss(tmp_path, capsys):
    trainer = make_trainer(tmp_path / "cache", tmp_path / "run", *CHECKS, "training.loss_chunk_tokens=16")
    poison(trainer, "output.weight")
    with pytest.raises(NumericalFailure, match="step 0: NaN"):
        train_step(trainer, 0)
    assert "first non-finite: output, forward output" in capsys.readouterr().out


def test_an_unusable_dump_directory_skips_the_dump_and_still_stops_with_a_checkpoint(tmp_path, capsys):
    trainer = make_trainer(tmp_path / "cache", tmp_path / "run", *CHECKS)
    (tmp_path / "run" / "debug").write_text("in the way")
    poison(trainer)
    with pytest.raises(NumericalFailure) as failure:
        train_step(trainer, 0)
    assert "Tensor dump skipped" in capsys.readouterr().out and "; dump " not in str(failure.value)
    assert (tmp_path / "run" / "checkpoints" / "nan_grad_step_0" / "model.pt").exists()


def test_without_room_on_disk_the_dump_is_skipped_and_the_run_still_stops_with_its_checkpoint(tmp_path, monkeypatch, capsys):
    trainer = make_trainer(tmp_path / "cache", tmp_path / "run", *CHECKS)
    poison(trainer)
    monkeypatch.setattr(debug, "room_for_dump", lambda model, directory: (False, 64 * 2**30))
    with pytest.raises(NumericalFailure):
        train_step(trainer, 0)
    assert "Tensor dump skipped: it needs 64.0 GiB" in capsys.readouterr().out
    assert not (tmp_path / "run" / "debug" / "nan_debug_step_0.npz").exists()
    assert (tmp_path / "run" / "checkpoints" / "nan_grad_step_0" / "model.pt").exists()


def test_skip_mode_drops_the_updates_then_stops_after_too_many_in_a_row(tmp_path, capsys):
    trainer = make_trainer(tmp_path / "cache", tmp_path / "run", *CHECKS, "debug.on_nonfinite=skip", "debug.max_skips_in_a_row=2")
    train_step(trainer, 0)  # a good step first, so that there are Adam moments to leave alone
    poison(trainer)
    output = trainer.model.get_parameter("output.weight")
    before, moments = output.detach().clone(), trainer.optimizer.state[output]["exp_avg"].clone()
    for step in range(1, 3):
        train_step(trainer, step)
    assert trainer.skipped_steps == 2 and "update skipped (2 in a row, 2 in all" in capsys.readouterr().out
    assert all(p.grad is None for p in trainer.model.parameters())
    with pytest.raises(NumericalFailure, match="step 3"):
        train_step(trainer, 3)
    assert torch.equal(output, before) and torch.equal(trainer.optimizer.state[output]["exp_avg"], moments)


def test_skip_mode_carries_on_after_one_bad_gradient(tmp_path, capsys):
    trainer = make_trainer(tmp_path / "cache", tmp_path / "run", *CHECKS, "debug.on_nonfinite=skip", "training.max_steps=4")
    calls = []

    def spike(grad):  # one gradient turns infinite once, as after a bad batch
        calls.append(1)
        return torch.full_like(grad, float("inf")) if len(calls) == 2 else grad

    trainer.tracer.remove()
    trainer.model.get_parameter("norm.weight").register_hook(spike)
    trainer.tracer = FirstNonFinite(trainer.model)  # its hooks after the spike's, to see what the spike made
    trainer.log.setLevel(logging.INFO)
    fit(trainer)
    out = capsys.readouterr().out
    assert trainer.skipped_steps == 1 and trainer.skips_in_a_row == 0
    assert "Step 1: loss" in out and "update skipped (1 in a row, 1 in all" in out
    assert "first non-finite: norm.weight, gradient" in out
    assert "1 update(s) skipped for NaN/Inf" in out
    assert all(math.isfinite(loss) for loss in trainer.losses)


def test_with_the_check_off_a_nan_goes_into_the_weights(tmp_path):
    trainer = make_trainer(tmp_path / "cache", tmp_path / "run", "debug.check_finite=false", "debug.trace_nonfinite=false")
    poison(trainer)
    train_step(trainer, 0)
    assert torch.isnan(trainer.model.get_parameter("output.weight")).all()
