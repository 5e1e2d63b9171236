"""benchmarks/checkpoints.py, the checkpoint stall and goodput benchmark: what it reads from a run's
metrics.jsonl, goodput.json and output, the medians and the ratio against the synchronous row, the
JSON and Markdown, how it launches its runs, and that it starts as the docs run it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import checkpoints  # noqa: E402
from benchmarks import checkpoints_report as report  # noqa: E402
from benchmarks.checkpoints_report import Save, StallResult  # noqa: E402


def record(step: int, stall: float, write: float, is_async: bool = True, tier: str = "durable") -> str:
    return json.dumps(
        {
            "checkpoint": {
                "step": step,
                "tier": tier,
                "async": is_async,
                "stall_s": stall,
                "write_s": write,
                "path": f"/r/step_{step}",
            }
        }
    )


METRICS = [
    json.dumps({"kind": "train", "step": 0, "loss": 11.0}),
    record(3, 0.2, 4.0),
    record(5, 0.01, 0.02, tier="local"),
    record(6, 0.4, 5.0),
    '{"checkpoint": {"step": 9, "tier": "durable", "async": tr',  # a killed writer's half line
    record(9, 0.3, 4.5),
    record(10, 6.0, 6.0),  # the end of the run waits for its save
]


def test_the_per_save_records_are_read_from_metrics_lines_and_other_lines_skipped():
    saves = report.saves_in(METRICS)
    assert [s.step for s in saves] == [3, 5, 6, 9, 10]
    assert saves[0] == Save(3, "durable", True, 0.2, 4.0) and saves[1].tier == "local"


def test_the_medians_take_the_periodic_durable_saves_after_the_first_and_leave_out_the_end_of_run_save():
    kept, warning = report.periodic(report.saves_in(METRICS), 10, "async")
    assert [s.step for s in kept] == [3, 6, 9] and warning == ""
    result = StallResult("small", "fsdp", 2, "async", 0, kept, 30.0)
    assert result.first_stall_s == pytest.approx(0.2)  # the staging copy's allocation, set apart
    assert result.stall_s == pytest.approx(0.35) and result.write_s == pytest.approx(4.75)
    alone = StallResult("small", "fsdp", 2, "async", 0, kept[:1])
    assert alone.stall_s == alone.first_stall_s == pytest.approx(0.2)


def test_a_save_that_ran_in_the_other_mode_than_the_row_asked_is_named():
    kept, warning = report.periodic(report.saves_in(METRICS), 10, "sync")
    assert len(kept) == 3 and warning == "save(s) at step 3, 6, 9 ran async"


def test_the_async_row_shows_its_stall_as_a_share_of_the_sync_rows_and_flags_one_above_ten_percent():
    sync_saves = [Save(3, "durable", False, 9.0, 9.0), Save(6, "durable", False, 4.0, 4.0), Save(9, "durable", False, 5.0, 5.0)]
    sync = StallResult("small", "ddp", 2, "sync", 0, sync_saves)
    fast = StallResult("small", "ddp", 2, "async", 0, [Save(3, "durable", True, 0.2, 4.4)])
    slow = StallResult("small", "fsdp", 2, "async", 0, [Save(3, "durable", True, 1.0, 4.4)])
    slow_sync = StallResult("small", "fsdp", 2, "sync", 0, [Save(3, "durable", False, 5.0, 5.0)])
    results = [sync, fast, slow_sync, slow]
    assert report.ratio_of(fast, results) == pytest.approx(0.2 / 4.5) and report.ratio_of(sync, results) is None
    cells = report.stall_cells(fast, results)
    assert cells[4:9] == ["1", "0.200", "0.200", "4.400", "4.4%"]
    assert report.stall_cells(sync, results)[4:7] == ["3", "9.000", "4.500 (4.000–5.000)"]
    assert report.stall_cells(slow, results)[8] == "20.0% (above 10%)"
    assert report.verdict(results) == (
        "Async stall / sync stall, `small` on 2 ranks (target at most 10%): ddp: 4.4% (met); fsdp: 20.0% (NOT met)."
    )


def test_a_failed_run_without_saves_shows_its_exit_and_dashes():
    failed = StallResult("debug", "ddp", 2, "async", None, [], None, "no save recorded in metrics.jsonl")
    cells = report.stall_cells(failed, [failed])
    assert cells[3] == "async (no save recorded in metrics.jsonl)" and cells[4] == "0; exit timeout"
    assert cells[5:] == ["—", "—", "—", "—", "—"]


def test_the_json_rows_carry_the_issues_keys_and_the_saves_behind_the_medians(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(METRICS) + "\n")
    kept, _ = report.periodic(report.read_saves(tmp_path), 10, "async")
    data = report.json_report([StallResult("small", "fsdp", 2, "async", 0, kept, 31.5)], [], {"machine": "m"})
    row = data["rows"][0]
    assert {k: row[k] for k in ("preset", "parallelism", "ranks", "mode", "stall_s", "write_s")} == {
        "preset": "small",
        "parallelism": "fsdp",
        "ranks": 2,
        "mode": "async",
        "stall_s": pytest.approx(0.35),
        "write_s": pytest.approx(4.75),
    }
    assert row["first_stall_s"] == pytest.approx(0.2)
    assert [s["step"] for s in row["saves"]] == [3, 6, 9] and data["goodput"] == [] and data["machine"] == "m"
    json.dumps(data)  # serialisable as written


def test_the_goodput_row_reads_goodput_json_and_checks_the_parts_against_the_wall_time(tmp_path):
    parts = {
        "productive": 60.0,
        "redone": 5.0,
        "startup": 10.0,
        "checkpoint_stall": 2.0,
        "evaluation": 1.0,
        "restart": 20.0,
        "other": 2.0,
    }
    (tmp_path / "goodput.json").write_text(json.dumps({"wall_s": 100.0, "goodput": 0.6, "parts_s": parts}))
    result = report.GoodputResult("durable only", False, 0, report.read_goodput(tmp_path), [50, 100, 150])
    cells = report.goodput_cells(result)
    assert cells[:5] == ["durable only", "0", "step_50, step_100, step_150", "100.0", "60.0%"]
    assert cells[5:12] == ["60.0", "5.0", "10.0", "2.0", "1.0", "20.0", "2.0"] and cells[12] == "1.000"
    assert result.row()["parts_s"] == parts
    assert report.read_goodput(tmp_path / "absent") is None
    assert report.goodput_cells(report.GoodputResult("x", True, None, None))[1:5] == ["timeout", "—", "—", "—"]


def test_the_steps_resumed_at_are_one_workers_and_the_training_time_rank_zeros():
    output = "\n".join(
        [
            "CPU0:INFO | [CPU 0] Resumed from /r/checkpoints/step_50 at step 50",
            "CPU1:INFO | [CPU 1] Resumed from /r/checkpoints/step_50 at step 50",
            "launcher:   INFO | [CPU 1] Resumed from /r/checkpoints/step_0 at step 0",  # a summary's quote
            "CPU0:INFO | [CPU 0] Resumed from /dev/shm/x/step_120 at step 120",
            "CPU1:INFO | [CPU 1] Training complete: 10 steps in 44.0s, final loss 6.4",
            "CPU0:INFO | [CPU 0] Training complete: 10 steps in 42.5s, final loss 6.4; checkpoint /r/step_10",
        ]
    )
    assert report.resumed_steps(output) == [50, 120]
    assert report.trained_seconds(output) == 42.5 and report.trained_seconds("nothing") is None


def test_the_goodput_runs_kill_rank_one_every_interval_in_successive_attempts_with_a_restart_each(tmp_path):
    args = checkpoints.parse_args([])
    assert checkpoints.faults(args) == "0:1:60:sigkill,1:1:120:sigkill,2:1:180:sigkill"
    plain = checkpoints.goodput_argv(False, args, tmp_path / "run", tmp_path / "local")
    local = checkpoints.goodput_argv(True, args, tmp_path / "run", tmp_path / "local")
    assert plain[plain.index("--max-restarts") + 1] == "3" and plain[plain.index("--max-steps") + 1] == "200"
    assert "training.checkpoint_interval=50" in plain and "--local-checkpoint-dir" not in plain
    assert "training.local_checkpoint_interval=10" in local and local[local.index("--local-checkpoint-dir") + 1] == str(
        tmp_path / "local"
    )


def test_the_stall_runs_set_the_mode_and_keep_smalls_model_on_a_short_cpu_step(tmp_path):
    args = checkpoints.parse_args(["--quick"])
    cases = checkpoints.stall_cases(args.quick)
    assert [(c.preset, c.parallelism, c.mode) for c in cases] == [("small", "fsdp", "sync"), ("small", "fsdp", "async")]
    assert len(checkpoints.stall_cases(False)) == 8
    sync, asynchronous = (checkpoints.stall_argv(case, args, tmp_path) for case in cases)
    assert "training.async_checkpoint=false" in sync and "training.async_checkpoint=true" in asynchronous
    assert "training.parallelism=fsdp" in sync and "data.source=builtin" in sync
    assert not any(item.startswith("model.") for item in sync)  # the checkpoint is small's own
    debug = checkpoints.stall_argv(checkpoints.StallCase("debug", "ddp", "sync"), args, tmp_path)
    assert "data.source=builtin" not in debug and "training.checkpoint_interval=4" in debug
    # --saves periodic saves, the last a whole interval before the end (whose save would wait for it)
    assert debug[debug.index("--max-steps") + 1] == "20" and sync[sync.index("--max-steps") + 1] == "25"


@pytest.mark.parametrize(
    "argv",
    [
        ["--small-interval", "0"],
        ["--presets", "small,tiny"],
        ["--local-interval", "50"],
        ["--kill-every", "200"],
        ["--saves", "0"],
    ],
)
def test_a_schedule_that_could_not_measure_is_refused_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        checkpoints.parse_args(argv)
    assert stopped.value.code == 2 and re.search(r"error: (argument )?--", capsys.readouterr().err)


def test_the_benchmark_run_as_a_script_answers_help():
    result = subprocess.run(
        [sys.executable, str(Path("benchmarks") / "checkpoints.py"), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout and "--json" in result.stdout


def test_the_stall_cases_follow_the_chosen_presets_and_quick_runs_no_goodput():
    assert [(c.preset, c.parallelism) for c in checkpoints.stall_cases(False, ["debug"], ["fsdp"])] == [("debug", "fsdp")] * 2
    assert checkpoints.parse_args(["--quick"]).goodput is False and checkpoints.parse_args([]).goodput is True
    assert checkpoints.parse_args(["--presets", "debug", "--no-goodput"]).presets == ["debug"]


def test_a_tiny_debug_run_gives_a_row_from_the_writers_own_records(tmp_path, monkeypatch):
    monkeypatch.setenv("PRETRAIN_CACHE_DIR", str(tmp_path / "cache"))
    args = checkpoints.parse_args(["--saves", "2", "--debug-interval", "2", "--timeout", "120"])
    result = checkpoints.run_stall(checkpoints.StallCase("debug", "fsdp", "async"), args, tmp_path / "work")
    assert result.exit_code == 0 and result.warning == ""
    assert [s.step for s in result.saves] == [2, 4] and all(s.is_async and s.tier == "durable" for s in result.saves)
    assert result.stall_s is not None and result.write_s is not None and 0 <= result.stall_s <= result.write_s
    assert result.trained_s is not None and result.trained_s > 0
