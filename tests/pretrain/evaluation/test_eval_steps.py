"""Evaluation steps are checkpoint steps: a validation loss or HellaSwag score logged at step N
(the log line, metrics.jsonl, and so TensorBoard, W&B and the plot) is that of the weights after N
steps, the weights checkpoint step_N holds; a fresh run also evaluates at step 0, before training."""

from __future__ import annotations

import json

import pytest
import torch

from support.runs import run_in_process
from pretrain.checkpoint import save_restore
from pretrain.evaluation import task_eval
from pretrain import config as cfg
from pretrain.build import build
from pretrain.data.fitting import fit_to_dataset
from pretrain.data.loader import ValBatch
from pretrain.data.prepare import prepare
from pretrain.evaluation.evaluate import main as evaluate_command
from pretrain.observe.metrics import read_metrics
from pretrain.distributed.runtime import Runtime, setup_logging
from pretrain.train import evaluate, fit, log_evaluations
from support.evaluation import EXAMPLES, write_examples

INTERVAL = 2
STEPS = 4


def config_for(tmp_path, *sets: str) -> cfg.Config:
    data = write_examples(tmp_path / "hellaswag.jsonl", EXAMPLES[:3])
    return cfg.resolve(
        preset="debug",
        sets=[
            f"data.cache_dir={tmp_path / 'cache'}",
            "training.batch_size=2",
            "data.context_length=32",
            "training.eval_batches=1",
            f"training.max_steps={STEPS}",
            f"training.checkpoint_interval={INTERVAL}",
            f"training.eval_interval={INTERVAL}",
            f"evaluation.data={data}",
            f"evaluation.interval={INTERVAL}",
            *sets,
        ],
    )


def built(config: cfg.Config, run_dir):
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")
    dataset = prepare(config.data, log=lambda _: None)
    config, _ = fit_to_dataset(config, dataset, world_size=1)
    trainer = build(config, runtime, dataset, run_dir, setup_logging("CPU 0", "WARNING"))
    trainer.task = task_eval.load_task(config, None)  # the byte tokenizer: no tokenizer file
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step run, checkpoints and evaluations every 2 steps: (config, run directory,
    metrics records)."""
    tmp_path = tmp_path_factory.mktemp("eval_steps")
    config = config_for(tmp_path)
    trainer = built(config, tmp_path / "run")
    with trainer.metrics:
        fit(trainer)
    return config, trainer.run_dir, read_metrics(trainer.run_dir / "metrics.jsonl")


def steps_of(records, kind: str) -> list[int]:
    return [record["step"] for record in records if record["kind"] == kind]


def test_validation_and_hellaswag_are_logged_at_the_checkpoint_steps_and_at_step_zero(trained):
    _, run_dir, records = trained
    saved = sorted(int(path.name.removeprefix("step_")) for path in (run_dir / "checkpoints").iterdir())
    assert saved == [2, 4]
    assert steps_of(records, "val") == steps_of(records, "hellaswag") == [0, *saved]
    assert steps_of(records, "train") == list(range(STEPS))  # the step taken from the weights after N steps


def test_a_validation_loss_logged_at_step_n_is_that_of_checkpoint_step_n(trained, tmp_path):
    config, run_dir, records = trained
    logged = {record["step"]: record["val_loss"] for record in records if record["kind"] == "val"}
    trainer = built(config, tmp_path / "other")  # the same seed: the weights before training
    assert evaluate(trainer) == pytest.approx(logged[0], abs=1e-6)
    for step in (2, 4):
        trainer.model.load_state_dict(save_restore.load_model_state(run_dir / "checkpoints" / f"step_{step}"))
        assert evaluate(trainer) == pytest.approx(logged[step], abs=1e-6), step


def test_a_hellaswag_score_logged_at_step_n_is_what_the_command_gives_for_checkpoint_step_n(trained, tmp_path, capsys):
    config, run_dir, records = trained
    logged = {record["step"]: record for record in records if record["kind"] == "hellaswag"}
    for step in (2, 4):
        output = tmp_path / f"step_{step}.json"
        argv = ["--checkpoint", str(run_dir / "checkpoints" / f"step_{step}"), "--data", config.evaluation.data]
        result = run_in_process(evaluate_command, [*argv, "--output", str(output)], capsys)
        assert result.returncode == 0, result.stderr
        scored = json.loads(output.read_text())
        assert (scored["step"], scored["accuracy"], scored["accuracy_norm"]) == (
            step,
            pytest.approx(logged[step]["accuracy"]),
            pytest.approx(logged[step]["accuracy_norm"]),
        )


@pytest.mark.parametrize(
    ("interval", "data", "due"),
    [(2, True, [0, 2, 4]), (3, True, [0, 3]), (0, True, []), (2, False, [])],
)
def test_the_task_is_due_every_interval_steps_from_step_zero(interval, data, due):
    evaluation = cfg.EvaluationConfig(data="val.jsonl" if data else "", interval=interval)
    config = cfg.Config(evaluation=evaluation)
    assert [steps for steps in range(5) if task_eval.is_due(config, steps)] == due


def test_without_intervals_nothing_is_evaluated_on_the_way(tmp_path):
    config = config_for(tmp_path, "training.eval_interval=0", "evaluation.interval=0")
    trainer = built(config, tmp_path / "run")
    with trainer.metrics:
        for steps in range(STEPS):
            log_evaluations(trainer, steps)
    assert not (trainer.run_dir / "metrics.jsonl").exists() or read_metrics(trainer.run_dir / "metrics.jsonl") == []


def test_validation_weighs_every_window_alike_and_leaves_a_stand_in_batch_out(tmp_path):
    trainer = built(config_for(tmp_path), tmp_path / "run")
    x, y, windows = trainer.val_batches[0]
    assert windows == 2
    whole = evaluate(trainer)
    # A batch of one window and its predecessor of two: the mean is over windows, not over batches.
    trainer.val_batches.append(ValBatch(x[:1], y[:1], 1))
    expected = (2 * whole + evaluate_batches(trainer, [ValBatch(x[:1], y[:1], 1)])) / 3
    assert evaluate(trainer) == pytest.approx(expected, abs=1e-6)
    trainer.val_batches[-1] = ValBatch(torch.zeros_like(x), torch.zeros_like(y), 0)  # a stand-in
    assert evaluate(trainer) == pytest.approx(whole, abs=1e-6)


def evaluate_batches(trainer, batches) -> float:
    kept, trainer.val_batches = trainer.val_batches, batches
    try:
        return evaluate(trainer)
    finally:
        trainer.val_batches = kept
