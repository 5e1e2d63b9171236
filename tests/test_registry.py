"""pretrain/registry.py: a config names an optimizer, a schedule and a feed-forward block; one
registry line adds another, and the optimizer, the memory estimate, the parameter count and the
checkpoint follow it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from pretrain import config as cfg
from pretrain import registry
from pretrain.checkpoint import CheckpointError, check_same_optimizer
from pretrain.memory import estimate, parameter_count
from pretrain.model import Transformer
from pretrain.optim import build_optimizer
from pretrain.schedule import lr_at


def build_sgd(model: torch.nn.Module, training: cfg.TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=training.learning_rate)


def constant(step: int, training: cfg.TrainingConfig) -> float:
    return training.learning_rate


class Linear2(torch.nn.Module):
    """A feed-forward block of two plain projections (2 x dim x ffn_dim parameters)."""

    def __init__(self, model: cfg.ModelConfig) -> None:
        super().__init__()
        self.up = torch.nn.Linear(model.dim, model.ffn_dim, bias=False)
        self.down = torch.nn.Linear(model.ffn_dim, model.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def residual_outputs(self) -> list[torch.nn.Module]:
        return [self.down]


@pytest.fixture
def registered(monkeypatch) -> None:
    """One more optimizer, schedule and feed-forward block, each a single registry entry."""
    monkeypatch.setitem(registry.OPTIMIZERS, "sgd", registry.OptimizerKind(f"{__name__}:build_sgd", 0))
    monkeypatch.setitem(registry.LR_SCHEDULES, "constant", f"{__name__}:constant")
    monkeypatch.setitem(
        registry.FEED_FORWARDS,
        "linear2",
        registry.FeedForwardKind(
            f"{__name__}:Linear2", parameters=lambda m: 2 * m.dim * m.ffn_dim, saved_per_token=lambda m: 2 * m.ffn_dim
        ),
    )


def test_the_defaults_are_adamw_cosine_and_swiglu():
    config = cfg.debug()
    assert (config.training.optimizer, config.training.lr_schedule, config.model.ffn) == ("adamw", "cosine", "swiglu")
    model = Transformer(dataclasses.replace(config.model, vocab_size=257), max_seq_len=8)
    assert type(build_optimizer(model, config.training, torch.device("cpu"))) is torch.optim.AdamW
    assert type(model.layers[0].feed_forward).__name__ == "SwiGLU"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("training.optimizer", "adam", "training.optimizer: unknown name 'adam' (did you mean 'adamw'?); choose one of adamw"),
        ("training.lr_schedule", "linear", "training.lr_schedule: unknown name 'linear'; choose one of cosine"),
        ("model.ffn", "swiglu2", "model.ffn: unknown name 'swiglu2' (did you mean 'swiglu'?); choose one of swiglu"),
    ],
)
def test_a_name_that_is_not_registered_is_refused_naming_the_choices(key, value, message):
    with pytest.raises(cfg.ConfigError) as error:
        cfg.resolve("debug", sets=[f"{key}={value}"])
    assert message in str(error.value)


def test_a_name_that_is_not_registered_is_refused_in_one_line_by_the_launcher(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--debug", "--set", "training.optimizer=lion"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "unknown name 'lion'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_registered_optimizer_schedule_and_feed_forward_are_what_training_builds(registered):
    config = cfg.debug()
    training = dataclasses.replace(config.training, optimizer="sgd", lr_schedule="constant", learning_rate=0.5)
    model_config = dataclasses.replace(config.model, ffn="linear2", vocab_size=257)
    model = Transformer(model_config, max_seq_len=8)
    assert type(build_optimizer(model, training, torch.device("cpu"))) is torch.optim.SGD
    assert [lr_at(step, training) for step in (0, 5, 9)] == [0.5, 0.5, 0.5]
    assert type(model.layers[1].feed_forward) is Linear2
    assert parameter_count(model_config) == model.num_params()


def test_the_memory_estimate_takes_the_optimizers_state_size_from_the_registry(registered):
    config = cfg.production()
    stateless = dataclasses.replace(config, training=dataclasses.replace(config.training, optimizer="sgd"))
    assert estimate(config, 8, "fsdp").optimizer == -(-8 * parameter_count(config.model) // 8)
    assert estimate(stateless, 8, "fsdp").optimizer == 0
    assert estimate(stateless, 8, "fsdp").weights == estimate(config, 8, "fsdp").weights


def test_resuming_with_another_optimizer_is_refused_naming_the_one_to_use(registered, tmp_path):
    adamw, sgd = cfg.TrainingConfig(), cfg.TrainingConfig(optimizer="sgd")
    check_same_optimizer(tmp_path, adamw, adamw)  # the same: nothing to say
    with pytest.raises(
        CheckpointError,
        match="trained with training.optimizer=adamw, not sgd; resume with --set training.optimizer=adamw or start fresh",
    ):
        check_same_optimizer(tmp_path, adamw, sgd)
