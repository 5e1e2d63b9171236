"""Checkpoints: what a save holds, that a restore continues exactly, pruning, unfinished saves,
refusals with one line, a pickled tensor file that must not run code, and resuming an earlier
checkpoint of the same run. Sharded (FSDP2, DCP) checkpoints: test_checkpoint_sharded.py."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from support.processes import one_line_error
from pretrain.checkpoint import files, save_restore as checkpoint
from pretrain.checkpoint.model_state import named_optimizer_state
from pretrain.checkpoint.reading import checkpoint_tensors
from pretrain.checkpoint.save_restore import CheckpointError
from pretrain.model.transformer import Transformer
from pretrain.build import Trainer
from pretrain.optim.schedule import lr_at
from pretrain.train import train_step
from support.checkpointing import as_separate_layout, as_sharded, assert_same_tensors, draws, make_trainer, trained_trainer


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def trained(cache, tmp_path) -> tuple[Trainer, Path]:
    return trained_trainer(cache, tmp_path)


def test_a_restored_trainer_has_the_saved_weights_optimizer_state_data_position_and_random_streams(trained, cache, tmp_path):
    saved, path = trained
    expected = draws()  # what the saving process draws next
    fresh = make_trainer(cache, tmp_path / "fresh")  # build() reseeds torch; scramble the others too
    random.seed(7)
    np.random.seed(7)
    assert checkpoint.restore(fresh, path) == 2
    got = draws()
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and np.array_equal(got[2], expected[2])
    assert_same_tensors(fresh.model.state_dict(), saved.model.state_dict())
    assert_same_tensors(fresh.optimizer.state_dict()["state"], saved.optimizer.state_dict()["state"])
    assert fresh.loader.state_dict() == saved.loader.state_dict() == {"epoch": 0, "batch_index": 2}
    assert all(torch.equal(a, b) for a, b in zip(next(fresh.batches), next(saved.batches), strict=True))


def test_four_steps_equal_two_then_a_save_and_restore_then_two_bit_for_bit(cache, tmp_path):
    whole = make_trainer(cache, tmp_path / "whole")
    expected = [float(train_step(whole, step)[0]) for step in range(4)]
    first = make_trainer(cache, tmp_path / "first")
    losses = [float(train_step(first, step)[0]) for step in range(2)]
    path = checkpoint.save(first, 2, first.run_dir)
    second = make_trainer(cache, tmp_path / "second")
    start = checkpoint.restore(second, path)
    losses += [float(train_step(second, step)[0]) for step in range(start, 4)]
    assert losses == expected
    assert expected[2] != expected[3]  # the steps differ, so equal lists mean the same steps


def test_the_checkpoint_holds_the_run_state_and_every_tensor_file_loads_with_weights_only(trained):
    trainer, path = trained
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.pt", "optimizer.pt", "rng_rank0.pt", "state.json"]
    state = checkpoint.read_state(path)
    assert state == {
        "format_version": checkpoint.FORMAT_VERSION,
        "steps_done": 2,
        "world_size": 1,
        "parallelism": "single",
        "loader": {"epoch": 0, "batch_index": 2},
        "lr_schedule": {"steps_done": 2, "lr": lr_at(2, trainer.config.training)},
    }
    assert checkpoint.load_config(path) == trainer.config
    for file in path.glob("*.pt"):
        assert torch.load(file, weights_only=True), file  # raises on any pickled object
    optimizer = checkpoint.load_tensors(path, "optimizer.pt")
    assert "layers.0.attention.wqkv.weight" in optimizer["state"]  # keyed by name: loads under any wrapper
    rng = checkpoint.load_tensors(path, "rng_rank0.pt")
    assert rng.keys() == {"cpu", "python", "numpy"}


def test_load_model_state_gives_the_weights_under_the_plain_parameter_names(trained):
    trainer, path = trained
    weights = checkpoint.load_model_state(path)
    plain = Transformer(trainer.config.model, max_seq_len=32).state_dict()
    assert weights.keys() == plain.keys()
    assert_same_tensors(weights, trainer.model.state_dict())


def test_only_the_newest_step_checkpoints_are_kept_and_named_ones_never_pruned(cache, tmp_path):
    trainer = make_trainer(cache, tmp_path / "run", "training.keep_checkpoints=2")
    for steps in (1, 2, 3):
        checkpoint.save(trainer, steps, trainer.run_dir)
    checkpoint.save(trainer, 3, trainer.run_dir, name="nan_grad_step_3")
    directory = trainer.run_dir / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["nan_grad_step_3", "step_2", "step_3"]
    checkpoint.save(trainer, 1, trainer.run_dir)  # older than the rest, but just written: kept
    assert sorted(p.name for p in directory.iterdir()) == ["nan_grad_step_3", "step_1", "step_3"]


def test_an_interrupted_save_is_ignored_by_latest_and_cleaned_by_the_next_save(trained):
    trainer, path = trained
    directory = path.parent
    unfinished = directory / "step_9.tmp"
    unfinished.mkdir()
    (unfinished / "state.json").write_text('{"steps_done": 9}')  # written, but never renamed into place
    (directory / "step_8").mkdir()  # no state.json: not a checkpoint
    assert checkpoint.latest(directory) == path
    checkpoint.save(trainer, 3, trainer.run_dir)
    assert not unfinished.exists()
    assert checkpoint.latest(directory) == directory / "step_3"


def test_a_checkpoint_moved_aside_by_an_interrupted_replace_is_put_back_by_the_next_save(trained):
    trainer, path = trained
    aside = path.with_name("step_2.old")
    os.rename(path, aside)  # killed between moving the old step_2 aside and renaming the new one in
    checkpoint.save(trainer, 3, trainer.run_dir)
    assert checkpoint.read_state(path)["steps_done"] == 2 and not aside.exists()


def test_a_model_of_another_width_is_refused_naming_the_key(trained, cache, tmp_path):
    _, path = trained
    narrower = make_trainer(cache, tmp_path / "other", "model.dim=64", "model.ffn_dim=192")
    with pytest.raises(CheckpointError) as error:
        checkpoint.restore(narrower, path)
    assert one_line_error(error) == (
        f"checkpoint {path} is for a different model: model.dim is 128 there, 64 "
        "here; resume with the same model config or start fresh"
    )


def test_tensors_that_do_not_fit_the_model_are_refused_naming_the_first_one(trained, cache, tmp_path):
    _, path = trained
    weights = checkpoint.load_tensors(path, "model.pt")
    weights["output.weight"] = weights["output.weight"][:100]
    torch.save(weights, path / "model.pt")
    with pytest.raises(CheckpointError) as error:
        checkpoint.restore(make_trainer(cache, tmp_path / "other"), path)
    assert one_line_error(error) == (
        f"checkpoint {path} is for a different model: output.weight is of shape "
        "[100, 128] there, of shape [257, 128] here; resume with the same model config "
        "or start fresh"
    )


def test_a_directory_that_is_not_a_complete_checkpoint_is_refused_with_what_is_wrong(trained, cache, tmp_path):
    _, path = trained
    trainer = make_trainer(cache, tmp_path / "other")
    with pytest.raises(CheckpointError) as error:
        checkpoint.restore(trainer, tmp_path)
    assert "no state.json (not a checkpoint, or an unfinished save)" in one_line_error(error)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError) as error:
        checkpoint.restore(trainer, path)
    assert one_line_error(error) == (
        f"checkpoint {path} is incomplete: optimizer.pt is missing; use another checkpoint of the run"
    )


def test_a_pickled_object_in_a_tensor_file_is_refused_not_run(trained, cache, tmp_path):
    _, path = trained
    torch.save({"cpu": torch.get_rng_state(), "payload": Path("/")}, path / "rng_rank0.pt")  # a class, pickled
    with pytest.raises(CheckpointError) as error:
        checkpoint.restore(make_trainer(cache, tmp_path / "other"), path)
    assert one_line_error(error).startswith(f"checkpoint {path}: cannot read rng_rank0.pt (")


class RunsCode:
    """Unpickling this calls os.system: what a hostile checkpoint would do."""

    def __reduce__(self):
        return os.system, ("true",)


def test_dcp_metadata_naming_anything_but_checkpoint_classes_is_refused_unread(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    with pytest.raises(CheckpointError) as error:
        checkpoint.read_dcp_metadata(tmp_path)
    assert one_line_error(error) == (
        f"checkpoint {tmp_path}: cannot read dcp/.metadata (posix.system is not part "
        "of checkpoint metadata); use another checkpoint of the run"
    )


def test_a_bigger_batch_continues_after_the_windows_already_read(trained, cache, tmp_path):
    saved, path = trained  # 2 steps of 1 x 2 windows: 4 windows read
    halves = [next(saved.batches) for _ in range(2)]
    bigger = make_trainer(cache, tmp_path / "bigger", "training.batch_size=4")
    checkpoint.restore(bigger, path)
    assert bigger.loader.state_dict() == {"epoch": 0, "batch_index": 1}
    x, y = next(bigger.batches)
    assert torch.equal(x, torch.cat([halves[0][0], halves[1][0]])) and torch.equal(y, torch.cat([halves[0][1], halves[1][1]]))


def test_a_data_position_that_is_not_a_whole_batch_of_the_new_run_is_refused(trained, cache, tmp_path):
    _, path = trained
    with pytest.raises(CheckpointError) as error:
        checkpoint.restore(make_trainer(cache, tmp_path / "other", "training.batch_size=8"), path)
    assert one_line_error(error) == (
        f"checkpoint {path} stopped 4 windows into epoch 0 (1 rank(s) x batch 2), not a whole number of batches "
        "of 1 rank(s) x batch 8; resume with 1 rank(s) and training.batch_size 2"
    )


def mark_format_1(path: Path) -> None:
    """Rewrite checkpoint path's state.json as format 1 wrote it: no parallelism or lr_schedule."""
    state = checkpoint.read_state(path)
    for key in ("parallelism", "lr_schedule"):
        del state[key]
    (path / "state.json").write_text(json.dumps(state | {"format_version": 1}))


