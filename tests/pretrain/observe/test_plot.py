"""The plot command: python -m pretrain.plot RUN_DIR [--output PATH], run as a user runs it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from support.processes import ROOT
from support.runs import assert_one_line_error
from pretrain.observe.metrics import MetricsLog
from pretrain.observe.plot import latest_by_step, load_records, plot_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_plot(*args: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    pythonpath = f"{extra_path}:{ROOT}" if extra_path else str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "pretrain.plot", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=pythonpath),
    )


def write_run(run_dir: Path, steps: int = 30, val_every: int = 10) -> Path:
    """A run's metrics.jsonl: train records every step, validation every val_every."""
    with MetricsLog(run_dir, enabled=True, tensorboard=False) as log:
        for step in range(steps):
            log.log_train(
                step, 5.0 - 0.1 * step, 1e-3 * min(1.0, (step + 1) / 5), 1.0 / (step + 1), 10_000.0, None, None, float(step)
            )
            if step % val_every == val_every - 1:
                log.log_val(step, 5.2 - 0.1 * step)
    return run_dir


def assert_valid_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert path.stat().st_size > 20_000  # three panels of lines and labels, not an empty canvas
    height, width, channels = matplotlib.image.imread(path).shape
    assert height > 400 and width > 400 and channels in (3, 4)


def test_the_plot_is_written_into_the_run_directory_by_default(tmp_path):
    run_dir = write_run(tmp_path / "run")
    result = run_plot(run_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(run_dir / "metrics.png")
    assert_valid_png(run_dir / "metrics.png")
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "metrics.png"]  # no temp file left


def test_the_plot_is_readable_by_everyone_like_the_runs_other_files(tmp_path):
    run_dir = write_run(tmp_path / "run", steps=3)
    output = plot_metrics(load_records(run_dir), run_dir / "metrics.png")
    assert stat.S_IMODE(output.stat().st_mode) == 0o644  # not the 0600 of a temporary file
    assert output.read_bytes()[:8] == PNG_SIGNATURE


def test_the_output_option_chooses_the_path_and_creates_its_directory(tmp_path):
    run_dir = write_run(tmp_path / "run")
    output = tmp_path / "plots" / "loss.png"
    result = run_plot(run_dir, "--output", output)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(output)
    assert_valid_png(output)
    assert not (run_dir / "metrics.png").exists()
    assert [p.name for p in output.parent.iterdir()] == ["loss.png"]


def test_a_run_whose_last_line_is_being_written_still_plots(tmp_path):
    run_dir = write_run(tmp_path / "run")
    with open(run_dir / "metrics.jsonl", "a") as out:
        out.write('{"kind": "train", "step": 30, "lo')
    result = run_plot(run_dir)
    assert result.returncode == 0, result.stderr
    assert_valid_png(run_dir / "metrics.png")


def test_repeated_steps_of_a_resumed_run_keep_the_later_record():
    records = [
        {"kind": "train", "step": 0, "loss": 5.0},
        {"kind": "train", "step": 1, "loss": 4.0},
        {"kind": "val", "step": 1, "val_loss": 4.5},
        {"kind": "train", "step": 1, "loss": 3.9},
        {"kind": "train", "step": 2, "loss": 3.5},
    ]
    assert [(r["step"], r["loss"]) for r in latest_by_step(records, "train")] == [(0, 5.0), (1, 3.9), (2, 3.5)]
    assert latest_by_step(records, "val") == [{"kind": "val", "step": 1, "val_loss": 4.5}]


def test_a_missing_run_directory_is_a_one_line_error(tmp_path):
    assert_one_line_error(run_plot(tmp_path / "nowhere"), "nowhere", "no such run directory")


def test_a_run_without_metrics_says_who_writes_them(tmp_path):
    (tmp_path / "run").mkdir()
    assert_one_line_error(run_plot(tmp_path / "run"), "no metrics.jsonl: it is written by rank 0 during training")


def test_a_run_with_only_validation_records_has_nothing_to_plot(tmp_path):
    with MetricsLog(tmp_path, enabled=True, tensorboard=False) as log:
        log.log_val(0, 5.0)
    assert_one_line_error(run_plot(tmp_path), "no train records")
    assert not (tmp_path / "metrics.png").exists()


def test_a_corrupt_metrics_file_is_a_one_line_error_naming_the_line(tmp_path):
    run_dir = write_run(tmp_path / "run", steps=3)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert_one_line_error(run_plot(run_dir), "line 2")


def test_without_matplotlib_the_error_says_how_to_install_it(tmp_path):
    run_dir = write_run(tmp_path / "run", steps=3)
    shim = tmp_path / "no_matplotlib"
    (shim / "matplotlib").mkdir(parents=True)
    (shim / "matplotlib" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'matplotlib'\")\n")
    assert_one_line_error(run_plot(run_dir, extra_path=shim), "pip install matplotlib")
    assert not (run_dir / "metrics.png").exists()


def test_importing_the_plot_command_imports_neither_matplotlib_nor_torch():
    code = "import sys, pretrain.observe.plot; print(sorted({'matplotlib', 'torch'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_run_that_scored_hellaswag_gets_a_fourth_panel_for_its_accuracy(tmp_path):
    import matplotlib.image

    from pretrain.evaluation.hellaswag import Tally

    plain = plot_metrics(load_records(write_run(tmp_path / "plain")), tmp_path / "plain.png")
    run_dir = write_run(tmp_path / "run")
    with MetricsLog(run_dir, enabled=True, tensorboard=False) as log:
        for step, correct in [(0, 25), (10, 28), (30, 31)]:  # from step 0 to the last, 30
            log.log_task("hellaswag", step, Tally(100, correct - 2, correct))
    records = [r for r in load_records(run_dir) if r["kind"] == "hellaswag"]
    assert [(r["step"], r["accuracy"], r["accuracy_norm"]) for r in records][-1] == (30, 0.29, 0.31)
    with_task = plot_metrics(load_records(run_dir), tmp_path / "task.png")
    plain_height, width, _ = matplotlib.image.imread(plain).shape
    task_height, task_width, _ = matplotlib.image.imread(with_task).shape
    assert task_width == width and task_height == plain_height * 4 // 3  # one more panel of the same height
