"""Scoring a model on HellaSwag: the command (python -m pretrain.evaluate) on a real checkpoint, and
the same scoring during training (evaluation.data), run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.processes import ROOT, launcher_env
from support.runs import assert_one_line_error, run_in_process, run_launcher
from pretrain import config as cfg
from pretrain.evaluation.choices import score
from pretrain.data.tokenizer import ByteTokenizer
from pretrain.evaluation.evaluate import main
from pretrain.checkpoint.reading import read_checkpoint
from pretrain.evaluation.generate import load_model
from pretrain.evaluation.hellaswag import encode, load, longest_row
from pretrain.observe.metrics import read_metrics
from support.evaluation import saved  # noqa: F401 (a fixture)
from support.evaluation import EXAMPLES, write_examples


def expected_result(checkpoint: Path, data: Path) -> tuple[int, int]:
    """(correct, correct_norm) of the checkpoint's model on data, scored here in this process."""
    config, state = read_checkpoint(checkpoint)
    model = load_model(config, state, torch.device("cpu"))
    encoded = encode(load(str(data)), ByteTokenizer(), cfg.max_seq_len(config))
    tally = score(model, encoded, torch.device("cpu"), length=longest_row(encoded))
    return tally.correct, tally.correct_norm


def run_cli(argv: list[str], capsys) -> subprocess.CompletedProcess:
    return run_in_process(main, argv, capsys)


# --- the command -----------------------------------------------------------------------------------


def test_the_command_scores_a_small_file_in_one_line_and_as_json(saved, tmp_path, capsys):
    data = write_examples(tmp_path / "val.jsonl", EXAMPLES[:3])
    result = run_cli(
        ["--checkpoint", str(saved), "--task", "hellaswag", "--data", str(data), "--output", str(tmp_path / "r.json")],
        capsys,
    )
    assert result.returncode == 0, result.stderr
    scored = json.loads((tmp_path / "r.json").read_text())
    correct, correct_norm = expected_result(saved, data)
    assert (scored["examples"], scored["correct"], scored["correct_norm"], scored["step"]) == (3, correct, correct_norm, 1)
    assert scored["accuracy"] == pytest.approx(correct / 3)
    assert result.stdout == (
        f"HellaSwag | checkpoint step_1 | 3 examples | Accuracy: {correct / 3:.4f} ({correct}/3) | "
        f"Normalized: {correct_norm / 3:.4f} ({correct_norm}/3)\n"
    )


def test_the_command_takes_a_run_directory_and_the_first_examples_only(saved, tmp_path, capsys):
    data = write_examples(tmp_path / "val.jsonl")
    result = run_cli(["--checkpoint", str(saved.parent.parent), "--data", str(data), "--max-examples", "2"], capsys)
    assert result.returncode == 0, result.stderr
    assert " | 2 examples | " in result.stdout


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        ('{"ctx": "a", "endings": ["b"], "label": 0}\n', ["line 1: endings must be a list of 4 texts"]),
        ('{"text": "not hellaswag"}\n', ["line 1 has no ctx, endings, label"]),
    ],
)
def test_a_file_with_the_wrong_fields_is_refused_in_one_line(saved, tmp_path, capsys, content, fragments):
    (tmp_path / "bad.jsonl").write_text(content)
    result = run_cli(
        ["--checkpoint", str(saved), "--data", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "r.json")],
        capsys,
    )
    assert_one_line_error(result, *fragments, prefix="evaluate: error: ")
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--task", "mmlu"], "argument --task: invalid choice: 'mmlu'"),
        (["--max-examples", "-1"], "--max-examples must be 0 (all) or positive"),
        (["--batch-examples", "0"], "--batch-examples must be at least 1"),
    ],
)
def test_bad_options_are_one_line_errors(saved, tmp_path, capsys, args, fragment):
    data = write_examples(tmp_path / "val.jsonl")
    assert_one_line_error(
        run_cli(["--checkpoint", str(saved), "--data", str(data), *args], capsys), fragment, prefix="evaluate: error: "
    )


def test_a_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    data = write_examples(tmp_path / "val.jsonl")
    result = run_cli(["--checkpoint", str(tmp_path / "nowhere"), "--data", str(data)], capsys)
    assert_one_line_error(result, "--checkpoint", prefix="evaluate: error: ")


# --- during training ---------------------------------------------------------------------------------


def test_a_bad_benchmark_file_stops_the_launch_before_any_worker_starts(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"ctx": "a", "endings": ["b", "c", "d", "e"]}\n')
    result = run_launcher("--debug", "--run-dir", str(tmp_path / "run"), "--set", f"evaluation.data={tmp_path / 'bad.jsonl'}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "evaluation.data: " in result.stderr and "line 1 has no label" in result.stderr
    assert "Traceback" not in result.stderr and "CPU0:" not in result.stdout
    assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.slow
def test_fsdp_ranks_score_their_shares_during_training_and_match_the_command_on_the_last_checkpoint(tmp_path):
    """5 examples on 2 ranks one at a time: rank 1 runs a padding batch to keep FSDP's gathers in
    step. The last score is the final model's, which the command scores again from its checkpoint."""
    data = write_examples(tmp_path / "val.jsonl")
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "--debug",
            "--run-dir",
            str(run_dir),
            "--max-steps",
            "6",
            "--set",
            f"data.cache_dir={tmp_path / 'cache'}",
            "--set",
            "data.context_length=64",
            "--set",
            "training.parallelism=fsdp",
            "--set",
            "evaluation.data=" + str(data.relative_to(tmp_path)),
            "--set",
            "evaluation.interval=4",
            "--set",
            "evaluation.batch_examples=1",
        ],
        cwd=tmp_path,  # a relative evaluation.data, as a user types it
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FSDP" in result.stdout
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "hellaswag"]
    assert [(r["step"], r["examples"]) for r in records] == [(0, 5), (4, 5), (6, 5)]  # from step 0, and the last
    correct, correct_norm = expected_result(run_dir / "checkpoints" / "step_6", data)
    assert (records[-1]["accuracy"], records[-1]["accuracy_norm"]) == (
        pytest.approx(correct / 5),
        pytest.approx(correct_norm / 5),
    )
    assert f"CPU0:INFO | [CPU 0] HellaSwag | Step [6/6] | 5 examples | Accuracy: {correct / 5:.4f} ({correct}/5)" in result.stdout
    config = json.loads((run_dir / "config.json").read_text())
    assert config["evaluation"]["data"] == str(data)  # made absolute: a resume from elsewhere finds it
    plotted = subprocess.run(
        [sys.executable, "-m", "pretrain.plot", str(run_dir)],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plotted.returncode == 0, plotted.stderr
