"""Pre-tokenized shards used in place: pretrain/data/shards.py through prepare (llm.c and Megatron)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from pretrain.data import DataError
from pretrain.data.prepare import prepare, read_meta, verify
from support.processes import cache_leftovers, one_line_error
from support.runs import data_config, prepared, split_tokens


LLMC_MAGIC = {"uint16": (20240520, 1), "uint32": (20240801, 7)}
MEGATRON_CODES = {"uint16": 8, "int32": 4}


def write_llmc(path: Path, tokens, dtype: str = "uint16", *, magic: int | None = None, promised: int | None = None) -> Path:
    """An llm.c shard: 256 int32 of header (magic, version, token count), then the tokens."""
    default_magic, version = LLMC_MAGIC[dtype]
    header = np.zeros(256, dtype="<i4")
    header[:3] = [default_magic if magic is None else magic, version, len(tokens) if promised is None else promised]
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2" if dtype == "uint16" else "<u4").tobytes())
    return path


def write_megatron(
    prefix: Path,
    documents: list[list[int]],
    dtype: str = "uint16",
    *,
    code: int | None = None,
    magic: bytes = b"MMIDIDX\x00\x00",
    document_indices: list[int] | None = None,
) -> Path:
    """A Megatron .bin/.idx pair with one sequence per document, unless document_indices (each
    document's first sequence, then the sequence count) groups the sequences otherwise."""
    np_dtype = np.dtype("<u2" if dtype == "uint16" else "<i4")
    sizes = np.array([len(d) for d in documents], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64) * np_dtype.itemsize]).astype("<i8")
    document_indices = np.array(range(len(documents) + 1) if document_indices is None else document_indices, dtype="<i8")
    header = magic + struct.pack("<Q", 1) + struct.pack("<B", MEGATRON_CODES[dtype] if code is None else code)
    header += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(document_indices))
    Path(f"{prefix}.idx").write_bytes(header + sizes.tobytes() + pointers.tobytes() + document_indices.tobytes())
    Path(f"{prefix}.bin").write_bytes(np.concatenate([np.asarray(d, dtype=np_dtype) for d in documents]).tobytes())
    return prefix


def touch_later(path: Path, seconds: int = 5) -> None:
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + seconds * 1_000_000_000))


