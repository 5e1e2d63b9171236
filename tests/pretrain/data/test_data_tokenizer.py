"""Tokenizers through prepare: pretrain/data/tokenizer.py (byte, bpe, huggingface, tiktoken)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from pretrain.data import DataError
from pretrain.data import prepare as prep
from pretrain.data.prepare import prepare, read_meta, verify
from pretrain.data import bpe_process
from pretrain.data.tokenizer import BYTE_EOT, BYTE_VOCAB_SIZE, ByteTokenizer, train_bpe
from support.processes import cache_leftovers, one_line_error
from support.runs import all_tokens, data_config, prepared


ROOT = Path(__file__).resolve().parents[3]

CORPUS = [
    f"Document {i}: the quick brown fox jumps over the lazy dog. " * (i % 4 + 1) + "héllo wörld ✓ naïve café\n" * (i % 3)
    for i in range(30)
]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def documents(tokens: np.ndarray, eot_id: int) -> list[np.ndarray]:
    """The token arrays between end-of-text ids (which must end the stream)."""
    assert tokens[-1] == eot_id
    ends = np.flatnonzero(tokens == eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e] for s, e in zip(starts, ends, strict=True)]


# --- byte ----------------------------------------------------------------------------------------


def test_the_byte_tokenizer_round_trips_utf8_and_ends_documents_with_256():
    tokenizer = ByteTokenizer()
    text = "héllo wörld ✓ 日本語 🙂\n"

    ids = tokenizer.encode_batch([text])[0]

    assert ids.tolist() == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.eot_id == BYTE_EOT == 256 and tokenizer.vocab_size == BYTE_VOCAB_SIZE == 257
    assert tokenizer.decode([104, 105, BYTE_EOT, 106]) == "hi\nj"


def test_byte_preparation_stores_uint16_ids_with_end_of_text_after_each_document(tmp_path):
    dataset = prepared(data_config(tmp_path), documents=["héllo", "✓"])

    tokens = all_tokens(dataset)
    assert tokens.tolist() == list("héllo".encode()) + [256] + list("✓".encode()) + [256]
    meta = read_meta(dataset)
    assert meta["tokenizer"] == {"kind": "byte", "name": "byte", "vocab_size": 257, "eot_id": 256}
    assert meta["dtype"] == "uint16" and meta["max_token_id"] == 256


# --- bpe -----------------------------------------------------------------------------------------


@pytest.fixture
def bpe_calls(monkeypatch):
    """Counts BPE trainings (the real trainer still runs)."""
    pytest.importorskip("tokenizers")
    calls = []
    real = prep.train_bpe

    def counting(texts, vocab_size, destination):
        calls.append(vocab_size)
        return real(texts, vocab_size, destination)

    monkeypatch.setattr(prep, "train_bpe", counting)
    return calls


def test_bpe_is_trained_once_cached_with_the_data_and_round_trips(tmp_path, bpe_calls):
    from tokenizers import Tokenizer

    source = write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    cfg = data_config(tmp_path, source="jsonl", path=str(source), tokenizer="bpe", bpe_vocab_size=300)

    dataset = prepared(cfg)
    assert prepared(cfg) == dataset
    assert bpe_calls == [300]

    trained = list((tmp_path / "cache" / "tokenizers").glob("bpe300-*/tokenizer.json"))
    assert len(trained) == 1
    assert (dataset / "tokenizer.json").read_bytes() == trained[0].read_bytes()
    tokenizer = Tokenizer.from_file(str(dataset / "tokenizer.json"))
    meta = read_meta(dataset)
    assert meta["vocab_size"] == tokenizer.get_vocab_size() == meta["tokenizer"]["vocab_size"]
    assert 258 <= meta["vocab_size"] <= 300
    assert meta["eot_id"] == tokenizer.token_to_id("<|endoftext|>")
    assert meta["tokenizer"]["file"] == "tokenizer.json" and "tokenizer.json" in meta["files"]
    tokens = all_tokens(dataset)
    assert int(tokens.max()) == meta["max_token_id"] < meta["vocab_size"]
    assert len(tokens) < sum(len(t.encode()) for t in CORPUS) + len(CORPUS)  # merges happened
    assert [tokenizer.decode(d.tolist()) for d in documents(tokens, meta["eot_id"])] == CORPUS
    assert tokenizer.decode(tokens.tolist(), skip_special_tokens=False) == "".join(t + "<|endoftext|>" for t in CORPUS)
    verify(dataset)


def test_bpe_retrains_only_when_its_training_data_or_size_changes(tmp_path, bpe_calls):
    source = write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    base = dict(source="jsonl", path=str(source), tokenizer="bpe", bpe_vocab_size=300)

    first = prepared(data_config(tmp_path, **base))
    other_split = prepared(data_config(tmp_path, **base, val_fraction=0.2))  # new dataset, same tokenizer
    longer_context = prepared(data_config(tmp_path, **base, context_length=64))  # same dataset
    assert bpe_calls == [300]
    assert other_split != first and longer_context == first

    prepared(data_config(tmp_path, **base, max_samples=10))  # trained on fewer documents
    assert bpe_calls == [300, 300]
    prepared(data_config(tmp_path, **{**base, "bpe_vocab_size": 320}))
    assert bpe_calls == [300, 300, 320]

    # A dataset deleted from the cache is rebuilt with the cached tokenizer.
    import shutil

    shutil.rmtree(first)
    assert prepared(data_config(tmp_path, **base)) == first
    assert bpe_calls == [300, 300, 320]
    assert len(list((tmp_path / "cache" / "tokenizers").glob("bpe*-*/tokenizer.json"))) == 3


def test_bpe_with_max_samples_is_trained_and_tokenized_on_those_documents_only(tmp_path, bpe_calls):
    source = write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    dataset = prepared(
        data_config(tmp_path, source="jsonl", path=str(source), tokenizer="bpe", bpe_vocab_size=300, max_samples=5)
    )

    meta = read_meta(dataset)
    assert meta["documents"]["total"] == 5
    assert meta["key"]["tokenizer"]["max_samples"] == 5


def test_text_that_spells_the_end_of_text_token_is_not_a_document_end(tmp_path, bpe_calls):
    from tokenizers import Tokenizer

    texts = ["before <|endoftext|> after, still one document", "second document"] * 5
    dataset = prepared(data_config(tmp_path, tokenizer="bpe", bpe_vocab_size=300), documents=texts)

    meta = read_meta(dataset)
    tokens = all_tokens(dataset)
    assert int((tokens == meta["eot_id"]).sum()) == len(texts) == meta["documents"]["total"]
    tokenizer = Tokenizer.from_file(str(dataset / "tokenizer.json"))
    assert [tokenizer.decode(d.tolist()) for d in documents(tokens, meta["eot_id"])] == texts


# --- huggingface (a local tokenizer.json) --------------------------------------------------------


def word_level(path: Path, words: list[str], specials: list[str] = ("<|endoftext|>",), *, ids: list[int] | None = None) -> Path:
    """A whitespace WordLevel tokenizer.json: [UNK] is 0, then the words, then the special tokens."""
    models = pytest.importorskip("tokenizers.models")
    from tokenizers import Tokenizer, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i for i, w in zip(ids or range(1, len(words) + 1), words, strict=True)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(specials))
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


WORDS = ["the", "cat", "sat", "on", "mat"]


def test_a_tokenizer_json_file_and_its_directory_both_work(tmp_path):
    tokenizer_file = word_level(tmp_path / "mytok" / "tokenizer.json", WORDS)
    texts = ["the cat sat", "on the mat dog"]

    by_file = prepared(data_config(tmp_path, tokenizer="huggingface", tokenizer_name=str(tokenizer_file)), documents=texts)
    by_dir = prepared(data_config(tmp_path, tokenizer="huggingface", tokenizer_name=str(tmp_path / "mytok")), documents=texts)

    eot = 6  # [UNK], five words, then the special token
    for dataset in (by_file, by_dir):
        assert all_tokens(dataset).tolist() == [1, 2, 3, eot, 4, 1, 5, 0, eot]
        meta = read_meta(dataset)
        assert meta["eot_id"] == eot and meta["vocab_size"] == 7
        assert meta["tokenizer"]["kind"] == "huggingface"
        assert (dataset / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
        assert dataset.name.startswith("custom-hf-mytok-")
    assert by_file == by_dir  # the same tokenizer file: the same key


def test_a_changed_tokenizer_json_is_a_new_dataset(tmp_path):
    tokenizer_file = word_level(tmp_path / "tok" / "tokenizer.json", WORDS)
    cfg = data_config(tmp_path, tokenizer="huggingface", tokenizer_name=str(tokenizer_file))
    first = prepared(cfg, documents=["the cat", "sat"])

    word_level(tokenizer_file, list(reversed(WORDS)))
    second = prepared(cfg, documents=["the cat", "sat"])

    assert second != first and all_tokens(second).tolist() == [5, 4, 6, 3, 6]


def test_a_tokenizer_json_that_does_not_parse_is_a_one_line_error_naming_it(tmp_path):
    pytest.importorskip("tokenizers")
    broken = tmp_path / "broken" / "tokenizer.json"
    broken.parent.mkdir()
    broken.write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, tokenizer="huggingface", tokenizer_name=str(broken)), documents=["x y"])

    message = one_line_error(excinfo)
    assert str(broken) in message and "tokenizer.json" in message
    assert cache_leftovers(tmp_path) == []


def test_a_tokenizer_without_an_end_of_text_token_asks_for_data_eot_token(tmp_path):
    tokenizer_file = word_level(tmp_path / "tok" / "tokenizer.json", WORDS, specials=["<pad>"])

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, tokenizer="huggingface", tokenizer_name=str(tokenizer_file)), documents=["the cat"])

    message = one_line_error(excinfo)
    assert "data.eot_token" in message and "<|endoftext|>" in message
    assert "its special tokens are '<pad>':" in message  # what the file has, to choose from
    assert cache_leftovers(tmp_path) == []


def test_a_tokenizer_without_any_special_token_says_so_when_asking_for_data_eot_token(tmp_path):
    tokenizer_file = word_level(tmp_path / "tok" / "tokenizer.json", WORDS, specials=[])

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, tokenizer="huggingface", tokenizer_name=str(tokenizer_file)), documents=["the cat"])

    assert "; it has no special tokens: set data.eot_token to the one it uses" in one_line_error(excinfo)


def test_a_missing_end_of_text_token_lists_only_the_first_few_special_tokens(tmp_path):
    specials = [f"<|reserved_{i}|>" for i in range(20)]
    tokenizer_file = word_level(tmp_path / "tok" / "tokenizer.json", WORDS, specials=specials)

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, tokenizer="huggingface", tokenizer_name=str(tokenizer_file)), documents=["the cat"])

    shown = ", ".join(repr(name) for name in specials[:8])
    assert f"its special tokens are {shown} and 12 more: set data.eot_token" in one_line_error(excinfo)


def test_data_eot_token_picks_the_named_token(tmp_path):
    tokenizer_file = word_level(tmp_path / "tok" / "tokenizer.json", WORDS, specials=["</s>", "<sep>"])
    texts = ["the cat", "sat"]

    default = prepared(data_config(tmp_path, tokenizer="huggingface", tokenizer_name=str(tokenizer_file)), documents=texts)
    named = prepared(
        data_config(tmp_path, tokenizer="huggingface", tokenizer_name=str(tokenizer_file), eot_token="<sep>"), documents=texts
    )

    assert read_meta(default)["eot_id"] == 6  # "</s>", one of the usual names
    assert read_meta(named)["eot_id"] == 7
    assert all_tokens(named).tolist() == [1, 2, 7, 3, 7]
    assert named != default


def test_data_eot_token_naming_a_token_the_tokenizer_lacks_is_an_error(tmp_path):
    tokenizer_file = word_level(tmp_path / "tok" / "tokenizer.json", WORDS)

    with pytest.raises(DataError) as excinfo:
        prepared(
            data_config(tmp_path, tokenizer="huggingface", tokenizer_name=str(tokenizer_file), eot_token="<eot>"),
            documents=["the"],
        )

    message = one_line_error(excinfo)
    assert "data.eot_token" in message and "'<eot>'" in message and "special tokens are '<|endoftext|>'" in message


def test_a_vocabulary_with_unused_ids_is_sized_by_its_largest_id(tmp_path):
    tokenizer_file = word_level(tmp_path / "tok" / "tokenizer.json", ["the", "cat"], ids=[1, 40])

    dataset = prepared(
        data_config(tmp_path, tokenizer="huggingface", tokenizer_name=str(tokenizer_file)), documents=["the cat", "cat"]
    )

    meta = read_meta(dataset)
    assert meta["vocab_size"] == 41
    assert all_tokens(dataset).tolist() == [1, 40, meta["eot_id"], 40, meta["eot_id"]]


@pytest.mark.parametrize("name", ["missing/tokenizer.json", "/no/such/directory", "./relative/dir"])
def test_a_tokenizer_path_that_does_not_exist_is_an_error(tmp_path, name):
    if not name.startswith(("/", ".")):
        name = str(tmp_path / name)

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, tokenizer="huggingface", tokenizer_name=name), documents=["x"])

    assert "data.tokenizer_name" in one_line_error(excinfo) and "does not exist" in str(excinfo.value)
    assert cache_leftovers(tmp_path) == []


# --- tiktoken ------------------------------------------------------------------------------------


def test_tiktoken_offline_without_cached_files_says_what_to_do(tmp_path, monkeypatch):
    pytest.importorskip("tiktoken")
    requests = pytest.importorskip("requests")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))

    def offline(*args, **kwargs):
        raise requests.exceptions.ConnectionError("network is unreachable")

    monkeypatch.setattr(requests, "get", offline)  # offline even on a machine with network

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, tokenizer="tiktoken", tokenizer_name="gpt2"), documents=["hello"])

    message = one_line_error(excinfo)
    assert "'gpt2'" in message and "offline" in message and "TIKTOKEN_CACHE_DIR" in message
    assert cache_leftovers(tmp_path) == []
    assert not (tmp_path / "tiktoken").exists() or not any((tmp_path / "tiktoken").iterdir())


def test_an_unknown_tiktoken_encoding_lists_the_known_ones(tmp_path):
    pytest.importorskip("tiktoken")

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, tokenizer="tiktoken", tokenizer_name="gpt5"), documents=["hello"])

    message = one_line_error(excinfo)
    assert "'gpt5'" in message and "data.tokenizer_name" in message
    assert "gpt2" in message and "cl100k_base" in message
    assert cache_leftovers(tmp_path) == []


# --- a tokenizer that misbehaves ----------------------------------------------------------------


def test_an_id_beyond_the_vocabulary_is_an_error_and_nothing_is_left_half_written(tmp_path, monkeypatch):
    class Broken(ByteTokenizer):
        def encode_batch(self, texts):
            return [np.array([104, 300, 105], dtype=np.uint32) for _ in texts]

    monkeypatch.setattr(prep, "load_tokenizer", lambda cfg, bpe_file=None: Broken())

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path), documents=["hi", "there"])

    message = one_line_error(excinfo)
    assert "300" in message and "257" in message
    assert cache_leftovers(tmp_path) == []


# --- imports -------------------------------------------------------------------------------------


def test_padding_and_truncation_saved_in_a_tokenizer_json_are_not_applied(tmp_path):
    from tokenizers import Tokenizer

    path = word_level(tmp_path / "padded" / "tokenizer.json", WORDS, specials=["<|endoftext|>", "[PAD]"])
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(max_length=2)
    tokenizer.enable_padding(pad_id=7, pad_token="[PAD]")
    tokenizer.save(str(path))

    dataset = prepared(
        data_config(tmp_path, tokenizer="huggingface", tokenizer_name=str(path)), documents=["the cat sat on", "mat"]
    )

    assert all_tokens(dataset).tolist() == [1, 2, 3, 4, 6, 5, 6]  # whole documents, no padding


def test_a_damaged_cached_bpe_tokenizer_is_trained_again(tmp_path, bpe_calls):
    source = write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    cfg = data_config(tmp_path, source="jsonl", path=str(source), tokenizer="bpe", bpe_vocab_size=300)
    dataset = prepared(cfg)
    (trained,) = (tmp_path / "cache" / "tokenizers").glob("bpe300-*/tokenizer.json")
    trained.write_text('{"truncated": ')
    lines: list[str] = []

    assert prepare(cfg, log=lines.append, force=True) == dataset

    assert bpe_calls == [300, 300]
    assert any(line.startswith("dataset: training the BPE tokenizer again (forced)") for line in lines)
    assert json.loads(trained.read_text())["model"]["type"] == "BPE"


# --- the BPE trainer's child process (pretrain/data/bpe_process.py) -------------------------------


def test_a_bpe_tokenizer_that_cannot_be_written_is_a_one_line_error_naming_the_file(tmp_path):
    destination = tmp_path / "missing" / "tokenizer.json"
    with pytest.raises(DataError) as error:
        train_bpe(iter(CORPUS), 300, destination)
    assert one_line_error(error) == f"cannot write {destination}: No such file or directory (os error 2)"


def test_a_bpe_trainer_killed_by_the_kernel_is_an_error_that_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(bpe_process, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")  # as the OOM killer
    with pytest.raises(DataError) as error:
        train_bpe(iter(CORPUS), 300, tmp_path / "tokenizer.json")
    assert one_line_error(error) == "training the BPE tokenizer was killed by SIGKILL; out of memory?"


class Stopped(Exception):
    pass


def test_a_bpe_trainer_ended_by_a_stop_signal_stops_its_parent_as_that_signal_would(tmp_path, monkeypatch):
    # Slurm signals every process of a job: the trainer can die of SIGTERM before its parent
    # gets its own, which must then still be acted on, not reported as a failed training.
    monkeypatch.setattr(bpe_process, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")

    def stop(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(Stopped) as stopped:
            train_bpe(iter(CORPUS), 300, tmp_path / "tokenizer.json")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.args == (signal.SIGTERM,)
    assert list(tmp_path.iterdir()) == []