def test_a_format_1_checkpoint_restores_its_weights_and_adam_moments(trained, cache, tmp_path):
    saved, path = trained
    # Format 1: the optimizer's own numbered state dict, torch's CPU generator only.
    torch.save(saved.optimizer.state_dict(), path / "optimizer.pt")
    torch.save({"cpu": torch.get_rng_state()}, path / "rng_rank0.pt")
    mark_format_1(path)
    fresh = make_trainer(cache, tmp_path / "fresh")
    assert checkpoint.restore(fresh, path) == 2
    assert_same_tensors(fresh.optimizer.state_dict()["state"], saved.optimizer.state_dict()["state"])
    assert_same_tensors(fresh.model.state_dict(), saved.model.state_dict())


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
def test_a_checkpoint_of_the_separate_layout_resumes_to_the_losses_of_an_uninterrupted_run_with_a_note(
    cache, tmp_path, capsys, sharded
):
    whole = make_trainer(cache, tmp_path / "whole")
    expected = [float(train_step(whole, step)[0]) for step in range(4)]
    first = make_trainer(cache, tmp_path / "first")
    losses = [float(train_step(first, step)[0]) for step in range(2)]
    path = checkpoint.save(first, 2, first.run_dir)
    if sharded:
        as_sharded(path)
    as_separate_layout(path, first.config.model)  # wq/wk/wv, w1/w3 and their Adam moments, as written before the fusion
    assert "layers.0.attention.wq.weight" in checkpoint.load_model_state(path, as_saved=True)

    second = make_trainer(cache, tmp_path / "second")
    second.log.setLevel("INFO")
    capsys.readouterr()
    start = checkpoint.restore(second, path)
    assert (
        f"Checkpoint {path} has the separate wq/wk/wv and w1/w3 weights of the layout before the fused projections; "
        "converted them to wqkv and w13, their optimizer state too"
    ) in capsys.readouterr().out
    assert_same_tensors(second.optimizer.state_dict()["state"], first.optimizer.state_dict()["state"])
    losses += [float(train_step(second, step)[0]) for step in range(start, 4)]
    assert losses == expected
    # The readers (generate, evaluate, export) get the fused weights too.
    assert_same_tensors(checkpoint.load_model_state(path), {k: v for k, v in first.model.state_dict().items()})


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
def test_an_export_reads_a_separate_layout_checkpoints_weights_fused_under_the_models_names(trained, sharded):
    saved, path = trained
    if sharded:
        as_sharded(path)
    as_separate_layout(path, saved.config.model)
    _, shapes, tensors = checkpoint_tensors(path)
    assert "layers.0.attention.wqkv.weight" in shapes and "layers.0.attention.wq.weight" not in shapes
    expected = saved.model.state_dict()
    assert shapes == {name: tuple(value.shape) for name, value in expected.items()}
    assert_same_tensors(dict(tensors), dict(expected))


