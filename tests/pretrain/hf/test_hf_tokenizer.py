"""The run's tokenizer in Hugging Face form (pretrain/hf/tokenizer_files.py): transformers' AutoTokenizer,
loading only the files written, gives the ids and the text the run's own tokenizer gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, processors, trainers

from pretrain import config as cfg
from pretrain.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, TiktokenTokenizer
from pretrain.hf.tokenizer_files import write_tokenizer_files

TEXTS = [
    "Hello world. The list, sorted in place.",
    "héllo wörld: 日本語のテキスト, emoji 🙂🙃 and ÆØÅ",
    "  leading spaces,\ttabs\n\nand blank lines \r\n trailing   ",
    "I'll say DON'T it's 12345 678.90 x=y+1;",
    "a <|endoftext|> spelled in the text is text",
    "",
]
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)


def debug_config(tmp_path: Path, *sets: str) -> cfg.Config:
    return cfg.resolve(preset="debug", sets=[f"data.cache_dir={tmp_path / 'cache'}", *sets])


def auto_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def corpus() -> str:
    """Text to train and compare tokenizers on: this repository's documentation."""
    root = Path(__file__).resolve().parents[3]
    return "\n".join((root / name).read_text(encoding="utf-8") for name in ("README.md", "docs/training.md"))


def test_a_byte_export_encodes_and_decodes_every_text_as_the_byte_tokenizer(tmp_path):
    written = write_tokenizer_files(debug_config(tmp_path), None, tmp_path / "export", max_seq_len=128)
    assert (written.bos_id, written.eos_id, written.lacking) == (256, 256, None)
    assert sorted(written.written) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    hf, ours = auto_tokenizer(tmp_path / "export"), ByteTokenizer()

    for text in TEXTS:
        ids = ours.encode(text).tolist()
        assert hf(text)["input_ids"] == ids, text  # no BOS, every byte its own id
        assert hf.decode(ids) == ours.decode(ids) == text
    invalid_utf8 = [0xFF, 0x41, 0xE6, 0x97, 0x41, 0xF0, 0x9F, 0x98, 0xC3]  # stray, cut and truncated sequences
    assert hf.decode(invalid_utf8) == ours.decode(invalid_utf8) == bytes(invalid_utf8).decode("utf-8", errors="replace")
    assert (hf.eos_token_id, hf.bos_token_id, hf.model_max_length, len(hf)) == (256, 256, 128, 257)
    assert hf.decode([0x41, 256]) == "A<|endoftext|>"  # ours prints a newline there; generation stops at it either way


def test_a_tokenizer_json_that_adds_a_bos_is_exported_as_the_run_applies_it(tmp_path):
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.train_from_iterator(
        [corpus()],
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    from tokenizers import decoders

    rust.decoder = decoders.ByteLevel()
    # Llama-3's file: a BOS on every encoding, and (as some files carry) padding and truncation.
    rust.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]),
        ]
    )
    rust.enable_truncation(8)
    rust.enable_padding(length=16)
    source = tmp_path / "source" / "tokenizer.json"
    source.parent.mkdir()
    rust.save(str(source))
    config = debug_config(tmp_path, "data.tokenizer=huggingface", f"data.tokenizer_name={source}")

    written = write_tokenizer_files(config, source, tmp_path / "export", max_seq_len=64)
    ours = HuggingFaceTokenizer(source, "", "test")
    assert (written.eos_id, written.lacking) == (ours.eot_id, None) and ours.eot_id == 1
    hf = auto_tokenizer(tmp_path / "export")
    exported = RustTokenizer.from_file(str(tmp_path / "export" / "tokenizer.json"))  # as older transformers read it
    for text in [*TEXTS, "<|end_of_text|> and <|begin_of_text|>", corpus()[:3000]]:
        ids = ours.encode_batch([text])[0].tolist()
        assert exported.encode(text.replace("<|", "")).ids == ours.encode_batch([text.replace("<|", "")])[0].tolist()
        assert hf(text)["input_ids"] == ids, text[:40]  # no BOS, not cut to 8, not padded, specials as text
        assert hf.decode(ids) == ours.decode(ids)
    assert (hf.eos_token, hf.bos_token, hf.model_max_length) == ("<|end_of_text|>", "<|end_of_text|>", 64)


@pytest.mark.parametrize("pattern", [GPT2_PATTERN, CL100K_PATTERN], ids=["gpt2", "cl100k"])
def test_a_tiktoken_encoding_becomes_a_tokenizer_with_the_same_ids(tmp_path, monkeypatch, pattern):
    import tiktoken
    import tiktoken.registry

    # An encoding made here (tiktoken's own files need the network): byte ranks, then a BPE's merges.
    text = corpus()
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.train_from_iterator(
        [text[: len(text) // 2]], trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    from pretrain.hf.vocabulary import byte_to_char

    byte_of = {char: byte for byte, char in byte_to_char().items()}
    ranks = {bytes([byte]): byte for byte in range(256)}
    for left, right in json.loads(rust.to_str())["model"]["merges"]:
        ranks.setdefault(bytes(byte_of[c] for c in left + right), len(ranks))
    encoding = tiktoken.Encoding("gpt2", pat_str=pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)})
    monkeypatch.setitem(tiktoken.registry.ENCODINGS, "gpt2", encoding)
    config = debug_config(tmp_path, "data.tokenizer=tiktoken", "data.tokenizer_name=gpt2")

    written = write_tokenizer_files(config, None, tmp_path / "export", max_seq_len=32)
    assert (written.eos_id, written.lacking) == (len(ranks), None)
    ours, hf = TiktokenTokenizer("gpt2"), auto_tokenizer(tmp_path / "export")
    lines = [*TEXTS, *text[len(text) // 2 :].splitlines()]  # text the ranks were not made from too
    for line in lines:
        ids = ours.encode_batch([line])[0].tolist()
        assert hf(line)["input_ids"] == ids, line
        assert hf.decode(ids) == ours.decode(ids)
    assert hf.decode([0xFF, len(ranks)]) == ours.decode([0xFF, len(ranks)])


def test_pretokenized_shards_of_an_unknown_tokenizer_write_nothing_and_say_what_is_lacking(tmp_path):
    config = debug_config(tmp_path, "data.source=llmc", f"data.path={tmp_path / 'shards'}")
    written = write_tokenizer_files(config, None, tmp_path / "export", max_seq_len=32)
    assert (written.written, written.bos_id, written.eos_id) == ([], None, None)
    assert written.lacking is not None and "pre-tokenized llmc shards" in written.lacking
    assert not (tmp_path / "export").exists()


def test_a_bpe_run_whose_tokenizer_file_is_not_found_says_what_is_lacking(tmp_path):
    written = write_tokenizer_files(debug_config(tmp_path, "data.tokenizer=bpe"), None, tmp_path / "export", max_seq_len=32)
    assert written.written == [] and written.lacking is not None and "tokenizer.json was not found" in written.lacking
