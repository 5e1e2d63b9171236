"""training.epochs and training.max_steps both set a run's length: the user may give one of
them, never both, and a run set in epochs reaches its workers as steps."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import pytest

from support.runs import run_debug_training, run_launcher
from pretrain import config as cfg
from pretrain.data.fitting import fit_to_dataset
from pretrain.data.prepare import prepare


def from_cli(*argv: str) -> cfg.Config:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    return cfg.from_args(parser.parse_args(list(argv)))


def refusal(*argv: str) -> str:
    with pytest.raises(cfg.ConfigError) as caught:
        from_cli(*argv)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_epochs_and_max_steps_both_on_the_command_line_are_refused_naming_each():
    assert refusal("--debug", "--set", "training.epochs=1", "--max-steps", "3") == (
        "training.epochs=1 (--set) and training.max_steps=3 (--max-steps) both set the run length; keep one of them"
    )
    assert "training.max_steps=7 (--set)" in refusal("--debug", "--set", "training.max_steps=7", "--set", "training.epochs=2")


def test_epochs_in_a_config_file_and_max_steps_on_the_command_line_are_refused(tmp_path):
    in_file = tmp_path / "epochs.json"
    in_file.write_text(json.dumps({"training": {"epochs": 1}}))
    assert refusal("--debug", "--config", str(in_file), "--max-steps", "3").startswith(
        f"training.epochs=1 ({in_file}) and training.max_steps=3 (--max-steps)"
    )
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"training": {"epochs": 2, "max_steps": 50}}))
    assert f"training.max_steps=50 ({both})" in refusal("--debug", "--config", str(both))
    steps_in_file = tmp_path / "steps.json"
    steps_in_file.write_text(json.dumps({"training": {"max_steps": 50}}))
    assert "training.epochs=2 (--set)" in refusal("--debug", "--config", str(steps_in_file), "--set", "training.epochs=2")


def test_epochs_over_the_presets_max_steps_is_the_users_choice():
    config = from_cli("--debug", "--set", "training.epochs=1")
    assert (config.training.epochs, config.training.max_steps) == (1, cfg.debug().training.max_steps)


def test_max_steps_with_epochs_back_at_zero_is_no_conflict(tmp_path):
    in_file = tmp_path / "epochs.json"
    in_file.write_text(json.dumps({"training": {"epochs": 1}}))
    config = from_cli("--debug", "--config", str(in_file), "--set", "training.epochs=0", "--max-steps", "3")
    assert (config.training.epochs, config.training.max_steps) == (0, 3)


def test_max_steps_over_a_presets_epochs_is_the_users_choice(monkeypatch):
    def in_epochs() -> cfg.Config:
        debug = cfg.debug()
        return dataclasses.replace(debug, training=dataclasses.replace(debug.training, epochs=2))

    monkeypatch.setitem(cfg.PRESETS, "debug", in_epochs)
    assert from_cli("--debug").training.epochs == 2
    config = from_cli("--debug", "--max-steps", "3")
    assert (config.training.epochs, config.training.max_steps) == (0, 3)


def test_a_run_set_in_epochs_reaches_its_workers_as_steps_they_accept(tmp_path):
    config = from_cli("--debug", "--set", "training.epochs=1", "--set", f"data.cache_dir={tmp_path / 'cache'}")
    fitted, length = fit_to_dataset(config, prepare(config.data, log=lambda line: None), world_size=2)
    assert (fitted.training.epochs, fitted.training.max_steps) == (0, length.steps_per_epoch)
    cfg.save(fitted, tmp_path / "config.json")
    # What a worker does with the launcher's config: a file that sets both keys, one of them 0.
    assert from_cli("--config", str(tmp_path / "config.json")) == fitted


def test_a_config_saved_by_an_earlier_run_in_epochs_still_loads(tmp_path):
    debug = cfg.debug()
    earlier = dataclasses.replace(debug, training=dataclasses.replace(debug.training, epochs=1, max_steps=221))
    cfg.save(earlier, tmp_path / "config.json")  # as runs saved them before epochs became 0 there
    assert cfg.load(tmp_path / "config.json") == earlier


def test_the_launcher_refuses_conflicting_run_lengths_in_one_line_and_starts_nothing(tmp_path):
    result = run_launcher(
        "--debug",
        "--device",
        "cpu",
        "--max-steps",
        "3",
        "--set",
        "training.epochs=1",
        "--run-dir",
        str(tmp_path / "r"),
        timeout=60,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "launcher: error: training.epochs=1 (--set) and training.max_steps=3 (--max-steps) "
        "both set the run length; keep one of them\n"
    )
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_run_in_epochs_shows_them_in_the_step_line_and_saves_a_checkpoint_at_each_epochs_end(tmp_path):
    run_dir = tmp_path / "run"
    result = run_debug_training(
        tmp_path,
        ["-m", "launcher", "--device", "cpu"],
        run_dir,
        "--set",
        "training.epochs=2",
        "--set",
        "training.batch_size=32",
        "--set",
        "data.max_samples=3",  # 3 steps an epoch: 2 epochs in 6 steps
    )
    (first,) = re.findall(r"CPU0:INFO \| \[CPU 0\] Epoch 1 of 2 done; checkpoint saved to \S+/step_(\d+)", result.stdout)
    per_epoch = int(first)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == sorted([f"step_{per_epoch}", f"step_{2 * per_epoch}"])
    epochs = re.findall(r"CPU0:INFO \| \[CPU 0\] Step \[(\d+)/(\d+)\] \| Epoch: (\d+\.\d\d)/2 \| Loss", result.stdout)
    assert int(epochs[-1][1]) == 2 * per_epoch and epochs[-1][2] == "2.00"
    assert [float(e) for _, _, e in epochs] == sorted(float(e) for _, _, e in epochs)
