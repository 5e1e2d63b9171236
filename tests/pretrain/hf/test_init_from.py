"""Starting a run from a Hugging Face Llama or Mixtral checkpoint (training.init_from, --init-from):
pretrain/hf/init_checkpoint.py finds and checks it before any worker starts, pretrain/hf/init_from.py
loads it, each rank its own rows."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from support.processes import ROOT, launcher_env, run_gloo_ranks
from support.runs import assert_one_line_error, run_in_process
from support.workers.init_from_worker import DENSE, MOE
from pretrain import config as cfg
from pretrain.hf.init_checkpoint import InitFromError, check_fits, find_checkpoint, read_checkpoint
from pretrain.hf.transformers_form import expected_hf_shapes, hf_config, unpermute_qk
from pretrain.hf.init_from import load_weights
from pretrain.model.transformer import Transformer
from pretrain.train import main as pretrain_main
from support.hub import add_snapshot

SEQ = 16
LLAMA = cfg.ModelConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, rope_theta=10000.0, max_seq_len=SEQ
)
DEBUG = dataclasses.replace(cfg.debug().model, vocab_size=257)
"""The debug preset's model with the byte tokenizer's vocabulary, as a run of it builds it."""
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def write_checkpoint(directory: Path, model: cfg.ModelConfig, drop: str = "", shapes: dict | None = None, seed: int = 0) -> Path:
    """A Hugging Face checkpoint of model's shapes with random weights (written without torch):
    config.json and model.safetensors; drop leaves out one tensor, shapes replaces some."""
    rng = np.random.default_rng(seed)
    wanted = expected_hf_shapes(model, SEQ) | (shapes or {})
    tensors = {name: np.asarray(rng.standard_normal(shape, dtype=np.float32)) for name, shape in wanted.items() if name != drop}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = hf_config(model, SEQ, bos_id=None, eos_id=None, dtype="float32")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def config_with(model: cfg.ModelConfig) -> cfg.Config:
    return dataclasses.replace(cfg.debug(), model=model)


def loaded_model(directory: Path, model: cfg.ModelConfig) -> Transformer:
    checkpoint = read_checkpoint(str(directory), directory)
    check_fits(checkpoint, config_with(model))
    ours = Transformer(model, SEQ, seed=1)
    load_weights(ours, checkpoint, logging.getLogger("test"))
    return ours.eval()


# --- the weights, as transformers computes with them ----------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "tied llama", "mixtral"])
def test_a_checkpoint_transformers_saved_gives_our_model_its_logits(tmp_path, kind):
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    shape = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    torch.manual_seed(0)
    if kind == "mixtral":
        hf = MixtralForCausalLM(MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0))
        model = dataclasses.replace(LLAMA, moe=cfg.MoEConfig(num_experts=4, top_k=2))
    else:
        hf = LlamaForCausalLM(
            LlamaConfig(**shape, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=kind == "tied llama")
        )
        model = LLAMA
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))

    ours = loaded_model(tmp_path / "hf", model)

    with torch.no_grad():
        expected = hf.eval()(tokens).logits  # (2, SEQ, 64)
        assert torch.allclose(ours(tokens).out, expected, atol=1e-5, rtol=0), (ours(tokens).out - expected).abs().max()
        assert not torch.allclose(Transformer(model, SEQ, seed=1)(tokens).out, expected, atol=1e-2)  # a real comparison


@pytest.mark.parametrize(
    "model", [LLAMA, dataclasses.replace(LLAMA, moe=cfg.MoEConfig(num_experts=4, top_k=2))], ids=["llama", "mixtral"]
)
def test_an_export_started_from_gives_the_exported_models_weights_and_logits(tmp_path, model):
    from pretrain.hf.export import export

    exported = Transformer(model, SEQ, seed=3).eval()
    # fp32, and sharded small enough to need model.safetensors.index.json
    export(exported.state_dict(), config_with(model), tmp_path / "export", dtype="float32", max_shard_bytes=20_000, warn=print)
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))

    ours = loaded_model(tmp_path / "export", model)

    assert (tmp_path / "export" / "model.safetensors.index.json").is_file()
    assert all(torch.equal(ours.state_dict()[name], tensor) for name, tensor in exported.state_dict().items())
    with torch.no_grad():
        assert torch.equal(ours(tokens).out, exported(tokens).out)


def test_the_fused_projections_are_filled_from_transformers_separate_ones(tmp_path):
    """wqkv: q_proj's, k_proj's and v_proj's rows (q and k back in our rotary order); w13: gate_proj's and up_proj's."""
    ours = loaded_model(write_checkpoint(tmp_path / "ckpt", LLAMA), LLAMA).state_dict()
    theirs = {name: torch.from_numpy(w) for name, w in load_file(str(tmp_path / "ckpt" / "model.safetensors")).items()}
    for i, hd in ((i, LLAMA.dim // LLAMA.n_heads) for i in range(LLAMA.n_layers)):
        q, k, v, gate, up = (theirs[f"model.layers.{i}.{x}.weight"] for x in [*PROJECTIONS, "mlp.gate_proj", "mlp.up_proj"])
        assert torch.equal(ours[f"layers.{i}.attention.wqkv.weight"], torch.cat([unpermute_qk(q, hd), unpermute_qk(k, hd), v]))
        assert torch.equal(ours[f"layers.{i}.feed_forward.w13.weight"], torch.cat([gate, up]))


# --- where the checkpoint is ------------------------------------------------------------------------


@pytest.fixture
def model_cache(tmp_path, monkeypatch):
    """An offline Hub cache in tmp_path; returns a function that copies a checkpoint directory in as a model repo."""
    from huggingface_hub import constants

    home = tmp_path / "hf"
    (home / "hub").mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def add(repo: str, checkpoint: Path) -> Path:
        return add_snapshot(home, "model", repo, COMMIT, {p.name: p.read_bytes() for p in checkpoint.iterdir()})

    return add


def test_a_hub_id_is_found_offline_in_the_hub_cache_and_pinned_to_its_commit(tmp_path, model_cache):
    snapshot = model_cache("owner/tiny-llama", write_checkpoint(tmp_path / "made", LLAMA))

    checkpoint = find_checkpoint("owner/tiny-llama", log=print)

    assert checkpoint.directory == snapshot and checkpoint.source == f"owner/tiny-llama@{COMMIT}"
    check_fits(checkpoint, config_with(LLAMA))
    assert find_checkpoint(checkpoint.source, log=print).directory == snapshot  # the workers' lookup, by commit


@pytest.mark.parametrize("hub", ["names the commit", "cannot be reached"])
def test_online_a_hub_id_whose_commit_is_cached_is_not_downloaded_again(tmp_path, model_cache, monkeypatch, hub):
    from huggingface_hub import HfApi, constants

    from pretrain.data import hub_process

    snapshot = model_cache("owner/tiny-llama", write_checkpoint(tmp_path / "made", LLAMA))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def repo_info(self, repo, revision=None, **kwargs):
        if hub == "cannot be reached":
            raise ConnectionError("no network")
        return SimpleNamespace(sha=COMMIT)

    monkeypatch.setattr(HfApi, "repo_info", repo_info)
    monkeypatch.setattr(hub_process, "download_in_child", lambda *args: pytest.fail("downloaded a cached commit"))

    checkpoint = find_checkpoint("owner/tiny-llama@main", log=print)

    assert checkpoint.directory == snapshot and checkpoint.source == f"owner/tiny-llama@{COMMIT}"


def test_the_launcher_checks_and_pins_the_weights_without_loading_torch(tmp_path):
    write_checkpoint(tmp_path / "ckpt", DEBUG)
    probe = (
        "import sys; from pretrain import config as cfg; from pretrain.hf.init_checkpoint import for_workers; "
        f"c = cfg.resolve(preset='debug', sets=['training.init_from={tmp_path / 'ckpt'}']); "
        "c, found = for_workers(c, print); print(c.training.init_from, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=launcher_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "weights: " in result.stdout and result.stdout.splitlines()[-1] == f"{tmp_path / 'ckpt'} False"


# --- each rank its own rows ----------------------------------------------------------------------


def test_under_fsdp_each_rank_reads_only_its_rows_and_the_model_equals_one_loaded_whole(tmp_path):
    write_checkpoint(tmp_path / "dense", DENSE, seed=2)
    write_checkpoint(tmp_path / "moe", MOE, seed=3)

    ranks = run_gloo_ranks("init_from_worker.py", tmp_path, timeout=300)

    for seen in ranks:
        assert all(seen["dense"]["equal"].values()) and all(seen["moe"]["equal"].values()), seen
    dense = [{name: (a, b) for name, a, b in seen["dense"]["reads"]} for seen in ranks]
    # wqkv's 56 rows (wq's 40, wk's 8, wv's 8) split 28/28: through head 3 of wq (rows 24-32), and
    # rank 1's shard crosses from wq into wk and wv. Each rank reads of each part only the rows its
    # shard holds, of wq the whole heads it touches.
    layer = "model.layers.0."
    assert dense[0][layer + "self_attn.q_proj.weight"] == (0, 32)
    assert dense[1][layer + "self_attn.q_proj.weight"] == (24, 40)
    assert layer + "self_attn.k_proj.weight" not in dense[0] and layer + "self_attn.v_proj.weight" not in dense[0]
    assert dense[1][layer + "self_attn.k_proj.weight"] == dense[1][layer + "self_attn.v_proj.weight"] == (0, 8)
    # w13's 48 rows (w1's 24, then w3's) split 24/24: rank 0 reads only gate_proj, rank 1 only up_proj
    assert dense[0][layer + "mlp.gate_proj.weight"] == dense[1][layer + "mlp.up_proj.weight"] == (0, 24)
    assert layer + "mlp.up_proj.weight" not in dense[0] and layer + "mlp.gate_proj.weight" not in dense[1]
    assert [d["model.embed_tokens.weight"] for d in dense] == [(0, 32), (32, 64)]
    assert [d["model.layers.0.mlp.down_proj.weight"] for d in dense] == [(0, 20), (20, 40)]
    moe = [{name for name, _, _ in seen["moe"]["reads"] if ".experts." in name} for seen in ranks]
    assert {name.split(".")[5] for name in moe[0]} == {"0", "1"} and {name.split(".")[5] for name in moe[1]} == {"2", "3"}


# --- a run started from weights --------------------------------------------------------------------


def run_pretrain(tmp_path: Path, capsys, *options: str) -> subprocess.CompletedProcess:
    """`python -m pretrain --debug` in this process: one step of a tiny run."""
    argv = ["--debug", "--max-steps", "1", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.context_length=16"]
    argv += ["--set", "training.batch_size=2", "--set", "data.max_samples=50", "--set", "training.eval_batches=1", *options]
    return run_in_process(pretrain_main, argv, capsys)


def test_a_run_from_weights_starts_at_step_0_and_a_resume_wins_over_them(tmp_path, capsys):
    write_checkpoint(tmp_path / "ckpt", DEBUG)
    run_dir = tmp_path / "run"

    first = run_pretrain(tmp_path, capsys, "--init-from", str(tmp_path / "ckpt"), "--run-dir", str(run_dir))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr
    assert f"Weights from {tmp_path / 'ckpt'} (Llama" in first.stdout and "start at step 0" in first.stdout
    assert "Step [0/1]" in first.stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps[0] == 0
    optimizer = torch.load(run_dir / "checkpoints" / "step_1" / "optimizer.pt", weights_only=True)
    assert {float(state["step"]) for state in optimizer["state"].values()} == {1.0}  # one update: its state started empty

    again = run_pretrain(tmp_path, capsys, "--init-from", str(tmp_path / "ckpt"), "--run-dir", str(run_dir), "--resume", "auto")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr
    assert "is not used: a resume wins" in again.stdout and "Weights from" not in again.stdout


def test_the_launcher_pins_a_hub_id_to_its_commit_and_its_worker_loads_it_offline(tmp_path):
    home = tmp_path / "hf"
    made = write_checkpoint(tmp_path / "made", DEBUG)
    add_snapshot(home, "model", "owner/tiny-llama", COMMIT, {p.name: p.read_bytes() for p in made.iterdir()})

    result = run_launcher_with(
        tmp_path,
        "owner/tiny-llama",
        *(
            "--max-steps",
            "1",
            "--set",
            "data.context_length=16",
            "--set",
            "training.batch_size=2",
            "--set",
            "data.max_samples=50",
        ),
        HF_HUB_OFFLINE="1",
        HF_HOME=str(home),
        HF_HUB_CACHE=str(home / "hub"),
    )

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    pinned = f"owner/tiny-llama@{COMMIT}"
    assert f"launcher: weights: {pinned} (Llama, 21 tensors; names and shapes fit the model)" in result.stdout
    assert f"Weights from {pinned} (Llama in {home / 'hub'}" in result.stdout
    assert json.loads((tmp_path / "run" / "config.json").read_text())["training"]["init_from"] == pinned


# --- bad input: one line, exit 2, before anything starts ---------------------------------------------


def run_launcher_with(tmp_path: Path, init_from: str, *options: str, **env: str) -> subprocess.CompletedProcess:
    argv = ["--device", "cpu", "--nproc", "1", "--debug", "--run-dir", str(tmp_path / "run"), "--init-from", init_from]
    argv += ["--set", f"data.cache_dir={tmp_path / 'cache'}", *options]
    return subprocess.run(
        [sys.executable, "-m", "launcher", *argv], cwd=ROOT, env=launcher_env(**env), capture_output=True, text=True, timeout=60
    )


def test_a_path_that_does_not_exist_is_refused_by_the_launcher(tmp_path):
    result = run_launcher_with(tmp_path, str(tmp_path / "absent"))

    assert_one_line_error(result, f"{tmp_path / 'absent'}: no such directory", prefix="launcher: error:", quiet_stdout=False)
    assert not (tmp_path / "run" / "logs").exists()  # no worker started


def test_a_hub_id_not_in_the_cache_offline_is_refused_by_the_launcher(tmp_path):
    hub = tmp_path / "hf" / "hub"
    hub.mkdir(parents=True)
    result = run_launcher_with(tmp_path, "owner/absent", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub), HF_HOME=str(tmp_path / "hf"))

    assert_one_line_error(
        result, "model owner/absent@main", "not in the Hugging Face cache", "hf download owner/absent", quiet_stdout=False
    )


def test_a_gated_repo_says_to_accept_its_license_and_log_in(tmp_path, capsys, monkeypatch):
    from huggingface_hub import HfApi, constants, errors

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def gated(*args, **kwargs):
        response = SimpleNamespace(headers={}, request=None)  # what the error reads of the Hub's 403 response
        raise errors.GatedRepoError("Access to model meta-llama/x is restricted", response=response)

    monkeypatch.setattr(HfApi, "repo_info", gated)

    result = run_in_process(pretrain_main, ["--debug", "--init-from", "meta-llama/x"], capsys)

    assert_one_line_error(result, "meta-llama/x@main is gated", "accept its terms", "hf auth login", prefix="pretrain: error:")


@pytest.mark.parametrize(
    ("model", "written", "fragments"),
    [
        pytest.param(
            DEBUG,
            dict(shapes={"model.layers.1.mlp.up_proj.weight": (256, 128)}),
            ["model.layers.1.mlp.up_proj.weight is [256, 128] in the checkpoint but [384, 128] in the model", "model.ffn_dim"],
            id="a tensor of another shape",
        ),
        pytest.param(
            DEBUG,
            dict(drop="model.layers.0.self_attn.k_proj.weight"),
            ["no tensor model.layers.0.self_attn.k_proj.weight", "which the model needs"],
            id="a missing tensor",
        ),
        pytest.param(
            dataclasses.replace(DEBUG, moe=cfg.MoEConfig(num_experts=4, top_k=2)),
            {},
            ["is a Mixtral (4 experts, 2 per token) but the model is dense", "model.moe.num_experts=4"],
            id="a mixtral into a dense model",
        ),
        pytest.param(
            dataclasses.replace(DEBUG, rope_theta=500000.0),
            {},
            ["its rope_theta is 500000.0 but model.rope_theta is 10000.0", "set model.rope_theta=500000.0"],
            id="another rotary base",
        ),
        pytest.param(
            dataclasses.replace(DEBUG, n_layers=3),
            {},
            ["holds model.layers.2.", "set model.n_layers=3"],
            id="more layers",
        ),
        pytest.param(  # the key shapes differ (k_proj), but by the heads: n_heads is what to set, not n_kv_heads
            dataclasses.replace(DEBUG, n_heads=8),
            {},
            [
                "k_proj.weight is [32, 128] in the checkpoint but [64, 128]",
                "in the model; set model.n_heads=8 (from its config.json)",
            ],
            id="other heads",
        ),
        pytest.param(  # every difference in the first line, so that one change fixes them all
            dataclasses.replace(DEBUG, n_heads=8, rope_theta=500000.0),
            {},
            ["in the model; set model.n_heads=8 model.rope_theta=500000.0 (from its config.json)"],
            id="other heads and rotary base",
        ),
        pytest.param(  # the same shapes (8 heads of 16 and 4 key/value heads: k_proj [64, 128] either way)
            dataclasses.replace(DEBUG, n_heads=8, n_kv_heads=4),
            {},
            ["its n_heads is 8 but model.n_heads is 4", "set model.n_heads=8 model.n_kv_heads=4"],
            id="other heads of the same shapes",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_the_model_is_refused_before_training(tmp_path, capsys, model, written, fragments):
    write_checkpoint(tmp_path / "ckpt", model, **written)

    result = run_pretrain(tmp_path, capsys, "--init-from", str(tmp_path / "ckpt"))

    assert_one_line_error(result, *fragments, prefix="pretrain: error: training.init_from: ")
    assert not (tmp_path / "cache").exists()  # refused before the data is prepared


def test_a_dense_checkpoint_into_a_mixture_of_experts_is_refused_by_the_launcher(tmp_path):
    write_checkpoint(tmp_path / "ckpt", DEBUG)

    result = run_launcher_with(tmp_path, str(tmp_path / "ckpt"), "--set", "model.moe.num_experts=4")

    assert_one_line_error(
        result, "is a dense Llama", "set model.moe.num_experts=0", prefix="launcher: error:", quiet_stdout=False
    )


@pytest.mark.parametrize(
    ("files", "fragment"),
    [
        (
            {"pytorch_model.bin": b"\x80\x04pickle", "config.json": "{}"},
            "only pickled weights (pytorch_model.bin), which are never unpickled",
        ),
        ({"model.safetensors": b""}, "no config.json"),
        ({"model.safetensors": b"\xff" * 8, "config.json": "{}"}, "model.safetensors is not a readable safetensors file"),
    ],
    ids=["pickles only", "no config.json", "a damaged safetensors file"],
)
def test_a_directory_without_config_or_safetensors_is_refused(tmp_path, capsys, files, fragment):
    (tmp_path / "ckpt").mkdir()
    for name, content in files.items():
        (tmp_path / "ckpt" / name).write_bytes(content if isinstance(content, bytes) else content.encode())

    result = run_pretrain(tmp_path, capsys, "--init-from", str(tmp_path / "ckpt"))

    assert_one_line_error(result, fragment, prefix="pretrain: error: training.init_from: ")


def truncate(path: Path, size: int) -> None:
    with path.open("r+b") as file:
        file.truncate(size)


def rewrite_header(path: Path, change) -> None:
    """path's safetensors header, changed in place by change(header), its data left as it is."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])


def _reshape_norm(header: dict) -> None:
    header["model.norm.weight"]["shape"] = [64]  # 256 bytes of offsets, 64 floats


def _add_a_gap(header: dict) -> None:
    first = min(header.values(), key=lambda info: info.get("data_offsets", [1 << 62])[0])
    first["data_offsets"] = [8, first["data_offsets"][1]]  # the data no longer starts at 0


@pytest.mark.parametrize(
    ("damage", "fragments"),
    [
        (lambda path: truncate(path, 50_000), ["model.safetensors is 50000 bytes but its header describes {size}"]),
        (lambda path: truncate(path, 8 + 20), ["model.safetensors is 28 bytes but its header describes at least"]),
        (
            lambda path: path.write_bytes(path.read_bytes() + b"xyz"),
            ["model.safetensors is {longer} bytes but its header describes {size}"],
        ),
        (
            lambda path: rewrite_header(path, _reshape_norm),
            ["model.norm.weight's data_offsets hold 512 bytes", "F32 [64] takes 256"],
        ),
        (lambda path: rewrite_header(path, _add_a_gap), ["data_offsets start at 8, not 0"]),
    ],
    ids=["truncated", "cut inside the header", "longer", "a shape its bytes do not fit", "a gap"],
)
def test_a_damaged_safetensors_file_is_refused_before_training_naming_the_file_and_its_sizes(tmp_path, capsys, damage, fragments):
    write_checkpoint(tmp_path / "ckpt", DEBUG)
    weights = tmp_path / "ckpt" / "model.safetensors"
    size = weights.stat().st_size
    damage(weights)

    result = run_pretrain(tmp_path, capsys, "--init-from", str(tmp_path / "ckpt"))

    fragments = [fragment.format(size=size, longer=size + 3) for fragment in fragments]
    assert_one_line_error(result, *fragments, "download or copy it again", prefix="pretrain: error: training.init_from: ")
    assert not (tmp_path / "cache").exists()  # refused before the data is prepared


def test_a_file_damaged_after_the_check_is_one_line_in_the_worker(tmp_path):
    write_checkpoint(tmp_path / "ckpt", LLAMA)
    checkpoint = read_checkpoint(str(tmp_path / "ckpt"), tmp_path / "ckpt")
    truncate(tmp_path / "ckpt" / "model.safetensors", 50_000)  # after the launcher's check, before the worker reads it

    with pytest.raises(InitFromError) as excinfo:
        load_weights(Transformer(LLAMA, SEQ), checkpoint, logging.getLogger("test"))

    assert "\n" not in str(excinfo.value)
    assert f"training.init_from: {tmp_path / 'ckpt'}: model.safetensors cannot be read" in str(excinfo.value)


def test_a_vocabulary_other_than_the_tokenizers_is_found_once_the_data_is_prepared(tmp_path):
    write_checkpoint(tmp_path / "ckpt", dataclasses.replace(DEBUG, vocab_size=300))
    checkpoint = read_checkpoint(str(tmp_path / "ckpt"), tmp_path / "ckpt")
    check_fits(checkpoint, cfg.debug())  # vocab_size null: not known before the tokenizer sets it

    with pytest.raises(InitFromError) as excinfo:
        check_fits(checkpoint, config_with(DEBUG))

    assert "model.embed_tokens.weight is [300, 128] in the checkpoint but [257, 128]" in str(excinfo.value)
    assert "model.vocab_size=300" in str(excinfo.value)
