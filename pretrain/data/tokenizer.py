"""Tokenizers: text to ids, one batch at a time, with an end-of-text id between documents.

- byte: each UTF-8 byte is its own id, 256 is end-of-text (257 ids). Built in.
- bpe: byte-level BPE trained on the source with the `tokenizers` library; trained once per
  (source, sample count, vocabulary size) and cached like the data (see train_bpe).
- huggingface: a `tokenizer.json`, as a file or from a Hub model repository.
- tiktoken: an OpenAI encoding (gpt2, cl100k_base, o200k_base), when its files are available.

Each has an identity: a dict that changes whenever the ids it produces could. It is computed
without loading or training anything, so a cache hit stays cheap; tokenizer_spec() gives it.
The libraries are imported only when a tokenizer is built. Each is a recipe class here (its
identity, its name, building it), named by data.tokenizer in pretrain/registry.py (TOKENIZERS).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pretrain import registry
from pretrain.data import DataError, first_line

if TYPE_CHECKING:
    from pretrain.config import DataConfig

BYTE_EOT = 256
BYTE_VOCAB_SIZE = 257
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BPE_EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
ENCODING_RULES = 2
"""Bumped whenever how a tokenizer.json is applied changes (2: special tokens spelled in the
text are text; the file's padding and truncation are off), so older caches are rebuilt."""


class Tokenizer(Protocol):
    """What preparing a dataset needs from a tokenizer."""

    name: str
    """Short and readable, part of the cache directory name."""
    vocab_size: int
    eot_id: int

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# --- recipes: identity (cheap), name, building -----------------------------------------------


class TokenizerRecipe(Protocol):
    """What pretrain/registry.py's TOKENIZERS name for each data.tokenizer: static methods."""

    @staticmethod
    def spec(cfg: DataConfig, source_identity: dict[str, Any]) -> dict[str, Any]:
        """Everything that decides the ids, without loading the tokenizer: part of the cache key."""
        ...

    @staticmethod
    def label(cfg: DataConfig) -> str:
        """The readable part of the cache directory name."""
        ...

    @staticmethod
    def build(cfg: DataConfig, file: Path | None) -> Tokenizer:
        """The tokenizer; file is its tokenizer.json when the registry says it has one (trained,
        found in a dataset or beside a checkpoint), None to find it from the config."""
        ...


def recipe(cfg: DataConfig) -> TokenizerRecipe:
    return registry.load(registry.TOKENIZERS[cfg.tokenizer].recipe)


def tokenizer_spec(cfg: DataConfig, source_identity: dict[str, Any]) -> dict[str, Any]:
    """Everything that decides the ids, without loading the tokenizer."""
    return recipe(cfg).spec(cfg, source_identity)


def tokenizer_label(cfg: DataConfig) -> str:
    """The readable part of the cache directory name."""
    return recipe(cfg).label(cfg)


def load_tokenizer(cfg: DataConfig, file: Path | None = None) -> Tokenizer:
    """The tokenizer of cfg. For "bpe", file is the trained tokenizer.json (train_bpe)."""
    return recipe(cfg).build(cfg, file)


class ByteRecipe:
    @staticmethod
    def spec(cfg: DataConfig, source_identity: dict[str, Any]) -> dict[str, Any]:
        return {"kind": "byte"}

    @staticmethod
    def label(cfg: DataConfig) -> str:
        return "byte"

    @staticmethod
    def build(cfg: DataConfig, file: Path | None) -> Tokenizer:
        return ByteTokenizer()


class BpeRecipe:
    @staticmethod
    def spec(cfg: DataConfig, source_identity: dict[str, Any]) -> dict[str, Any]:
        return {
            "kind": "bpe",
            "vocab_size": cfg.bpe_vocab_size,
            "trained_on": source_identity,
            "max_samples": cfg.max_samples,
            "recipe": 1,
            "encoding": ENCODING_RULES,
        }

    @staticmethod
    def label(cfg: DataConfig) -> str:
        return f"bpe{cfg.bpe_vocab_size}"

    @staticmethod
    def build(cfg: DataConfig, file: Path | None) -> Tokenizer:
        assert file is not None, "train the BPE tokenizer first"
        return HuggingFaceTokenizer(file, BPE_EOT, BpeRecipe.label(cfg))


class HuggingFaceRecipe:
    @staticmethod
    def spec(cfg: DataConfig, source_identity: dict[str, Any]) -> dict[str, Any]:
        file = huggingface_file(cfg.tokenizer_name)
        return {"kind": "huggingface", "file_sha256": file_sha256(file), "eot_token": cfg.eot_token, "encoding": ENCODING_RULES}

    @staticmethod
    def label(cfg: DataConfig) -> str:
        name = cfg.tokenizer_name.rstrip("/")
        path = Path(name).expanduser()
        if name.endswith(".json"):
            return "hf-" + path.resolve().parent.name
        # A local directory by its name (a whole absolute path can exceed the 255-byte name limit).
        return "hf-" + (path.resolve().name if path.is_dir() else name.replace("/", "-"))

    @staticmethod
    def build(cfg: DataConfig, file: Path | None) -> Tokenizer:
        file = file or huggingface_file(cfg.tokenizer_name)
        return HuggingFaceTokenizer(file, cfg.eot_token, HuggingFaceRecipe.label(cfg))


class TiktokenRecipe:
    @staticmethod
    def spec(cfg: DataConfig, source_identity: dict[str, Any]) -> dict[str, Any]:
        return {"kind": "tiktoken", "encoding": cfg.tokenizer_name}

    @staticmethod
    def label(cfg: DataConfig) -> str:
        return cfg.tokenizer_name

    @staticmethod
    def build(cfg: DataConfig, file: Path | None) -> Tokenizer:
        return TiktokenTokenizer(cfg.tokenizer_name)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def huggingface_file(name: str) -> Path:
    """The tokenizer.json that data.tokenizer_name names: a local file (or a directory holding
    one), else a Hub model repository id, fetched into the Hub cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if path.is_file():
        return path.resolve()
    if name.endswith(".json") or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise DataError(
            f"data.tokenizer_name: {path} does not exist (expected a tokenizer.json file, "
            "a directory holding one, or a Hub repo id owner/name)"
        )
    from pretrain.data.hub_process import hub_snapshot

    folder = hub_snapshot(name, "main", TOKENIZER_FILE, repo_type="model")
    if not (folder / TOKENIZER_FILE).is_file():
        raise DataError(f"data.tokenizer_name: the Hub repo {name} has no {TOKENIZER_FILE}")
    return folder / TOKENIZER_FILE


# --- building ---------------------------------------------------------------------------------


def train_bpe(texts: Iterator[str], vocab_size: int, destination: Path) -> None:
    """Train a byte-level BPE (GPT-2 style pre-tokenization, no unknown tokens) on texts and
    write its tokenizer.json to destination. Streams: the trainer keeps word counts, not text.
    It trains in a child process (bpe_process.py), so that a stop signal is acted on at once."""
    import importlib.util

    if importlib.util.find_spec("tokenizers") is None:
        raise DataError("data.tokenizer bpe needs the tokenizers package: pip install tokenizers")
    from pretrain.data.bpe_process import train_in_child

    train_in_child(texts, vocab_size, BPE_EOT, destination)


class ByteTokenizer:
    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eot_id = BYTE_EOT

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids; end-of-text ids become newlines, invalid UTF-8 is replaced."""
        data = bytes(10 if int(i) == BYTE_EOT else int(i) for i in ids)
        return data.decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A `tokenizers` tokenizer.json. Batches are encoded on every core (the library's threads)."""

    def __init__(self, path: Path, eot_token: str, name: str) -> None:
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise DataError("a tokenizer.json needs the tokenizers package: pip install tokenizers") from None
        try:
            self.tokenizer = RustTokenizer.from_file(str(path))
        except Exception as error:  # the library raises plain Exception for a file it cannot parse
            raise DataError(f"{path}: not a usable tokenizer.json ({first_line(error)})") from None
        self.path, self.name = path, name
        # Padding and truncation saved in a file (BERT-style tokenizers) would cut or pad every
        # document: pretraining wants each text's ids exactly.
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        # Text that spells a special token ("<|endoftext|>" in a web page) is text, not that token:
        # only end-of-text ids the preparation adds may mark document ends (tiktoken's encode_ordinary).
        self.tokenizer.encode_special_tokens = True
        # The largest id + 1, not the token count: a vocabulary may have unused ids (holes).
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.eot_id = self._eot_id(path, eot_token)

    def _eot_id(self, path: Path, eot_token: str) -> int:
        candidates = (eot_token,) if eot_token else EOT_CANDIDATES
        for token in candidates:
            token_id = self.tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        if eot_token:
            raise DataError(f"data.eot_token: {path} has no token {eot_token!r}; {self._specials()}")
        raise DataError(
            f"{path} has none of the end-of-text tokens {', '.join(EOT_CANDIDATES)}; "
            f"{self._specials()}: set data.eot_token to the one it uses"
        )

    def _specials(self, shown: int = 8) -> str:
        """The file's special tokens, for an error that asks to pick one: the first few, in id
        order (a Llama-3 file has 256 of them, mostly reserved)."""
        added = sorted(self.tokenizer.get_added_tokens_decoder().items())
        names = [token.content for _, token in added if token.special]
        if not names:
            return "it has no special tokens"
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        return f"its special tokens are {', '.join(repr(name) for name in names[:shown])}{more}"

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.array(encoding.ids, dtype=np.uint32) for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class TiktokenTokenizer:
    """An OpenAI tiktoken encoding. Its files are downloaded on first use and cached by tiktoken
    (TIKTOKEN_CACHE_DIR); offline without them, a clear error."""

    def __init__(self, encoding: str) -> None:
        try:
            import tiktoken
        except ImportError:
            raise DataError("data.tokenizer tiktoken needs the tiktoken package: pip install tiktoken") from None
        if encoding not in tiktoken.list_encoding_names():
            raise DataError(
                f"data.tokenizer_name: unknown tiktoken encoding {encoding!r}; known: {', '.join(tiktoken.list_encoding_names())}"
            )
        try:
            self.encoding = tiktoken.get_encoding(encoding)
        except Exception as error:  # requests/urllib errors, or a damaged cached file
            raise DataError(
                f"tiktoken encoding {encoding!r} is not available offline ({type(error).__name__}); its files "
                "are downloaded on first use: run once with network, or point TIKTOKEN_CACHE_DIR at a "
                "directory that holds them"
            ) from None
        self.name = encoding
        self.vocab_size = self.encoding.n_vocab
        self.eot_id = self.encoding.eot_token

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        batches = self.encoding.encode_ordinary_batch(list(texts), num_threads=os.cpu_count() or 1)
        return [np.array(ids, dtype=np.uint32) for ids in batches]

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])