def test_a_separate_layout_optimizer_state_whose_parts_disagree_is_reset_and_the_note_says_so(trained, cache, tmp_path, capsys):
    saved, path = trained
    as_separate_layout(path, saved.config.model)
    optimizer = checkpoint.load_tensors(path, "optimizer.pt")
    optimizer["state"]["layers.1.feed_forward.w3.weight"]["step"] = torch.tensor(7.0)  # not w1's step
    torch.save(optimizer, path / "optimizer.pt")
    fresh = make_trainer(cache, tmp_path / "fresh")
    fresh.log.setLevel("INFO")
    capsys.readouterr()
    checkpoint.restore(fresh, path)
    assert "but the optimizer state of layers.1.feed_forward.w13.weight could not be combined and starts afresh" in (
        capsys.readouterr().out
    )
    assert_same_tensors(fresh.model.state_dict(), saved.model.state_dict())
    state = named_optimizer_state(fresh.optimizer, fresh.model)["state"]
    expected = named_optimizer_state(saved.optimizer, saved.model)["state"]
    assert "layers.1.feed_forward.w13.weight" not in state  # a fresh start: no moments yet
    assert_same_tensors(state["layers.1.attention.wqkv.weight"], expected["layers.1.attention.wqkv.weight"])


SEPARATE_BLOCK_ORDER = [
    "attention_norm.weight",
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "attention.wo.weight",
    "ffn_norm.weight",
    "feed_forward.w1.weight",
    "feed_forward.w2.weight",
    "feed_forward.w3.weight",
]
"""A block's weights in the order the model before the fused projections registered them."""


