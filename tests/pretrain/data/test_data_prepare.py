"""Preparing and caching datasets: pretrain/data/prepare.py and builtin.py (the prepare_dataset.py
command: test_prepare_dataset_script.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from pretrain.config import DataConfig
from pretrain.data import DataError
from pretrain.data import encode as encoding
from pretrain.data import prepare as prep
from pretrain.data.builtin import builtin_documents, content_digest
from pretrain.data.tokenizer import BYTE_EOT, ByteTokenizer

from support.processes import launcher_env
from support.runs import data_config, split_tokens

# Varied lengths and non-ASCII text, so a byte-level round trip means something.
CORPUS = [f"Document {i}: " + "héllo wörld ✓ " * (i % 7 + 1) + "\n" * (i % 3) for i in range(40)]


def prepare_quietly(cfg: DataConfig, documents=CORPUS, **kwargs) -> tuple[Path, list[str]]:
    lines: list[str] = []
    return prep.prepare(cfg, log=lines.append, documents=documents, **kwargs), lines


def split_documents(path: Path, split: str) -> list[str]:
    """The texts of a split, one per end-of-text."""
    tokens = split_tokens(path, split)
    assert tokens[-1] == BYTE_EOT
    ends = np.flatnonzero(tokens == BYTE_EOT)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [bytes(tokens[s:e].astype(np.uint8)).decode("utf-8") for s, e in zip(starts, ends, strict=True)]


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- building ------------------------------------------------------------------------------------


def test_prepare_writes_tokens_and_meta_into_a_readable_keyed_directory(tmp_path):
    path, lines = prepare_quietly(data_config(tmp_path))

    assert path.parent == tmp_path / "cache"
    assert path.name.startswith("custom-byte-") and len(path.name) == len("custom-byte-") + 12
    assert entries(path) == ["meta.json", "tokens.bin"]
    assert len(lines) == 1 and lines[0].startswith(f"dataset: prepared {path} (")
    assert "40 documents) in " in lines[0] and lines[0].endswith(" tokens/s)")


def test_meta_records_the_key_the_tokenizer_the_splits_counts_and_checksums(tmp_path):
    path, _ = prepare_quietly(data_config(tmp_path, val_fraction=0.1))
    meta = prep.read_meta(path)

    assert meta["format_version"] == prep.FORMAT_VERSION
    assert meta["key"]["source"] == {"source": "custom", "content": content_digest(CORPUS)}
    assert meta["key"]["tokenizer"] == {"kind": "byte"} and meta["key"]["max_samples"] == 0
    assert meta["key"]["val_fraction"] == 0.1
    assert meta["tokenizer"] == {"kind": "byte", "name": "byte", "vocab_size": 257, "eot_id": 256}
    assert (meta["vocab_size"], meta["eot_id"], meta["dtype"], meta["max_token_id"]) == (257, 256, "uint16", 256)
    total = sum(len(doc.encode("utf-8")) + 1 for doc in CORPUS)
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == total
    assert meta["documents"]["total"] == 40
    assert meta["documents"]["train"] + meta["documents"]["val"] == 40
    assert meta["splits"]["train"] == [{"file": "tokens.bin", "offset": 0, "tokens": meta["tokens"]["train"], "dtype": "uint16"}]
    assert meta["splits"]["val"] == [
        {"file": "tokens.bin", "offset": 2 * meta["tokens"]["train"], "tokens": meta["tokens"]["val"], "dtype": "uint16"}
    ]
    assert meta["files"]["tokens.bin"] == {"bytes": 2 * total, "sha256": prep.file_sha256(path / "tokens.bin")}
    assert time.time() - time.mktime(time.strptime(meta["created"], "%Y-%m-%dT%H:%M:%SZ")) < 86400 + 60


def test_documents_keep_their_order_validation_is_the_tail_and_both_round_trip(tmp_path):
    path, _ = prepare_quietly(data_config(tmp_path, val_fraction=0.1))
    train, val = split_documents(path, "train"), split_documents(path, "val")

    assert train + val == CORPUS  # the cut fell on a document boundary
    assert len(val) in (3, 4, 5)
    assert ByteTokenizer().decode(split_tokens(path, "val")) == "".join(d + "\n" for d in val)


def test_tokens_are_uint16_when_the_vocabulary_fits_and_uint32_when_not():
    assert prep.storage_dtype(257) == "uint16"
    assert prep.storage_dtype(65536) == "uint16"
    assert prep.storage_dtype(128256) == "uint32"


def test_the_validation_cut_moves_to_a_nearby_document_boundary_or_stays_inside_one_long_document():
    # 1000 tokens, 10%: the ideal cut is at 900.
    assert prep.split_point(1000, [100, 880, 950, 1000], 0.1) == 950  # next boundary leaves 50 >= 50
    assert prep.split_point(1000, [100, 880, 960, 1000], 0.1) == 880  # next leaves 40 < 50; previous 120 <= 200
    assert prep.split_point(1000, [100, 500, 1000], 0.1) == 900  # both too far: cut inside a document
    assert prep.split_point(1000, [1000], 0.1) == 900  # one document
    assert prep.split_point(2, [2], 0.5) == 1
    with pytest.raises(DataError, match="1 token"):
        prep.split_point(1, [1], 0.1)


def test_a_single_long_document_is_split_inside_it(tmp_path):
    path, _ = prepare_quietly(data_config(tmp_path, val_fraction=0.25), documents=["x" * 399])
    meta = prep.read_meta(path)

    assert meta["tokens"] == {"train": 300, "val": 100}
    assert meta["documents"] == {"total": 1, "train": 0, "val": 1}


def test_an_empty_source_is_a_one_line_error_and_leaves_nothing_behind(tmp_path):
    with pytest.raises(DataError, match="has no documents"):
        prepare_quietly(data_config(tmp_path), documents=[])
    assert [e for e in entries(tmp_path / "cache") if not e.endswith(".lock")] == []


def test_max_samples_takes_the_first_documents(tmp_path):
    path, _ = prepare_quietly(data_config(tmp_path, max_samples=10))
    meta = prep.read_meta(path)

    assert meta["documents"]["total"] == 10
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == sum(len(d.encode("utf-8")) + 1 for d in CORPUS[:10])


def test_each_input_that_changes_the_bytes_changes_the_cache_directory(tmp_path):
    base, _ = prepare_quietly(data_config(tmp_path))
    other_fraction, _ = prepare_quietly(data_config(tmp_path, val_fraction=0.2))
    other_text, _ = prepare_quietly(data_config(tmp_path), documents=CORPUS[:-1] + ["changed"])
    other_samples, _ = prepare_quietly(data_config(tmp_path, max_samples=5))
    other_tokenizer, _ = prepare_quietly(data_config(tmp_path, tokenizer="bpe", bpe_vocab_size=300))
    other_context, _ = prepare_quietly(data_config(tmp_path, context_length=64))

    assert len({base, other_fraction, other_text, other_samples, other_tokenizer}) == 5
    # Deliberate: windows are cut at load time, so the bytes do not depend on the context length
    # and one preparation serves them all.
    assert other_context == base


# --- reuse, damage, failure ----------------------------------------------------------------------


def test_second_prepare_reuses_the_cache_without_tokenizing_again(tmp_path, monkeypatch):
    calls = []
    encode = ByteTokenizer.encode_batch
    monkeypatch.setattr(ByteTokenizer, "encode_batch", lambda self, texts: calls.append(texts) or encode(self, texts))
    cfg = data_config(tmp_path)

    first, _ = prepare_quietly(cfg)
    built = len(calls)
    second, lines = prepare_quietly(cfg)

    assert built > 0 and len(calls) == built
    assert second == first
    (line,) = lines
    assert line.startswith(
        f"dataset: reusing {first} ({prep.read_meta(first)['tokens']['train']:,} train tokens, "
        f"{prep.read_meta(first)['tokens']['val']:,} val tokens; checked in "
    )
    assert line.endswith(" ms)")


def test_force_rebuilds_a_valid_cache_in_place(tmp_path):
    cfg = data_config(tmp_path)
    first, _ = prepare_quietly(cfg)
    inode = (first / "tokens.bin").stat().st_ino

    second, lines = prepare_quietly(cfg, force=True)

    assert second == first and (second / "tokens.bin").stat().st_ino != inode
    assert lines[0] == f"dataset: rebuilding {first} (forced)"
    assert lines[1].startswith("dataset: prepared")
    assert entries(tmp_path / "cache") == [first.name]  # the lock file goes with its build


def truncate_tokens(path: Path) -> None:
    with open(path / "tokens.bin", "r+b") as file:
        file.truncate(10)


def garble_meta(path: Path) -> None:
    (path / "meta.json").write_text("{not json")


def remove_tokens(path: Path) -> None:
    (path / "tokens.bin").unlink()


def drop_val_split(path: Path) -> None:
    meta = json.loads((path / "meta.json").read_text())
    del meta["splits"]["val"]
    (path / "meta.json").write_text(json.dumps(meta))


def bump_format_version(path: Path) -> None:
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "format_version": 0}))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (truncate_tokens, "tokens.bin has 10 bytes"),
        (garble_meta, "meta.json is unreadable"),
        (remove_tokens, "tokens.bin is missing"),
        (drop_val_split, "no segments for val"),
        (bump_format_version, "format_version 0"),
    ],
)
def test_a_damaged_cache_is_reported_in_one_line_and_rebuilt(tmp_path, damage, reason):
    cfg = data_config(tmp_path)
    path, _ = prepare_quietly(cfg)
    good_meta = prep.read_meta(path)
    damage(path)

    again, lines = prepare_quietly(cfg)

    assert again == path
    assert len(lines) == 2
    assert lines[0].startswith(f"dataset: rebuilding {path} (damaged: ") and reason in lines[0]
    assert lines[1].startswith(f"dataset: prepared {path}")
    assert prep.read_meta(path)["files"] == good_meta["files"]
    prep.verify(path)


def test_a_failed_build_leaves_no_temporary_directory_and_the_next_one_succeeds(tmp_path, monkeypatch):
    encode = ByteTokenizer.encode

    def fail_on_the_tenth_document(self, text):
        if text == CORPUS[9]:
            raise RuntimeError("tokenizer exploded")
        return encode(self, text)

    monkeypatch.setattr(ByteTokenizer, "encode", fail_on_the_tenth_document)
    monkeypatch.setattr(encoding, "BATCH_CHARS", 100)  # several batches: the failure comes mid-file
    with pytest.raises(RuntimeError, match="tokenizer exploded"):
        prepare_quietly(data_config(tmp_path))
    assert [e for e in entries(tmp_path / "cache") if not e.endswith(".lock")] == []

    monkeypatch.setattr(ByteTokenizer, "encode", encode)
    path, lines = prepare_quietly(data_config(tmp_path))
    assert lines[0].startswith("dataset: prepared") and prep.read_meta(path)["documents"]["train"] > 0


def test_temporary_directories_of_a_killed_preparer_are_cleaned_up_by_the_next_build(tmp_path):
    cfg = data_config(tmp_path)
    path, _ = prepare_quietly(cfg)
    leftover = path.parent / f".{path.name}.tmp-12345-deadbeef"
    leftover.mkdir()
    (leftover / "tokens.bin").write_bytes(b"half")
    truncate_tokens(path)

    prepare_quietly(cfg)

    assert not leftover.exists()


def test_verify_catches_a_flipped_byte_that_the_quick_check_cannot_see(tmp_path):
    cfg = data_config(tmp_path)
    path, _ = prepare_quietly(cfg)
    prep.verify(path)
    with open(path / "tokens.bin", "r+b") as file:
        first = file.read(1)
        file.seek(0)
        file.write(bytes([first[0] ^ 0x01]))

    _, lines = prepare_quietly(cfg)  # same size: the O(1) check reuses it
    assert lines[0].startswith("dataset: reusing")
    with pytest.raises(DataError, match=r"tokens\.bin does not match its sha256"):
        prep.verify(path)


def test_read_meta_of_a_directory_that_is_not_a_dataset_raises_data_error(tmp_path):
    with pytest.raises(DataError, match="meta.json is missing"):
        prep.read_meta(tmp_path)


CONCURRENT_PREPARER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from pretrain.config import DataConfig
    from pretrain.data.prepare import prepare
    from pretrain.data.tokenizer import ByteTokenizer

    cache, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    encode = ByteTokenizer.encode
    def slow_encode(self, text):  # a build long enough for the other preparer to arrive during it
        time.sleep(0.04)
        return encode(self, text)
    ByteTokenizer.encode = slow_encode
    import pretrain.data.encode as encoding
    encoding.BATCH_CHARS = 1  # one document per batch
    ready.touch()
    while not go.exists():
        time.sleep(0.002)
    documents = [f"document {i} " * 30 for i in range(30)]
    print("PATH", prepare(DataConfig(cache_dir=cache), documents=documents))
""")


