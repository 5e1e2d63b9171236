"""Pre-tokenized shards that users already have, read in place (never copied).

- llm.c / modded-nanogpt `.bin`: a header of 256 little-endian int32 (magic, version, token
  count, then zeros) followed by the tokens: magic 20240520 has uint16 tokens (GPT-2),
  magic 20240801 uint32 tokens (Llama 3).
- nanoGPT `.bin` (its prepare.py's train.bin / val.bin): little-endian uint16 token ids and
  nothing else, no header. token_file tells it from an llm.c shard by the header (see there).
- Megatron indexed dataset: `<prefix>.bin` holds the tokens of every sequence back to back;
  `<prefix>.idx` starts with b"MMIDIDX\\x00\\x00", a uint64 version (1), a uint8 dtype code,
  uint64 sequence and document counts, then int32 sizes, int64 pointers and int64 document
  indices.

A Shard says where the tokens are (file, byte offset, count, dtype): exactly a loader segment.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pretrain.data import DataError
from pretrain.data.windows import DTYPES

LLMC_HEADER_BYTES = 256 * 4
LLMC_DTYPES = {(20240520, 1): "uint16", (20240801, 7): "uint32"}
LLMC_MAGICS = {magic for magic, _ in LLMC_DTYPES}
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_HEADER = struct.Struct("<9sQBQQ")
# Integer codes only. int32 ids are non-negative, so they read the same as uint32; a negative
# one would show up as an id beyond the vocabulary in the scan.
MEGATRON_DTYPES = {8: "uint16", 4: "uint32"}
MEGATRON_UNSUPPORTED = {1: "uint8", 2: "int8", 3: "int16", 5: "int64", 6: "float64", 7: "float32"}


@dataclass(frozen=True)
class Shard:
    path: Path
    offset: int
    """Bytes before the first token."""
    tokens: int
    dtype: str
    form: str = "llmc"
    """What the file is: "llmc", "nanogpt" or "megatron"."""
    documents: int | None = None
    """Documents in the shard when its format records them (Megatron)."""
    document_ends: np.ndarray | None = field(default=None, compare=False, repr=False)
    """Token offsets in the shard where a document ends, ascending, when its format records them
    (Megatron): where the validation cut may move (prepare.split_point). Eight bytes a document,
    held while a dataset is prepared."""


def llmc_shard(path: Path) -> Shard:
    """Read and check an llm.c shard's header; DataError for anything else."""
    with open(path, "rb") as file:
        header = file.read(LLMC_HEADER_BYTES)
    if len(header) < LLMC_HEADER_BYTES:
        raise DataError(f"{path}: {len(header)} bytes, too short for an llm.c shard (a 1024-byte header comes first)")
    magic, version, tokens = (int(v) for v in np.frombuffer(header, dtype="<i4", count=3))
    if (magic, version) not in LLMC_DTYPES:
        known = " or ".join(f"{m} version {v}" for m, v in LLMC_DTYPES)
        raise DataError(
            f"{path}: not an llm.c / modded-nanogpt shard (magic number {magic} version {version}; "
            f"expected {known}); for Megatron .bin/.idx use data.source=megatron"
        )
    shard = Shard(path, LLMC_HEADER_BYTES, tokens, LLMC_DTYPES[magic, version])
    _check_size(shard, f"its header promises {tokens} tokens")
    return shard


def token_file(path: Path) -> Shard:
    """An llm.c shard or a nanoGPT .bin, told apart by the header; DataError for anything else.

    A file that starts with llm.c's magic number is llm.c (a nanoGPT file cannot: as uint16 ids
    the magic reads 54984 or 55969, beyond GPT-2's 50257), and so is one shaped like an llm.c
    header with another magic (a token count that matches the file's size, then zeros): that is
    a damaged or unknown llm.c shard, refused, never read as tokens. Anything else of an even
    size is nanoGPT's header-less uint16 ids, unless a Megatron index lies beside it."""
    with open(path, "rb") as file:
        data = file.read(LLMC_HEADER_BYTES)
    head = np.frombuffer(data[: len(data) - len(data) % 4], dtype="<i4")
    size = path.stat().st_size
    if head.size and (int(head[0]) in LLMC_MAGICS or _llmc_shaped(head, size)):
        return llmc_shard(path)
    if path.with_suffix(".idx").is_file():
        raise DataError(
            f"{path}: half of a Megatron dataset (beside {path.with_suffix('.idx').name}); "
            f"use data.source=megatron with data.path={path.with_suffix('')}"
        )
    return nanogpt_file(path)


def _llmc_shaped(head: np.ndarray, size: int) -> bool:
    """An llm.c header whatever its magic: a token count that fills the file exactly with 2- or
    4-byte tokens, and zeros after it."""
    if head.size < 256 or head[2] <= 0 or head[3:].any():
        return False
    return size - LLMC_HEADER_BYTES in (2 * int(head[2]), 4 * int(head[2]))


