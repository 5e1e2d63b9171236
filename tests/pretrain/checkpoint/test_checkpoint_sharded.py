"""Sharded (DCP) checkpoints: two FSDP2 gloo ranks saving and restoring exactly, and crafted DCP
checkpoints refused without unpickling anything."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from support.processes import ROOT, free_port, one_line_error
from pretrain.checkpoint import dcp_files, save_restore as checkpoint
from pretrain.checkpoint.save_restore import CheckpointError
from pretrain.model.transformer import Transformer
from pretrain.checkpoint.model_state import named_optimizer_state
from pretrain.distributed.parallel import is_fsdp
from pretrain.distributed.runtime import setup_logging
from pretrain.build import Trainer, build
from pretrain.train import train_step
from support.checkpointing import as_separate_layout, as_sharded, assert_same_tensors, make_trainer, resolved, trained_trainer


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def trained(cache, tmp_path) -> tuple[Trainer, Path]:
    return trained_trainer(cache, tmp_path)


# --- hostile DCP checkpoints ------------------------------------------------------------


class TouchesFile:
    """Unpickling this creates marker: proof that reading a checkpoint ran its code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def make_hostile(path: Path, marker: Path) -> None:
    """Turn a full checkpoint into a DCP one whose first Adam `step` is a pickled object that
    runs code when unpickled: DCP stores a non-tensor value as bytes and its planner reads them
    back with torch.load(weights_only=False)."""
    model = checkpoint.load_tensors(path, "model.pt")
    state = {name: dict(value) for name, value in checkpoint.load_tensors(path, "optimizer.pt")["state"].items()}
    state[next(iter(state))]["step"] = TouchesFile(marker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model, "optimizer": {"state": state}}, storage_writer=FileSystemWriter(path / "dcp"), no_dist=True)
    (path / "model.pt").unlink()
    (path / "optimizer.pt").unlink()


@pytest.fixture
def hostile(trained, tmp_path) -> tuple[Path, Path]:
    """A DCP checkpoint holding a pickled object, and the file the object would create."""
    _, path = trained
    marker = tmp_path / "code-ran"
    make_hostile(path, marker)
    return path, marker


def test_a_dcp_checkpoint_holding_a_pickled_value_is_refused_before_anything_loads(hostile, cache, tmp_path):
    path, marker = hostile
    fresh = make_trainer(cache, tmp_path / "fresh")
    before = {key: value.clone() for key, value in fresh.model.state_dict().items()}
    with pytest.raises(CheckpointError) as error:
        checkpoint.restore(fresh, path)
    assert one_line_error(error).startswith(f"checkpoint {path}: dcp/.metadata declares optimizer.state.")
    assert one_line_error(error).endswith(
        ".step as pickled bytes, which this code never writes (only tensors) and "
        "will not unpickle; use another checkpoint of the run"
    )
    assert_same_tensors(fresh.model.state_dict(), before)
    with pytest.raises(CheckpointError):
        checkpoint.load_model_state(path)  # generate and export read it too
    assert not marker.exists()


def test_the_dcp_reader_refuses_a_pickled_value_that_gets_past_the_metadata_check(hostile, cache, tmp_path, monkeypatch):
    path, marker = hostile
    monkeypatch.setattr(dcp_files, "_check_tensors_only", lambda *_: None)
    with pytest.raises(CheckpointError) as error:
        checkpoint.restore(make_trainer(cache, tmp_path / "fresh"), path)
    assert one_line_error(error) == (
        f"checkpoint {path}: a DCP entry is pickled bytes, which this code never "
        "writes (only tensors) and will not unpickle; use another checkpoint of the run"
    )
    assert not marker.exists()


