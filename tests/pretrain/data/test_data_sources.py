"""Local text sources end to end through prepare: pretrain/data/sources.py (text, jsonl, parquet);
the Hub is in test_data_hub.py."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from pretrain.data import DataError
from pretrain.data import sources
from pretrain.data.prepare import read_meta
from pretrain.data.tokenizer import BYTE_EOT
from support.processes import cache_leftovers, one_line_error
from support.runs import all_tokens, data_config, prepared, split_tokens
from support.datasets import write_parquet


def byte_documents(tokens: np.ndarray) -> list[str]:
    """The texts of byte-tokenizer ids, one per end-of-text (which must end the stream)."""
    assert tokens[-1] == BYTE_EOT
    ends = np.flatnonzero(tokens == BYTE_EOT)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [bytes(tokens[s:e].astype(np.uint8)).decode("utf-8") for s, e in zip(starts, ends, strict=True)]


def documents_of(dataset: Path) -> list[str]:
    return byte_documents(all_tokens(dataset))


def write_jsonl(path: Path, rows: list, field: str = "text") -> Path:
    path.write_text(
        "".join(json.dumps(row if not isinstance(row, str) else {field: row}) + "\n" for row in rows), encoding="utf-8"
    )
    return path


TEXTS = ["héllo wörld ✓\nsecond line\n", "plain ascii text", "third\n\nwith a blank line\n"]


# --- text ----------------------------------------------------------------------------------------


def test_a_text_file_is_one_document_followed_by_end_of_text(tmp_path):
    (tmp_path / "a.txt").write_text(TEXTS[0], encoding="utf-8")

    dataset = prepared(data_config(tmp_path, source="text", path=str(tmp_path / "a.txt")))

    tokens = all_tokens(dataset)
    assert tokens.tolist() == list(TEXTS[0].encode("utf-8")) + [BYTE_EOT]
    meta = read_meta(dataset)
    assert meta["documents"]["total"] == 1
    assert meta["eot_id"] == BYTE_EOT and meta["vocab_size"] == 257
    assert sorted(meta["files"]) == ["tokens.bin"]
    assert sorted(p.name for p in dataset.iterdir()) == ["meta.json", "tokens.bin"]


def test_a_directory_gives_its_text_files_recursively_sorted_one_document_each(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text(TEXTS[1])
    (root / "sub" / "c.txt").write_text(TEXTS[2])
    (root / "a.txt").write_text(TEXTS[0])
    (root / "notes.csv").write_text("not, text\n")  # another format: left out
    (root / ".hidden.txt").write_text("hidden\n")  # hidden: left out

    dataset = prepared(data_config(tmp_path, source="text", path=str(root)))

    assert documents_of(dataset) == [TEXTS[0], TEXTS[1], TEXTS[2]]  # a.txt, b.txt, sub/c.txt
    assert read_meta(dataset)["documents"]["total"] == 3


def test_a_glob_gives_its_matches_sorted(tmp_path):
    for name, text in zip(["x2.txt", "x1.txt", "y.txt"], TEXTS, strict=True):
        (tmp_path / name).write_text(text)

    dataset = prepared(data_config(tmp_path, source="text", path=str(tmp_path / "x*.txt")))

    assert documents_of(dataset) == [TEXTS[1], TEXTS[0]]  # x1.txt, x2.txt; y.txt does not match


def test_a_gzipped_text_file_is_read_unpacked(tmp_path):
    with gzip.open(tmp_path / "a.txt.gz", "wt", encoding="utf-8") as file:
        file.write(TEXTS[0])

    dataset = prepared(data_config(tmp_path, source="text", path=str(tmp_path / "a.txt.gz")))

    assert documents_of(dataset) == [TEXTS[0]]


def test_a_large_text_file_streams_in_pieces_and_gives_the_same_tokens_as_one_read(tmp_path, monkeypatch):
    lines = [f"line {i}: " + "wörd " * (i % 9) + "\n" for i in range(400)]
    big = tmp_path / "big.txt"
    big.write_text("".join(lines), encoding="utf-8")
    whole = prepared(data_config(tmp_path / "one", source="text", path=str(big)))

    monkeypatch.setattr(sources, "PIECE_CHARS", 200)
    cfg = data_config(tmp_path / "pieces", source="text", path=str(big))
    pieces = list(sources.text_source(cfg).pieces())
    streamed = prepared(cfg)

    assert len(pieces) > 10
    assert [p.ends_document for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert max(len(p.text) for p in pieces) < 200 + 60  # cut at the first line end past the size
    assert "".join(p.text for p in pieces) == big.read_text(encoding="utf-8")
    assert np.array_equal(all_tokens(streamed), all_tokens(whole))
    assert read_meta(streamed)["documents"]["total"] == 1


def test_a_text_file_without_line_ends_still_streams_in_bounded_pieces(tmp_path, monkeypatch):
    one_line = "abcdé" * 400  # 2000 characters, no newline
    (tmp_path / "flat.txt").write_text(one_line, encoding="utf-8")
    monkeypatch.setattr(sources, "PIECE_CHARS", 100)
    cfg = data_config(tmp_path, source="text", path=str(tmp_path / "flat.txt"))

    pieces = list(sources.text_source(cfg).pieces())

    assert max(len(p.text) for p in pieces) < 2 * 100  # a line longer than a piece is cut
    assert "".join(p.text for p in pieces) == one_line
    assert documents_of(prepared(cfg)) == [one_line]


def test_a_text_file_that_is_not_utf8_is_a_one_line_error(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="text", path=str(tmp_path / "latin1.txt")))

    assert "latin1.txt" in one_line_error(excinfo) and "UTF-8" in str(excinfo.value)
    assert cache_leftovers(tmp_path) == []


# --- jsonl ---------------------------------------------------------------------------------------


def test_jsonl_reads_the_named_field_one_document_per_line_and_skips_blank_lines(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(
        json.dumps({"body": TEXTS[0], "id": 1}) + "\n\n   \n" + json.dumps({"body": TEXTS[1], "id": 2}) + "\n", encoding="utf-8"
    )

    dataset = prepared(data_config(tmp_path, source="jsonl", path=str(path), text_field="body"))

    assert documents_of(dataset) == [TEXTS[0], TEXTS[1]]
    assert read_meta(dataset)["documents"]["total"] == 2


def test_jsonl_without_the_field_names_file_line_field_the_fields_there_are_and_the_setting(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, [{"text": "fine"}, {"content": "x", "id": 3}])

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="jsonl", path=str(path)))

    message = one_line_error(excinfo)
    assert f"{path}:2" in message
    assert "'text'" in message and "content" in message and "id" in message
    assert "data.text_field" in message
    assert cache_leftovers(tmp_path) == []


def test_jsonl_with_an_invalid_line_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "broken\n', encoding="utf-8")

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="jsonl", path=str(path)))

    message = one_line_error(excinfo)
    assert f"{path}:2" in message and "JSON" in message
    assert message.endswith("(Invalid control character at column 17)")  # one "at", not "character at at column"
    assert cache_leftovers(tmp_path) == []


def test_jsonl_with_a_field_that_is_not_text_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": ["a", "list"]}])

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="jsonl", path=str(path)))

    message = one_line_error(excinfo)
    assert f"{path}:1" in message and "list" in message and "data.text_field" in message


def test_jsonl_with_only_blank_lines_has_no_documents_and_leaves_nothing_half_written(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n  \n")

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="jsonl", path=str(tmp_path / "empty.jsonl")))

    assert "no documents" in one_line_error(excinfo)
    assert cache_leftovers(tmp_path) == []


# --- parquet -------------------------------------------------------------------------------------


def test_parquet_reads_the_named_column(tmp_path):
    path = write_parquet(tmp_path / "rows.parquet", {"id": [1, 2, 3], "content": TEXTS})

    dataset = prepared(data_config(tmp_path, source="parquet", path=str(path), text_field="content"))

    assert documents_of(dataset) == TEXTS
    assert read_meta(dataset)["documents"]["total"] == 3


def test_parquet_without_the_column_lists_the_columns(tmp_path):
    path = write_parquet(tmp_path / "rows.parquet", {"id": [1], "content": ["x"]})

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="parquet", path=str(path)))

    message = one_line_error(excinfo)
    assert str(path) in message and "'text'" in message and "id, content" in message
    assert "data.text_field" in message
    assert cache_leftovers(tmp_path) == []


def test_parquet_column_that_is_not_text_is_an_error(tmp_path):
    path = write_parquet(tmp_path / "rows.parquet", {"text": [1, 2]})

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="parquet", path=str(path)))

    message = one_line_error(excinfo)
    assert str(path) in message and "int64" in message and "not text" in message
    assert cache_leftovers(tmp_path) == []


def test_a_file_that_is_not_parquet_is_a_one_line_error(tmp_path):
    (tmp_path / "fake.parquet").write_text("not parquet at all")

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="parquet", path=str(tmp_path / "fake.parquet")))

    assert "fake.parquet" in one_line_error(excinfo)


# --- validation file -----------------------------------------------------------------------------


def test_val_path_becomes_exactly_the_validation_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", TEXTS)
    write_jsonl(tmp_path / "val.jsonl", ["held out ✓", "also held out"])

    dataset = prepared(
        data_config(tmp_path, source="jsonl", path=str(tmp_path / "train.jsonl"), val_path=str(tmp_path / "val.jsonl"))
    )

    assert byte_documents(split_tokens(dataset, "train")) == TEXTS
    assert byte_documents(split_tokens(dataset, "val")) == ["held out ✓", "also held out"]
    meta = read_meta(dataset)
    assert meta["documents"] == {"total": 5, "train": 3, "val": 2}
    assert meta["key"]["val_fraction"] is None


def test_an_empty_val_path_file_is_an_error(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", TEXTS)
    (tmp_path / "val.jsonl").write_text("\n")

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="jsonl", path=str(tmp_path / "train.jsonl"), val_path=str(tmp_path / "val.jsonl")))

    assert "data.val_path" in one_line_error(excinfo)
    assert cache_leftovers(tmp_path) == []


# --- max_samples ---------------------------------------------------------------------------------


def test_max_samples_limits_the_documents_and_has_its_own_cache_directory(tmp_path):
    rows = [f"document number {i}" for i in range(10)]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = dict(source="jsonl", path=str(tmp_path / "rows.jsonl"))

    three = prepared(data_config(tmp_path, max_samples=3, **cfg))
    five = prepared(data_config(tmp_path, max_samples=5, **cfg))
    every = prepared(data_config(tmp_path, **cfg))

    assert read_meta(three)["documents"]["total"] == 3
    assert documents_of(three) == rows[:3]
    assert sum(read_meta(three)["tokens"].values()) == sum(len(r) + 1 for r in rows[:3])
    assert read_meta(five)["documents"]["total"] == 5
    assert read_meta(every)["documents"]["total"] == 10
    assert len({three, five, every}) == 3


# --- errors that leave nothing behind ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet"])
def test_a_missing_path_is_a_one_line_error_naming_it(tmp_path, kind):
    missing = tmp_path / "nowhere" / "data.txt"

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source=kind, path=str(missing)))

    message = one_line_error(excinfo)
    assert "data.path" in message and str(missing) in message and "does not exist" in message
    assert cache_leftovers(tmp_path) == []


def test_a_missing_val_path_names_the_setting(tmp_path):
    (tmp_path / "a.txt").write_text("text")

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="text", path=str(tmp_path / "a.txt"), val_path=str(tmp_path / "none.txt")))

    assert "data.val_path" in one_line_error(excinfo)


def test_a_glob_matching_nothing_is_a_one_line_error(tmp_path):
    (tmp_path / "a.txt").write_text("text")

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="text", path=str(tmp_path / "*.jsonl")))

    assert "no file matches" in one_line_error(excinfo) and "*.jsonl" in str(excinfo.value)
    assert cache_leftovers(tmp_path) == []


def test_a_directory_without_files_of_the_format_is_a_one_line_error(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "rows.jsonl").write_text('{"text": "x"}\n')  # jsonl, but text is asked for

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="text", path=str(tmp_path / "corpus")))

    message = one_line_error(excinfo)
    assert "corpus" in message and ".txt" in message
    assert cache_leftovers(tmp_path) == []


def test_an_empty_directory_is_a_one_line_error(tmp_path):
    (tmp_path / "corpus").mkdir()

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="jsonl", path=str(tmp_path / "corpus")))

    assert "holds no" in one_line_error(excinfo)
    assert cache_leftovers(tmp_path) == []


def test_a_source_with_zero_documents_fails_during_the_build_and_leaves_only_the_lock(tmp_path):
    import pyarrow as pa

    write_parquet(tmp_path / "rows.parquet", {"text": pa.array([None, None], pa.string())})  # rows, no text

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="parquet", path=str(tmp_path / "rows.parquet")))

    assert "no documents" in one_line_error(excinfo)
    assert (tmp_path / "cache").is_dir()  # the build started (and took the lock) ...
    assert cache_leftovers(tmp_path) == []  # ... and removed its temporary directory


def test_an_empty_text_file_is_a_one_line_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="text", path=str(tmp_path / "empty.txt")))

    one_line_error(excinfo)
    assert cache_leftovers(tmp_path) == []


# --- the cache key -------------------------------------------------------------------------------


def test_the_cache_is_reused_and_changes_with_content_size_or_mtime_of_a_source_file(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    a, b = corpus / "a.txt", corpus / "b.txt"
    a.write_text("first text")
    b.write_text("second text")
    cfg = data_config(tmp_path, source="text", path=str(corpus / "*.txt"))
    first = prepared(cfg)
    assert prepared(cfg) == first  # unchanged: reused

    stat = a.stat()
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))  # touched: same bytes, new mtime
    touched = prepared(cfg)
    assert touched != first

    a.write_text("first text, longer")
    grown = prepared(cfg)
    assert grown not in (first, touched)
    assert documents_of(grown) == ["first text, longer", "second text"]

    stat = b.stat()
    b.write_text("SECOND TEXT")  # same size, same mtime: only the content changed
    os.utime(b, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # By design the key stats the files and reads no contents (a cache hit stays cheap): reused.
    assert prepared(cfg) == grown

    (corpus / "unrelated.md").write_text("outside the pattern")
    (tmp_path / "other.txt").write_text("outside the directory")
    assert prepared(cfg) == grown


def test_context_length_does_not_change_the_dataset_directory(tmp_path):
    # Deliberate: windows are cut at load time, so one preparation serves every context length.
    (tmp_path / "a.txt").write_text("some text " * 20)
    short = prepared(data_config(tmp_path, source="text", path=str(tmp_path / "a.txt"), context_length=16))
    long = prepared(data_config(tmp_path, source="text", path=str(tmp_path / "a.txt"), context_length=4096))

    assert short == long
    assert sorted(read_meta(short)["key"]) == [
        "format_version",
        "max_samples",
        "source",
        "tokenizer",
        "val_fraction",
        "val_source",
    ]


def test_the_text_field_is_part_of_the_key(tmp_path):
    write_jsonl(tmp_path / "rows.jsonl", [{"text": "a", "body": "b"}])
    first = prepared(data_config(tmp_path, source="jsonl", path=str(tmp_path / "rows.jsonl")))
    second = prepared(data_config(tmp_path, source="jsonl", path=str(tmp_path / "rows.jsonl"), text_field="body"))

    assert first != second and documents_of(second) == ["b"]


def test_a_damaged_gzip_file_is_a_one_line_error(tmp_path):
    data = gzip.compress(("line of text\n" * 2000).encode())
    path = tmp_path / "broken.txt.gz"
    path.write_bytes(data[:40] + bytes(200) + data[240:])

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="text", path=str(path)))

    assert f"{path}: cannot read" in one_line_error(excinfo)
    assert cache_leftovers(tmp_path) == []


def test_jsonl_nulls_are_skipped_and_lone_surrogates_replaced(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "first"}\n{"text": null}\n{"text": "a\\ud800b"}\n', encoding="utf-8")

    dataset = prepared(data_config(tmp_path, source="jsonl", path=str(path)))

    assert documents_of(dataset) == ["first", "a?b"]
