"""Tokenizers. The byte tokenizer maps each UTF-8 byte to its value and adds one
end-of-text id (256) that separates documents."""

from __future__ import annotations

from typing import Protocol

import numpy as np

BYTE_EOT = 256
BYTE_VOCAB_SIZE = 257


def tokenizer_vocab_size(name: str) -> int:
    """Number of ids the named tokenizer can produce; the model's vocabulary must cover it."""
    if name == "byte":
        return BYTE_VOCAB_SIZE
    raise ValueError(f"unknown tokenizer {name!r}")


class Tokenizer(Protocol):
    """What preparing a dataset needs from a tokenizer."""

    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer called name (the value of data.tokenizer)."""
    if name == "byte":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {name!r}")


class ByteTokenizer:
    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eot_id = BYTE_EOT

    def encode(self, text: str) -> np.ndarray:
        """Token ids of text, as uint16."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        """Text of ids; end-of-text ids become newlines, invalid UTF-8 is replaced."""
        data = bytes(10 if int(i) == BYTE_EOT else int(i) for i in ids)
        return data.decode("utf-8", errors="replace")