def test_the_dcp_load_planner_never_unpickles_a_value(tmp_path):
    marker = tmp_path / "code-ran"
    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex("optimizer.state.w.step"),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex("optimizer.state.w.step"),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )
    payload = io.BytesIO()
    torch.save(TouchesFile(marker), payload)
    payload.seek(0)
    with pytest.raises(CheckpointError, match="entry optimizer.state.w.step: a DCP entry is pickled bytes"):
        dcp_files.TensorsOnlyPlanner().load_bytes(item, payload)
    assert not marker.exists()


# --- FSDP2: two gloo ranks ------------------------------------------------------------


def gathered(tensors: dict) -> dict[str, torch.Tensor]:
    """Full tensors of a state dict whose values may be DTensors (a collective under FSDP)."""
    return {key: value.full_tensor() if hasattr(value, "full_tensor") else value for key, value in tensors.items()}


@contextlib.contextmanager
def fsyncs_recorded() -> Iterator[list[str]]:
    """The names of the files and directories this process fsyncs inside."""
    names: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        names.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real(fd)

    os.fsync = recording
    try:
        yield names
    finally:
        os.fsync = real


def fsdp_worker(cache: str, out: str, single_checkpoint: str, separate_checkpoint: str) -> None:
    """One of two FSDP2 ranks: train 2 steps, save (DCP), train 2 more; a fresh trainer restores
    the save and trains the same 2; a third restores the single-process checkpoint, a fourth the
    same as a DCP checkpoint of the separate layout (before the fused projections). Writes what
    it saw to out/rank<r>.json and, on rank 0, full tensors to out/*.pt."""
    from pretrain.distributed.runtime import init_runtime, shutdown

    config, dataset = resolved(Path(cache), "training.parallelism=fsdp", world_size=2)
    runtime = init_runtime(config)
    log = setup_logging(runtime.label, "WARNING")
    out_dir = Path(out)

    def fresh(name: str) -> Trainer:
        trainer = build(config, runtime, dataset, out_dir / name, log)
        assert is_fsdp(trainer.model)
        return trainer

    first = fresh("run")
    for step in range(2):
        train_step(first, step)
    with fsyncs_recorded() as synced:
        path = checkpoint.save(first, 2, first.run_dir)
    saved_weights = gathered(first.model.state_dict())
    continued = [float(train_step(first, step)[0]) for step in (2, 3)]

    second = fresh("second")
    assert checkpoint.restore(second, path) == 2
    resumed = [float(train_step(second, step)[0]) for step in (2, 3)]

    third = fresh("third")
    checkpoint.restore(third, Path(single_checkpoint))
    from_single = gathered(third.model.state_dict())
    moments = {
        name: gathered(state)["exp_avg"] for name, state in named_optimizer_state(third.optimizer, third.model)["state"].items()
    }
    draw = torch.rand(2).tolist()

    fourth = fresh("fourth")
    checkpoint.restore(fourth, Path(separate_checkpoint))
    from_separate = gathered(fourth.model.state_dict())
    separate_moments = {
        name: gathered(state)["exp_avg"] for name, state in named_optimizer_state(fourth.optimizer, fourth.model)["state"].items()
    }
    if runtime.is_main:
        torch.save(saved_weights, out_dir / "saved_weights.pt")
        torch.save({"weights": from_single, "exp_avg": moments}, out_dir / "from_single.pt")
        torch.save({"weights": from_separate, "exp_avg": separate_moments}, out_dir / "from_separate.pt")
    (out_dir / f"rank{runtime.rank}.json").write_text(
        json.dumps({"checkpoint": str(path), "continued": continued, "resumed": resumed, "draw": draw, "synced": synced})
    )
    shutdown(runtime, peers_alive=True)


