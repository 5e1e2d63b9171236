"""Our model in Hugging Face transformers' form: its config.json (model_type llama, or mixtral for a
mixture of experts), its tensor names, and the row order of the query and key projections.

Our parameters follow Meta's Llama layout; transformers' LlamaForCausalLM and MixtralForCausalLM
hold the same numbers under other names, with two differences of layout:

- rotary embeddings: we rotate adjacent channel pairs (2i, 2i + 1) of every head (Meta's
  convention); transformers rotates halves (i, i + head_dim / 2). The two are the same model when
  the rows of wq and wk are permuted within each head (permute_qk), and only those: v, o and
  the rest are unchanged.
- experts: our mixture of experts batches its experts' weights into (num_experts, ...) tensors;
  Mixtral's checkpoints store each expert as its own Linear (experts.{j}.w1.weight, (ffn, dim)),
  the layout of every Mixtral on the Hub, which transformers 4.x and 5.x and vLLM load.
- fused projections: our attention.wqkv stacks wq's, wk's and wv's rows, and feed_forward.w13
  w1's and w3's (pretrain/model/fused_layout.py); transformers keeps them apart (q_proj, k_proj,
  v_proj; gate_proj, up_proj). One of ours is several of theirs, split and joined by rows. Meta's
  separate names (a checkpoint written before the fusion) convert too.

Nothing here imports torch at module level: the launcher checks a checkpoint's shapes against the
model config (expected_hf_shapes, model_fields_from_hf) before any worker starts.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from pretrain import registry
from pretrain.config import ModelConfig, RopeScalingConfig

if TYPE_CHECKING:
    from torch import Tensor

LLAMA, MIXTRAL = "llama", "mixtral"
ARCHITECTURES = {LLAMA: "LlamaForCausalLM", MIXTRAL: "MixtralForCausalLM"}

# Defaults transformers assumes when config.json leaves a field out (LlamaConfig, MixtralConfig).
_RMS_NORM_EPS = {LLAMA: 1e-6, MIXTRAL: 1e-5}
_MAX_POSITIONS = {LLAMA: 2048, MIXTRAL: 4096 * 32}
_ROPE_THETA = 10000.0
LLAMA3 = "llama3"
"""The one rotary scaling our model has (Llama 3.1's, model.rope_scaling), by its rope_type."""

# Our name inside a layer -> transformers' (layers.{i}.<ours> -> model.layers.{i}.<theirs>).
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_DENSE_NAMES = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_ROUTER = ("feed_forward.router.weight", "block_sparse_moe.gate.weight")
_EXPERTS = ("w1", "w2", "w3")  # our batched feed_forward.{w} -> block_sparse_moe.experts.{j}.{w}.weight
HF_EMBEDDING, HF_OUTPUT = "model.embed_tokens.weight", "lm_head.weight"
_TOP_NAMES = {
    "tok_embed.weight": HF_EMBEDDING,
    "norm.weight": "model.norm.weight",
    "output.weight": HF_OUTPUT,
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_ROTARY = ("attention.wq.weight", "attention.wk.weight")
_FUSED = {"attention.wqkv.weight", "feed_forward.w13.weight"}
"""Our fused weights inside a layer (pretrain/model/fused_layout.py FUSED_PARTS, which imports torch)."""


class HfFormatError(ValueError):
    """A model or a config.json with no counterpart on the other side; the message says which and what to do."""


# --- config.json ------------------------------------------------------------------------------


def hf_model_type(model: ModelConfig) -> str:
    """llama for Llama's SwiGLU feed-forward, mixtral for a mixture of experts; HfFormatError otherwise."""
    if model.moe.num_experts > 0:
        return MIXTRAL
    if registry.FEED_FORWARDS[model.feed_forward].llama_layout:
        return LLAMA
    raise HfFormatError(
        f"model.ffn={model.ffn!r} is not Llama's SwiGLU block, so transformers has no model for it "
        "(only llama and mixtral have a Hugging Face form)"
    )


def hf_config(model: ModelConfig, max_seq_len: int, *, bos_id: int | None, eos_id: int | None, dtype: str) -> dict[str, Any]:
    """transformers' config.json for model: every field LlamaConfig or MixtralConfig reads, so that
    AutoModelForCausalLM builds exactly this model (4.x reads rope_theta and rope_scaling, 5.x
    rope_parameters)."""
    model_type = hf_model_type(model)
    if model.vocab_size is None:
        raise HfFormatError("model.vocab_size is not set: resolve the config (pretrain.config.resolve) first")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.dim,
        "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.dim // model.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": _hf_rope_scaling(model.rope_scaling),
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta}
        | (_hf_rope_scaling(model.rope_scaling) or {}),
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": model.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": dtype,  # transformers 4.x's name
        "dtype": dtype,  # 5.x's
    }
    if model_type == LLAMA:
        return config | {"attention_bias": False, "mlp_bias": False}
    return config | {
        "num_local_experts": model.moe.num_experts,
        "num_experts_per_tok": model.moe.top_k,
        "router_aux_loss_coef": model.moe.aux_loss_weight,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }


