"""nanoGPT's header-less uint16 .bin files read in place, and told apart from llm.c shards:
pretrain/data/shards.py (token_file) and pretrain/data/shard_files.py through prepare."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from support.processes import ROOT, cache_leftovers, launcher_env, one_line_error
from support.runs import assert_one_line_error, data_config, prepared, run_debug_training, split_tokens
from pretrain.data import DataError
from pretrain.data.loader import TokenWindows
from pretrain.data.prepare import prepare, read_meta, verify
from pretrain.data.shards import scan, token_file
from test_data_shards import write_llmc, write_megatron

IDS = np.random.default_rng(1).integers(0, 50257, size=600).astype(np.uint16)


def write_nanogpt(path, tokens):
    """What nanoGPT's prepare.py writes: np.uint16 ids, nothing else."""
    np.asarray(tokens, dtype="<u2").tofile(path)
    return path


def windows(dataset, split, context_length=16):
    return TokenWindows(dataset, split, context_length).batch(np.arange(len(TokenWindows(dataset, split, context_length))))


def test_a_nanogpt_bin_gives_the_same_windows_as_the_same_ids_in_an_llmc_shard(tmp_path):
    nanogpt = prepared(data_config(tmp_path, source="nanogpt", path=str(write_nanogpt(tmp_path / "ids.bin", IDS))))
    llmc = prepared(data_config(tmp_path, source="llmc", path=str(write_llmc(tmp_path / "shard.bin", IDS))))

    assert sorted(p.name for p in nanogpt.iterdir()) == ["meta.json"]  # read in place, nothing copied
    meta = read_meta(nanogpt)
    assert meta["splits"]["train"][0] == {
        "file": str((tmp_path / "ids.bin").resolve()),
        "offset": 0,
        "tokens": 570,
        "dtype": "uint16",
    }
    assert meta["vocab_size"] == int(IDS.max()) + 1 and meta["tokenizer"] is None  # as llm.c shards: the data sizes it
    for split in ("train", "val"):
        for ours, theirs in zip(windows(nanogpt, split), windows(llmc, split), strict=True):
            assert ours.shape[0] > 0 and torch.equal(ours, theirs)
    verify(nanogpt)


def test_a_nanogpt_directory_trains_on_train_bin_and_validates_on_val_bin(tmp_path):
    folder = tmp_path / "shakespeare"
    folder.mkdir()
    write_nanogpt(folder / "train.bin", IDS[:500])
    write_nanogpt(folder / "val.bin", IDS[500:])
    (folder / "meta.pkl").write_bytes(b"not read")

    dataset = prepared(data_config(tmp_path, source="nanogpt", path=str(folder)))

    assert split_tokens(dataset, "train").tolist() == IDS[:500].tolist()
    assert split_tokens(dataset, "val").tolist() == IDS[500:].tolist()
    assert read_meta(dataset)["key"]["val_fraction"] is None


def test_the_llmc_source_reads_nanogpt_files_and_says_so_in_one_line(tmp_path):
    folder = tmp_path / "owt"
    folder.mkdir()
    write_nanogpt(folder / "train.bin", IDS[:500])
    write_nanogpt(folder / "val.bin", IDS[500:])
    lines: list[str] = []

    dataset = prepare(data_config(tmp_path, source="llmc", path=str(folder)), log=lines.append)

    assert split_tokens(dataset, "val").tolist() == IDS[500:].tolist()
    assert [line for line in lines if "header" in line] == [
        "dataset: no llm.c header (magic number 20240520 or 20240801) in train.bin, val.bin: "
        "read as nanoGPT's header-less uint16 token ids"
    ]


def test_an_llmc_shard_given_as_nanogpt_is_read_past_its_header_never_as_ids(tmp_path):
    shard = write_llmc(tmp_path / "fineweb_train_000001.bin", IDS)
    lines: list[str] = []

    dataset = prepare(data_config(tmp_path, source="nanogpt", path=str(shard)), log=lines.append)

    assert np.concatenate([split_tokens(dataset, "train"), split_tokens(dataset, "val")]).tolist() == IDS.tolist()
    assert read_meta(dataset)["splits"]["train"][0]["offset"] == 1024
    assert [line for line in lines if "llm.c" in line] == [
        "dataset: llm.c's header in fineweb_train_000001.bin: read as llm.c shards, past their 1024-byte header"
    ]


@pytest.mark.parametrize("source", ["llmc", "nanogpt"])
def test_an_llmc_header_with_an_unknown_magic_is_refused_not_read_as_nanogpt_ids(tmp_path, source):
    # The shape of an llm.c header (a token count that fills the file, zeros after it): a damaged
    # or newer llm.c shard, whose header must never become 512 token ids.
    bad = write_llmc(tmp_path / "newer.bin", IDS, magic=20250101)

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source=source, path=str(bad)))

    message = one_line_error(excinfo)
    assert str(bad) in message and "20250101" in message and "not an llm.c" in message
    assert cache_leftovers(tmp_path) == []


def test_a_truncated_llmc_shard_is_refused_as_llmc_not_read_as_nanogpt(tmp_path):
    short = write_llmc(tmp_path / "short.bin", IDS, promised=len(IDS) + 10)

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="nanogpt", path=str(short)))

    assert "truncated" in one_line_error(excinfo) and f"{len(IDS) + 10} tokens" in str(excinfo.value)


