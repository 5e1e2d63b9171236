"""Segments, window counts and run length from meta.json: pretrain/data/windows.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pretrain.data import DataError
from pretrain.data.windows import (
    REBUILD_HINT,
    RunLength,
    Segment,
    check_segment_file,
    open_segment,
    plan_run,
    segments,
    split_window_count,
    window_count,
)

ROOT = Path(__file__).resolve().parents[3]


def meta_with(train: list[int], val: list[int] | None = None) -> dict:
    """A meta.json whose splits have segments of these token counts (files never read)."""

    def entries(counts: list[int], name: str) -> list[dict]:
        return [{"file": f"{name}{i}.bin", "offset": 0, "tokens": n, "dtype": "uint16"} for i, n in enumerate(counts)]

    return {
        "format_version": 2,
        "splits": {"train": entries(train, "train"), "val": entries(val or [100], "val")},
        "tokens": {"train": sum(train)},
        "tokenizer": {"ignored": True},
    }


# --- segments --------------------------------------------------------------------------------------


def test_segments_are_read_from_the_split_in_order_with_every_field():
    meta = {
        "splits": {
            "train": [
                {"file": "a.bin", "offset": 0, "tokens": 10, "dtype": "uint16"},
                {"file": "/data/b.bin", "offset": 1024, "tokens": 7, "dtype": "uint32"},
            ]
        }
    }

    assert segments(meta, "train") == [Segment("a.bin", 0, 10, "uint16"), Segment("/data/b.bin", 1024, 7, "uint32")]
    assert segments(meta, "train")[1].nbytes == 28


def test_a_relative_file_is_inside_the_dataset_and_an_absolute_one_is_used_in_place(tmp_path):
    assert Segment("tokens.bin", 0, 1, "uint16").path(tmp_path) == tmp_path / "tokens.bin"
    assert Segment("/shards/x.bin", 1024, 1, "uint16").path(tmp_path) == Path("/shards/x.bin")


@pytest.mark.parametrize(
    "meta, problem",
    [
        ({"format_version": 1, "tokens": {"train": 5}, "dtype": "uint16"}, "no 'train' split"),
        ({"splits": {"val": []}}, "no 'train' split"),
        ({"splits": {"train": {"file": "a.bin"}}}, "no 'train' split"),
        ({"splits": {"train": ["a.bin"]}}, "train segment 0 is not an object"),
        ({"splits": {"train": [{"offset": 0, "tokens": 1, "dtype": "uint16"}]}}, "train segment 0 has no file"),
        ({"splits": {"train": [{"file": "a", "offset": -1, "tokens": 1, "dtype": "uint16"}]}}, "has offset -1"),
        ({"splits": {"train": [{"file": "a", "offset": 0, "tokens": "9", "dtype": "uint16"}]}}, "has tokens '9'"),
        ({"splits": {"train": [{"file": "a", "offset": 0, "tokens": True, "dtype": "uint16"}]}}, "has tokens True"),
        ({"splits": {"train": [{"file": "a", "offset": 0, "tokens": 1, "dtype": "int8"}]}}, "has dtype 'int8'"),
    ],
)
def test_a_missing_or_malformed_split_is_a_one_line_error_that_says_to_rebuild(meta, problem):
    with pytest.raises(DataError) as error:
        segments(meta, "train")

    message = str(error.value)
    assert problem in message and "\n" not in message
    assert message.endswith("; rebuild it with `python3 prepare_dataset.py --force`") and REBUILD_HINT in message


# --- windows ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_tokens, windows", [(0, 0), (1, 0), (8, 0), (9, 1), (16, 1), (17, 2), (1000, 124)])
def test_a_segment_of_n_tokens_holds_n_minus_one_over_t_windows_of_t_plus_one(n_tokens, windows):
    assert window_count(n_tokens, 8) == windows == Segment("a", 0, n_tokens, "uint16").window_count(8)


def test_a_split_counts_windows_per_segment_because_no_window_crosses_two():
    meta = meta_with(train=[16, 16, 9])
    # 41 tokens in one piece would hold 5 windows of 9; in pieces of 16, 16 and 9 only 1 + 1 + 1.
    assert split_window_count(meta, "train", 8) == 3
    assert split_window_count(meta, "val", 8) == window_count(100, 8)


# --- files -----------------------------------------------------------------------------------------


def test_a_segment_file_is_mapped_read_only_from_its_byte_offset(tmp_path):
    (tmp_path / "shard.bin").write_bytes(b"\xff" * 1024 + np.arange(5, dtype="<u4").tobytes() + b"\xee" * 4)
    tokens = open_segment(tmp_path, Segment("shard.bin", 1024, 5, "uint32"))

    assert tokens.tolist() == [0, 1, 2, 3, 4]
    assert isinstance(tokens, np.memmap) and tokens.mode == "r"
    with pytest.raises(ValueError):
        tokens[0] = 1


@pytest.mark.parametrize("size, found", [(None, "missing"), (1024 + 2 * 9, "1,042 bytes on disk")])
def test_a_missing_or_short_segment_file_is_refused_naming_the_file_and_the_sizes(tmp_path, size, found):
    if size is not None:
        (tmp_path / "shard.bin").write_bytes(b"\0" * size)
    segment = Segment("shard.bin", 1024, 10, "uint16")

    with pytest.raises(DataError) as error:
        check_segment_file(tmp_path, segment)

    message = str(error.value)
    assert message.startswith(
        f"{tmp_path / 'shard.bin'}: {found}, but meta.json promises 10 tokens of uint16 "
        "from byte 1,024 (1,044 bytes); rebuild it with"
    )
    assert "\n" not in message
    (tmp_path / "shard.bin").write_bytes(b"\0" * 1044)
    assert check_segment_file(tmp_path, segment) == tmp_path / "shard.bin"


# --- run length ------------------------------------------------------------------------------------


def test_plan_run_counts_whole_optimizer_steps_per_epoch_on_every_rank():
    meta = meta_with(train=[4801 * 128 + 1])  # 4,801 windows of 129
    run = plan_run(meta, context_length=128, batch_size=8, grad_accum=4, world_size=2, epochs=2, max_steps=999)

    assert run == RunLength(
        windows=4801,
        steps_per_epoch=75,
        total_steps=150,
        tokens_per_step=8 * 128 * 4 * 2,
        epochs=2.0,
        batch_size=8,
        context_length=128,
        grad_accum=4,
        world_size=2,
        train_tokens=4801 * 128 + 1,
    )
    assert run.describe() == (
        "75 optimizer steps per epoch of 4,801 windows; 2 epochs = 150 steps; "
        "8,192 tokens per step (batch 8 x context 128 x accum 4 x 2 ranks); "
        "reads 1,228,800 tokens of 614,529 prepared: repeats the data ~2.0 times"
    )


def test_plan_run_without_epochs_runs_max_steps_and_says_how_many_epochs_that_is():
    meta = meta_with(train=[1000 * 16 + 1])  # 1,000 windows of 17
    run = plan_run(meta, context_length=16, batch_size=10, grad_accum=1, world_size=1, epochs=0, max_steps=250)

    assert (run.steps_per_epoch, run.total_steps, run.epochs, run.tokens_per_step) == (100, 250, 2.5, 160)
    assert run.describe() == (
        "100 optimizer steps per epoch of 1,000 windows; 250 steps = 2.50 epochs; "
        "160 tokens per step (batch 10 x context 16 x accum 1 x 1 rank); "
        "reads 40,000 tokens of 16,001 prepared: repeats the data ~2.5 times"
    )


def test_a_run_shorter_than_an_epoch_says_how_much_of_the_prepared_data_it_reads_and_no_repeat():
    meta = meta_with(train=[6 * 10**9 // 1024 * 1024 + 1])  # a large train split: only counted
    run = plan_run(meta, context_length=1024, batch_size=16, grad_accum=4, world_size=8, epochs=0, max_steps=10_000)

    assert run.tokens == 10_000 * 16 * 1024 * 4 * 8
    assert run.describe().endswith("; reads 5.24B tokens of 6.00B prepared")
    assert "repeats" not in run.describe()


def test_windows_left_over_after_the_last_whole_step_on_every_rank_are_not_a_step():
    meta = meta_with(train=[63 * 8 + 1])  # 63 windows; a step on 2 ranks needs 2 x 4 x 8 = 64
    with pytest.raises(DataError):
        plan_run(meta, context_length=8, batch_size=4, grad_accum=8, world_size=2, epochs=1, max_steps=0)
    assert plan_run(meta, context_length=8, batch_size=4, grad_accum=7, world_size=2, epochs=1, max_steps=0).steps_per_epoch == 1


def test_a_train_split_too_small_for_one_step_is_refused_with_the_numbers_and_the_fix():
    meta = meta_with(train=[6000])
    with pytest.raises(DataError) as error:
        plan_run(meta, context_length=128, batch_size=8, grad_accum=4, world_size=2, epochs=1, max_steps=0)

    assert str(error.value) == (
        "the train split (6,000 tokens) has 46 windows of 129 tokens, fewer than one optimizer step needs: "
        "batch_size 8 x grad_accum_nums 4 x 2 rank(s) = 64; "
        "reduce training.batch_size, training.grad_accum_nums or data.context_length, or add data"
    )