def nanogpt_file(path: Path) -> Shard:
    """A nanoGPT .bin: uint16 token ids, 2 bytes each, no header."""
    size = path.stat().st_size
    if size % 2:
        raise DataError(
            f"{path}: {size:,} bytes, an odd count: neither nanoGPT's header-less uint16 tokens (2 bytes each) "
            f"nor an llm.c shard (no magic number {' or '.join(str(m) for m in sorted(LLMC_MAGICS))}); "
            "the file is truncated or holds no token ids"
        )
    shard = Shard(path, 0, size // 2, "uint16", form="nanogpt")
    _check_size(shard, "2 bytes a token")
    return shard


def megatron_shard(prefix: Path) -> Shard:
    """The token file of a Megatron .bin/.idx pair, checked against its index."""
    index, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (index, data):
        if not path.is_file():
            raise DataError(
                f"data.path: {path} does not exist (a Megatron dataset is a .bin and .idx pair; give the path without the suffix)"
            )
    with open(index, "rb") as file:
        head = file.read(MEGATRON_HEADER.size)
        if len(head) < MEGATRON_HEADER.size:
            raise DataError(f"{index}: too short for a Megatron index")
        magic, version, code, sequences, documents = MEGATRON_HEADER.unpack(head)
        if magic != MEGATRON_MAGIC:
            raise DataError(f"{index}: not a Megatron index (magic {magic!r}, expected {MEGATRON_MAGIC!r})")
        if version != 1:
            raise DataError(f"{index}: Megatron index version {version} is not supported (expected 1)")
        if code not in MEGATRON_DTYPES:
            name = MEGATRON_UNSUPPORTED.get(code, f"code {code}")
            raise DataError(f"{index}: token type {name} is not supported (uint16 or int32 only)")
        # A damaged header could name any count: check it against the file before reading.
        # After the header: int32 sizes and int64 pointers per sequence, int64 document indices.
        if sequences * 12 + documents * 8 > index.stat().st_size - MEGATRON_HEADER.size:
            raise DataError(
                f"{index}: truncated or damaged (its header lists {sequences} sequences and {documents} document indices)"
            )
        sizes = np.fromfile(file, dtype="<i4", count=sequences)
        file.seek(sequences * 8, 1)  # the pointers: byte offsets that follow from the sizes
        document_starts = np.fromfile(file, dtype="<i8", count=documents)
    if sizes.size != sequences or (sizes < 0).any():
        raise DataError(f"{index}: truncated or damaged (expected {sequences} sequence sizes)")
    shard = Shard(
        data,
        0,
        int(sizes.sum(dtype=np.int64)),
        MEGATRON_DTYPES[code],
        "megatron",
        max(0, documents - 1),
        _document_ends(index, sizes, document_starts),
    )
    _check_size(shard, f"{index.name} lists {shard.tokens} tokens")
    return shard


def _document_ends(index: Path, sizes: np.ndarray, document_starts: np.ndarray) -> np.ndarray:
    """Token offsets where documents end. The index lists each document's first sequence (0
    first, the sequence count last); a document ends where the next one's first sequence starts."""
    if document_starts.size and (
        document_starts[0] != 0 or (np.diff(document_starts) < 0).any() or document_starts[-1] > sizes.size
    ):
        raise DataError(
            f"{index}: truncated or damaged (its document indices are not ascending sequence numbers from 0 to {sizes.size})"
        )
    sequence_ends = np.cumsum(sizes, dtype=np.int64)
    starts = document_starts[1:]
    return sequence_ends[starts[starts > 0] - 1]


def _check_size(shard: Shard, promise: str) -> None:
    expected = shard.offset + shard.tokens * DTYPES[shard.dtype].itemsize
    size = shard.path.stat().st_size
    if size != expected:
        raise DataError(
            f"{shard.path}: {size} bytes, but {promise} of {shard.dtype} ({expected} bytes); the file is truncated or damaged"
        )
    if shard.tokens < 1:
        raise DataError(f"{shard.path}: holds no tokens")


@dataclass(frozen=True)
class Scan:
    max_id: int
    sha256: str
    """Of the whole file, header included."""
    max_count: int = 0
    """How many times max_id occurs."""
    below: int = -1
    """The largest id below max_id (-1: none): far below it, max_id alone sizes the vocabulary."""


@dataclass
class _Top:
    """The largest id so far, how often it occurred, and the largest id below it."""

    top: int = -1
    count: int = 0
    below: int = -1

    def add(self, tokens: np.ndarray) -> None:
        largest = int(tokens.max())
        if largest < self.top:  # a chunk without the largest id (most chunks hold it)
            self.below = max(self.below, largest)
            return
        ties = tokens == largest
        under = int(np.max(tokens, where=~ties, initial=0))  # 0 also where every token is the largest
        if largest > self.top:
            self.top, self.count, self.below = largest, 0, max(self.below, self.top)
        self.count += int(np.count_nonzero(ties))
        self.below = max(self.below, under)


def scan(shard: Shard, advance: Callable[[int], None] = lambda n: None, chunk_bytes: int = 64 << 20) -> Scan:
    """Read a shard once: its largest token id (checked against the model's vocabulary), how often
    it occurs and the next id below it, and its sha256 (for --verify). advance(n) is called with
    the tokens read, for a progress bar."""
    digest = hashlib.sha256()
    dtype = DTYPES[shard.dtype]
    top = _Top()
    with open(shard.path, "rb") as file:
        digest.update(file.read(shard.offset))
        chunk_bytes -= chunk_bytes % dtype.itemsize
        while data := file.read(chunk_bytes):
            digest.update(data)
            tokens = np.frombuffer(data, dtype=dtype)
            if tokens.size:
                top.add(tokens)
                advance(tokens.size)
    return Scan(max(top.top, 0), digest.hexdigest(), top.count, top.below)