@pytest.mark.slow
def test_concurrent_preparers_build_once_and_both_get_the_same_path(tmp_path):
    script = tmp_path / "preparer.py"
    script.write_text(CONCURRENT_PREPARER)
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "cache"), str(r), str(go)],
            env=launcher_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in ready
    ]
    deadline = time.monotonic() + 20
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()  # both start preparing at the same moment
    outputs = [p.communicate(timeout=30) for p in processes]

    assert [p.returncode for p in processes] == [0, 0], outputs
    stdout = "".join(out for out, _ in outputs)
    assert stdout.count("dataset: prepared") == 1
    assert stdout.count("dataset: reusing") == 1
    assert stdout.count("dataset: waiting for another process") == 1
    paths = {line for line in stdout.splitlines() if line.startswith("PATH")}
    assert len(paths) == 1
    path = Path(paths.pop().split(" ", 1)[1])
    prep.verify(path)
    assert entries(tmp_path / "cache") == [path.name]  # no lock file left beside the entry


# --- the builtin source and module boundaries ----------------------------------------------------


def test_builtin_documents_are_the_pydoc_topics_sorted_by_name():
    from pydoc_data.topics import topics

    documents = builtin_documents()
    assert documents == [topics[name] for name in sorted(topics)]
    assert len(documents) > 10


