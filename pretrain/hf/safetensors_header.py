"""A safetensors file's header, read and checked as safetensors checks it when it opens the file:
every tensor's name, dtype and shape (8 bytes of length, then JSON), no weight read, and the file
whole (each tensor's data_offsets hold exactly its dtype x shape bytes, and the file ends where the
last one does). A truncated download or a damaged file is refused in one line (SafetensorsDamage),
not by a SafetensorError in a worker. Standard library only: the launcher checks --init-from's
files (pretrain/hf/init_checkpoint.py), and generate and evaluate an export's
(pretrain/hf/exported.py)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from pretrain.data import first_line

MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
DTYPE_BYTES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "F64", "C64"), 8),
}
"""Bytes per value of safetensors' dtypes (those of less than a byte, F4 and F6, are left out: not checked)."""

FIX_DAMAGED = "download or copy it again"
"""What a damaged or truncated file's line tells the user to do."""


class SafetensorsDamage(ValueError):
    """A safetensors file that safetensors would refuse to open: the one-line reason and what to do."""


def check_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in a safetensors file, read from its header, which is
    checked as safetensors checks it when the file is opened: each tensor's data_offsets hold
    exactly its dtype x shape bytes, one after another from 0, and the file ends where the last
    one does (8 bytes of length + the header + the data). A truncated or damaged file is thus
    refused here, in one line naming its size and the size its header describes, and not by a
    SafetensorError from the workers. SafetensorsDamage otherwise."""
    size, length, raw = _raw_header(path)
    try:
        tensors = {
            name: (info["dtype"], tuple(int(n) for n in info["shape"]), _offsets(info["data_offsets"]))
            for name, info in json.loads(raw).items()
            if name != "__metadata__"
        }
    except UnicodeDecodeError:  # its message would quote a byte of the file
        raise SafetensorsDamage(f"{path.name} is not a readable safetensors file (a header not UTF-8); {FIX_DAMAGED}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise SafetensorsDamage(f"{path.name} is not a readable safetensors file ({first_line(error)}); {FIX_DAMAGED}") from None
    end = 0
    for name, (dtype, shape, (begin, stop)) in sorted(tensors.items(), key=lambda item: item[1][2]):
        if begin != end:
            raise SafetensorsDamage(f"{path.name}: {name}'s data_offsets start at {begin}, not {end} (damaged); {FIX_DAMAGED}")
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype] if dtype in DTYPE_BYTES else stop - begin
        if stop - begin != nbytes:
            raise SafetensorsDamage(
                f"{path.name}: {name}'s data_offsets hold {stop - begin} bytes but {dtype} {list(shape)} takes {nbytes} "
                f"(damaged); {FIX_DAMAGED}"
            )
        end = stop
    if size != 8 + length + end:
        what = "truncated" if size < 8 + length + end else "damaged"
        described = 8 + length + end
        raise SafetensorsDamage(f"{path.name} is {size} bytes but its header describes {described} ({what}); {FIX_DAMAGED}")
    return {name: (dtype, shape) for name, (dtype, shape, _) in tensors.items()}


def _raw_header(path: Path) -> tuple[int, int, bytes]:
    """A safetensors file's size, its header's length and the header's bytes; SafetensorsDamage
    for a file too short to hold them."""
    try:
        with path.open("rb") as file:
            size = os.fstat(file.fileno()).st_size
            length = int.from_bytes(file.read(8), "little")
            raw = file.read(length) if 8 + length <= size and length <= MAX_HEADER else b""
    except OSError as error:
        raise SafetensorsDamage(f"{path.name} cannot be read ({first_line(error)})") from None
    if size < 8 or not 2 <= length <= MAX_HEADER:
        # The length is the file's first 8 bytes: never said (of a text file they are its text).
        what = f"its header length is not plausible for a file of {size} bytes" if size >= 8 else f"{size} bytes"
        raise SafetensorsDamage(f"{path.name} is not a readable safetensors file ({what}); {FIX_DAMAGED}")
    if size < 8 + length:
        raise SafetensorsDamage(
            f"{path.name} is {size} bytes but its header describes at least {8 + length} (truncated); {FIX_DAMAGED}"
        )
    return size, length, raw


def _offsets(value: Any) -> tuple[int, int]:
    """A tensor's data_offsets [begin, end) as safetensors writes them; ValueError for anything else."""
    begin, end = (int(n) for n in value)
    if not 0 <= begin <= end:
        raise ValueError(f"data_offsets {value}")
    return begin, end
