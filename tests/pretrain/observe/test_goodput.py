"""The goodput ledger's worker side (pretrain/observe/goodput.py, and its record files,
pretrain/observe/goodput_records.py): the pure combining of launch and attempt records into
goodput.json, the attempt clock, the metrics record, a standalone run's goodput.json end to end, and
damaged records, a ledger that cannot be written and an unreadable goodput/, none of which ends a run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from support.runs import run_debug_training
from pretrain.observe import goodput, goodput_records
from pretrain.observe.metrics import MetricsLog, read_metrics
from support.goodput import DAMAGED, damaged_records, unreadable_goodput_dir
from support.goodput import attempt, T0


def assert_adds_up(ledger: dict) -> None:
    assert set(ledger) == {"wall_s", "goodput", "parts_s"}
    assert list(ledger["parts_s"]) == list(goodput.PARTS)
    assert sum(ledger["parts_s"].values()) == pytest.approx(ledger["wall_s"], abs=0.01)
    assert ledger["goodput"] == pytest.approx(ledger["parts_s"]["productive"] / ledger["wall_s"], abs=1e-4)


def test_a_run_without_failures_is_start_up_its_steps_and_the_rest_adding_up_to_its_wall_time():
    launch = {"launch": 1, "started": T0, "ended": T0 + 112, "attempts": [{"attempt": 0, "spawned": T0 + 1, "ended": T0 + 111}]}
    record = attempt(1, 0, T0 + 10, T0 + 110, 0, 100, final=True)
    ledger = goodput.combine([launch], [record])
    assert_adds_up(ledger)
    parts = ledger["parts_s"]
    assert ledger["wall_s"] == 112
    assert parts["startup"] == pytest.approx(10) and parts["restart"] == parts["redone"] == 0
    assert parts["productive"] == pytest.approx(80) and parts["checkpoint_stall"] == pytest.approx(10)
    assert parts["evaluation"] == pytest.approx(5) and parts["other"] == pytest.approx(7)  # 5 in the loop, 2 after it


def test_a_restart_from_an_earlier_checkpoint_counts_the_steps_after_it_and_the_tail_as_redone():
    # Attempt 0 does steps 0-17 (1 s of step time each) and dies 0.5 s after its last record; the
    # launcher's teardown takes 1 s; attempt 1 starts 4 s later from step_15 and finishes.
    first = attempt(0 + 1, 0, T0 + 10, T0 + 32.5, 0, 18, step_s=18.0)
    second = attempt(1, 1, T0 + 38, T0 + 68, 15, 40, step_s=25.0, final=True)
    launch = {
        "launch": 1,
        "started": T0,
        "ended": T0 + 69,
        "attempts": [
            {"attempt": 0, "spawned": T0 + 1, "failed": T0 + 33, "ended": T0 + 34},
            {"attempt": 1, "spawned": T0 + 35, "failed": None, "ended": T0 + 68.5},
        ],
    }
    ledger = goodput.combine([launch], [first, second])
    assert_adds_up(ledger)
    parts = ledger["parts_s"]
    assert parts["redone"] == pytest.approx(3.0 + 0.5)  # steps 15-17, and the half second after the last record
    assert parts["productive"] == pytest.approx(15.0 + 25.0)
    assert parts["restart"] == pytest.approx(1.0 + 4.0)  # the teardown, then up to the next first step
    assert parts["startup"] == pytest.approx(10.0)
    assert goodput.restarts_of([launch], [first, second]) == 1
    assert goodput.summary_line(ledger, 1).startswith(f"goodput {100 * ledger['goodput']:.1f}%: lost 8 s to 1 restart, ")


def test_a_second_launch_resuming_the_run_takes_away_the_first_launchs_later_steps_and_not_the_time_between():
    # Launch 1's launcher was killed with its attempt (no end recorded); a day later launch 2 resumed from step_10.
    first = attempt(1, 0, T0 + 10, T0 + 30, 0, 14, step_s=14.0)
    launch_one = {"launch": 1, "started": T0, "ended": None, "attempts": [{"attempt": 0, "spawned": T0 + 1, "ended": None}]}
    later = T0 + 86_400
    second = attempt(2, 0, later + 8, later + 20, 10, 20, step_s=10.0, final=True)
    launch_two = {
        "launch": 2,
        "started": later,
        "ended": later + 21,
        "attempts": [{"attempt": 0, "spawned": later + 1, "ended": later + 20.5}],
    }
    ledger = goodput.combine([launch_one, launch_two], [first, second])
    assert_adds_up(ledger)
    assert ledger["wall_s"] == pytest.approx(30 + 21)
    parts = ledger["parts_s"]
    assert parts["redone"] == pytest.approx(4.0)  # steps 10-13 of launch 1
    assert parts["productive"] == pytest.approx(10.0 + 10.0)
    assert parts["startup"] == pytest.approx(10 + 8)  # each launch's start-up
    assert goodput.restarts_of([launch_one, launch_two], [first, second]) == 0


def test_an_attempt_resumed_before_its_own_start_is_redone_whole_and_its_predecessors_after_that_step():
    records = [
        attempt(1, 0, T0 + 10, T0 + 30, 0, 20, step_s=20.0),
        attempt(1, 1, T0 + 40, T0 + 50, 20, 30, step_s=10.0),
        attempt(1, 2, T0 + 60, T0 + 90, 15, 45, step_s=30.0, final=True),  # step_20 and later were damaged
    ]
    assert goodput.kept_step_seconds(records) == pytest.approx([15.0, 0.0, 30.0])


def test_a_worker_without_the_launcher_stands_for_its_own_launch():
    record = attempt(1, 0, T0 + 5, T0 + 50, 0, 40, final=True)  # started 3 s before its first step
    ledger = goodput.combine([], [record])
    assert_adds_up(ledger)
    assert ledger["wall_s"] == pytest.approx(48) and ledger["parts_s"]["startup"] == pytest.approx(3)


def test_a_launch_still_running_is_counted_up_to_now():
    launch = {"launch": 1, "started": T0, "ended": None, "attempts": [{"attempt": 0, "spawned": T0 + 1, "ended": None}]}
    ledger = goodput.combine([launch], [attempt(1, 0, T0 + 10, T0 + 20, 0, 10)], now=T0 + 20.2)
    assert_adds_up(ledger)
    assert ledger["wall_s"] == pytest.approx(20.2) and ledger["parts_s"]["redone"] == 0


def test_the_clock_counts_step_time_without_the_checkpoint_stall_in_it_and_writes_the_ledger(tmp_path, monkeypatch):
    now, stall = [T0], [0.0]
    monkeypatch.setattr(goodput.time, "time", lambda: now[0])
    monkeypatch.setattr(goodput, "process_started", lambda: T0 - 5)
    clock = goodput.AttemptClock(tmp_path, True, 0, lambda steps: steps % 2 == 0, lambda: stall[0], environ={})
    clock.begin()
    for step in range(4):
        now[0] += 1.0
        stall[0] += 0.25  # the writer blocked the step (waiting for the save before)
        clock.step_time(step + 1)  # the loss read, at a logging step
        now[0] += 0.1
        clock.record(step + 1)  # its logging: not the step's
        with clock.evaluating():
            now[0] += 0.5
        now[0] += 0.2  # the stop agreement waits for the device: the step's
        clock.step_time(step + 1, done=True)
    ledger = clock.record(4, final=True)
    assert ledger is not None
    assert_adds_up(ledger)
    written = json.loads((tmp_path / "goodput" / "launch_1_attempt_0.json").read_text())
    assert written["step_s"] == pytest.approx(4 * 0.95) and written["checkpoint_stall_s"] == pytest.approx(1.0)
    assert written["points"] == [[2, pytest.approx(2 * 0.95)], [4, pytest.approx(4 * 0.95)]]
    assert ledger["parts_s"]["startup"] == pytest.approx(5) and ledger["parts_s"]["evaluation"] == pytest.approx(2)
    assert ledger["parts_s"]["other"] == pytest.approx(0.4)
    assert json.loads((tmp_path / "goodput.json").read_text()) == ledger


def test_the_metrics_log_carries_goodput_and_its_parts(tmp_path):
    ledger = goodput.combine([], [attempt(1, 0, T0 + 5, T0 + 50, 0, 40, final=True)])
    with MetricsLog(tmp_path, enabled=True, tensorboard=False) as log:
        log.log_goodput(7, ledger)
        log.log_goodput(8, None)  # another rank: nothing
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record["kind"] == "goodput" and record["step"] == 7 and record["goodput"] == ledger["goodput"]
    assert {f"{part}_s" for part in goodput.PARTS} | {"wall_s"} <= set(record)


@pytest.mark.slow
def test_a_run_without_the_launcher_writes_goodput_json_adding_up_with_little_left_over(tmp_path):
    run_dir = tmp_path / "run"
    result = run_debug_training(tmp_path, ["-m", "pretrain"], run_dir, "--max-steps", "12", "--set", "training.eval_interval=6")
    ledger = json.loads((run_dir / "goodput.json").read_text())
    parts = ledger["parts_s"]
    assert abs(sum(parts.values()) - ledger["wall_s"]) <= 0.02 * ledger["wall_s"]
    assert parts["productive"] > 0 and parts["evaluation"] > 0 and parts["startup"] > 0
    assert parts["redone"] == parts["restart"] == 0
    assert parts["other"] <= 0.1 * ledger["wall_s"], parts  # the accounting is real: little is left unexplained
    logged = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "goodput"]
    assert [r["step"] for r in logged] == list(range(12))  # at every logging step
    assert "goodput " in result.stderr + result.stdout and "% so far (goodput.json)" in result.stderr + result.stdout
    assert "goodput" in (result.stderr + result.stdout).split("Training complete")[1]
    assert Path(run_dir / "goodput" / "launch_1_attempt_0.json").exists()


# --- damaged records and an unreadable goodput/ ----------------------------------------------


def test_damaged_records_are_passed_over_each_said_once_naming_its_file(tmp_path):
    launch, good = damaged_records(tmp_path)
    said: list[str] = []
    written = goodput.write_ledger(tmp_path, warn=said.append)
    assert written is not None
    assert written == (goodput.combine([launch], [good]), 0)  # the good records alone
    assert_adds_up(written[0])
    assert len(said) == len(DAMAGED)
    for name in DAMAGED:
        (line,) = [line for line in said if f"{tmp_path / 'goodput' / name}:" in line]
        assert line.startswith("goodput: skipping ") and "(delete it to silence this)" in line
    assert any("'step_s' is not a finite number (got NaN)" in line for line in said)
    goodput.write_ledger(tmp_path, warn=said.append)  # read again at the next logging step: not said again
    assert len(said) == len(DAMAGED)


def test_combine_passes_over_records_of_the_wrong_shape():
    launch = {"launch": 1, "started": T0, "ended": T0 + 112, "attempts": [{"attempt": 0, "spawned": T0 + 1, "ended": T0 + 111}]}
    good = attempt(1, 0, T0 + 10, T0 + 110, 0, 100, final=True)
    bad_launches = [{"launch": 1, "attempt": 0}, {"launch": 2, "started": None, "attempts": []}, None]
    bad_launches += [{"launch": 3, "started": T0, "attempts": [{"attempt": "0"}]}]
    bad_attempts = [attempt(1, 1, T0 + 10, T0 + 20, 0, 10) | {key: value} for key, value in BAD_FIELDS]
    bad_attempts.append({"launch": 1, "attempt": 2})
    assert goodput.combine([launch, *bad_launches], [good, *bad_attempts]) == goodput.combine([launch], [good])
    assert goodput.restarts_of([launch, *bad_launches], [good, *bad_attempts]) == 0


BAD_FIELDS = [
    ("started", None),
    ("updated", float("inf")),
    ("step_s", float("nan")),
    ("start_step", True),
    ("checkpoint_stall_s", "0.1"),
    ("points", None),
    ("first_step", [1]),
    ("final", "yes"),
]


@pytest.fixture
def ledger_warnings(caplog, monkeypatch):
    """caplog with the "pretrain" logger's warnings, which a worker's setup_logging (run by an earlier
    test in this process) stops from propagating to the root logger caplog listens on."""
    monkeypatch.setattr(logging.getLogger("pretrain"), "propagate", True)
    return caplog


def test_a_workers_record_goes_on_past_damaged_records_and_says_so_once(tmp_path, ledger_warnings):
    damaged_records(tmp_path)
    clock = goodput.AttemptClock(tmp_path, True, 0, lambda steps: False, lambda: 0.0, environ={})
    assert clock.launch == 5  # past every recorded launch number, damaged or not
    clock.begin()
    clock.step_time(1, done=True)
    with ledger_warnings.at_level("WARNING", logger="pretrain"):
        first = clock.record(1)
        second = clock.record(2, final=True)
    assert first is not None and second is not None
    assert_adds_up(second)
    skipped = [r.getMessage() for r in ledger_warnings.records if r.getMessage().startswith("goodput: skipping ")]
    assert len(skipped) == len(DAMAGED)  # once each, though read at both records


def test_a_ledger_that_cannot_be_written_costs_the_ledger_not_the_run_and_is_said_once(tmp_path, monkeypatch, ledger_warnings):
    def broken(*args, **kwargs):
        raise KeyError("started")  # whatever combining a record it did not foresee raises

    monkeypatch.setattr(goodput, "combine", broken)
    clock = goodput.AttemptClock(tmp_path, True, 0, lambda steps: steps % 2 == 0, lambda: 0.0, environ={})
    clock.begin()
    with ledger_warnings.at_level("WARNING", logger="pretrain"):
        for step in range(4):
            clock.step_time(step + 1, done=True)  # a checkpoint step records too
            assert clock.record(step + 1) is None
        assert clock.record(4, final=True) is None
    (warning,) = [r.getMessage() for r in ledger_warnings.records]
    assert warning == f"goodput: cannot write the ledger in {tmp_path}: 'started'; training goes on without it"
    assert (tmp_path / "goodput" / "launch_1_attempt_0.json").exists()  # its own record was written


def test_an_unreadable_goodput_directory_means_no_ledger_said_once_and_the_run_goes_on(tmp_path, monkeypatch, ledger_warnings):
    (tmp_path / "goodput").mkdir()
    unreadable_goodput_dir(monkeypatch)
    said: list[str] = []
    assert goodput_records.next_launch(tmp_path, said.append) is None
    assert (
        goodput_records.read_records(tmp_path, said.append) is None and goodput.write_ledger(tmp_path, warn=said.append) is None
    )
    assert said == [
        f"goodput: cannot list {tmp_path / 'goodput'}: Permission denied; no goodput ledger this time "
        "(make it readable, or remove it)"
    ]
    with ledger_warnings.at_level("WARNING", logger="pretrain"):
        clock = goodput.AttemptClock(tmp_path, True, 0, lambda steps: True, lambda: 0.0, environ={})
        clock.begin()
        clock.step_time(1, done=True)
        assert not clock.enabled and clock.record(1, final=True) is None and clock.summary() is None
    assert not (tmp_path / "goodput.json").exists() and not list((tmp_path / "goodput").glob("*"))