def model_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Our ModelConfig's fields (and max_seq_len) from a transformers config.json of a Llama or a
    Mixtral; HfFormatError for what our model cannot express. Tied embeddings (tie_word_embeddings,
    Llama 3.2's) are untied: our model holds its output projection apart, and the loaders start it
    as a copy of the embedding (tied_output)."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HfFormatError(f"config.json's model_type is {model_type!r}: only llama and mixtral models load here")
    missing = [
        key
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        if key not in hf
    ]
    if missing:
        raise HfFormatError(f"config.json of a {model_type} model lacks {', '.join(missing)}")
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    _refuse(hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r} (this model's feed-forward uses silu)")
    _refuse(
        hf.get("head_dim") not in (None, dim // n_heads),
        f"head_dim {hf.get('head_dim')} other than hidden_size / num_attention_heads",
    )
    _refuse(bool(hf.get("attention_bias")) or bool(hf.get("mlp_bias")), "biases (attention_bias or mlp_bias)")
    _refuse(hf.get("sliding_window") is not None, f"sliding-window attention (sliding_window {hf.get('sliding_window')})")
    fields: dict[str, Any] = {
        "dim": dim,
        "n_layers": hf["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "ffn_dim": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "norm_eps": hf.get("rms_norm_eps", _RMS_NORM_EPS[model_type]),
        **_rotary_fields(hf, model_type),
        "max_seq_len": hf.get("max_position_embeddings", _MAX_POSITIONS[model_type]),
    }
    if "initializer_range" in hf:
        fields["init_std"] = hf["initializer_range"]
    if model_type == MIXTRAL:
        fields["moe"] = {"num_experts": hf.get("num_local_experts", 8), "top_k": hf.get("num_experts_per_tok", 2)}
    return fields


def _hf_rope_scaling(scaling: RopeScalingConfig) -> dict[str, Any] | None:
    """4.x's rope_scaling for our rotary scaling (5.x's rope_parameters is it plus rope_theta); None when unscaled."""
    if not scaling.scales:
        return None
    return {
        "rope_type": LLAMA3,
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_seq_len,
    }


def _rotary_fields(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """rope_theta and rope_scaling of a config.json, read as transformers 5.x reads them: 4.x's
    rope_scaling, where set, wins over 5.x's rope_parameters, and a rope_theta inside either wins
    over the top-level one. HfFormatError for a scaling other than Llama 3.1's ("llama3")."""
    scaling, parameters = hf.get("rope_scaling"), hf.get("rope_parameters")
    for described in (scaling, parameters):
        _refuse(
            described is not None and not isinstance(described, dict),
            f"a rotary description this model cannot read ({described!r})",
        )
    rope = scaling or parameters or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    _refuse(
        kind not in ("default", LLAMA3),
        f"rotary scaling ({kind!r} in rope_scaling or rope_parameters; only Llama 3.1's {LLAMA3!r} is supported)",
    )
    fields: dict[str, Any] = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", _ROPE_THETA)))}
    if kind != LLAMA3:
        return fields | {"rope_scaling": {}}  # unscaled: the defaults, factor 1
    # transformers takes a missing original_max_position_embeddings from max_position_embeddings; the rest it needs
    rope = {"original_max_position_embeddings": hf.get("max_position_embeddings", _MAX_POSITIONS[model_type])} | rope
    if missing := [key for key in ("factor", "low_freq_factor", "high_freq_factor") if key not in rope]:
        raise HfFormatError(f"config.json's rotary scaling ({LLAMA3!r}) lacks {', '.join(missing)}, which transformers needs too")
    return fields | {
        "rope_scaling": {
            "factor": float(rope["factor"]),
            "low_freq_factor": float(rope["low_freq_factor"]),
            "high_freq_factor": float(rope["high_freq_factor"]),
            "original_max_seq_len": int(rope["original_max_position_embeddings"]),
        }
    }


def _refuse(condition: bool, what: str) -> None:
    if condition:
        raise HfFormatError(f"config.json describes {what}, which this project's Llama model does not have")


# --- tensor names and shapes ------------------------------------------------------------------


def tied_output(hf: dict[str, Any], names: Collection[str]) -> bool:
    """Whether a checkpoint's output projection is its embedding: config.json ties them
    (tie_word_embeddings, as Llama 3.2 does) and no lm_head.weight is among its tensor names.
    Our model's output projection then starts as a copy of the embedding."""
    return bool(hf.get("tie_word_embeddings")) and HF_OUTPUT not in names


def fused_parts(name: str, model: ModelConfig) -> list[tuple[str, int]] | None:
    """Of our fused weight name (layers.{i}.attention.wqkv.weight, layers.{i}.feed_forward.w13.weight
    of a dense model), the separate weights it stacks, under Meta's names, with their rows, in
    order; None for any other name."""
    match = _LAYER.fullmatch(name)
    if match is None or match[2] not in _FUSED or (match[2].startswith("feed_forward.") and model.moe.num_experts > 0):
        return None
    from pretrain.model.fused_layout import FUSED_PARTS, part_rows  # torch: only where a tensor is converted

    module = match[2].removesuffix(".weight")
    prefix = f"layers.{match[1]}."
    return [(f"{prefix}{part}.weight", rows) for part, rows in zip(FUSED_PARTS[module], part_rows(model, module), strict=True)]


def hf_names(name: str, model: ModelConfig) -> list[str]:
    """The transformers tensor names our state-dict entry name becomes: one, several for a fused
    weight (q_proj, k_proj, v_proj; gate_proj, up_proj), or num_experts (in expert order) for a
    mixture of experts' batched w1, w2, w3."""
    if name in _TOP_NAMES:
        return [_TOP_NAMES[name]]
    if (parts := fused_parts(name, model)) is not None:
        return [hf_name for part, _ in parts for hf_name in hf_names(part, model)]
    match = _LAYER.fullmatch(name)
    if match is not None:
        layer, inner = match.groups()
        prefix = f"model.layers.{layer}."
        if inner in _LAYER_NAMES:
            return [prefix + _LAYER_NAMES[inner]]
        if model.moe.num_experts == 0 and inner in _DENSE_NAMES:
            return [prefix + _DENSE_NAMES[inner]]
        if model.moe.num_experts > 0 and inner == _ROUTER[0]:
            return [prefix + _ROUTER[1]]
        if model.moe.num_experts > 0 and inner.removeprefix("feed_forward.") in _EXPERTS:
            w = inner.removeprefix("feed_forward.")
            return [f"{prefix}block_sparse_moe.experts.{j}.{w}.weight" for j in range(model.moe.num_experts)]
    raise HfFormatError(f"{name} has no Hugging Face name (a {hf_model_type(model)} model has no such tensor)")


def expected_hf_shapes(model: ModelConfig, max_seq_len: int) -> dict[str, tuple[int, ...]]:
    """transformers name -> shape of every tensor of model's Hugging Face checkpoint, without torch.
    max_seq_len shapes nothing stored (the rotary tables are computed) and is taken for symmetry
    with the model's constructor."""
    del max_seq_len
    hf_model_type(model)  # HfFormatError for a block with no Hugging Face form
    if model.vocab_size is None:
        raise HfFormatError("model.vocab_size is not set: resolve the config (pretrain.config.resolve) first")
    d, f, head_dim = model.dim, model.ffn_dim, model.dim // model.n_heads
    q, kv = model.n_heads * head_dim, model.n_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {HF_EMBEDDING: (model.vocab_size, d)}
    for i in range(model.n_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": (q, d),
            layer + "self_attn.k_proj.weight": (kv, d),
            layer + "self_attn.v_proj.weight": (kv, d),
            layer + "self_attn.o_proj.weight": (d, q),
            layer + "input_layernorm.weight": (d,),
            layer + "post_attention_layernorm.weight": (d,),
        }
        if model.moe.num_experts == 0:
            shapes |= {
                layer + "mlp.gate_proj.weight": (f, d),
                layer + "mlp.up_proj.weight": (f, d),
                layer + "mlp.down_proj.weight": (d, f),
            }
            continue
        shapes[layer + _ROUTER[1]] = (model.moe.num_experts, d)
        for j in range(model.moe.num_experts):
            expert = f"{layer}block_sparse_moe.experts.{j}."
            shapes |= {expert + "w1.weight": (f, d), expert + "w3.weight": (f, d), expert + "w2.weight": (d, f)}
    return shapes | {"model.norm.weight": (d,), HF_OUTPUT: (model.vocab_size, d)}


# --- tensors ------------------------------------------------------------------------------------


def permute_qk(w: Tensor, head_dim: int) -> Tensor:
    """Rows of wq or wk (heads x head_dim, cols), ours (adjacent pairs) -> transformers' (halves).
    Works on any block of whole heads, so a rank can convert only the heads of its shard."""
    cols = w.shape[-1]
    # (heads, head_dim // 2, 2, cols): pair i's two rows -> (2, head_dim // 2): every pair's first row, then every second
    return w.reshape(-1, head_dim // 2, 2, cols).transpose(1, 2).reshape(-1, cols)


def unpermute_qk(w: Tensor, head_dim: int) -> Tensor:
    """permute_qk's inverse: transformers' row order (halves) -> ours (adjacent pairs)."""
    cols = w.shape[-1]
    return w.reshape(-1, 2, head_dim // 2, cols).transpose(1, 2).reshape(-1, cols)  # (heads * head_dim, cols)


def to_hf(name: str, tensor: Tensor, model: ModelConfig) -> list[tuple[str, Tensor]]:
    """Our state-dict entry as transformers' tensors (views where no copy is needed), in hf_names order."""
    if (parts := fused_parts(name, model)) is not None:  # split by rows (views), each part converted
        pieces = tensor.split([rows for _, rows in parts])
        return [converted for (part, _), piece in zip(parts, pieces, strict=True) for converted in to_hf(part, piece, model)]
    names = hf_names(name, model)
    inner = name.split(".", 2)[-1]
    if inner in _ROTARY:
        return [(names[0], permute_qk(tensor, model.dim // model.n_heads))]
    if len(names) > 1:  # batched experts: w1, w3 (E, dim, ffn) -> (ffn, dim) each; w2 (E, ffn, dim) -> (dim, ffn)
        return [(hf_name, tensor[j].T) for j, hf_name in enumerate(names)]
    return [(names[0], tensor)]


def from_hf(name: str, pieces: list[Tensor], model: ModelConfig) -> Tensor:
    """Our state-dict entry name from transformers' tensors (pieces, in hf_names order)."""
    names = hf_names(name, model)
    if len(pieces) != len(names):
        raise HfFormatError(f"{name} is made of {len(names)} Hugging Face tensors, not {len(pieces)}")
    if (parts := fused_parts(name, model)) is not None:  # each part from its own tensors, joined by rows
        import torch

        given = iter(pieces)
        return torch.cat([from_hf(part, [next(given) for _ in hf_names(part, model)], model) for part, _ in parts])
    inner = name.split(".", 2)[-1]
    if inner in _ROTARY:
        return unpermute_qk(pieces[0], model.dim // model.n_heads)
    if len(names) > 1:
        import torch

        return torch.stack([piece.T for piece in pieces])  # (E, dim, ffn) for w1, w3; (E, ffn, dim) for w2
    return pieces[0]