@pytest.mark.slow
def test_fsdp_ranks_save_shards_that_restore_exactly_and_load_whole_in_one_process(cache, tmp_path):
    single = make_trainer(cache, tmp_path / "single")
    for step in range(2):
        train_step(single, step)
    single_path = checkpoint.save(single, 2, single.run_dir)
    after_save = torch.rand(2).tolist()  # the draw rank 0 must repeat after restoring single_path
    separate_path = tmp_path / "separate" / "step_2"
    shutil.copytree(single_path, separate_path)
    as_sharded(separate_path)
    as_separate_layout(separate_path, single.config.model)
    assert "layers.0.attention.wq.weight" in checkpoint.load_model_state(separate_path, as_saved=True)
    port = free_port()
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import test_checkpoint_sharded; test_checkpoint_sharded.fsdp_worker({str(cache)!r}, "
                f"{str(tmp_path)!r}, {str(single_path)!r}, {str(separate_path)!r}); "
                "from pretrain.distributed.runtime import exit_process; exit_process(0)",
            ],
            cwd=ROOT,
            env=dict(
                os.environ,
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(Path(__file__).parent)]),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE="2",
                OMP_NUM_THREADS="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [worker.communicate(timeout=120)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], "\n".join(outputs)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    # Each rank made its own files durable before the checkpoint was renamed into place; rank 0
    # only its own, and the directories.
    synced = [set(seen["synced"]) for seen in ranks]
    assert {"rng_rank0.pt", "step_2.tmp", "dcp", "checkpoints"} <= synced[0]
    assert "rng_rank1.pt" in synced[1] and any(name.startswith("__1_") for name in synced[1])
    assert not any(name.startswith("__1_") or name == "rng_rank1.pt" for name in synced[0])
    assert not synced[1] & {"step_2.tmp", "dcp", "checkpoints"}

    # Each rank continues from the restored shards exactly as the rank that saved them.
    for seen in ranks:
        assert seen["resumed"] == seen["continued"]
    path = Path(ranks[0]["checkpoint"])
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "dcp", "rng_rank0.pt", "rng_rank1.pt", "state.json"]
    assert checkpoint.read_state(path)["parallelism"] == "fsdp"
    assert not any(
        isinstance(item, BytesStorageMetadata)  # nothing DCP would unpickle
        for item in checkpoint.read_dcp_metadata(path).state_dict_metadata.values()
    )

    # One process, no process group: the whole model, plain names, the gathered weights.
    saved_weights = torch.load(tmp_path / "saved_weights.pt", weights_only=True)
    whole = checkpoint.load_model_state(path)
    assert whole.keys() == Transformer(single.config.model, 32).state_dict().keys()
    assert_same_tensors(whole, saved_weights)

    # The sharded checkpoint restores into one process (DCP reshards; the data position converts).
    alone = make_trainer(cache, tmp_path / "alone")
    checkpoint.restore(alone, path)
    assert_same_tensors(alone.model.state_dict(), saved_weights)
    assert alone.loader.state_dict() == {"epoch": 0, "batch_index": 4}  # 2 ranks x 2 micro-batches of 2

    # The single-process checkpoint restored into FSDP: the same weights and Adam moments; rank 0
    # took up the saved random stream, rank 1 (which the single run did not have) a fresh one.
    from_single = torch.load(tmp_path / "from_single.pt", weights_only=True)
    assert_same_tensors(from_single["weights"], single.model.state_dict())
    expected_moments = named_optimizer_state(single.optimizer, single.model)["state"]
    assert_same_tensors(from_single["exp_avg"], {k: v["exp_avg"] for k, v in expected_moments.items()})
    assert ranks[0]["draw"] == after_save and ranks[1]["draw"] != after_save
    assert "has no random state for rank 1" in outputs[1]

    # A DCP checkpoint of the separate layout restored into FSDP: each rank's rows of wqkv and w13
    # (rank 1's wqkv rows span wk's and wv's) from their parts, the same weights and Adam moments.
    from_separate = torch.load(tmp_path / "from_separate.pt", weights_only=True)
    assert_same_tensors(from_separate["weights"], single.model.state_dict())
    assert_same_tensors(from_separate["exp_avg"], {k: v["exp_avg"] for k, v in expected_moments.items()})
