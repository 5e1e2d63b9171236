"""Memory-mapped, deterministic, rank-sharded batches: pretrain/data/loader.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.config import DataConfig
from pretrain.data import DataError
from pretrain.data.loader import TokenWindows, TrainBatches, validation_batches
from pretrain.data.prepare import prepare

T = 8  # context length: small, so a small corpus has hundreds of windows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """About 6,000 train tokens of random letters: every window is distinct."""
    rng = np.random.default_rng(0)
    documents = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz "), size=int(n)))
                 for n in rng.integers(50, 250, size=50)]
    cfg = DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache")), val_fraction=0.1)
    return prepare(cfg, log=lambda line: None, documents=documents)


def train_batches(dataset: Path, **changes) -> TrainBatches:
    args = dict(context_length=T, batch_size=4, rank=0, world_size=1, seed=7, num_workers=0)
    return TrainBatches(dataset, **{**args, **changes})


def take(batches, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(batches, n))


def window_index(windows: TokenWindows) -> dict[bytes, int]:
    """Which window a row of x is, by its content."""
    return {windows[i][0].numpy().tobytes(): i for i in range(len(windows))}


def indices_of(batch_x: torch.Tensor, lookup: dict[bytes, int]) -> list[int]:
    return [lookup[row.numpy().tobytes()] for row in batch_x]


def assert_same_batches(a, b) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# --- windows -------------------------------------------------------------------------------------

def test_windows_are_read_through_a_read_only_memory_map(dataset):
    windows = TokenWindows(dataset, "train", T)

    assert isinstance(windows.tokens, np.memmap) and windows.tokens.mode == "r"
    assert len(windows) == (windows.n_tokens - 1) // T
    with pytest.raises(ValueError):
        windows.tokens[0] = 1


def test_window_i_is_tokens_i_times_t_plus_one_split_into_input_and_target(dataset):
    windows = TokenWindows(dataset, "train", T)
    tokens = np.fromfile(dataset / "train.bin", dtype=np.uint16).astype(np.int64)

    for i in (0, 1, len(windows) - 1):
        x, y = windows[i]
        assert x.tolist() == tokens[i * T:i * T + T].tolist()
        assert y.tolist() == tokens[i * T + 1:i * T + T + 1].tolist()
    with pytest.raises(IndexError):
        windows[len(windows)]


def test_a_truncated_token_file_is_refused_rather_than_read_short(tmp_path, dataset):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("meta.json", "val.bin"):
        (copy / name).write_bytes((dataset / name).read_bytes())
    (copy / "train.bin").write_bytes((dataset / "train.bin").read_bytes()[:-2])

    with pytest.raises(DataError, match="meta.json promises"):
        train_batches(copy)


# --- training batches ----------------------------------------------------------------------------

def test_batches_are_int64_of_batch_size_by_context_length_and_y_is_x_shifted_by_one(dataset):
    windows = TokenWindows(dataset, "train", T)
    for x, y in take(train_batches(dataset), 3):
        assert x.shape == y.shape == (4, T)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x, y):
            (i,) = [i for i in range(len(windows)) if torch.equal(windows[i][0], row_x)]
            assert torch.equal(windows[i][1], row_y)


def test_ranks_get_disjoint_windows_that_together_cover_the_epochs_used_windows(dataset):
    world = 3
    lookup = window_index(TokenWindows(dataset, "train", T))
    ranks = [train_batches(dataset, rank=r, world_size=world) for r in range(world)]
    per_epoch = ranks[0].batches_per_epoch
    seen = [[i for x, _ in take(loader, per_epoch) for i in indices_of(x, lookup)] for loader in ranks]

    assert all(loader.batches_per_epoch == per_epoch for loader in ranks)
    assert all(len(set(s)) == len(s) == per_epoch * 4 for s in seen)
    assert not set(seen[0]) & set(seen[1]) and not set(seen[1]) & set(seen[2]) and not set(seen[0]) & set(seen[2])
    # The epoch's permutation, cut to what the ranks can use in equal whole batches.
    order = np.random.default_rng([7, 0]).permutation(len(lookup))
    assert set().union(*seen) == set(order[:world * per_epoch * 4].tolist())


def test_two_loaders_with_the_same_settings_give_the_same_batches(dataset):
    first, second = train_batches(dataset, rank=1, world_size=2), train_batches(dataset, rank=1, world_size=2)
    n = first.batches_per_epoch + 3  # into the second epoch
    assert_same_batches(take(first, n), take(second, n))


def test_each_epoch_and_each_seed_has_its_own_order(dataset):
    loader = train_batches(dataset)

    assert not np.array_equal(loader.epoch_batches(0), loader.epoch_batches(1))
    assert not np.array_equal(loader.epoch_batches(0), train_batches(dataset, seed=8).epoch_batches(0))
    for epoch in (0, 1):  # an epoch never repeats a window
        assert len(set(loader.epoch_batches(epoch).ravel().tolist())) == loader.epoch_batches(epoch).size


def test_iteration_rolls_over_into_the_next_epoch(dataset):
    loader = train_batches(dataset)
    lookup = window_index(loader.windows)
    per_epoch = loader.batches_per_epoch

    batches = take(loader, per_epoch + 1)

    assert loader.state_dict() == {"epoch": 1, "batch_index": 1}
    assert indices_of(batches[-1][0], lookup) == loader.epoch_batches(1)[0].tolist()
    assert indices_of(batches[per_epoch - 1][0], lookup) == loader.epoch_batches(0)[-1].tolist()


def test_state_dict_names_the_next_batch_while_the_caller_holds_the_current_one(dataset):
    loader = train_batches(dataset)
    assert loader.state_dict() == {"epoch": 0, "batch_index": 0}
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict() == {"epoch": 0, "batch_index": 1}
    next(iterator)
    assert loader.state_dict() == {"epoch": 0, "batch_index": 2}


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_loader_resumed_from_state_dict_continues_with_exactly_the_next_batches(dataset, num_workers):
    uninterrupted = train_batches(dataset)
    per_epoch = uninterrupted.batches_per_epoch
    expected = take(uninterrupted, per_epoch + 4)

    interrupted = train_batches(dataset)
    stop = per_epoch - 2  # resume shortly before an epoch boundary and cross it
    take(interrupted, stop)
    resumed = train_batches(dataset, num_workers=num_workers)
    resumed.load_state_dict(dict(interrupted.state_dict()))

    assert_same_batches(take(resumed, per_epoch + 4 - stop), expected[stop:])


def test_a_resume_position_beyond_the_epoch_is_refused(dataset):
    loader = train_batches(dataset)
    with pytest.raises(DataError, match="did the dataset, batch size or world size change"):
        loader.load_state_dict({"epoch": 0, "batch_index": loader.batches_per_epoch})


def test_one_worker_process_gives_the_same_batches_as_loading_in_process(dataset):
    in_process = train_batches(dataset, rank=1, world_size=2, num_workers=0)
    n = in_process.batches_per_epoch + 2
    assert_same_batches(take(train_batches(dataset, rank=1, world_size=2, num_workers=1), n), take(in_process, n))


def test_data_too_small_for_one_batch_per_rank_raises_with_the_numbers_and_the_fix(dataset):
    n_windows = len(TokenWindows(dataset, "train", T))
    with pytest.raises(DataError) as error:
        train_batches(dataset, batch_size=n_windows // 2 + 1, world_size=2)

    message = str(error.value)
    assert f"{n_windows} windows" in message and "\n" not in message
    assert "reduce training.batch_size or data.context_length, or add data" in message
    assert train_batches(dataset, batch_size=n_windows // 2, world_size=2).batches_per_epoch == 1


# --- validation batches --------------------------------------------------------------------------

def test_validation_batches_are_the_same_on_every_call(dataset):
    first = validation_batches(dataset, T, batch_size=4, rank=0, world_size=2, num_batches=3)
    assert len(first) == 3
    assert_same_batches(first, validation_batches(dataset, T, batch_size=4, rank=0, world_size=2, num_batches=3))


def test_validation_batches_are_the_first_windows_of_val_shared_disjointly_by_rank(dataset):
    windows = TokenWindows(dataset, "val", T)
    lookup = window_index(windows)
    world, batch, num = 2, 4, 3
    per_rank = [validation_batches(dataset, T, batch, rank, world, num) for rank in range(world)]
    seen = [[i for x, _ in batches for i in indices_of(x, lookup)] for batches in per_rank]

    assert sorted(seen[0] + seen[1]) == list(range(world * batch * num))
    assert not set(seen[0]) & set(seen[1])
    for x, y in per_rank[1]:
        assert x.shape == y.shape == (batch, T) and torch.equal(x[:, 1:], y[:, :-1])


def test_a_small_val_split_gives_fewer_batches_but_the_same_number_on_every_rank(dataset):
    n_val = len(TokenWindows(dataset, "val", T))
    world = 3
    counts = [len(validation_batches(dataset, T, 4, rank, world, num_batches=1000)) for rank in range(world)]

    assert counts == [n_val // world // 4] * world


def test_a_val_split_smaller_than_one_full_batch_per_rank_gives_one_smaller_batch(dataset):
    n_val = len(TokenWindows(dataset, "val", T))
    batches = validation_batches(dataset, T, batch_size=n_val, rank=1, world_size=2, num_batches=4)

    assert len(batches) == 1 and batches[0][0].shape == (n_val // 2, T)


def test_a_val_split_with_fewer_windows_than_ranks_raises_with_the_fix(dataset):
    n_val = len(TokenWindows(dataset, "val", T))
    with pytest.raises(DataError, match="increase data.val_fraction, reduce data.context_length"):
        validation_batches(dataset, T, batch_size=1, rank=0, world_size=n_val + 1, num_batches=1)
