"""The Hugging Face form of the model: transformers loads what we write and computes the same logits."""

from __future__ import annotations

import dataclasses
import json
import math
import weakref
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors.torch import save_file

from support.processes import run_gloo_ranks
from support.runs import assert_one_line_error, run_in_process
from pretrain import config as cfg
from pretrain.config import ModelConfig, MoEConfig
from pretrain.data.tokenizer import BYTE_EOT
from pretrain.evaluation.evaluate import main as evaluate_main
from pretrain.checkpoint.reading import read_checkpoint
from pretrain.hf.export import export, load_exported, write_export
from pretrain.hf.export import main as export_main
from pretrain.evaluation.generate import generate, load_model
from pretrain.evaluation.generate import main as generate_main
from pretrain.hf.transformers_form import (
    HfFormatError,
    expected_hf_shapes,
    from_hf,
    hf_config,
    hf_names,
    model_fields_from_hf,
    permute_qk,
    to_hf,
    unpermute_qk,
)
from pretrain.hf.tokenizer_files import write_tokenizer_files
from pretrain.model.fused_layout import split_fused
from pretrain.model.transformer import Transformer
from support.evaluation import write_examples
from support.evaluation import saved  # noqa: F401 (a fixture)

SEQ = 16
DENSE = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=257, max_seq_len=SEQ, rope_theta=10000.0)
MOE = ModelConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=48,
    vocab_size=257,
    max_seq_len=SEQ,
    moe=MoEConfig(num_experts=4, top_k=2),
)


def hf_state(model: Transformer) -> dict[str, torch.Tensor]:
    return {
        hf_name: piece.contiguous()
        for name, tensor in model.state_dict().items()
        for hf_name, piece in to_hf(name, tensor, model.cfg)
    }


