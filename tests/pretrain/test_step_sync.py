"""At most one host synchronization per optimizer step that logs nothing: the finite check's
all-reduce also carries the ranks' agreement on a stop request (pretrain/numerics/debug.py
agree_on_step, pretrain/run/stopping.py). Counted here as collectives, in one process that plays
rank 0 of two: torch.distributed.all_reduce is replaced by a peer that answers as rank 1
would. On a GPU each of these all-reduces is followed by one read to the host, and
the GPU acceptance (benchmarks/gpu_acceptance/checks.py) counts the synchronizations themselves."""

from __future__ import annotations

import signal

import pytest
import torch
import torch.distributed as dist

from support.checkpointing import make_trainer
from pretrain import train
from pretrain.numerics import debug
from pretrain.build import Trainer
from pretrain.distributed.runtime import Runtime
from pretrain.run.stopping import Stopped

RANK0_OF_TWO = Runtime(rank=0, world_size=2, device=torch.device("cpu"), label="CPU 0")
STEPS = 6


class Peer:
    """Rank 1, as rank 0's all-reduces see it: finite everywhere, a stop signal from step
    stop_at on (None: never), the same loss. Records every collective in events."""

    def __init__(self, events: list, stop_at: int | None = None) -> None:
        self.events, self.stop_at, self.step = events, stop_at, -1

    def signum(self) -> int:
        return signal.SIGTERM if self.stop_at is not None and self.step >= self.stop_at else 0

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, **_: object) -> None:
        self.events.append("all_reduce")
        if op == dist.ReduceOp.MIN:  # the finite check: not affected, finite, finite, stop
            tensor.copy_(torch.minimum(tensor, torch.tensor([2, 1, 1, -self.signum()])))
        elif op == dist.ReduceOp.MAX:  # the separate stop agreement
            tensor.copy_(torch.maximum(tensor, torch.tensor([self.signum()])))
        else:  # a mean: the peer's value is the same
            tensor.mul_(2)


@pytest.fixture
def run_as_rank0(tmp_path, monkeypatch):
    """fit() a debug trainer as rank 0 of two; returns (events, the trainer). Events are
    ("step", n) when step n starts, then "all_reduce" for each collective."""

    def run(*sets: str, stop_at: int | None = None, own_signal_at: int | None = None) -> tuple[list, Trainer]:
        trainer = make_trainer(
            tmp_path / "cache",
            tmp_path / "run",
            "logging.log_interval=100",
            f"training.max_steps={STEPS}",
            "debug.trace_nonfinite=false",
            "training.async_checkpoint=false",  # the simulated peer writes no marker: a background save never completes
            *sets,
        )
        trainer.runtime = RANK0_OF_TWO  # the model stays unwrapped: the peer answers the collectives
        events: list = []
        peer = Peer(events, stop_at)
        monkeypatch.setattr(dist, "all_reduce", peer.all_reduce)
        monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
        step = train.train_step

        def counted_step(trainer: Trainer, n: int):
            events.append(("step", n))
            peer.step = n
            if n == own_signal_at:
                trainer.stop.signum = signal.SIGINT  # as the handler records a Ctrl-C during the step
            return step(trainer, n)

        monkeypatch.setattr(train, "train_step", counted_step)
        try:
            train.fit(trainer)
        except Stopped as stopped:
            events.append(("stopped", stopped.signum))
        return events, trainer

    return run


def collectives_per_step(events: list) -> dict[int, int]:
    counts, step = {}, None
    for event in events:
        if isinstance(event, tuple) and event[0] == "step":
            step = event[1]
            counts[step] = 0
        elif event == "all_reduce":
            counts[step] += 1
    return counts


def test_a_step_that_logs_nothing_makes_one_all_reduce_that_also_agrees_on_stopping(run_as_rank0):
    events, _ = run_as_rank0("debug.check_finite=true")
    counts = collectives_per_step(events)
    assert [counts[n] for n in range(1, STEPS - 1)] == [1] * (STEPS - 2), counts
    assert counts[0] == 2  # a logging step adds the mean loss


def test_without_the_finite_check_the_stop_agreement_is_the_one_all_reduce_of_a_step(run_as_rank0):
    events, _ = run_as_rank0("debug.check_finite=false")
    counts = collectives_per_step(events)
    assert [counts[n] for n in range(1, STEPS - 1)] == [1] * (STEPS - 2), counts


@pytest.mark.parametrize("check_finite", ["true", "false"])
def test_a_stop_signal_only_the_other_rank_received_stops_this_rank_after_the_same_step(run_as_rank0, check_finite):
    events, trainer = run_as_rank0(f"debug.check_finite={check_finite}", stop_at=2)
    assert events[-1] == ("stopped", signal.SIGTERM)
    assert [e for e in events if isinstance(e, tuple) and e[0] == "step"][-1] == ("step", 2)
    assert (trainer.run_dir / "checkpoints" / "step_3").is_dir()


def test_this_ranks_own_signal_travels_in_the_finite_check(run_as_rank0, monkeypatch):
    agreed: list[int | None] = []
    agree = debug.agree_on_step

    def recorded(*args, **kwargs):
        result = agree(*args, **kwargs)
        agreed.append(result.stop_signum)
        return result

    monkeypatch.setattr(debug, "agree_on_step", recorded)
    events, _ = run_as_rank0("debug.check_finite=true", own_signal_at=1)
    assert agreed == [None, signal.SIGINT] and events[-1] == ("stopped", signal.SIGINT)


def test_a_signal_that_arrives_after_the_steps_check_stops_the_ranks_after_the_next_step(run_as_rank0, monkeypatch):
    from pretrain.run.stopping import StopRequest

    settle = StopRequest.settle

    def signal_just_after_the_check_of_step_1(self, signum):
        settle(self, signum)
        if self.signum is None and len(settled) == 1:
            self.signum = signal.SIGTERM  # the handler runs between the check and the end of step 1
        settled.append(signum)

    settled: list[int | None] = []
    monkeypatch.setattr(StopRequest, "settle", signal_just_after_the_check_of_step_1)
    events, trainer = run_as_rank0("debug.check_finite=true")
    assert settled == [None, None, signal.SIGTERM] and events[-1] == ("stopped", signal.SIGTERM)
    assert (trainer.run_dir / "checkpoints" / "step_3").is_dir()


def test_agreement_reports_a_non_finite_step_and_a_pending_stop_together():
    one = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")
    result = debug.agree_on_step(5, torch.tensor(float("nan")), torch.tensor(1.0), one, stop_signum=signal.SIGTERM)
    assert result.stop_signum == signal.SIGTERM
    assert (result.nonfinite.step, result.nonfinite.what, result.nonfinite.kind) == (5, "LOSS", "NaN")
    assert debug.agree_on_step(5, torch.tensor(1.0), torch.tensor(1.0), one) == debug.StepAgreement(None, None)