def test_the_content_digest_changes_with_the_corpus_and_its_document_boundaries():
    documents = builtin_documents()
    assert content_digest(documents) == content_digest(builtin_documents())
    assert content_digest(documents[:-1]) != content_digest(documents)
    assert content_digest(["ab", "c"]) != content_digest(["a", "bc"])


def test_document_ends_far_before_the_validation_cut_are_dropped_without_changing_the_split(tmp_path, monkeypatch):
    documents = [f"doc {i} " + "x" * (i % 13) for i in range(3000)]
    reference, _ = prepare_quietly(data_config(tmp_path / "a", val_fraction=0.1), documents=documents)
    monkeypatch.setattr(encoding, "BOUNDARIES_KEPT", 10)
    monkeypatch.setattr(encoding, "BATCH_CHARS", 500)  # many batches, so dropping happens along the way
    kept: list[int] = []
    write = encoding.TokenWriter.write

    def spy(self, *args):
        write(self, *args)
        kept.append(len(self.boundaries))

    monkeypatch.setattr(encoding.TokenWriter, "write", spy)

    bounded, _ = prepare_quietly(data_config(tmp_path / "b", val_fraction=0.1), documents=documents)

    assert max(kept) < 800  # of 3000 document ends
    assert prep.read_meta(bounded)["splits"] == prep.read_meta(reference)["splits"]
    assert prep.read_meta(bounded)["documents"] == prep.read_meta(reference)["documents"]


def test_the_build_lock_excludes_every_other_holder_although_each_holder_deletes_its_file(tmp_path):
    """A waiter that gets the lock of a file its holder deleted must not count it as held:
    otherwise it and a newcomer that created the next file would both build at once."""
    import threading
    from pretrain.data.cache import build_lock

    final = tmp_path / "entry"
    inside, most, waits = [0], [0], []
    guard = threading.Lock()

    def contend() -> None:
        for _ in range(40):
            with build_lock(final, waits.append):
                with guard:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                time.sleep(0.0005)  # long enough for the others to queue up on the file
                with guard:
                    inside[0] -= 1

    threads = [threading.Thread(target=contend) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert most[0] == 1
    assert waits  # they did contend
    assert entries(tmp_path) == []  # and left no lock file