def separate_layout_position(name: str) -> tuple[int, int, int]:
    """Where the model before the fused projections had the weight called name among its parameters."""
    if name.startswith("layers."):
        _, layer, rest = name.split(".", 2)
        return (1, int(layer), SEPARATE_BLOCK_ORDER.index(rest))
    return ({"tok_embed.weight": 0, "norm.weight": 2, "output.weight": 3}[name], 0, 0)


def test_a_format_1_checkpoint_of_the_separate_layout_restores_its_weights_and_adam_moments(trained, cache, tmp_path):
    saved, path = trained
    as_separate_layout(path, saved.config.model)
    # Format 1: the optimizer's numbered state, numbered in the order the separate layout's
    # modules registered their weights (written out here, not derived from the code under test).
    named = checkpoint.load_tensors(path, "optimizer.pt")
    order = [name for group in named["param_groups"] for name in sorted(group["params"], key=separate_layout_position)]
    numbered = {order.index(name): value for name, value in named["state"].items()}
    groups = [{**group, "params": [order.index(name) for name in group["params"]]} for group in named["param_groups"]]
    torch.save({"state": numbered, "param_groups": groups}, path / "optimizer.pt")
    mark_format_1(path)
    fresh = make_trainer(cache, tmp_path / "fresh")
    assert checkpoint.restore(fresh, path) == 2
    assert "layers.0.attention.wqkv.weight" in fresh.model.state_dict()  # restored into the fused layout
    assert_same_tensors(fresh.optimizer.state_dict()["state"], saved.optimizer.state_dict()["state"])
    assert_same_tensors(fresh.model.state_dict(), saved.model.state_dict())


