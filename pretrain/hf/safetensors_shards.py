"""Weights as sharded safetensors files, as transformers writes them, written one tensor at a time.

A model bigger than max_shard_bytes is split into model-00001-of-0000N.safetensors, ... with
model.safetensors.index.json (metadata.total_size, and the file of every tensor: weight_map); a
smaller one is one model.safetensors and no index. Every tensor's shape and dtype are known
before any of them exists (an FSDP rank learns the full shapes from its shards), so the files
are planned first: each file's header is written, then its tensors' bytes as they come, one at a
time. Nothing holds more than the tensor being written, never a shard, never the model.

The safetensors format: 8 bytes (little-endian header length), a JSON header (name -> dtype,
shape, data_offsets; __metadata__), padded with spaces to a multiple of 8, then the raw bytes
of the tensors, C order, little-endian, in the order of their offsets. Each file is written to a
temporary name and renamed (pretrain/run/files.py atomic_write), and files of an earlier export
that the new one does not have are removed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from pretrain.hf.init_checkpoint import index_weight_map
from pretrain.run.files import atomic_write, atomic_write_text

if TYPE_CHECKING:
    from torch import Tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""transformers' and the Hub's usual limit, 5 GB per file."""
DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2)}
"""The dtypes an export is written in: torch's name -> (safetensors' code, bytes per value)."""
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_WEIGHT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def parse_size(text: str) -> int:
    """Bytes in "5GB", "200MB", "1.5GiB" or "1000" (decimal units as transformers' max_shard_size);
    ValueError for anything else."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size (such as 5GB, 200MB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written, known before it exists."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """torch's name for it, one of DTYPES."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """specs in order, cut into files of at most max_shard_bytes (a tensor bigger than that gets
    a file of its own), as transformers cuts them."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    return [SINGLE_FILE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header(specs: list[TensorSpec]) -> bytes:
    """A safetensors file's first bytes: its length, then the JSON header padded to 8 bytes."""
    described: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        described[spec.name] = {
            "dtype": DTYPES[spec.dtype][0],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(described, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_shards(
    out_dir: Path, specs: list[TensorSpec], tensors: Iterator[tuple[str, Tensor]], max_shard_bytes: int
) -> list[str]:
    """Write the tensors (name, tensor), which must come in specs' order with specs' shapes and
    dtypes, into out_dir's weight files, one at a time; the index when there are several files.
    Returns the file names written. Weight files of an earlier export not among them are removed."""
    shards = plan_shards(specs, max_shard_bytes)
    names = shard_file_names(len(shards))
    for name, shard in zip(names, shards, strict=True):
        atomic_write(out_dir / name, functools.partial(_write_file, specs=shard, tensors=tensors))
    written = list(names)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(spec.nbytes for spec in specs)},
            "weight_map": {spec.name: name for name, shard in zip(names, shards, strict=True) for spec in shard},
        }
        atomic_write_text(out_dir / INDEX_FILE, json.dumps(index, indent=2) + "\n")
        written.append(INDEX_FILE)
    for stale in out_dir.iterdir():
        if _WEIGHT_FILES.fullmatch(stale.name) and stale.name not in written:
            stale.unlink(missing_ok=True)
    return written


def _write_file(path: Path, specs: list[TensorSpec], tensors: Iterator[tuple[str, Tensor]]) -> None:
    with open(path, "wb") as file:
        file.write(header(specs))
        for spec in specs:
            name, tensor = next(tensors)
            _write_tensor(file, spec, name, tensor)
            del tensor  # nothing here holds a written tensor


def _write_tensor(file: BinaryIO, spec: TensorSpec, name: str, tensor: Tensor) -> None:
    import torch

    dtype = str(tensor.dtype).removeprefix("torch.")
    if (name, tuple(tensor.shape), dtype) != (spec.name, spec.shape, spec.dtype):
        raise ValueError(f"expected {spec.name} {list(spec.shape)} {spec.dtype}, got {name} {list(tensor.shape)} {dtype}")
    raw = tensor.detach().to("cpu").contiguous().view(torch.uint8)  # its bytes, no copy when already contiguous on the CPU
    file.write(raw.numpy().data)


# --- reading ------------------------------------------------------------------------------------


def weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> the file in directory that holds it: from the index, else model.safetensors'
    header. FileNotFoundError when there are no weights; SafetensorsDamage (a ValueError) when the
    index is damaged or names a file that is not beside it (index_weight_map)."""
    index = directory / INDEX_FILE
    if index.is_file():
        return index_weight_map(index)
    if not (directory / SINGLE_FILE).is_file():
        raise FileNotFoundError(2, f"no {SINGLE_FILE} nor {INDEX_FILE}", str(directory))
    with WeightFiles(directory, {}) as files:
        return dict.fromkeys(files.handle(SINGLE_FILE).keys(), SINGLE_FILE)


class WeightFiles:
    """A directory's safetensors files, each opened once when first needed, read one tensor at a
    time (memory-mapped: a tensor read is a copy of its bytes only). A context manager."""

    def __init__(self, directory: Path, files_by_name: dict[str, str]) -> None:
        self.directory, self.files_by_name = directory, files_by_name
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}

    def handle(self, file: str) -> Any:
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = self._stack.enter_context(safe_open(str(self.directory / file), framework="pt"))
        return self._handles[file]

    def get(self, name: str) -> Tensor:
        return self.handle(self.files_by_name[name]).get_tensor(name)

    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