@pytest.fixture
def shards(tmp_path):
    """Three llm.c uint16 shards in tmp_path/shards; returns their tokens in order."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "shards"
    folder.mkdir()
    tokens = [rng.integers(0, 50257, size=n).astype(np.uint16) for n in (300, 200, 100)]
    tokens[1][7] = 50256  # the largest id somewhere in the middle
    for i, t in enumerate(tokens):
        write_llmc(folder / f"train_{i:06d}.bin", t)
    return tokens


# --- llm.c ---------------------------------------------------------------------------------------


def test_llmc_shards_are_used_in_place_with_the_tail_as_validation(tmp_path, shards):
    dataset = prepared(data_config(tmp_path, source="llmc", path=str(tmp_path / "shards" / "train_*.bin"), val_fraction=0.25))

    assert sorted(p.name for p in dataset.iterdir()) == ["meta.json"]  # nothing copied
    meta = read_meta(dataset)
    paths = [str((tmp_path / "shards" / f"train_{i:06d}.bin").resolve()) for i in range(3)]
    assert sorted(meta["files"]) == paths
    for segment in meta["splits"]["train"] + meta["splits"]["val"]:
        assert segment["file"] in paths and segment["dtype"] == "uint16"
    assert [s["offset"] for s in meta["splits"]["train"]] == [1024, 1024]
    everything = np.concatenate(shards)
    assert np.array_equal(np.concatenate([split_tokens(dataset, "train"), split_tokens(dataset, "val")]), everything)
    assert meta["tokens"] == {"train": 450, "val": 150}  # the last quarter
    assert np.array_equal(split_tokens(dataset, "val"), everything[-150:])
    # The cut falls inside the second shard: its val part starts after its first 50 tokens.
    assert meta["splits"]["val"][0] == {"file": paths[1], "offset": 1024 + 2 * 150, "tokens": 50, "dtype": "uint16"}
    assert meta["vocab_size"] == 50257 and meta["max_token_id"] == 50256
    assert meta["tokenizer"] is None and meta["eot_id"] is None
    verify(dataset)


def test_the_prepared_line_counts_documents_only_where_the_shards_record_them(tmp_path, shards):
    lines: list[str] = []
    prepare(data_config(tmp_path, source="llmc", path=str(tmp_path / "shards" / "train_*.bin")), log=lines.append)
    prepare(data_config(tmp_path, source="megatron", path=str(write_megatron(tmp_path / "corpus", DOCUMENTS))), log=lines.append)
    llmc, megatron = (line for line in lines if line.startswith("dataset: prepared"))
    assert " val tokens) in " in llmc and "documents" not in llmc, llmc  # not "None documents"
    assert "val tokens, 5 documents) in " in megatron, megatron


def test_a_directory_of_llmc_shards_gives_its_bin_files_sorted(tmp_path, shards):
    (tmp_path / "shards" / "README.md").write_text("not a shard")

    dataset = prepared(data_config(tmp_path, source="llmc", path=str(tmp_path / "shards")))

    assert np.array_equal(np.concatenate([split_tokens(dataset, "train"), split_tokens(dataset, "val")]), np.concatenate(shards))


def test_llmc_val_path_is_exactly_the_validation_split(tmp_path, shards):
    val = write_llmc(tmp_path / "val_000000.bin", [5, 6, 7, 8])

    dataset = prepared(data_config(tmp_path, source="llmc", path=str(tmp_path / "shards" / "*.bin"), val_path=str(val)))

    meta = read_meta(dataset)
    assert meta["splits"]["val"] == [{"file": str(val.resolve()), "offset": 1024, "tokens": 4, "dtype": "uint16"}]
    assert split_tokens(dataset, "val").tolist() == [5, 6, 7, 8]
    assert np.array_equal(split_tokens(dataset, "train"), np.concatenate(shards))
    assert meta["tokens"] == {"train": 600, "val": 4}
    assert meta["key"]["val_fraction"] is None


def test_uint32_llmc_shards_are_read_with_their_wider_type(tmp_path):
    tokens = np.array([0, 70000, 128255, 3, 4, 5, 6, 7, 8, 9], dtype=np.uint32)
    write_llmc(tmp_path / "llama.bin", tokens, "uint32")

    dataset = prepared(data_config(tmp_path, source="llmc", path=str(tmp_path / "llama.bin"), val_fraction=0.2))

    meta = read_meta(dataset)
    assert {s["dtype"] for s in meta["splits"]["train"] + meta["splits"]["val"]} == {"uint32"}
    assert meta["vocab_size"] == 128256
    assert np.array_equal(np.concatenate([split_tokens(dataset, "train"), split_tokens(dataset, "val")]), tokens)
    assert meta["splits"]["val"][0]["offset"] == 1024 + 8 * 4


def test_verify_finds_a_changed_token_byte_in_a_shard(tmp_path, shards):
    cfg = data_config(tmp_path, source="llmc", path=str(tmp_path / "shards" / "*.bin"))
    dataset = prepared(cfg)
    verify(dataset)

    shard = tmp_path / "shards" / "train_000001.bin"
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[1024 + 10] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime: same key

    assert prepared(cfg) == dataset  # a cache hit stats, it does not hash
    with pytest.raises(DataError) as excinfo:
        verify(dataset)
    message = one_line_error(excinfo)
    assert "train_000001.bin" in message and "sha256" in message and "--force" in message


def test_a_modified_shard_makes_the_next_prepare_index_again(tmp_path, shards):
    cfg = data_config(tmp_path, source="llmc", path=str(tmp_path / "shards" / "*.bin"))
    first = prepared(cfg)
    assert prepared(cfg) == first

    shard = tmp_path / "shards" / "train_000002.bin"
    write_llmc(shard, np.full(100, 7, dtype=np.uint16))
    touch_later(shard)
    second = prepared(cfg)

    assert second != first
    assert split_tokens(second, "val").tolist()[-5:] == [7] * 5
    verify(second)


def test_a_wrong_magic_number_is_a_one_line_error_naming_the_file(tmp_path):
    bad = write_llmc(tmp_path / "bad.bin", [1, 2, 3], magic=12345)

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="llmc", path=str(bad)))

    message = one_line_error(excinfo)
    assert str(bad) in message and "magic" in message and "12345" in message
    assert cache_leftovers(tmp_path) == []


def test_a_truncated_llmc_shard_is_an_error(tmp_path):
    short = write_llmc(tmp_path / "short.bin", [1, 2, 3], promised=10)

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="llmc", path=str(short)))

    message = one_line_error(excinfo)
    assert str(short) in message and "10 tokens" in message and "truncated" in message


def test_a_shard_shorter_than_its_header_is_an_error(tmp_path):
    # A download cut short: llm.c's magic number, then not even the rest of the header. (Without
    # the magic, 100 bytes would be 50 of nanoGPT's header-less tokens: test_data_nanogpt.py.)
    whole = write_llmc(tmp_path / "whole.bin", [1, 2, 3]).read_bytes()
    (tmp_path / "tiny.bin").write_bytes(whole[:100])

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="llmc", path=str(tmp_path / "tiny.bin")))

    message = one_line_error(excinfo)
    assert "tiny.bin" in message and "100 bytes" in message and "1024" in message


def test_an_llmc_shard_without_tokens_is_an_error(tmp_path):
    write_llmc(tmp_path / "empty.bin", [])

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="llmc", path=str(tmp_path / "empty.bin")))

    assert "no tokens" in one_line_error(excinfo)


def test_no_llmc_shard_matching_is_an_error(tmp_path):
    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="llmc", path=str(tmp_path / "*.bin")))

    assert "no file matches" in one_line_error(excinfo)


# --- Megatron ------------------------------------------------------------------------------------

DOCUMENTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12, 13, 14, 15], [16, 17, 18, 19]]


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_megatron_bin_idx_is_used_in_place_with_its_documents(tmp_path, dtype):
    documents = [list(d) for d in DOCUMENTS]
    documents[2][0] = 70000 if dtype == "int32" else 60000
    prefix = write_megatron(tmp_path / "corpus_text_document", documents, dtype)

    dataset = prepared(data_config(tmp_path, source="megatron", path=str(prefix), val_fraction=0.25))

    assert sorted(p.name for p in dataset.iterdir()) == ["meta.json"]
    meta = read_meta(dataset)
    data = str(Path(f"{prefix}.bin").resolve())
    assert sorted(meta["files"]) == [data]
    assert meta["splits"]["train"][0]["file"] == data and meta["splits"]["train"][0]["offset"] == 0
    assert meta["splits"]["train"][0]["dtype"] == ("uint16" if dtype == "uint16" else "uint32")
    everything = [t for d in documents for t in d]
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == len(everything) == 19
    assert np.concatenate([split_tokens(dataset, "train"), split_tokens(dataset, "val")]).tolist() == everything
    assert meta["documents"]["total"] == 5
    assert meta["vocab_size"] == max(everything) + 1
    verify(dataset)


def test_the_megatron_validation_cut_moves_to_the_nearest_document_end_its_index_records(tmp_path):
    # 19 tokens, val_fraction 0.25: the exact cut (14) is inside [10..15]; the next end is 15.
    dataset = prepared(
        data_config(tmp_path, source="megatron", path=str(write_megatron(tmp_path / "corpus", DOCUMENTS)), val_fraction=0.25)
    )
    assert split_tokens(dataset, "val").tolist() == [16, 17, 18, 19]
    assert read_meta(dataset)["tokens"] == {"train": 15, "val": 4}


def test_megatron_sequences_of_one_document_are_never_split_between_train_and_validation(tmp_path):
    # Sequences (sentences) of the same five sizes, grouped into two documents: [1..9] and [10..19].
    # The cut at 14 has no document end after it, so it moves back to the one before: 9.
    prefix = write_megatron(tmp_path / "corpus", DOCUMENTS, document_indices=[0, 3, 5])
    dataset = prepared(data_config(tmp_path, source="megatron", path=str(prefix), val_fraction=0.25))
    assert split_tokens(dataset, "val").tolist() == list(range(10, 20))
    assert read_meta(dataset)["documents"]["total"] == 2


def test_megatron_document_indices_that_are_not_ascending_are_an_error(tmp_path):
    prefix = write_megatron(tmp_path / "corpus", DOCUMENTS, document_indices=[0, 3, 2, 5])
    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="megatron", path=str(prefix)))
    assert one_line_error(excinfo) == (
        f"{prefix}.idx: truncated or damaged (its document indices are not ascending sequence numbers from 0 to 5)"
    )


def test_megatron_val_path_is_its_own_pair(tmp_path):
    train = write_megatron(tmp_path / "train", DOCUMENTS)
    val = write_megatron(tmp_path / "val", [[100, 101], [102]])

    dataset = prepared(data_config(tmp_path, source="megatron", path=str(train), val_path=str(val)))

    assert split_tokens(dataset, "val").tolist() == [100, 101, 102]
    assert read_meta(dataset)["documents"]["total"] == 7


def test_a_megatron_pair_without_its_idx_is_an_error(tmp_path):
    prefix = write_megatron(tmp_path / "corpus", DOCUMENTS)
    Path(f"{prefix}.idx").unlink()

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="megatron", path=str(prefix)))

    message = one_line_error(excinfo)
    assert "corpus.idx" in message and "does not exist" in message


def test_a_megatron_path_given_with_its_suffix_says_to_leave_it_out(tmp_path):
    prefix = write_megatron(tmp_path / "corpus", DOCUMENTS)

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="megatron", path=f"{prefix}.bin"))

    assert "without the suffix" in one_line_error(excinfo)


def test_a_megatron_index_with_a_bad_magic_is_an_error(tmp_path):
    prefix = write_megatron(tmp_path / "corpus", DOCUMENTS, magic=b"NOTMEGAT\x00")

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="megatron", path=str(prefix)))

    message = one_line_error(excinfo)
    assert "corpus.idx" in message and "magic" in message
    assert cache_leftovers(tmp_path) == []


@pytest.mark.parametrize("code,name", [(7, "float32"), (6, "float64"), (5, "int64")])
def test_a_megatron_index_with_an_unsupported_token_type_is_an_error(tmp_path, code, name):
    prefix = write_megatron(tmp_path / "corpus", DOCUMENTS, code=code)

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="megatron", path=str(prefix)))

    message = one_line_error(excinfo)
    assert "corpus.idx" in message and name in message and "not supported" in message


def test_a_megatron_bin_shorter_than_its_index_says_is_an_error(tmp_path):
    prefix = write_megatron(tmp_path / "corpus", DOCUMENTS)
    data = Path(f"{prefix}.bin")
    data.write_bytes(data.read_bytes()[:-4])

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="megatron", path=str(prefix)))

    message = one_line_error(excinfo)
    assert "corpus.bin" in message and "truncated" in message


def test_a_modified_megatron_bin_makes_the_next_prepare_index_again(tmp_path):
    prefix = write_megatron(tmp_path / "corpus", DOCUMENTS)
    cfg = data_config(tmp_path, source="megatron", path=str(prefix))
    first = prepared(cfg)

    write_megatron(prefix, [[d + 1 for d in doc] for doc in DOCUMENTS])  # same sizes, new ids
    touch_later(Path(f"{prefix}.bin"))
    second = prepared(cfg)

    assert second != first
    assert read_meta(second)["max_token_id"] == 20


def test_a_rewritten_megatron_index_alone_makes_the_next_prepare_index_again(tmp_path):
    prefix = write_megatron(tmp_path / "corpus", DOCUMENTS)
    cfg = data_config(tmp_path, source="megatron", path=str(prefix))
    first = prepared(cfg)
    bin_stat = Path(f"{prefix}.bin").stat()

    merged = [sum(DOCUMENTS, [])]  # the same tokens as one document: only the .idx changes
    write_megatron(prefix, merged)
    os.utime(f"{prefix}.bin", ns=(bin_stat.st_atime_ns, bin_stat.st_mtime_ns))
    touch_later(Path(f"{prefix}.idx"))
    second = prepared(cfg)

    assert second != first
    assert read_meta(second)["documents"]["total"] == 1


def test_a_validation_shard_that_data_path_also_matches_is_refused(tmp_path):
    write_llmc(tmp_path / "shard_train_000.bin", range(100))
    write_llmc(tmp_path / "shard_val_000.bin", range(50))

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="llmc", path=str(tmp_path), val_path=str(tmp_path / "shard_val_*.bin")))

    message = one_line_error(excinfo)
    assert message.startswith(f"{tmp_path / 'shard_val_000.bin'} is in both data.path and data.val_path")
