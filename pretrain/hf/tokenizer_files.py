"""The run's tokenizer in Hugging Face form, so that an export loads in transformers and lm-eval as it is.

write_tokenizer_files writes, into the export directory,

    tokenizer.json            the tokenizers-library file: for bpe and huggingface the run's own
                              (its padding, truncation and BOS-adding post-processor off, as the
                              run applies it); for byte and tiktoken one built here
    tokenizer_config.json     PreTrainedTokenizerFast, bos_token and eos_token the end-of-text
                              token, model_max_length, no BOS or EOS added, special tokens spelled
                              in text kept as text, no clean-up of spaces on decode
    special_tokens_map.json   bos_token and eos_token, for older transformers

so that `transformers.AutoTokenizer.from_pretrained(export)` encodes any text to the ids the model
was trained on (training and pretrain.evaluation.generate add no BOS) and decodes them to the same text.

The byte tokenizer (ids 0-255 are the bytes, 256 end-of-text) becomes a byte-level BPE with no
merges whose vocabulary gives every byte its own id. One difference remains: end-of-text decodes
to "<|endoftext|>" (pretrain.evaluation.generate prints a newline; both stop generating there). A tiktoken
encoding becomes a BPE built from its ranks and split pattern, as transformers converts tiktoken
files (every split of a token into two tokens is a merge, ranked by the token), with its special
tokens. Pre-tokenized shards whose tokenizer is unknown get no tokenizer: HfTokenizerFiles.lacking
says so. No library is needed: the files are plain JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain import registry
from pretrain.config import Config
from pretrain.data import DataError
from pretrain.data.tokenizer import BYTE_EOT, TOKENIZER_FILE, HuggingFaceTokenizer, TiktokenTokenizer, load_tokenizer
from pretrain.hf.vocabulary import byte_level, byte_vocabulary, tiktoken_vocabulary
from pretrain.run.files import atomic_write_text

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
"""transformers' class for a bare tokenizer.json: it takes the file as it is (a class such as
LlamaTokenizerFast rebuilds the pipeline from its own rules)."""
POST_PROCESSORS_KEPT = ("ByteLevel",)
"""Post-processors that add no tokens (ByteLevel only adjusts offsets); any other (TemplateProcessing,
BertProcessing, ...) may add a BOS the model never saw in training, and is dropped."""


@dataclass(frozen=True)
class HfTokenizerFiles:
    """What write_tokenizer_files wrote, and the ids generation_config.json and config.json name."""

    written: list[str]
    """The file names written into the export directory (empty when lacking)."""
    bos_id: int | None
    """The id transformers calls bos_token_id: the end-of-text id (no run here trains with a BOS)."""
    eos_id: int | None
    """The end-of-text id: generation stops there."""
    lacking: str | None
    """One sentence saying what the export lacks and what to use instead; None when nothing is lacking."""


def write_tokenizer_files(config: Config, tokenizer_file: Path | None, out_dir: Path, max_seq_len: int) -> HfTokenizerFiles:
    """Write the tokenizer of config (tokenizer_file for bpe and huggingface) into out_dir in
    Hugging Face form, each file atomically. A tokenizer that is not known or not available here
    (pre-tokenized shards, a tokenizer.json not found, tiktoken's files not downloaded) writes
    nothing and says so in lacking: the weights are still worth exporting."""
    try:
        tokenizer_json, eot_id = tokenizer_definition(config, tokenizer_file)
    except TokenizerUnavailable as error:
        return HfTokenizerFiles([], None, None, str(error))
    eot_token = token_of(tokenizer_json, eot_id)
    atomic_write_text(out_dir / TOKENIZER_FILE, json.dumps(tokenizer_json, ensure_ascii=False) + "\n")
    tokenizer_config = {
        "tokenizer_class": TOKENIZER_CLASS,
        "bos_token": eot_token,
        "eos_token": eot_token,
        "model_max_length": max_seq_len,
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
    }
    atomic_write_text(out_dir / TOKENIZER_CONFIG_FILE, json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    special_tokens = {"bos_token": eot_token, "eos_token": eot_token}
    atomic_write_text(out_dir / SPECIAL_TOKENS_MAP_FILE, json.dumps(special_tokens, indent=2, ensure_ascii=False) + "\n")
    return HfTokenizerFiles([TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE], eot_id, eot_id, None)


class TokenizerUnavailable(Exception):
    """The run's tokenizer has no Hugging Face form here; the message is the sentence for lacking."""


def tokenizer_definition(config: Config, tokenizer_file: Path | None) -> tuple[dict[str, Any], int]:
    """(the tokenizer.json content, the end-of-text id) of the run's tokenizer."""
    from pretrain.checkpoint.reading import shards_without_tokenizer  # it loads torch, which writing a tokenizer does not need

    data = config.data
    without = "so the export has no tokenizer files"
    if shards_without_tokenizer(config):
        raise TokenizerUnavailable(
            f"the model was trained on pre-tokenized {data.source} shards and its config does not say which tokenizer "
            f"made them, {without}: set data.tokenizer and data.tokenizer_name in the checkpoint's config.json "
            "(for example tiktoken and gpt2) and export again"
        )
    if data.tokenizer == "byte":
        return byte_tokenizer_json(), BYTE_EOT
    if registry.TOKENIZERS[data.tokenizer].file and tokenizer_file is None:
        raise TokenizerUnavailable(
            f"the model's {data.tokenizer} tokenizer.json was not found, {without}: copy the run's "
            "tokenizer.json into the checkpoint directory and export again"
        )
    try:
        tokenizer = load_tokenizer(data, tokenizer_file)
    except DataError as error:
        raise TokenizerUnavailable(
            f"the model's tokenizer is not available here ({error}), {without}: export again where it is"
        ) from None
    if isinstance(tokenizer, TiktokenTokenizer):
        return tiktoken_tokenizer_json(tokenizer.encoding), tokenizer.eot_id
    if not isinstance(tokenizer, HuggingFaceTokenizer):
        raise TokenizerUnavailable(f"data.tokenizer {data.tokenizer} has no Hugging Face form here: {without}")
    return as_applied(json.loads(tokenizer.path.read_text(encoding="utf-8"))), tokenizer.eot_id


def as_applied(tokenizer_json: dict[str, Any]) -> dict[str, Any]:
    """A tokenizer.json as pretrain/data/tokenizer.py applies it: no padding, no truncation, and no
    post-processor that adds tokens (a Llama-3 file's TemplateProcessing adds <|begin_of_text|>)."""
    processor = tokenizer_json.get("post_processor")
    if processor is not None and processor.get("type") == "Sequence":
        kept = [p for p in processor.get("processors", []) if p.get("type") in POST_PROCESSORS_KEPT]
        processor = processor | {"processors": kept} if kept else None
    elif processor is not None and processor.get("type") not in POST_PROCESSORS_KEPT:
        processor = None
    return tokenizer_json | {"padding": None, "truncation": None, "post_processor": processor}


def token_of(tokenizer_json: dict[str, Any], token_id: int) -> str:
    """The text of token_id: an added token's content, else its entry in the model's vocabulary."""
    for added in tokenizer_json.get("added_tokens", []):
        if added["id"] == token_id:
            return str(added["content"])
    vocab = tokenizer_json.get("model", {}).get("vocab", {})
    if isinstance(vocab, dict):
        for token, number in vocab.items():
            if number == token_id:
                return str(token)
    else:  # Unigram: a list of [piece, score], the id its index
        return str(vocab[token_id][0])
    raise ValueError(f"the tokenizer.json has no token with id {token_id}")


# --- built here: byte and tiktoken ---------------------------------------------------------------


def special_token(token_id: int, content: str) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def bpe_tokenizer_json(
    vocab: dict[str, int],
    merges: list[list[str]],
    pre_tokenizer: dict[str, Any],
    specials: dict[str, int],
    *,
    ignore_merges: bool,
) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json: pre_tokenizer ends in ByteLevel, the decoder turns the
    alphabet back into bytes and those into text (invalid UTF-8 replaced, as Python's errors="replace")."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [special_token(token_id, content) for content, token_id in sorted(specials.items(), key=lambda s: s[1])],
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }


def byte_level_pre_tokenizer() -> dict[str, Any]:
    """Bytes to byte_to_char's alphabet, the whole text as one piece (no splitting by a pattern)."""
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def byte_tokenizer_json() -> dict[str, Any]:
    """The byte tokenizer: every byte its own id (no merges), end-of-text 256 as a special token."""
    vocab, specials = byte_vocabulary()
    return bpe_tokenizer_json(vocab, [], byte_level_pre_tokenizer(), specials, ignore_merges=False)


POSSESSIVE_INTERVAL = re.compile(r"(\\[pP]\{\w+\}|\[(?:\\.|[^\]\\])*\]|\\.|[^\\()|])(\{\d+(?:,\d*)?\})\+")
"""An atom followed by a possessive interval, X{1,3}+: a character class, an escape or one character."""


def oniguruma_pattern(pattern: str) -> str:
    """tiktoken's split pattern (Rust's fancy-regex) for the tokenizers library's Oniguruma, which
    reads X{1,3}+ as (X{1,3})+ (cl100k's numbers would become one piece): an atomic group instead,
    which is what possessive means."""
    return POSSESSIVE_INTERVAL.sub(r"(?>\1\2)", pattern)


def tiktoken_tokenizer_json(encoding: Any) -> dict[str, Any]:
    """A tiktoken.Encoding as a BPE: its ranks are the ids, every split of a token into two tokens
    is a merge ranked by the token (so that the pair tiktoken would join first is joined first),
    a piece that is a whole token is taken as it is (ignore_merges, as tiktoken does), and its
    split pattern comes before the byte-level mapping."""
    ranks: dict[bytes, int] = encoding._mergeable_ranks  # tiktoken keeps these private; stable since 0.1
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    pre_tokenizer = {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": oniguruma_pattern(encoding._pat_str)},
                "behavior": "Isolated",
                "invert": False,
            },
            byte_level_pre_tokenizer(),
        ],
    }
    vocab, specials = tiktoken_vocabulary(encoding)
    merged = [[byte_level(left), byte_level(right)] for *_, left, right in merges]
    return bpe_tokenizer_json(vocab, merged, pre_tokenizer, specials, ignore_merges=True)
