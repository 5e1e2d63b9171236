"""Token ids beyond the model's vocabulary (a token file damaged in place, same size, which the
cache's size checks cannot see) are found on the host as a batch is made: one line naming the
file, the byte and `prepare_dataset.py --verify`, exit 2, never an embedding's IndexError
traceback or a device-side assert (pretrain/data/loader.py out_of_vocabulary)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from support.processes import ROOT, launcher_env, one_line_error
from pretrain.data.loader import TokenIdError, TrainBatches, out_of_vocabulary, validation_batches
from support.datasets import HEADER, T, Part, write_dataset

VOCAB = 40000


def dataset(directory: Path, shards: Path, bad: int | None = None, where: str = "train") -> Path:
    """Train in three segments (two of them shards with headers) and val; all ids below 31,000,
    but `bad` at token 300 of the second shard (where="train") or token 17 of val."""
    second = 20000 + np.arange(803)
    val = 30000 + np.arange(601)
    if bad is not None:
        (second if where == "train" else val)[300 if where == "train" else 17] = bad
    train = [
        Part(1000 + np.arange(2001), "tokens.bin"),
        Part(10000 + np.arange(1500), shards / "shard_01.bin", header=HEADER),
        Part(second, shards / "shard_02.bin", header=HEADER),
    ]
    return write_dataset(directory, train=train, val=[Part(val, "tokens.bin")])


def every_batch(path: Path, vocab_size: int, num_workers: int = 0) -> int:
    """Batches of a whole epoch and one more, checked against vocab_size."""
    batches = TrainBatches(path, T, batch_size=4, rank=0, world_size=1, seed=3, num_workers=num_workers, vocab_size=vocab_size)
    return len(list(itertools.islice(batches, batches.batches_per_epoch + 1)))


def test_the_first_id_beyond_the_vocabulary_is_found_in_its_row_and_window_column():
    windows = torch.arange(3 * (T + 1)).reshape(3, T + 1)
    assert out_of_vocabulary((windows[:, :-1], windows[:, 1:]), 27) is None  # the largest is 26
    windows[1, 0] = windows[2, 5] = 27  # an input-only id (the first column) counts too
    assert out_of_vocabulary((windows[:, :-1], windows[:, 1:]), 27) == (1, 0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_damaged_token_in_a_shard_stops_training_naming_the_file_and_the_byte(tmp_path, num_workers):
    shards = tmp_path / "shards"
    shards.mkdir()
    path = dataset(tmp_path / "data", shards, bad=65535)
    with pytest.raises(TokenIdError) as error:
        every_batch(path, VOCAB, num_workers)
    assert one_line_error(error) == (
        f"{shards / 'shard_02.bin'}: token id 65,535 at byte {HEADER + 300 * 2:,} is beyond the model's vocabulary "
        f"of 40,000: the prepared dataset {path} is damaged; check it with `python3 prepare_dataset.py --verify` "
        "(with the run's --preset/--config/--set options) and rebuild it with `--force`"
    )


def test_ids_up_to_the_last_one_of_the_vocabulary_pass(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    path = dataset(tmp_path / "data", shards, bad=VOCAB - 1)
    assert every_batch(path, VOCAB) > 0
    with pytest.raises(TokenIdError):
        every_batch(path, VOCAB - 1)


def test_a_damaged_validation_token_is_found_when_the_validation_batches_are_made(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    path = dataset(tmp_path / "data", shards, bad=VOCAB, where="val")
    every_batch(path, VOCAB)  # train is intact
    with pytest.raises(TokenIdError) as error:
        validation_batches(path, T, batch_size=4, rank=0, world_size=1, num_batches=10, vocab_size=VOCAB)
    offset = (2001 + 17) * 2  # in tokens.bin, val follows train's 2,001 tokens
    assert one_line_error(error).startswith(f"{path / 'tokens.bin'}: token id 40,000 at byte {offset:,} is beyond")


# --- a whole training process -----------------------------------------------------------------


def prepared_debug_dataset(cache: Path) -> Path:
    result = subprocess.run(
        [sys.executable, str(ROOT / "prepare_dataset.py"), "--debug", "--set", f"data.cache_dir={cache}"],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    (tokens,) = cache.glob("*/tokens.bin")
    return tokens


@pytest.mark.parametrize("part", ["train", "val"])
@pytest.mark.slow
def test_training_on_a_token_file_damaged_in_place_exits_2_with_one_line_and_no_traceback(tmp_path, part):
    tokens = prepared_debug_dataset(tmp_path / "cache")
    size = tokens.stat().st_size
    val_start = json.loads((tokens.parent / "meta.json").read_text())["splits"]["val"][0]["offset"]
    with open(tokens, "r+b") as file:  # same size: only --verify's checksums could tell
        file.seek(0 if part == "train" else val_start)
        file.write(b"\xff" * (val_start if part == "train" else 2000))
    assert tokens.stat().st_size == size
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "pretrain_main.py"),
            "--debug",
            "--max-steps",
            "3",
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output and "IndexError" not in output
    errors = [line for line in output.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1, output[-3000:]
    assert f"{tokens}: token id 65,535 at byte" in errors[0] and "prepare_dataset.py --verify" in errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained on damaged data was saved
