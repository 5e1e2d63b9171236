"""Memory-mapped, deterministic, rank-sharded batches: pretrain/data/loader.py.

The datasets here are written directly (token files plus a meta.json of format version 2), not
by prepare.py, so these tests pin the file format the loader reads. Every token value occurs once
per split, so a window is known by its first token.
"""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from pretrain.data import DataError
from pretrain.data.loader import TokenWindows, TrainBatches, as_is, validation_batches, validation_split
from support.datasets import HEADER, Part, T, write_dataset


def expected_windows(parts: list[Part]) -> np.ndarray:
    """Every window of the split, segment by segment, computed straight from the definition."""
    return np.array([part.tokens[i * T : i * T + T + 1] for part in parts for i in range((len(part.tokens) - 1) // T)])


class Data(NamedTuple):
    path: Path
    train: np.ndarray  # (windows, T + 1): what window i must be
    val: np.ndarray


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Data:
    """537 train windows in four segments and three files: one beside meta.json shared with val,
    two absolute shards elsewhere with 1,024-byte headers; one segment too short for any window."""
    shards = tmp_path_factory.mktemp("shards")
    train = [
        Part(1000 + np.arange(2001), "tokens.bin"),  # 250 windows
        Part(10000 + np.arange(1500), shards / "shard_01.bin", header=HEADER),  # 187
        Part(15000 + np.arange(5), "tokens.bin"),  # none
        Part(20000 + np.arange(803), shards / "shard_02.bin", header=HEADER),
    ]  # 100
    val = [Part(30000 + np.arange(601), "tokens.bin")]  # 75
    path = write_dataset(tmp_path_factory.mktemp("dataset"), train=train, val=val)
    return Data(path, expected_windows(train), expected_windows(val))


def train_batches(data: Data, **changes) -> TrainBatches:
    args = dict(context_length=T, batch_size=4, rank=0, world_size=1, seed=7, num_workers=0)
    return TrainBatches(data.path, **{**args, **changes})


def take(batches, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(batches, n))


def indices_of(batch_x: torch.Tensor, windows: np.ndarray) -> list[int]:
    """Which windows the rows of batch_x are, by their first token."""
    first = {int(token): i for i, token in enumerate(windows[:, 0])}
    return [first[int(token)] for token in batch_x[:, 0]]


def assert_same_batches(a, b) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# --- windows -------------------------------------------------------------------------------------


def test_windows_are_read_through_read_only_memory_maps(data):
    windows = TokenWindows(data.path, "train", T)

    assert len(windows.maps) == 4
    for tokens in windows.maps:
        assert isinstance(tokens, np.memmap) and tokens.mode == "r"
        with pytest.raises(ValueError):
            tokens[0] = 1


def test_window_i_is_tokens_i_times_t_plus_one_of_its_segment_split_into_input_and_target(data):
    windows = TokenWindows(data.path, "train", T)

    assert len(windows) == len(data.train) == 537
    for i in range(len(windows)):
        x, y = windows[i]
        assert x.tolist() == data.train[i, :-1].tolist() and y.tolist() == data.train[i, 1:].tolist()


@pytest.mark.parametrize("index", [3, -1])
def test_a_window_index_out_of_range_is_refused_rather_than_wrapped_around(tmp_path, index):
    path = write_dataset(tmp_path, train=[Part(np.arange(3 * T + 1), "train.bin")], val=[Part(np.arange(T + 1), "train.bin")])
    windows = TokenWindows(path, "train", T)
    with pytest.raises(IndexError):
        windows[index]
    with pytest.raises(IndexError):
        windows.batch([0, index])


def test_windows_never_cross_from_one_segment_into_the_next(data):
    x, y = TokenWindows(data.path, "train", T).batch(np.arange(537))

    # Within a segment tokens count up by one; across the junction of two they jump.
    assert (torch.diff(torch.cat([x, y[:, -1:]], dim=1)) == 1).all()
    assert {int(token) // 5000 for token in x[:, 0]} == {0, 2, 4}  # segments 1, 2 and 4; none from segment 3


def test_shards_elsewhere_are_read_in_place_after_their_header(data):
    meta = json.loads((data.path / "meta.json").read_text())
    shard = meta["splits"]["train"][1]
    assert Path(shard["file"]).is_absolute() and shard["offset"] == HEADER

    x, _ = TokenWindows(data.path, "train", T)[250]
    assert x.tolist() == list(range(10000, 10000 + T))


def test_uint32_tokens_beyond_the_uint16_range_are_read_whole(tmp_path):
    tokens = 100_000 + np.arange(3 * T + 1)
    path = write_dataset(tmp_path, train=[Part(tokens, "train.bin", "uint32")], val=[Part(tokens, "val.bin", "uint32")])
    x, y = TokenWindows(path, "train", T).batch([2, 0])

    assert x.tolist() == [tokens[2 * T : 3 * T].tolist(), tokens[:T].tolist()]
    assert y[0, -1].item() == tokens[-1] == 100_000 + 3 * T


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_token_file_is_refused_with_a_one_line_error(tmp_path, damage):
    path = write_dataset(
        tmp_path, train=[Part(np.arange(100), "a.bin"), Part(np.arange(100), "b.bin")], val=[Part(np.arange(50), "a.bin")]
    )
    if damage == "missing":
        (path / "b.bin").unlink()
    else:
        (path / "b.bin").write_bytes((path / "b.bin").read_bytes()[:-2])

    with pytest.raises(DataError) as error:
        TrainBatches(path, T, batch_size=2, rank=0, world_size=1, seed=0, num_workers=0)

    message = str(error.value)
    assert message.startswith(f"{path / 'b.bin'}: ") and "meta.json promises 100 tokens of uint16" in message
    assert message.endswith("; rebuild it with `python3 prepare_dataset.py --force`") and "\n" not in message


def test_a_dataset_of_the_old_format_says_to_rebuild_it(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"format_version": 1, "tokens": {"train": 100}, "dtype": "uint16"}))
    with pytest.raises(DataError, match="format_version 1, expected 2.*; rebuild it with"):
        TrainBatches(tmp_path, T, batch_size=2, rank=0, world_size=1, seed=0, num_workers=0)


def test_a_pickled_dataset_carries_no_token_data_and_maps_again_where_it_lands(data):
    windows = TokenWindows(data.path, "train", T)
    expected = windows.batch([0, 300, 500])

    copy = pickle.loads(pickle.dumps(windows))

    assert len(pickle.dumps(windows)) < 2000
    assert_same_batches([copy.batch([0, 300, 500])], [expected])


# --- batches ---------------------------------------------------------------------------------------


def test_a_batch_is_contiguous_int64_windows_in_the_order_asked_even_across_segments(data):
    order = [500, 3, 260, 4, 536]
    x, y = TokenWindows(data.path, "train", T).batch(order)

    assert x.shape == y.shape == (5, T) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert x.tolist() == data.train[order, :-1].tolist() and y.tolist() == data.train[order, 1:].tolist()


def test_dataloader_fetches_a_whole_batch_through_getitems(data):
    windows = TokenWindows(data.path, "train", T)
    sampler = [[5, 400], [1, 2]]
    batches = list(DataLoader(windows, batch_sampler=sampler, collate_fn=as_is))

    assert_same_batches(batches, [windows.batch(indices) for indices in sampler])


def test_training_batches_are_batch_size_by_context_length_and_y_is_x_shifted_by_one(data):
    for x, y in take(train_batches(data), 3):
        assert x.shape == y.shape == (4, T) and x.dtype == torch.int64
        assert y.tolist() == data.train[indices_of(x, data.train), 1:].tolist()


def test_ranks_get_disjoint_windows_that_together_cover_the_epoch_but_the_remainder(data):
    world = 3
    ranks = [train_batches(data, rank=r, world_size=world) for r in range(world)]
    per_epoch = ranks[0].batches_per_epoch
    seen = [[i for x, _ in take(loader, per_epoch) for i in indices_of(x, data.train)] for loader in ranks]

    assert [loader.batches_per_epoch for loader in ranks] == [537 // 3 // 4] * world == [44] * world
    assert all(len(set(s)) == len(s) == per_epoch * 4 for s in seen)
    assert sum(len(s) for s in seen) == len(set().union(*seen))  # disjoint
    # The epoch's permutation, but the 9 windows that cannot give every rank one more batch.
    order = np.random.default_rng([7, 0]).permutation(537)
    assert set().union(*seen) == set(order[:528].tolist())


def test_the_same_seed_and_epoch_give_the_same_order_and_another_epoch_or_seed_another(data):
    first, second = train_batches(data, rank=1, world_size=2), train_batches(data, rank=1, world_size=2)
    n = first.batches_per_epoch + 3  # into the second epoch
    assert_same_batches(take(first, n), take(second, n))

    assert not np.array_equal(first.epoch_batches(0), first.epoch_batches(1))
    assert not np.array_equal(first.epoch_batches(0), train_batches(data, rank=1, world_size=2, seed=8).epoch_batches(0))
    for epoch in (0, 1):  # an epoch never repeats a window
        assert len(set(first.epoch_batches(epoch).ravel().tolist())) == first.epoch_batches(epoch).size


def test_iteration_rolls_over_into_the_next_epoch(data):
    loader = train_batches(data)
    per_epoch = loader.batches_per_epoch

    batches = take(loader, per_epoch + 1)

    assert loader.state_dict() == {"epoch": 1, "batch_index": 1}
    assert indices_of(batches[per_epoch - 1][0], data.train) == loader.epoch_batches(0)[-1].tolist()
    assert indices_of(batches[-1][0], data.train) == loader.epoch_batches(1)[0].tolist()


def test_grad_accum_makes_an_epoch_a_whole_number_of_optimizer_steps(data):
    loader = train_batches(data, world_size=2, grad_accum=3)
    # 537 windows // 2 ranks // (4 x 3) = 22 steps of 3 micro-batches; without accumulation 67 batches.
    assert loader.batches_per_epoch == 66 and train_batches(data, world_size=2).batches_per_epoch == 67

    batches = take(loader, 66 + 3)

    assert loader.state_dict() == {"epoch": 1, "batch_index": 3}
    assert indices_of(batches[66][0], data.train) == loader.epoch_batches(1)[0].tolist()


def test_state_dict_names_the_next_batch_while_the_caller_holds_the_current_one(data):
    loader = train_batches(data)
    assert loader.state_dict() == {"epoch": 0, "batch_index": 0}
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict() == {"epoch": 0, "batch_index": 1}
    next(iterator)
    assert loader.state_dict() == {"epoch": 0, "batch_index": 2}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_resumed_from_state_dict_continues_with_exactly_the_next_batches(data, num_workers):
    uninterrupted = train_batches(data, rank=1, world_size=2, grad_accum=2)
    per_epoch = uninterrupted.batches_per_epoch
    expected = take(uninterrupted, per_epoch + 4)

    interrupted = train_batches(data, rank=1, world_size=2, grad_accum=2, num_workers=num_workers)
    stop = per_epoch - 2  # resume shortly before an epoch boundary and cross it
    take(interrupted, stop)
    resumed = train_batches(data, rank=1, world_size=2, grad_accum=2, num_workers=num_workers)
    resumed.load_state_dict(json.loads(json.dumps(interrupted.state_dict())))  # as a checkpoint stores it

    assert_same_batches(take(resumed, per_epoch + 4 - stop), expected[stop:])
    assert resumed.state_dict() == {"epoch": 1, "batch_index": 4}


def test_a_resume_position_beyond_the_epoch_is_refused(data):
    loader = train_batches(data)
    with pytest.raises(DataError, match="did the dataset, batch size, gradient accumulation or world size change"):
        loader.load_state_dict({"epoch": 0, "batch_index": loader.batches_per_epoch})


def test_data_too_small_for_one_optimizer_step_raises_with_the_numbers_and_the_fix(data):
    with pytest.raises(DataError) as error:
        train_batches(data, batch_size=90, grad_accum=3, world_size=2)

    message = str(error.value)
    assert "has 537 windows of 9 tokens" in message and "= 540;" in message and "\n" not in message
    assert message.endswith("reduce training.batch_size, training.grad_accum_nums or data.context_length, or add data")
    assert train_batches(data, batch_size=89, grad_accum=3, world_size=2).batches_per_epoch == 3


# --- validation batches --------------------------------------------------------------------------


def counted_windows(batches, val: np.ndarray) -> list[int]:
    """The val windows a rank's validation batches count towards the mean (not a stand-in's)."""
    return [i for batch in batches if batch.windows for i in indices_of(batch.inputs, val)]


def test_validation_batches_are_the_same_on_every_call(data):
    first = validation_batches(data.path, T, batch_size=4, rank=0, world_size=2, num_batches=3)
    assert len(first) == 3
    again = validation_batches(data.path, T, batch_size=4, rank=0, world_size=2, num_batches=3)
    assert_same_batches([batch[:2] for batch in first], [batch[:2] for batch in again])


def test_validation_batches_are_the_first_windows_of_val_shared_disjointly_by_rank(data):
    world, batch, num = 2, 4, 3
    per_rank = [validation_batches(data.path, T, batch, rank, world, num) for rank in range(world)]

    assert counted_windows(per_rank[0], data.val) == list(range(0, 24, 2)) and counted_windows(per_rank[1], data.val) == list(
        range(1, 24, 2)
    )
    for x, y, windows in per_rank[1]:
        assert x.shape == y.shape == (batch, T) and windows == batch and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize(("world", "grad_accum"), [(1, 4), (2, 2), (4, 1), (3, 1)])
def test_validation_covers_num_batches_global_batches_whatever_the_number_of_ranks(data, world, grad_accum):
    # A global batch of 12 sequences: 4 x 3 on one rank, 2 x 3 on two, 1 x 3 on four; 3 x 4 on three.
    batch = 12 // (world * grad_accum)
    per_rank = [validation_batches(data.path, T, batch, rank, world, 5, grad_accum=grad_accum) for rank in range(world)]
    assert sorted(i for batches in per_rank for i in counted_windows(batches, data.val)) == list(range(60))


@pytest.mark.parametrize(("windows", "batch", "world"), [(17, 8, 2), (10, 4, 3), (5, 1, 4), (2, 4, 3), (75, 4, 1)])
def test_windows_that_do_not_divide_over_the_ranks_are_each_used_once_in_as_many_batches_on_every_rank(windows, batch, world):
    split = [validation_split(windows, batch, rank, world) for rank in range(world)]

    assert sorted(int(i) for batches in split for indices in batches for i in indices) == list(range(windows))
    assert len({len(batches) for batches in split}) == 1  # every rank runs as many forward passes
    assert all(0 < len(split[0][k]) <= batch for k in range(len(split[0])))  # rank 0's share is the largest


def test_a_rank_whose_share_runs_out_sooner_runs_a_stand_in_batch_that_counts_no_window(data):
    # 75 windows over 4 ranks in batches of 2: ranks 0-2 get 19 (10 batches), rank 3 gets 18 (9 and a stand-in).
    per_rank = [validation_batches(data.path, T, 2, rank, 4, num_batches=1000) for rank in range(4)]

    assert [len(batches) for batches in per_rank] == [10] * 4
    assert [batch.windows for batch in per_rank[3]][-2:] == [2, 0] and per_rank[3][-1].inputs.shape == (2, T)
    assert [batch.windows for batch in per_rank[0]][-2:] == [2, 1]
    assert sorted(i for batches in per_rank for i in counted_windows(batches, data.val)) == list(range(75))


def test_a_small_val_split_is_used_whole_in_the_same_number_of_batches_on_every_rank(data):
    per_rank = [validation_batches(data.path, T, 4, rank, 3, num_batches=1000) for rank in range(3)]
    assert [len(batches) for batches in per_rank] == [7] * 3  # 25 windows each: 6 batches of 4 and one of 1
    assert sorted(i for batches in per_rank for i in counted_windows(batches, data.val)) == list(range(75))


def test_a_val_split_smaller_than_one_full_batch_per_rank_gives_one_smaller_batch(data):
    batches = validation_batches(data.path, T, batch_size=75, rank=1, world_size=2, num_batches=4)
    assert len(batches) == 1 and batches[0].inputs.shape == (37, T) and batches[0].windows == 37


def test_a_val_split_with_fewer_windows_than_ranks_is_still_used_whole(data):
    per_rank = [validation_batches(data.path, T, batch_size=1, rank=rank, world_size=76, num_batches=1) for rank in range(76)]
    assert sorted(i for batches in per_rank for i in counted_windows(batches, data.val)) == list(range(75))
    assert [batch.windows for batch in per_rank[75]] == [0]


def test_a_val_split_without_a_window_raises_with_the_fix(tmp_path):
    path = write_dataset(tmp_path, train=[Part(np.arange(100), "tokens.bin")], val=[Part(np.arange(5), "val.bin")])
    with pytest.raises(DataError, match="has no window of 9 tokens; increase data.val_fraction or reduce data.context_length"):
        validation_batches(path, T, batch_size=1, rank=0, world_size=2, num_batches=1)
