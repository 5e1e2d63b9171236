"""The launcher's side of the goodput ledger (launcher/supervise/goodput.py): the launch's record,
and goodput.json and its summary line for a training run whose worker is killed and restarted, on
one machine and on two nodes (one launch for every round); damaged records and an unreadable
goodput/ never end a launch."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.processes import launcher_env
from support.runs import run_launcher
from launcher import launch
from launcher.supervise.goodput import LAUNCH_VAR, JobLedger, LaunchLedger
from support.nodes import start_nodes, train_options
from pretrain.observe import goodput
from pretrain.observe.metrics import read_metrics
from support.goodput import DAMAGED, damaged_records, unreadable_goodput_dir


def test_a_launch_whose_workers_never_started_leaves_no_record(tmp_path):
    ledger = LaunchLedger(tmp_path, started=100.0)
    assert ledger.finish() is None
    assert not (tmp_path / "goodput").exists() and not (tmp_path / "goodput.json").exists()


def test_each_launch_into_a_run_directory_gets_the_next_number_and_tells_its_workers(tmp_path):
    first = LaunchLedger(tmp_path, started=100.0)
    first.spawned(0)
    second = LaunchLedger(tmp_path, started=200.0)
    assert (first.number, second.number) == (1, 2)
    assert second.env() == {LAUNCH_VAR: "2"}
    first.ended(0, failed=150.0)
    (record,) = json.loads((tmp_path / "goodput" / "launch_1.json").read_text())["attempts"]
    assert record["failed"] == 150.0 and record["ended"] >= record["spawned"]


@pytest.mark.slow
def test_a_killed_worker_restarted_from_its_checkpoint_shows_redone_steps_and_the_restart(tmp_path):
    run_dir = tmp_path / "run"
    argv = ["--debug", "--device", "cpu", "--nproc", "2", "--max-steps", "12", "--run-dir", str(run_dir)]
    argv += ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "training.checkpoint_interval=3"]
    argv += ["--max-restarts", "1", "--restart-backoff", "0"]
    result = run_launcher(*argv, timeout=180, PRETRAIN_FAULTS="0:1:7:sigkill")  # 8 steps done; resumes from step_6
    assert result.returncode == 0, result.stdout[-3000:]
    ledger = json.loads((run_dir / "goodput.json").read_text())
    parts = ledger["parts_s"]
    assert set(ledger) == {"wall_s", "goodput", "parts_s"} and list(parts) == list(goodput.PARTS)
    assert abs(sum(parts.values()) - ledger["wall_s"]) <= 0.02 * ledger["wall_s"]
    assert parts["redone"] > 0 and parts["restart"] > 0 and parts["startup"] > 0 and parts["productive"] > 0
    assert parts["other"] <= 0.1 * ledger["wall_s"], parts  # the accounting is real: little is left unexplained
    assert ledger["goodput"] == pytest.approx(parts["productive"] / ledger["wall_s"], abs=1e-3)
    # The redone steps are the first attempt's steps 6 and 7 and its tail: a fraction of its step time.
    first = json.loads((run_dir / "goodput" / "launch_1_attempt_0.json").read_text())
    assert parts["redone"] < first["step_s"]
    line = re.search(
        r"^launcher: goodput (\d+\.\d)%: lost (\d+) s to 1 restart, \d+ s to checkpoints, \d+ s to start-up", result.stdout, re.M
    )
    assert line is not None, result.stdout[-2000:]
    assert float(line[1]) == pytest.approx(100 * ledger["goodput"], abs=0.06)
    assert line[0] in (run_dir / "logs" / "combined.log").read_text()
    launch = json.loads((run_dir / "goodput" / "launch_1.json").read_text())
    assert [a["attempt"] for a in launch["attempts"]] == [0, 1] and launch["attempts"][0]["failed"] is not None
    assert launch["attempts"][1]["failed"] is None and launch["ended"] >= launch["attempts"][1]["ended"]
    logged = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "goodput"]
    assert [r["step"] for r in logged] == list(range(8)) + list(range(6, 12))  # every logging step of both attempts
    assert logged[-1]["restart_s"] > 0 and logged[-1]["redone_s"] > 0


def test_a_command_of_ones_own_keeps_no_ledger(tmp_path, script):
    run_dir = tmp_path / "run"
    result = run_launcher("--nproc", "1", "--run-dir", str(run_dir), "--", *script("print('hello')"))
    assert result.returncode == 0, result.stdout
    assert not (run_dir / "goodput").exists() and "goodput" not in result.stdout
    assert not Path(run_dir / "goodput.json").exists()


def test_a_launch_finishes_past_damaged_records_saying_each_once(tmp_path):
    damaged_records(tmp_path)
    said: list[str] = []
    ledger = LaunchLedger(tmp_path, started=100.0, say=said.append)
    assert ledger.number == 5
    ledger.spawned(0)
    ledger.ended(0, failed=None)
    assert ledger.finish() is not None  # the good records' summary line
    assert len(said) == len(DAMAGED) and all(line.startswith("warning: goodput: skipping ") for line in said)
    assert json.loads((tmp_path / "goodput.json").read_text())["wall_s"] > 0


def test_a_ledger_that_cannot_be_combined_ends_the_launch_without_it_said_once(tmp_path, monkeypatch):
    problem = "unsupported operand type(s) for -: 'str' and 'float'"

    def broken(*args, **kwargs):
        raise TypeError(problem)  # whatever combining a record it did not foresee raises

    monkeypatch.setattr(goodput, "combine", broken)
    said: list[str] = []
    ledger = LaunchLedger(tmp_path, started=100.0, say=said.append)
    ledger.spawned(0)
    ledger.ended(0, failed=None)
    assert ledger.finish() is None
    assert said == [f"warning: goodput: cannot write the ledger in {tmp_path}: {problem}; the run goes on without it"]


def test_an_unreadable_goodput_directory_leaves_the_launch_without_a_ledger(tmp_path, monkeypatch):
    (tmp_path / "goodput").mkdir()
    unreadable_goodput_dir(monkeypatch)
    said: list[str] = []
    ledger = LaunchLedger(tmp_path, started=100.0, say=said.append)
    assert ledger.number is None and ledger.env() == {}  # the workers keep none either
    ledger.spawned(0)
    ledger.ended(0, failed=None)
    assert ledger.finish() is None
    assert len(said) == 1 and said[0].startswith(f"warning: goodput: cannot list {tmp_path / 'goodput'}: Permission denied")
    assert not (tmp_path / "goodput.json").exists()


def test_every_round_of_a_job_that_restarts_is_an_attempt_of_node_0s_one_launch(tmp_path, monkeypatch):
    told: list[LaunchLedger | None] = []

    def run_owned(*args, **kwargs):
        (ledger,) = args[10:]
        told.append(ledger)
        ledger.spawned(args[8].count)
        ledger.ended(args[8].count, failed=None)
        return 0, None

    monkeypatch.setattr(launch, "run_owned", run_owned)
    job = JobLedger()
    rounds = launch.restarting_job(None, None, [], SimpleNamespace(placement=None), None, None, job)
    for number in range(2):
        rounds.attempt(None, None, tmp_path, 0, launch.Restarts(number, 1), lambda: None)
    assert told[0] is told[1] is not None and told[0].run_dir == tmp_path
    record = json.loads((tmp_path / "goodput" / "launch_1.json").read_text())
    assert [a["attempt"] for a in record["attempts"]] == [0, 1]
    assert goodput.restarts_of([record], []) == 1
    job.finish()
    assert json.loads((tmp_path / "goodput" / "launch_1.json").read_text())["ended"] is not None


@pytest.mark.slow
def test_two_nodes_restarting_keep_one_ledger_on_node_0_with_the_backoff_and_the_regrouping_as_restart(tmp_path, processes):
    run_dir = tmp_path / "run"
    options = ["--max-steps", "6", "--set", "training.checkpoint_interval=2", "--max-restarts", "1"]
    options += ["--restart-backoff", "2", "--node-timeout", "1", "--kill-grace", "2"]
    nodes = start_nodes(
        tmp_path, processes, train_options(tmp_path, run_dir, *options), env=launcher_env(PRETRAIN_FAULTS="0:1:3:sigkill")
    )
    assert [run.wait(timeout=240) for run in nodes] == [0, 0], nodes[0].text[-3000:] + nodes[1].text[-3000:]
    assert sorted(path.name for path in (run_dir / "goodput").iterdir()) == [
        "launch_1.json",
        "launch_1_attempt_0.json",
        "launch_1_attempt_1.json",
    ]
    launch_record = json.loads((run_dir / "goodput" / "launch_1.json").read_text())
    assert [a["attempt"] for a in launch_record["attempts"]] == [0, 1] and launch_record["ended"] is not None
    ledger = json.loads((run_dir / "goodput.json").read_text())
    parts = ledger["parts_s"]
    assert abs(sum(parts.values()) - ledger["wall_s"]) <= 0.02 * ledger["wall_s"]
    assert parts["restart"] >= 2.0, parts  # the backoff, and the teardown and the next round around it
    assert parts["redone"] > 0 and parts["startup"] > 0 and parts["productive"] > 0
    assert parts["other"] <= 0.1 * ledger["wall_s"], parts
    line = re.search(r"^launcher: goodput (\d+\.\d)%: lost (\d+) s to 1 restart, ", nodes[0].text, re.M)
    assert line is not None, nodes[0].text[-2000:]
    assert float(line[1]) == pytest.approx(100 * ledger["goodput"], abs=0.06)
    assert "launcher: goodput" not in nodes[1].text
