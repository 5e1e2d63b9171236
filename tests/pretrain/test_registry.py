"""pretrain/registry.py: a config names an optimizer, a schedule, a feed-forward block, a text
format and a tokenizer; one registry line adds another, and training, the memory estimate, the
parameter count, the checkpoint and data preparation follow it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from support.feed_forwards import Linear2
from support.processes import ROOT
from support.runs import all_tokens, data_config, prepared
from pretrain import config as cfg
from pretrain import registry
from pretrain.checkpoint.save_restore import CheckpointError, check_same_model, check_same_optimizer
from pretrain.data.token_budget import estimated_tokens
from pretrain.data.prepare import read_meta
from pretrain.data.sources import Piece
from pretrain.data.tokenizer import BYTE_EOT, ByteRecipe, ByteTokenizer
from pretrain.hf.export import parameter_naming
from pretrain.plan.gpu_memory import estimate, parameter_count
from pretrain.observe.metrics import flops_per_token
from pretrain.model.transformer import Transformer
from pretrain.optim.optimizers import build_optimizer
from pretrain.optim.schedule import lr_at


def build_sgd(model: torch.nn.Module, training: cfg.TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=training.learning_rate)


def constant(step: int, training: cfg.TrainingConfig) -> float:
    return training.learning_rate


@pytest.fixture
def registered(monkeypatch) -> None:
    """One more optimizer, schedule and feed-forward block, each a single registry entry."""
    monkeypatch.setitem(registry.OPTIMIZERS, "sgd", registry.OptimizerKind(f"{__name__}:build_sgd", 0))
    monkeypatch.setitem(registry.LR_SCHEDULES, "constant", f"{__name__}:constant")
    monkeypatch.setitem(
        registry.FEED_FORWARDS,
        "linear2",
        registry.FeedForwardKind(
            "support.feed_forwards:Linear2", parameters=lambda m: 2 * m.dim * m.ffn_dim, saved_per_token=lambda m: 2 * m.ffn_dim
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
        (
            "training.optimizer",
            "adam",
            'training.optimizer: "adam" (a string) is not one of "adamw", "muon"; did you mean "adamw"?',
        ),
        ("training.lr_schedule", "linear", 'training.lr_schedule: "linear" (a string) is not one of "cosine"'),
        ("model.ffn", "swiglu2", 'model.ffn: "swiglu2" (a string) is not one of "swiglu", "moe"; did you mean "swiglu"?'),
        (
            "data.source",
            "jsonll",
            'data.source: "jsonll" (a string) is not one of "builtin", "text", "jsonl", "parquet", "hub", "llmc", '
            '"nanogpt", "megatron"; did you mean "jsonl"?',
        ),
        (
            "data.tokenizer",
            "tiktok",
            'data.tokenizer: "tiktok" (a string) is not one of "byte", "bpe", "huggingface", "tiktoken"; '
            'did you mean "tiktoken"?',
        ),
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
    assert result.stderr.count("\n") == 1 and '"lion" (a string) is not one of "adamw"' in result.stderr, result.stderr
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


def test_flops_count_the_parameters_a_token_runs_through_where_the_block_says(registered, monkeypatch):
    model = dataclasses.replace(cfg.debug().model, ffn="linear2", vocab_size=257)
    every = flops_per_token(model, 64)
    half = dataclasses.replace(registry.FEED_FORWARDS["linear2"], active_parameters=lambda m: m.dim * m.ffn_dim)
    monkeypatch.setitem(registry.FEED_FORWARDS, "linear2", half)
    assert every - flops_per_token(model, 64) == 6 * model.n_layers * model.dim * model.ffn_dim


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


def test_resuming_with_another_feed_forward_block_is_refused_as_another_model(registered, tmp_path):
    swiglu = cfg.debug().model
    with pytest.raises(CheckpointError, match="is for a different model: model.ffn is swiglu there, linear2 here"):
        check_same_model(tmp_path, swiglu, dataclasses.replace(swiglu, ffn="linear2"))


def test_an_export_says_when_its_feed_forward_names_are_not_llamas(registered):
    config = cfg.debug()
    llama = parameter_naming(config)["convention"]
    other = parameter_naming(dataclasses.replace(config, model=dataclasses.replace(config.model, ffn="linear2")))
    assert "layers.{i}.feed_forward.{w1,w2,w3}" in llama
    assert "feed_forward.{w1,w2,w3}" not in other["convention"]
    assert "layers.{i}.feed_forward.* of model.ffn='linear2'" in other["convention"]


# --- data: a text format and a tokenizer ----------------------------------------------------


def csv_pieces(path, text_field):
    """A toy format: one document per line, the text after the first comma."""
    for line in path.read_text(encoding="utf-8").splitlines():
        yield Piece(line.split(",", 1)[1], True, len(line))


class UpperRecipe(ByteRecipe):
    """Bytes of the upper-cased text: another identity, another name, other ids."""

    @staticmethod
    def spec(cfg, source_identity):
        return {"kind": "upper"}

    @staticmethod
    def label(cfg):
        return "upper"

    @staticmethod
    def build(cfg, file):
        return UpperBytes()


class UpperBytes(ByteTokenizer):
    name = "upper"

    def encode_batch(self, texts):
        return super().encode_batch([text.upper() for text in texts])


@pytest.fixture
def data_registered(monkeypatch) -> None:
    monkeypatch.setitem(registry.TEXT_FORMATS, "csv", registry.TextFormat(f"{__name__}:csv_pieces", (".csv",)))
    monkeypatch.setitem(registry.TOKENIZERS, "upper", registry.TokenizerKind(f"{__name__}:UpperRecipe"))


def test_a_hub_datasets_files_of_a_registered_format_are_sized_by_its_tokens_per_byte(data_registered):
    assert estimated_tokens("train-0001.csv", 1000) == 250  # the default, 0.25
    assert estimated_tokens("train-0001.parquet", 1000) == 300
    assert estimated_tokens("train-0001.csv.gz", 1000) == 300  # compressed: as Parquet


def test_a_registered_text_format_and_tokenizer_prepare_a_dataset_from_a_directory(data_registered, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.csv").write_text("1,first doc\n2,second doc\n", encoding="utf-8")
    (corpus / "notes.txt").write_text("not a csv file: a directory contributes its format's files only\n")
    data = data_config(tmp_path, source="csv", path=str(corpus), tokenizer="upper", val_fraction=0.3)
    dataset = prepared(data)
    assert dataset.name.startswith("csv-upper-")
    assert read_meta(dataset)["tokenizer"]["kind"] == "upper"
    ids = all_tokens(dataset)
    text = bytes(int(i) for i in ids if i != BYTE_EOT).decode()
    assert text == "FIRST DOCSECOND DOC" and int((ids == BYTE_EOT).sum()) == 2