def test_half_of_a_megatron_pair_given_as_nanogpt_says_to_use_the_megatron_source(tmp_path):
    prefix = write_megatron(tmp_path / "corpus", [[1, 2, 3], [4, 5]])

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="nanogpt", path=f"{prefix}.bin"))

    assert one_line_error(excinfo) == (
        f"{prefix}.bin: half of a Megatron dataset (beside corpus.idx); use data.source=megatron with data.path={prefix}"
    )


def test_a_nanogpt_bin_with_an_odd_byte_count_is_refused_in_one_line_by_prepare_dataset(tmp_path):
    odd = tmp_path / "train.bin"
    odd.write_bytes(write_nanogpt(tmp_path / "x.bin", IDS[:50]).read_bytes() + b"\x01")

    result = subprocess.run(
        [sys.executable, "prepare_dataset.py", "--set", "data.source=nanogpt", "--set", f"data.path={odd}"]
        + ["--set", f"data.cache_dir={tmp_path / 'cache'}"],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert_one_line_error(result, f"{odd}: 101 bytes, an odd count", "uint16", prefix="prepare_dataset: error: ")
    assert cache_leftovers(tmp_path) == []


def test_nanogpt_ids_beyond_a_set_vocabulary_stop_the_run_before_it_starts(tmp_path):
    from pretrain import config as cfg
    from pretrain.data.fitting import fit_to_dataset

    path = write_nanogpt(tmp_path / "ids.bin", IDS)
    config = cfg.resolve(
        preset="debug",
        sets=[
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.source=nanogpt",
            f"data.path={path}",
            "model.vocab_size=50000",
            "data.context_length=8",
        ],
    )

    with pytest.raises(DataError) as excinfo:
        fit_to_dataset(config, prepared(config.data), world_size=1)

    assert f"go up to {int(IDS.max())}, beyond model.vocab_size 50000" in one_line_error(excinfo)


def test_a_debug_run_trains_on_a_nanogpt_directory_through_the_launcher(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    ids = np.random.default_rng(2).integers(0, 300, size=6000)
    write_nanogpt(folder / "train.bin", ids[:5000])
    write_nanogpt(folder / "val.bin", ids[5000:])

    result = run_debug_training(
        tmp_path,
        ["-m", "launcher", "--device", "cpu", "--nproc", "1"],
        tmp_path / "run",
        "--max-steps",
        "2",
        "--set",
        "data.source=nanogpt",
        "--set",
        f"data.path={folder}",
    )

    assert "(5,000 train tokens, 1,000 val tokens)" in result.stdout + result.stderr
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_a_nanogpt_directory_without_val_bin_says_in_one_line_that_validation_is_train_bins_tail(tmp_path):
    folder = tmp_path / "shakespeare"
    folder.mkdir()
    write_nanogpt(folder / "train.bin", IDS)
    lines: list[str] = []

    dataset = prepare(data_config(tmp_path, source="nanogpt", path=str(folder), val_fraction=0.05), log=lines.append)

    assert [line for line in lines if "val.bin" in line] == [
        f"dataset: no val.bin beside {folder / 'train.bin'}: validation is its last 5% (data.val_fraction), "
        "which training does not read; put val.bin there, or set data.val_path"
    ]
    assert split_tokens(dataset, "val").tolist() == IDS[570:].tolist()


def test_one_stray_id_far_above_the_rest_is_said_in_one_line_with_its_count_and_the_vocabulary_it_grew_to(tmp_path):
    folder = tmp_path / "owt"
    folder.mkdir()
    ids = IDS.copy()
    ids[123] = 60000  # one damaged id in GPT-2 data (ids up to 50256)
    write_nanogpt(folder / "train.bin", ids[:500])
    write_nanogpt(folder / "val.bin", ids[500:])
    below = int(np.sort(ids)[-2])
    lines: list[str] = []

    dataset = prepare(data_config(tmp_path, source="nanogpt", path=str(folder)), log=lines.append)

    assert [line for line in lines if "token id" in line] == [
        f"dataset: token id 60,000 occurs 1 time(s) in 600 tokens, far above every other id (the next is {below:,}): "
        f"the vocabulary grew from {below + 1:,} to 60,001 ids to fit it; if it is damage, fix the data"
    ]
    assert read_meta(dataset)["vocab_size"] == 60001
    lines.clear()
    prepare(data_config(tmp_path, source="nanogpt", path=str(write_nanogpt(tmp_path / "ids.bin", IDS))), log=lines.append)
    assert not [line for line in lines if "token id" in line]  # ids that reach the top evenly are not stray


@pytest.mark.parametrize("chunk_tokens", [1, 7, 1000])
def test_the_scan_counts_the_largest_id_and_finds_the_next_below_it_whatever_the_chunks(tmp_path, chunk_tokens):
    ids = np.array([5, 9, 3, 9, 2, 7, 9, 1, 8], dtype=np.uint16)
    shard = token_file(write_nanogpt(tmp_path / "ids.bin", ids))
    found = scan(shard, chunk_bytes=2 * chunk_tokens)
    assert (found.max_id, found.max_count, found.below) == (9, 3, 8)
