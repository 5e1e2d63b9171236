"""pretrain/model/fused_layout.py: the fused projections' names against Meta Llama's separate ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain import registry
from pretrain.config import ModelConfig
from pretrain.model.fused_layout import fuse_separate, has_separate_layout, split_fused

TINY = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97)
SEPARATE = {
    "layers.0.attention.wq.weight": torch.zeros(32, 32),
    "layers.0.attention.wk.weight": torch.ones(16, 32),
    "layers.0.attention.wv.weight": torch.full((16, 32), 2.0),
    "layers.0.attention.wo.weight": torch.zeros(32, 32),
    "layers.0.feed_forward.w1.weight": torch.zeros(64, 32),
    "layers.0.feed_forward.w2.weight": torch.zeros(32, 64),
    "layers.0.feed_forward.w3.weight": torch.ones(64, 32),
}


@pytest.fixture
def llama_named_plugin(monkeypatch):
    """A registered feed-forward block whose own weights are called feed_forward.w1/w2/w3, as
    docs/extending.md lets a plugin name them (llama_layout)."""
    monkeypatch.setitem(registry.FEED_FORWARDS, "plugin", registry.FEED_FORWARDS["swiglu"])
    return dataclasses.replace(TINY, ffn="plugin")


def test_swiglus_separate_weights_fuse_in_row_order_and_split_back_to_the_same_tensors():
    assert has_separate_layout(SEPARATE, TINY)
    fused = fuse_separate(SEPARATE, TINY)
    names = ["attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2"]
    assert list(fused) == [f"layers.0.{name}.weight" for name in names]
    assert fused["layers.0.attention.wqkv.weight"][32:48].eq(1).all() and fused["layers.0.attention.wqkv.weight"][48:].eq(2).all()
    assert not has_separate_layout(fused, TINY)
    back = split_fused(fused, TINY)
    assert back.keys() == SEPARATE.keys() and all(torch.equal(back[name], SEPARATE[name]) for name in SEPARATE)


def test_a_plugin_feed_forward_named_like_llamas_keeps_its_own_w1_w2_w3(llama_named_plugin):
    own = {name: value for name, value in SEPARATE.items() if "feed_forward" in name}
    own["layers.0.attention.wqkv.weight"] = torch.zeros(64, 32)
    assert not has_separate_layout(own, llama_named_plugin)  # a checkpoint of its own fused layout
    assert fuse_separate(own, llama_named_plugin).keys() == own.keys()


def test_the_separate_attention_weights_of_a_plugin_models_checkpoint_still_fuse(llama_named_plugin):
    fused = fuse_separate(SEPARATE, llama_named_plugin)
    assert has_separate_layout(SEPARATE, llama_named_plugin)
    assert "layers.0.attention.wqkv.weight" in fused and "layers.0.feed_forward.w1.weight" in fused
    assert "layers.0.feed_forward.w13.weight" not in fused
