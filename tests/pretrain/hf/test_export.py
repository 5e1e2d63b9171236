"""Export: the weights and config round-trip, files appear whole, the command line (the Hugging
Face side, transformers loading it, is tests/pretrain/hf/test_hf_export.py)."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as RustTokenizer

from support.processes import launcher_env
from pretrain.checkpoint import save_restore as checkpoint
from pretrain.checkpoint import reading as checkpoint_reading
from pretrain.hf import safetensors_shards
from pretrain.checkpoint.save_restore import CheckpointError
from pretrain import config as cfg
from pretrain.config import ModelConfig
from pretrain.data.fitting import fit_to_dataset
from pretrain.data.prepare import prepare
from pretrain.checkpoint.reading import find_checkpoint, find_tokenizer_file
from pretrain.hf.export import default_output, export, load_exported, main
from pretrain.model.transformer import Transformer
from pretrain.distributed.runtime import Runtime, setup_logging
from pretrain.build import Trainer, build
from pretrain.train import train_step


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Trainer]:
    """A real checkpoint of a tiny byte-level model after one optimizer step, and its trainer."""
    root = tmp_path_factory.mktemp("export")
    config = cfg.resolve(
        preset="debug", sets=[f"data.cache_dir={root / 'cache'}", "training.batch_size=2", "data.context_length=32"]
    )
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")
    dataset = prepare(config.data, log=lambda _: None)
    config, _ = fit_to_dataset(config, dataset, world_size=1)
    trainer = build(config, runtime, dataset, root / "run", setup_logging("CPU 0", "WARNING"))
    train_step(trainer, 0)  # weights that are no longer the seeded initialisation
    return checkpoint.save(trainer, 1, root / "run"), trainer


def trained_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err


EXPORT_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


def test_an_export_holds_the_checkpoints_weights_and_a_config_that_rebuilds_the_model(trained, tmp_path, capsys):
    path, trainer = trained
    argv = ["--checkpoint", str(path), "--output", str(tmp_path / "out"), "--dtype", "float32"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "exported" in out and str(tmp_path / "out") in out

    state, described = load_exported(tmp_path / "out")
    expected = trained_state(trainer)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[name], expected[name]) for name in expected)
    assert described["model_type"] == "llama" and described["max_position_embeddings"] == 32
    meta = described["pretrain"]
    assert meta["format"] == "huggingface" and meta["format_version"] == 2
    assert meta["max_seq_len"] == 32 and meta["model"]["max_seq_len"] == 32 and meta["model"]["vocab_size"] == 257
    assert meta["torch_dtype"] == "float32" and described["torch_dtype"] == "float32"
    assert meta["tokenizer"] == {"kind": "byte", "name": "byte", "eot_id": 256, "vocab_size": 257, "file": "tokenizer.json"}
    assert meta["exported_from"]["steps_done"] == 1
    assert meta["run_config"] == cfg.to_dict(trainer.config)

    rebuilt = Transformer(ModelConfig(**meta["model"]), max_seq_len=meta["max_seq_len"])
    rebuilt.load_state_dict(state)  # strict
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(rebuilt(tokens).out, trainer.model(tokens).out)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_is_exported_reading_one_tensor_at_a_time(trained, tmp_path, capsys, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from pretrain.checkpoint import model_state

    path, trainer = trained
    sharded = shutil.copytree(path, tmp_path / "step_1")
    (sharded / "model.pt").unlink()
    dcp.save({"model": trained_state(trainer)}, storage_writer=dcp.FileSystemWriter(sharded / "dcp"), no_dist=True)
    loads: list[list[str]] = []

    def recording_load(state, path, alone=None):
        loads.append(list(state))
        return dcp_load(state, path, alone)

    dcp_load = model_state.dcp_load
    monkeypatch.setattr(model_state, "dcp_load", recording_load)
    code, _, err = run_cli(["--checkpoint", str(sharded), "--output", str(tmp_path / "out"), "--dtype", "float32"], capsys)
    assert code == 0, err
    expected = trained_state(trainer)
    assert sorted(key for keys in loads for key in keys) == sorted(f"model.{name}" for name in expected)
    assert all(len(keys) == 1 for keys in loads)  # DCP read one tensor per call, never the model
    state, _ = load_exported(tmp_path / "out")
    assert all(torch.equal(state[name], expected[name]) for name in expected)


def test_without_output_a_run_is_exported_into_its_export_folder(trained, tmp_path, capsys):
    path, _ = trained
    run_dir = shutil.copytree(path.parent.parent, tmp_path / "run")
    code, _, err = run_cli(["--checkpoint", str(run_dir)], capsys)
    assert code == 0, err
    assert (run_dir / "export" / "model.safetensors").is_file()
    state, _ = load_exported(run_dir / "export")
    assert {tensor.dtype for tensor in state.values()} == {torch.bfloat16}  # the default
    assert default_output(tmp_path / "loose-checkpoint") == tmp_path / "loose-checkpoint" / "export"


def test_exporting_again_leaves_no_temporary_files_and_a_failed_write_keeps_the_previous_export(trained, tmp_path, monkeypatch):
    _, trainer = trained
    out = tmp_path / "out"
    export(trained_state(trainer), trainer.config, out)
    export(trained_state(trainer), trainer.config, out)
    assert sorted(p.name for p in out.iterdir()) == EXPORT_FILES
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}  # meant to be shared
    before = (out / "model.safetensors").read_bytes()

    def disk_full(file, spec, name, tensor):
        file.write(b"half a tensor")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_shards, "_write_tensor", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export(trained_state(trainer), trainer.config, out)
    assert sorted(p.name for p in out.iterdir()) == EXPORT_FILES
    assert (out / "model.safetensors").read_bytes() == before


def test_tensors_that_share_storage_are_written_as_separate_copies(trained, tmp_path):
    _, trainer = trained
    state = trained_state(trainer)
    state["output.weight"] = state["tok_embed.weight"]  # tied embeddings: safetensors refuses shared storage
    export(state, trainer.config, tmp_path / "out", dtype="float32")
    loaded, _ = load_exported(tmp_path / "out")
    assert torch.equal(loaded["output.weight"], state["tok_embed.weight"])
    assert loaded["output.weight"].data_ptr() != loaded["tok_embed.weight"].data_ptr()


@pytest.fixture
def bpe_run(tmp_path) -> tuple[cfg.Config, Path]:
    """The config of a tiny BPE model, fitted to its prepared dataset, and that dataset."""
    config = cfg.resolve(
        preset="debug",
        sets=[f"data.cache_dir={tmp_path / 'cache'}", "data.tokenizer=bpe", "data.bpe_vocab_size=300", "data.context_length=32"],
    )
    dataset = prepare(config.data, log=lambda _: None)
    config, _ = fit_to_dataset(config, dataset, world_size=1)
    return config, dataset


def test_a_bpe_models_tokenizer_is_found_copied_and_described(bpe_run, tmp_path):
    config, dataset = bpe_run
    checkpoint_dir = tmp_path / "step_1"
    checkpoint_dir.mkdir()
    assert find_tokenizer_file(config, checkpoint_dir) == dataset / "tokenizer.json"
    shutil.copyfile(dataset / "tokenizer.json", checkpoint_dir / "tokenizer.json")
    assert find_tokenizer_file(config, checkpoint_dir) == checkpoint_dir / "tokenizer.json"  # a copy beside it wins

    state = Transformer(config.model, max_seq_len=32).state_dict()
    eot = RustTokenizer.from_file(str(dataset / "tokenizer.json")).token_to_id("<|endoftext|>")
    export(state, config, tmp_path / "out", checkpoint_dir / "tokenizer.json")
    exported = RustTokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert exported.get_vocab() == RustTokenizer.from_file(str(dataset / "tokenizer.json")).get_vocab()
    described = json.loads((tmp_path / "out" / "config.json").read_text())
    assert described["pretrain"]["tokenizer"] == {
        "kind": "bpe",
        "name": "bpe300",
        "eot_id": eot,
        "vocab_size": 300,
        "file": "tokenizer.json",
    }
    assert described["eos_token_id"] == eot
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == eot


def test_export_looks_nothing_up_and_copies_only_the_tokenizer_it_is_given(bpe_run, tmp_path, monkeypatch):
    config, dataset = bpe_run

    def no_lookup(*args, **kwargs):
        raise AssertionError("export recomputed the data recipe to find the tokenizer")

    monkeypatch.setattr(checkpoint_reading, "recipe_for", no_lookup)  # finding the dataset: may hash files, reach the Hub
    monkeypatch.setattr(checkpoint_reading, "huggingface_file", no_lookup)
    state = Transformer(config.model, max_seq_len=32).state_dict()
    export(state, config, tmp_path / "given", tokenizer_file=dataset / "tokenizer.json")
    assert (tmp_path / "given" / "tokenizer.json").is_file()

    warnings = []
    export(state, config, tmp_path / "none", tokenizer_file=None, warn=warnings.append)  # although the dataset beside it has one
    assert sorted(p.name for p in (tmp_path / "none").iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    described = json.loads((tmp_path / "none" / "config.json").read_text())["pretrain"]["tokenizer"]
    assert described == {"kind": "bpe", "name": "bpe300", "eot_id": None, "vocab_size": None, "file": None}
    assert len(warnings) == 1 and "tokenizer.json was not found" in warnings[0]


@pytest.mark.slow
def test_the_export_command_runs_as_a_module(trained, tmp_path):
    path, _ = trained
    result = subprocess.run(
        [sys.executable, "-m", "pretrain.export", "--checkpoint", str(path), "--output", str(tmp_path / "out")],
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == EXPORT_FILES


DAMAGE = {
    "no weights": lambda checkpoint_dir: (checkpoint_dir / "model.pt").unlink(),
    "no config": lambda checkpoint_dir: (checkpoint_dir / "config.json").unlink(),
    "damaged state": lambda checkpoint_dir: (checkpoint_dir / "state.json").write_text('{"steps_do'),
}


@pytest.mark.parametrize(
    "damage, fragment",
    [
        ("missing", "no such directory"),
        ("no weights", "model.pt is missing"),
        ("no config", "config.json is missing (an incomplete checkpoint)"),
        ("damaged state", "state.json is unreadable"),
    ],
)
def test_an_unusable_checkpoint_is_one_line_and_exit_2(trained, tmp_path, capsys, damage, fragment):
    path, _ = trained
    target = tmp_path / "step_1"
    if damage != "missing":
        shutil.copytree(path, target)
        DAMAGE[damage](target)
    code, out, err = run_cli(["--checkpoint", str(target), "--output", str(tmp_path / "out")], capsys)
    assert code == 2 and out == ""
    assert err.startswith("export: error: ") and err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "out").exists()


def test_an_output_that_is_a_file_is_one_line_and_exit_2(trained, tmp_path, capsys):
    path, _ = trained
    (tmp_path / "afile").write_text("mine")
    code, out, err = run_cli(["--checkpoint", str(path), "--output", str(tmp_path / "afile")], capsys)
    assert code == 2 and out == ""
    assert err == f"export: error: --output {tmp_path / 'afile'} is a file; give a directory (it is created if missing)\n"
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_run_directory_means_its_latest_complete_checkpoint(trained, tmp_path):
    path, _ = trained
    run_dir = shutil.copytree(path.parent.parent, tmp_path / "run")
    for name in ("step_10", "step_9", "step_11.tmp"):
        copy = shutil.copytree(run_dir / "checkpoints" / "step_1", run_dir / "checkpoints" / name)
        state = json.loads((copy / "state.json").read_text())  # a step_<N> holds N steps done
        (copy / "state.json").write_text(json.dumps(state | {"steps_done": int(name[5:].removesuffix(".tmp"))}))
    assert find_checkpoint(run_dir) == run_dir / "checkpoints" / "step_10"
    assert find_checkpoint(run_dir / "checkpoints" / "step_9") == run_dir / "checkpoints" / "step_9"
    for step in ("step_1", "step_9", "step_10"):
        shutil.rmtree(run_dir / "checkpoints" / step)
    with pytest.raises(CheckpointError, match="the run has no complete checkpoint"):
        find_checkpoint(run_dir)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        find_checkpoint(tmp_path / "elsewhere")