# --- resuming, saving and pruning in a run's own directory --------------------------------


def test_resuming_an_earlier_checkpoint_of_the_same_run_sets_its_later_ones_aside(cache, tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = make_trainer(cache, run_dir, "training.keep_checkpoints=3")
    for steps in (1, 2, 3):
        checkpoint.save(first, steps, run_dir)
    directory = run_dir / "checkpoints"
    checkpoint.restore(make_trainer(cache, tmp_path / "elsewhere"), directory / "step_1")
    assert sorted(p.name for p in directory.iterdir()) == ["step_1", "step_2", "step_3"]  # not the run it writes

    again = make_trainer(cache, run_dir, "training.keep_checkpoints=3")
    assert checkpoint.restore(again, directory / "step_1") == 1
    assert sorted(p.name for p in directory.iterdir()) == ["step_1", "step_2.superseded", "step_3.superseded"]
    assert (
        f"Resuming step_1 abandons the run's later checkpoints; renamed step_2.superseded, step_3.superseded "
        f"in {directory} (kept, but never resumed or pruned automatically)"
    ) in capsys.readouterr().out
    checkpoint.save(again, 2, run_dir)
    assert checkpoint.latest(directory) == directory / "step_2"  # --resume auto continues the new run
    assert checkpoint.read_state(directory / "step_3.superseded")["steps_done"] == 3  # the user's data, intact


def test_a_name_taken_by_an_earlier_supersede_gets_a_number(tmp_path):
    directory = tmp_path / "checkpoints"
    for name in ("step_1", "step_2", "step_2.superseded"):
        (directory / name).mkdir(parents=True)
    assert files.supersede_after(directory, 1) == [directory / "step_2.superseded.2"]


def test_a_checkpoint_past_the_runs_last_step_is_refused(trained, cache, tmp_path):
    _, path = trained  # 2 steps done
    with pytest.raises(CheckpointError) as error:
        checkpoint.restore(make_trainer(cache, tmp_path / "shorter", "training.max_steps=1"), path)
    assert one_line_error(error) == (
        f"checkpoint {path} has 2 steps done, more than training.max_steps 1; raise --max-steps or resume an earlier checkpoint"
    )
    assert checkpoint.restore(make_trainer(cache, tmp_path / "done", "training.max_steps=2"), path) == 2


def test_a_prune_killed_midway_leaves_nothing_that_passes_for_a_checkpoint(cache, tmp_path, monkeypatch):
    trainer = make_trainer(cache, tmp_path / "run", "training.keep_checkpoints=1")
    directory = trainer.run_dir / "checkpoints"
    checkpoint.save(trainer, 3, trainer.run_dir)

    def killed(path, *args, **kwargs):  # the weights are gone, state.json is not, when the process dies
        (Path(path) / "model.pt").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(trainer, 1, trainer.run_dir)  # the newest other, step_3, is pruned
    monkeypatch.undo()
    assert sorted(p.name for p in directory.iterdir()) == ["step_1", "step_3.deleting"]
    assert checkpoint.latest(directory) == directory / "step_1"
    checkpoint.save(trainer, 2, trainer.run_dir)
    assert sorted(p.name for p in directory.iterdir()) == ["step_2"]


def test_a_full_disk_during_a_save_is_one_line_naming_the_file(cache, tmp_path, monkeypatch):
    trainer = make_trainer(cache, tmp_path / "run")

    def full(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file "
            "data/0: file write failed\nException raised from write_record at ..."
        )

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError) as error:
        checkpoint.save(trainer, 1, trainer.run_dir)
    file = trainer.run_dir / "checkpoints" / "step_1.tmp" / "rng_rank0.pt"
    assert one_line_error(error) == (
        f"cannot write checkpoint file {file} ([enforce fail at inline_container.cc:626] . PytorchStreamWriter "
        "failed writing file data/0: file write failed); make room on its disk (or make it writable) and resume "
        "from the latest checkpoint"
    )
    assert checkpoint.latest(trainer.run_dir / "checkpoints") is None
