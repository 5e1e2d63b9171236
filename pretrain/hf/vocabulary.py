"""Tokenizers' vocabularies as byte-level BPE spells them: GPT-2's byte-level alphabet, the byte
tokenizer's and a tiktoken encoding's vocabulary in it, and any tokenizer.json's ids.

pretrain/hf/tokenizer_files.py writes an export's tokenizer.json from these, and
pretrain/hf/init_tokenizer.py compares an --init-from checkpoint's tokenizer with the run's: an id
means the same token in both only where both vocabularies give it the same spelling. No library
is needed (the files are plain JSON, an encoding's ranks are bytes), and no torch: the launcher
runs the comparison.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pretrain.data.tokenizer import BPE_EOT, BYTE_EOT


@cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet (what tokenizers' ByteLevel pre-tokenizer maps bytes to): the
    printable bytes as themselves, the others shifted past 255, so that every byte is one character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + shift)
            shift += 1
    return chars


def byte_level(token: bytes) -> str:
    """A token's bytes spelled in byte_to_char's alphabet, as a byte-level vocabulary holds them."""
    table = byte_to_char()
    return "".join(table[byte] for byte in token)


def byte_vocabulary() -> tuple[dict[str, int], dict[str, int]]:
    """(the vocabulary, the special tokens) of the byte tokenizer: every byte its own id, end-of-text 256."""
    return {byte_level(bytes([byte])): byte for byte in range(256)}, {BPE_EOT: BYTE_EOT}


def tiktoken_vocabulary(encoding: Any) -> tuple[dict[str, int], dict[str, int]]:
    """(the vocabulary, the special tokens) of a tiktoken.Encoding: its ranks are the ids."""
    ranks: dict[bytes, int] = encoding._mergeable_ranks  # tiktoken keeps these private; stable since 0.1
    return {byte_level(token): rank for token, rank in ranks.items()}, dict(encoding._special_tokens)


def token_ids(vocabulary: dict[str, int], specials: dict[str, int]) -> dict[int, str]:
    """id -> token of a vocabulary and its special tokens (a special token's text wins its id)."""
    return {number: token for token, number in vocabulary.items()} | {number: token for token, number in specials.items()}


def tokenizer_json_ids(tokenizer_json: Any) -> dict[int, str]:
    """id -> token of a tokenizer.json: its model's vocabulary (a dict of token -> id; Unigram's
    list of [piece, score], the id its index) and its added tokens. ValueError for anything else."""
    if not isinstance(tokenizer_json, dict) or not isinstance(tokenizer_json.get("model"), dict):
        raise ValueError("no model")
    vocab = tokenizer_json["model"].get("vocab")
    if isinstance(vocab, dict):
        vocabulary = {str(token): int(number) for token, number in vocab.items()}
    elif isinstance(vocab, list):
        vocabulary = {str(entry[0]): number for number, entry in enumerate(vocab)}
    else:
        raise ValueError("no vocabulary in its model")
    added = tokenizer_json.get("added_tokens") or []
    specials = {str(token["content"]): int(token["id"]) for token in added}
    return token_ids(vocabulary, specials)
