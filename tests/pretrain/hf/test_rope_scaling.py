"""Llama 3.1's rotary scaling (model.rope_scaling, rope_type "llama3" in a Hugging Face config.json):
our rotary tables compute transformers' frequencies, a scaled Llama checkpoint starts a run
(training.init_from) and an export of a scaled model loads in transformers with the same logits,
and a scaling that differs from the model's, or makes no sense, is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import pytest
import torch

from pretrain import config as cfg
from pretrain.hf.init_checkpoint import InitFromError, check_fits, read_checkpoint
from pretrain.hf.transformers_form import HfFormatError, expected_hf_shapes, hf_config, model_fields_from_hf
from pretrain.model.transformer import Transformer, llama3_frequencies
from test_init_from import LLAMA, SEQ, config_with, loaded_model, write_checkpoint

# context of 64 (bounds 64 / 4 = 16 and 64 / 1 = 64) the first pair is kept, the second blended
# and the last two slowed: every branch of the scaling is used.
SCALING = cfg.RopeScalingConfig(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64)
SCALED = dataclasses.replace(LLAMA, rope_scaling=SCALING)
HF_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
"""meta-llama/Llama-3.2-1B's config.json as the Hub serves it (transformers 4.x's rope_scaling form)."""
LLAMA_3_2_1B_SETS = [
    "model.dim=2048",
    "model.n_layers=16",
    "model.ffn_dim=8192",
    "model.rope_scaling.factor=32",
    "data.tokenizer_name=meta-llama/Llama-3.2-1B",
]
"""What docs/training.md tells a user to set on the production preset for Llama-3.2-1B."""


def transformers_llama(scaling: dict | None, tied: bool = False):
    """A tiny transformers Llama of LLAMA's shape with the given rope_scaling, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,  # above original_max_position_embeddings, as transformers wants
        initializer_range=0.3,  # attention far from uniform, so that the rotary angles matter
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0} | (scaling or {}),  # 5.x's form
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))  # (2, SEQ)


# --- what is computed ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "head_dim, theta, scaling",
    [
        (8, 10000.0, SCALING),
        (128, 500000.0, cfg.RopeScalingConfig(factor=8.0)),  # Llama 3.1 8B
        (64, 500000.0, cfg.RopeScalingConfig(factor=32.0)),  # Llama 3.2 1B
    ],
)
def test_the_scaled_rotary_frequencies_are_transformers_llama3_ones(head_dim, theta, scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        max_position_embeddings=scaling.original_max_seq_len * 2,
        rope_parameters=HF_SCALING
        | {"rope_theta": theta, "factor": scaling.factor, "original_max_position_embeddings": scaling.original_max_seq_len},
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)  # (head_dim // 2,) float32
    unscaled = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    ours = llama3_frequencies(unscaled, scaling)

    assert torch.allclose(ours, theirs.double(), rtol=1e-6, atol=0)
    assert (ours < unscaled).any() and (ours == unscaled).any()  # some slowed, some kept


@pytest.mark.parametrize("form", ["rope_scaling", "rope_parameters"])
def test_a_scaled_llama_with_tied_embeddings_starts_a_run_with_transformers_logits(tmp_path, form):
    """Llama-3.2-1B's combination: llama3 scaling and tie_word_embeddings, in the Hub's 4.x form
    (rope_scaling and rope_theta) or as transformers 5.x saves it (rope_parameters)."""
    hf = transformers_llama(HF_SCALING, tied=True)
    hf.save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == "llama3" and not saved.get("rope_scaling")
    if form == "rope_scaling":  # as Llama 3.1 and 3.2's config.json on the Hub
        del saved["rope_parameters"]
        (tmp_path / "hf" / "config.json").write_text(json.dumps(saved | {"rope_scaling": HF_SCALING, "rope_theta": 10000.0}))

    ours = loaded_model(tmp_path / "hf", SCALED)

    with torch.no_grad():
        expected = hf(tokens()).logits  # (2, SEQ, 64)
        assert torch.allclose(ours(tokens()).out, expected, atol=1e-5, rtol=0), (ours(tokens()).out - expected).abs().max()
        unscaled = Transformer(LLAMA, SEQ)
        unscaled.load_state_dict(ours.state_dict())
        assert not torch.allclose(unscaled(tokens()).out, expected, atol=1e-2)  # the scaling matters at this length


def test_an_export_of_a_scaled_model_loads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from pretrain.hf.export import export

    ours = Transformer(SCALED, SEQ, seed=3).eval()
    export(ours.state_dict(), config_with(SCALED), tmp_path / "export", dtype="float32", warn=print)

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()

    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["rope_scaling"] == HF_SCALING  # transformers 4.x reads it
    assert written["rope_parameters"] == HF_SCALING | {"rope_theta": 10000.0}  # 5.x
    with torch.no_grad():
        assert torch.allclose(hf(tokens()).logits, ours(tokens()).out, atol=1e-5, rtol=0)
    assert cfg.ModelConfig(**model_fields_from_hf(written)) == SCALED  # and read back as it was