def write_hf(model: Transformer, out: Path) -> Path:
    """The bare conversion (no export): config.json and model.safetensors."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config(model.cfg, SEQ, bos_id=None, eos_id=96, dtype="float32")))
    save_file(hf_state(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def tokens() -> torch.Tensor:
    return torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_config, architecture", [(DENSE, "LlamaForCausalLM"), (MOE, "MixtralForCausalLM")])
def test_transformers_loads_the_converted_weights_and_computes_our_logits(tmp_path, model_config, architecture):
    from transformers import AutoModelForCausalLM

    ours = Transformer(model_config, max_seq_len=SEQ, seed=0).eval()
    theirs = AutoModelForCausalLM.from_pretrained(write_hf(ours, tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(theirs).__name__ == architecture
    with torch.no_grad():
        expected, got = ours(tokens()).out, theirs(tokens()).logits
    assert (got - expected).abs().max() < 1e-5


@pytest.mark.parametrize("model_config", [DENSE, MOE])
def test_every_tensor_converts_there_and_back_unchanged_with_the_shapes_expected(model_config):
    ours = Transformer(model_config, max_seq_len=SEQ, seed=0)
    converted = {}
    for name, tensor in ours.state_dict().items():
        pieces = to_hf(name, tensor, model_config)
        assert [hf_name for hf_name, _ in pieces] == hf_names(name, model_config)
        assert torch.equal(from_hf(name, [piece for _, piece in pieces], model_config), tensor)
        converted |= {hf_name: tuple(piece.shape) for hf_name, piece in pieces}
    assert converted == expected_hf_shapes(model_config, SEQ)


def test_an_export_of_the_fused_model_holds_transformers_separate_projections(tmp_path):
    """Our attention.wqkv is q_proj's, k_proj's and v_proj's rows (q and k permuted to rotate halves),
    our feed_forward.w13 gate_proj's and up_proj's; the export writes them apart, and reads them back fused."""
    ours = exported(DENSE, tmp_path / "export", dtype="float32")
    state = ours.state_dict()
    assert "layers.0.attention.wqkv.weight" in state and "layers.0.attention.wq.weight" not in state  # the fused model
    written = safetensors.torch.load_file(str(tmp_path / "export" / "model.safetensors"))
    head_dim, q, kv, f = DENSE.dim // DENSE.n_heads, DENSE.dim, DENSE.n_kv_heads * DENSE.dim // DENSE.n_heads, DENSE.ffn_dim
    for i in range(DENSE.n_layers):
        wqkv, w13, layer = (
            state[f"layers.{i}.attention.wqkv.weight"],
            state[f"layers.{i}.feed_forward.w13.weight"],
            f"model.layers.{i}.",
        )
        assert torch.equal(written[layer + "self_attn.q_proj.weight"], permute_qk(wqkv[:q], head_dim))
        assert torch.equal(written[layer + "self_attn.k_proj.weight"], permute_qk(wqkv[q : q + kv], head_dim))
        assert torch.equal(written[layer + "self_attn.v_proj.weight"], wqkv[q + kv :])
        assert torch.equal(written[layer + "mlp.gate_proj.weight"], w13[:f]) and torch.equal(
            written[layer + "mlp.up_proj.weight"], w13[f:]
        )
    assert written.keys() == expected_hf_shapes(DENSE, SEQ).keys()
    back, _ = load_exported(tmp_path / "export")
    assert back.keys() == state.keys() and all(torch.equal(back[name], tensor) for name, tensor in state.items())


def test_a_checkpoint_of_the_separate_layout_exports_as_the_fused_model_does(tmp_path):
    """A checkpoint written before the fusion (Meta's separate wq, wk, wv, w1, w3) exports the same files."""
    ours = Transformer(DENSE, max_seq_len=SEQ, seed=0)
    export(ours.state_dict(), run_config(DENSE), tmp_path / "fused", dtype="float32", warn=pytest.fail)
    export(split_fused(ours.state_dict(), DENSE), run_config(DENSE), tmp_path / "separate", dtype="float32", warn=pytest.fail)
    assert (tmp_path / "separate" / "model.safetensors").read_bytes() == (tmp_path / "fused" / "model.safetensors").read_bytes()


def test_the_rotary_permutation_works_on_any_block_of_whole_heads():
    head_dim, heads = 8, 4
    w = torch.randn(heads * head_dim, 5)
    whole = permute_qk(w, head_dim)
    assert not torch.equal(whole, w)
    assert torch.equal(torch.cat([permute_qk(w[:head_dim], head_dim), permute_qk(w[head_dim:], head_dim)]), whole)
    assert torch.equal(unpermute_qk(whole, head_dim), w)
    assert torch.equal(whole[: head_dim // 2], w[0:head_dim:2])  # transformers' first half: our pairs' first channels


@pytest.mark.parametrize("model_config", [DENSE, MOE])
def test_a_config_json_gives_back_the_model_config_it_was_written_from(model_config):
    fields = model_fields_from_hf(hf_config(model_config, SEQ, bos_id=None, eos_id=96, dtype="bfloat16"))
    assert ModelConfig(**fields) == model_config


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"model_type": "gpt2"}, "model_type is 'gpt2'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rotary scaling ('llama3'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rotary scaling ('yarn'"),
        ({"attention_bias": True}, "biases"),
        ({"sliding_window": 4096}, "sliding-window attention"),
        ({"head_dim": 128}, "head_dim 128"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_a_config_json_our_model_cannot_express_is_refused_in_one_line(change, fragment):
    hf = hf_config(DENSE, SEQ, bos_id=None, eos_id=96, dtype="bfloat16") | change
    with pytest.raises(HfFormatError, match=fragment.replace("(", r"\(").replace("[", r"\[")) as error:
        model_fields_from_hf(hf)
    assert "\n" not in str(error.value)


def test_a_feed_forward_that_is_not_llamas_has_no_hugging_face_form(monkeypatch):
    from pretrain import registry

    monkeypatch.setitem(registry.FEED_FORWARDS, "other", registry.FEED_FORWARDS["swiglu"].__class__("x:Y", len, len))
    model_config = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn="other", ffn_dim=96, vocab_size=97)
    with pytest.raises(HfFormatError, match="model.ffn='other' is not Llama's SwiGLU block"):
        hf_config(model_config, SEQ, bos_id=None, eos_id=None, dtype="bfloat16")


# --- the export ---------------------------------------------------------------------------------


def run_config(model_config: ModelConfig) -> cfg.Config:
    base = cfg.debug()
    return dataclasses.replace(base, model=model_config, data=dataclasses.replace(base.data, context_length=SEQ))


def exported(model_config: ModelConfig, out: Path, **options) -> Transformer:
    """Our model of model_config (seeded), exported into out with options; returned in eval mode."""
    ours = Transformer(model_config, max_seq_len=SEQ, seed=0).eval()
    export(ours.state_dict(), run_config(model_config), out, warn=pytest.fail, **options)
    return ours


def weight_files(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("model"))


@pytest.mark.parametrize("model_config, architecture", [(DENSE, "LlamaForCausalLM"), (MOE, "MixtralForCausalLM")])
def test_transformers_loads_an_export_as_it_is_and_computes_our_logits(tmp_path, model_config, architecture):
    from transformers import AutoModelForCausalLM

    ours = exported(model_config, tmp_path / "export", dtype="float32")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(theirs).__name__ == architecture and theirs.dtype == torch.float32
    with torch.no_grad():
        assert (theirs(tokens()).logits - ours(tokens()).out).abs().max() < 1e-5


@pytest.mark.parametrize("model_config", [DENSE, MOE])
def test_greedy_generation_from_transformers_and_from_pretrain_generate_gives_the_same_ids(tmp_path, model_config):
    from transformers import AutoModelForCausalLM

    ours = exported(model_config, tmp_path / "export", dtype="float32")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    prompt = [72, 101, 108, 108, 111]
    expected = generate(ours, prompt, max_tokens=10, temperature=0.0, top_k=0, eot_id=BYTE_EOT)
    with torch.no_grad():
        got = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10)[0, len(prompt) :].tolist()
    got = got[: got.index(BYTE_EOT)] if BYTE_EOT in got else got  # transformers keeps the end-of-text id; generate() drops it
    assert got == expected and len(expected) > 3


