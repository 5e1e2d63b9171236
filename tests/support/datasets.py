"""Small datasets written as the data code reads them: Parquet files, and prepared token
datasets (format version 2) written part by part without prepare.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def write_parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


T = 8  # context length: small, so a small dataset has hundreds of windows


HEADER = 1024  # bytes before the tokens of an llm.c-style shard


@dataclass(frozen=True)
class Part:
    """One segment to write: tokens appended to file (relative to the dataset, or absolute)."""

    tokens: np.ndarray
    file: str | Path
    dtype: str = "uint16"
    header: int = 0
    """Junk bytes written first when this part creates the file."""


def write_dataset(directory: Path, **splits: list[Part]) -> Path:
    """A prepared dataset in format version 2, without prepare.py: each part appended to its file."""
    directory.mkdir(parents=True, exist_ok=True)
    meta: dict = {"format_version": 2, "key": {}, "files": {}, "splits": {}, "tokens": {}, "vocab_size": 2**32}
    for split, parts in splits.items():
        entries = []
        for part in parts:
            path = directory / part.file
            offset = path.stat().st_size if path.exists() else part.header
            with path.open("ab") as file:
                file.write(JUNK * (offset - file.tell()))
                file.write(part.tokens.astype(np.dtype(part.dtype).newbyteorder("<")).tobytes())
            entries.append({"file": str(part.file), "offset": offset, "tokens": len(part.tokens), "dtype": part.dtype})
        meta["splits"][split] = entries
        meta["tokens"][split] = sum(len(part.tokens) for part in parts)
    for split in splits.values():
        for part in split:  # sizes as prepare.py records them; no test here reads the checksums
            meta["files"][str(part.file)] = {"bytes": (directory / part.file).stat().st_size, "sha256": ""}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


JUNK = b"\xab"  # header filling: read as tokens, it would give values no test expects