# --- what is refused ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "checkpoint, model, fragments",
    [
        (
            SCALED,
            LLAMA,
            ["is factor 4.0, low_freq_factor 1.0", "model.rope_scaling is none", "set model.rope_scaling.factor=4.0"],
        ),
        (LLAMA, SCALED, ["(rope_scaling) is none but model.rope_scaling is factor 4.0", "set model.rope_scaling.factor=1"]),
        (
            dataclasses.replace(SCALED, rope_scaling=dataclasses.replace(SCALING, high_freq_factor=2.0)),
            SCALED,
            ["high_freq_factor 2.0", "set model.rope_scaling.high_freq_factor=2.0"],
        ),
    ],
    ids=["scaled into unscaled", "unscaled into scaled", "other bounds"],
)
def test_a_checkpoint_whose_rotary_scaling_differs_from_the_models_is_refused_in_one_line(tmp_path, checkpoint, model, fragments):
    directory = write_checkpoint(tmp_path / "hf", checkpoint)

    with pytest.raises(InitFromError) as error:
        check_fits(read_checkpoint(str(directory), directory), config_with(model))

    assert "\n" not in str(error.value)
    for fragment in fragments:
        assert fragment in str(error.value)


@pytest.mark.parametrize(
    "rope_scaling, fragment",
    [
        ({"rope_type": "linear", "factor": 2.0}, "rotary scaling ('linear'"),
        ({"rope_type": "dynamic", "factor": 2.0}, "rotary scaling ('dynamic'"),
        ({"type": "yarn", "factor": 2.0}, "rotary scaling ('yarn'"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "lacks high_freq_factor"),
    ],
)
def test_a_config_json_with_another_rotary_scaling_is_refused_in_one_line(rope_scaling, fragment):
    hf = hf_config(LLAMA, SEQ, bos_id=None, eos_id=None, dtype="float32") | {"rope_scaling": rope_scaling}

    with pytest.raises(HfFormatError, match=fragment.replace("(", r"\(")) as error:
        model_fields_from_hf(hf)

    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "setting, fragment",
    [
        ("model.rope_scaling.factor=0.5", "model.rope_scaling.factor: must be at least 1 (got 0.5)"),
        ("model.rope_scaling.low_freq_factor=0", "model.rope_scaling.low_freq_factor: must be positive (got 0.0)"),
        ("model.rope_scaling.high_freq_factor=1", "model.rope_scaling.high_freq_factor: 1.0 must be above"),
        ("model.rope_scaling.original_max_seq_len=0", "model.rope_scaling.original_max_seq_len: must be at least 1"),
        ("model.rope_scaling.factor=true", "model.rope_scaling.factor: expected a number"),
        ("model.rope_scaling.scale=2", "model.rope_scaling.scale: unknown key"),
    ],
)
def test_bad_rotary_scaling_settings_are_refused_in_one_line(setting, fragment):
    with pytest.raises(cfg.ConfigError) as error:
        cfg.resolve(preset="debug", sets=[setting])

    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_a_scaled_models_resolved_config_loads_back_the_same(tmp_path):
    config = cfg.resolve(preset="debug", sets=["model.rope_scaling.factor=8", "model.rope_scaling.original_max_seq_len=64"])
    cfg.save(config, tmp_path / "config.json")

    assert cfg.load(tmp_path / "config.json") == config
    assert config.model.rope_scaling == cfg.RopeScalingConfig(factor=8.0, original_max_seq_len=64)
    assert cfg.resolve(preset="debug").model.rope_scaling.scales is False  # the presets are unscaled


# --- Llama-3.2-1B, as the docs tell a user to start from it -----------------------------------------


def header_only_checkpoint(directory: Path, config: dict) -> Path:
    """config.json and a model.safetensors whose header describes every tensor of config (bf16,
    tied: no lm_head) and which holds no weights (a sparse file of the size its header describes):
    what check_fits reads of a 2.5 GB checkpoint."""
    model = cfg.ModelConfig(**model_fields_from_hf(config | {"tie_word_embeddings": False}))
    shapes = {name: shape for name, shape in expected_hf_shapes(model, SEQ).items() if name != "lm_head.weight"}
    header, end = {}, 0
    for name, shape in shapes.items():
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [end, end + 2 * math.prod(shape)]}
        end += 2 * math.prod(shape)
    directory.mkdir(parents=True)
    encoded = json.dumps(header).encode()
    with (directory / "model.safetensors").open("wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.truncate(8 + len(encoded) + end)  # holes: nothing written, nothing stored
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_documented_settings_for_llama_3_2_1b_fit_its_checkpoint(tmp_path):
    directory = header_only_checkpoint(tmp_path / "Llama-3.2-1B", LLAMA_3_2_1B)
    checkpoint = read_checkpoint("meta-llama/Llama-3.2-1B", directory)

    check_fits(checkpoint, cfg.resolve(sets=LLAMA_3_2_1B_SETS))

    with pytest.raises(InitFromError, match=r"set model\.rope_scaling\.factor=32\.0$"):
        check_fits(checkpoint, cfg.resolve(sets=[s for s in LLAMA_3_2_1B_SETS if "rope_scaling" not in s]))
    docs = (Path(__file__).resolve().parents[3] / "docs" / "training.md").read_text()
    assert " ".join(f"--set {setting}" for setting in LLAMA_3_2_1B_SETS) in " ".join(docs.replace("\\\n", " ").split())