def test_transformers_greedy_never_picks_an_id_past_the_tokenizers_vocabulary(tmp_path):
    from transformers import AutoModelForCausalLM

    rounded_up = dataclasses.replace(DENSE, vocab_size=320)  # the byte tokenizer has 257 ids
    ours = Transformer(rounded_up, max_seq_len=SEQ, seed=0).eval()
    with torch.no_grad():
        ours.output.weight[BYTE_EOT + 1 :] = 10.0  # every id past the vocabulary scores highest
    export(ours.state_dict(), run_config(rounded_up), tmp_path / "export", dtype="float32", warn=pytest.fail)
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(BYTE_EOT + 1, 320))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    prompt = [72, 101, 108, 108, 111]
    with torch.no_grad():
        got = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=5)[0, len(prompt) :].tolist()
    assert got and max(got) <= BYTE_EOT
    assert got[:1] == generate(ours, prompt, max_tokens=1, temperature=0.0, top_k=0, eot_id=BYTE_EOT, vocab_size=BYTE_EOT + 1)


def test_a_model_bigger_than_the_shard_limit_is_split_with_an_index_and_loads(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    ours = exported(DENSE, out, dtype="float32", max_shard_bytes=100_000)
    files = weight_files(out)
    shards = [name for name in files if name.endswith(".safetensors")]
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shapes = expected_hf_shapes(DENSE, SEQ)
    assert index["weight_map"].keys() == shapes.keys() and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == 4 * sum(math.prod(shape) for shape in shapes.values())
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as file:
            assert sum(file.get_tensor(name).nbytes for name in file.keys()) <= 100_000
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (theirs(tokens()).logits - ours(tokens()).out).abs().max() < 1e-5

    export(ours.state_dict(), run_config(DENSE), out, dtype="float32", warn=pytest.fail)  # again, in one file
    assert weight_files(out) == ["model.safetensors"]  # the earlier shards and index are gone
    state, _ = load_exported(out)
    assert all(torch.equal(state[name], tensor) for name, tensor in ours.state_dict().items())


def test_weights_are_bfloat16_by_default(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    ours = exported(MOE, out)
    described = json.loads((out / "config.json").read_text())
    assert described["torch_dtype"] == described["dtype"] == described["pretrain"]["torch_dtype"] == "bfloat16"
    state, _ = load_exported(out)
    assert all(torch.equal(state[name], tensor.to(torch.bfloat16)) for name, tensor in ours.state_dict().items())
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 256,
        "eos_token_id": 256,
        "pad_token_id": 256,
    }


def test_an_export_holds_one_whole_tensor_at_a_time(tmp_path):
    model = Transformer(MOE, max_seq_len=SEQ, seed=0)
    given: list[weakref.ref] = []

    def one_at_a_time():
        for name, tensor in model.state_dict().items():
            assert all(ref() is None for ref in given), f"a tensor given before {name} is still held"
            whole = tensor.clone()  # as FSDP's gather makes it: a tensor of its own
            given.append(weakref.ref(whole))
            yield name, whole
            del whole

    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    write_export(one_at_a_time(), shapes, run_config(MOE), tmp_path / "export", max_shard_bytes=10**9, warn=pytest.fail)
    assert len(given) == len(shapes)
    state, _ = load_exported(tmp_path / "export")
    assert all(torch.equal(state[name], tensor.to(torch.bfloat16)) for name, tensor in model.state_dict().items())


@pytest.mark.slow  # two gloo ranks: about 10 s
def test_an_fsdp_export_on_two_ranks_writes_what_one_process_writes(tmp_path):
    ranks = run_gloo_ranks("hf_export_worker.py", tmp_path, timeout=300)
    assert ranks[1] == {"fsdp": None, "single": None} and ranks[0]["fsdp"] and ranks[0]["single"]
    fsdp, single = Path(ranks[0]["fsdp"]), Path(ranks[0]["single"])
    assert sorted(p.name for p in fsdp.iterdir()) == sorted(p.name for p in single.iterdir())
    for file in single.iterdir():
        assert (fsdp / file.name).read_bytes() == file.read_bytes(), file.name


def test_a_model_with_no_hugging_face_form_is_exported_in_our_own_format_with_a_warning(tmp_path, monkeypatch):
    from pretrain import registry

    monkeypatch.setitem(registry.FEED_FORWARDS, "linear2", registry.FeedForwardKind("support.feed_forwards:Linear2", len, len))
    model_config = dataclasses.replace(DENSE, ffn="linear2")
    model = Transformer(model_config, max_seq_len=SEQ, seed=0)
    warnings: list[str] = []
    export(model.state_dict(), run_config(model_config), tmp_path / "export", warn=warnings.append)
    assert (
        len(warnings) == 1
        and "model.ffn='linear2' is not Llama's SwiGLU block" in warnings[0]
        and "pretrain-llama" in warnings[0]
    )
    described = json.loads((tmp_path / "export" / "config.json").read_text())
    assert "model_type" not in described and described["format"] == "pretrain-llama"
    assert not (tmp_path / "export" / "generation_config.json").exists()
    written = safetensors.torch.load_file(str(tmp_path / "export" / "model.safetensors"))
    assert {"layers.0.attention.wq.weight", "layers.0.attention.wk.weight", "layers.0.attention.wv.weight"} <= written.keys()
    assert written.keys() == split_fused(model.state_dict(), model_config).keys()  # Meta's names: wqkv split
    config, state = read_checkpoint(tmp_path / "export")
    assert config.model == model_config
    assert state.keys() == model.state_dict().keys()  # read back fused
    assert all(torch.equal(state[name], tensor.to(torch.bfloat16)) for name, tensor in model.state_dict().items())


# --- the project's loaders read exports ---------------------------------------------------------


def test_generate_and_evaluate_read_an_export_as_they_read_its_checkpoint(saved, tmp_path, capsys):
    out = tmp_path / "export"
    assert (
        run_in_process(export_main, ["--checkpoint", str(saved), "--output", str(out), "--dtype", "float32"], capsys).returncode
        == 0
    )
    config, state = read_checkpoint(out)
    checkpoint_config, checkpoint_state = read_checkpoint(saved)
    assert config == checkpoint_config  # the run's config, kept under "pretrain"
    assert all(torch.equal(state[name], tensor) for name, tensor in checkpoint_state.items())

    def both(main, *argv: str) -> list[str]:
        runs = [run_in_process(main, ["--checkpoint", str(path), *argv], capsys) for path in (saved, out)]
        assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
        return [run.stdout for run in runs]

    from_checkpoint, from_export = both(generate_main, "--prompt", "The module", "--max-tokens", "12", "--temperature", "0")
    assert from_export == from_checkpoint
    data = write_examples(tmp_path / "val.jsonl")
    scored = both(evaluate_main, "--data", str(data), "--output", str(tmp_path / "r.json"))
    assert [line.split(" | ", 2)[2] for line in scored] == [scored[0].split(" | ", 2)[2]] * 2  # the same tallies


@pytest.mark.parametrize(
    "model_config, architecture, tied",
    [(DENSE, "Llama", False), (DENSE, "Llama", True), (MOE, "Mixtral", False)],
    ids=["llama", "tied llama", "mixtral"],
)
def test_a_model_saved_by_transformers_is_read_as_a_checkpoint(tmp_path, capsys, model_config, architecture, tied):
    import transformers

    hf = hf_config(model_config, SEQ, bos_id=None, eos_id=None, dtype="float32") | {"tie_word_embeddings": tied}
    hf_class = getattr(transformers, f"{architecture}Config")
    settings = {key: value for key, value in hf.items() if key not in ("architectures", "model_type")}
    theirs = getattr(transformers, f"{architecture}ForCausalLM")(hf_class(**settings)).eval()
    theirs.save_pretrained(tmp_path / "model")  # transformers' own files, not ours
    write_tokenizer_files(run_config(model_config), None, tmp_path / "model", SEQ)  # a byte-level tokenizer.json, its eos_token
    if tied:  # Llama 3.2's form: no lm_head stored, the embedding stands for it
        assert "lm_head.weight" not in safetensors.safe_open(str(tmp_path / "model" / "model.safetensors"), "pt").keys()
    config, state = read_checkpoint(tmp_path / "model")
    assert config.model == model_config and config.data.tokenizer == "huggingface" and config.data.eot_token == "<|endoftext|>"
    assert torch.equal(state["output.weight"], state["tok_embed.weight"]) == tied  # untied here: the output starts as a copy
    ours = load_model(config, state, torch.device("cpu"))
    with torch.no_grad():
        assert (theirs(tokens()).logits - ours(tokens()).out).abs().max() < 1e-5
    result = run_in_process(
        generate_main, ["--checkpoint", str(tmp_path / "model"), "--prompt", "Hi", "--max-tokens", "3"], capsys
    )
    assert result.returncode == 0 and result.stdout.startswith("Hi"), result.stderr


BROKEN = {  # the fragment follows "export <out>"
    "another model": (
        lambda out: _edit_config(out, model_type="gpt2"),
        ": config.json's model_type is 'gpt2': only llama and mixtral",
    ),
    "scaled rotary": (
        lambda out: _edit_config(out, rope_scaling={"rope_type": "llama3"}),
        ": config.json's rotary scaling ('llama3'",
    ),
    "biases": (lambda out: _edit_config(out, attention_bias=True), ": config.json describes biases"),
    "no weights": (lambda out: (out / "model.safetensors").unlink(), ": cannot find its weights"),
    "a tensor short": (
        lambda out: _drop_tensor(out, "model.norm.weight"),
        ": the weights do not fit the model its config.json describes: 1 missing (model.norm.weight)",
    ),
    "a truncated file": (
        lambda out: _truncate(out / "model.safetensors", 5000),
        ": model.safetensors is 5000 bytes but its header describes",
    ),
    "a truncated shard": (
        lambda out: _truncate(out / "model-00002-of-00003.safetensors", 5000),
        ": model-00002-of-00003.safetensors is 5000 bytes but its header describes",
    ),
    "a shard's index naming a file outside": (  # never opened: the line names the entry, not the file's bytes
        lambda out: _index_names(out, "../passwd"),
        ": model.safetensors.index.json names '../passwd' for model.embed_tokens.weight, which is not a file beside it",
    ),
    "a shard's index naming an absolute path": (
        lambda out: _index_names(out, str(out.parent / "passwd")),
        ": model.safetensors.index.json names '/",
    ),
}


def _index_names(out: Path, entry: str) -> None:
    """The index names entry for the embedding, and the file there is not a safetensors file."""
    (out.parent / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.embed_tokens.weight"] = entry
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


def _edit_config(out: Path, **changes) -> None:
    described = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({k: v for k, v in described.items() if k != "pretrain"} | changes))


def _truncate(path: Path, size: int) -> None:
    with path.open("r+b") as file:
        file.truncate(size)


def _drop_tensor(out: Path, name: str) -> None:
    state = safetensors.torch.load_file(str(out / "model.safetensors"))
    del state[name]
    safetensors.torch.save_file(state, str(out / "model.safetensors"))


@pytest.mark.parametrize("broken", BROKEN)
def test_an_export_that_cannot_be_read_is_one_line_and_exit_2(tmp_path, capsys, broken):
    damage, fragment = BROKEN[broken]
    shards = {"max_shard_bytes": 80_000} if "shard" in broken else {}
    exported(DENSE, tmp_path / "export", **shards)
    damage(tmp_path / "export")
    result = run_in_process(generate_main, ["--checkpoint", str(tmp_path / "export"), "--prompt", "x"], capsys)
    assert_one_line_error(result, f"{tmp_path / 'export'}{fragment}", prefix="generate: error: export ")
    assert "root" not in result.stderr.replace(str(tmp_path), "")


def test_a_bad_max_shard_size_is_one_line_and_exit_2(saved, tmp_path, capsys):
    argv = ["--checkpoint", str(saved), "--output", str(tmp_path / "out"), "--max-shard-size", "5XB"]
    assert_one_line_error(
        run_in_process(export_main, argv, capsys), "--max-shard-size: '5XB' is not a size", prefix="export: error: "
    )
    assert not (tmp_path / "out").exists()


def test_an_export_of_the_first_format_still_loads(tmp_path, capsys):
    model = Transformer(DENSE, max_seq_len=SEQ, seed=0)
    out = tmp_path / "old"
    out.mkdir()
    separate = split_fused(model.state_dict(), DENSE)  # as the model was then: Meta's wq, wk, wv, w1, w3
    save_file({name: tensor.contiguous() for name, tensor in separate.items()}, str(out / "model.safetensors"))
    tokenizer = {"kind": "byte", "name": "byte", "eot_id": 256, "vocab_size": 257, "file": None}
    old = {
        "format": "pretrain-llama",
        "format_version": 1,
        "model": cfg.to_dict(run_config(DENSE))["model"],
        "tokenizer": tokenizer,
    }
    (out / "config.json").write_text(json.dumps(old | {"max_seq_len": SEQ, "torch_dtype": "float32"}))
    config, state = read_checkpoint(out)
    assert config.model == DENSE and config.data.tokenizer == "byte" and config.data.context_length == SEQ
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    result = run_in_process(
        generate_main, ["--checkpoint", str(out), "--prompt", "Hi", "--max-tokens", "3", "--seed", "1"], capsys
    )
    assert result.returncode == 0 and result.stdout.startswith("Hi"), result.stderr
