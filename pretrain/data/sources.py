"""Sources of text: where documents come from, streamed in bounded memory.

A source yields Pieces: some text and whether it ends a document. A JSON Lines or Parquet row is
one document. A text file is one document too, read in pieces of about 4 MB cut at line ends, so
a file larger than memory streams through. The end-of-text token goes after each document.

Every source has an identity, a JSON-able dict that changes whenever its text could: the files'
paths, sizes and modification times, the text field, the built-in corpus's content hash, a Hub
dataset's commit. It is part of the dataset's cache key, and computing it reads no file contents,
so a cache hit stays cheap whatever the size of the source.

Each text format is a reader here, named with its file suffixes in pretrain/registry.py
(TEXT_FORMATS): a reader takes (path, text_field) and yields the file's Pieces. Pre-tokenized
shards (llm.c, Megatron) are not text and live in shards.py.

No torch here: the launcher prepares data before it starts any worker.
"""

from __future__ import annotations

import glob
import gzip
import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pretrain import registry
from pretrain.data import DataError, first_line
from pretrain.data.builtin import builtin_documents, content_digest
from pretrain.data.formats import file_format, format_suffixes

if TYPE_CHECKING:
    from pretrain.config import DataConfig

PIECE_CHARS = 4 << 20
"""A text file is handed on in pieces of about this many characters."""


@dataclass(frozen=True)
class Piece:
    text: str
    ends_document: bool
    size: int = 0
    """Bytes of the source this piece stands for (about), for the progress bar."""


@dataclass(frozen=True)
class TextSource:
    name: str
    """Short and readable: the start of the cache directory's name."""
    identity: dict[str, Any]
    pieces: Callable[[], Iterator[Piece]] = field(compare=False)
    """A fresh stream of the source's pieces on each call."""
    total_bytes: int | None = None
    """What the pieces' sizes add up to, when known: the progress bar's total."""


# --- choosing the source ----------------------------------------------------------------------


def text_source(cfg: DataConfig, *, val: bool = False, log: Callable[[str], None] | None = None) -> TextSource:
    """The text source data.source names (data.val_path instead of data.path when val); log tells
    of a Hub download."""
    if cfg.source == "builtin":
        return documents_source(builtin_documents(), "builtin")
    if cfg.source == "hub":
        return hub_source(cfg, log)
    if cfg.source in registry.TEXT_FORMATS:
        path = cfg.val_path if val else cfg.path
        key = "data.val_path" if val else "data.path"
        return file_source(cfg.source, resolve_files(path, cfg.source, key), cfg.text_field)
    raise DataError(f"data.source: {cfg.source!r} is not a text source")


def documents_source(documents: list[str], name: str = "custom") -> TextSource:
    """Texts in memory as a source: the built-in corpus, and documents given by tests."""
    return TextSource(
        name,
        {"source": name, "content": content_digest(documents)},
        lambda: (Piece(d, True, len(d)) for d in documents),
        sum(map(len, documents)),
    )


def resolve_files(pattern: str, kind: str, key: str) -> list[Path]:
    """The files a path names: the file itself, a directory's files of the format (recursively,
    sorted), or a glob's matches (sorted). DataError when there are none."""
    path = Path(pattern).expanduser()
    if glob.has_magic(pattern):
        files = sorted(Path(p).resolve() for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"{key}: no file matches {pattern!r}")
        return files
    path = path.resolve()
    if path.is_file():
        return [path]
    if path.is_dir():
        suffixes = format_suffixes(kind)
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(suffixes) and not p.name.startswith("."))
        if not files:
            raise DataError(f"{key}: {path} holds no {' / '.join(suffixes)} files")
        return files
    raise DataError(f"{key}: {path} does not exist")


def file_source(kind: str, files: list[Path], text_field: str) -> TextSource:
    """Local files of one text format (pretrain/registry.py, TEXT_FORMATS: text, jsonl, parquet)."""
    stamps: list[list[Any]] = []  # [path, size, mtime_ns]: lists, as meta.json gives them back
    for path in files:
        stat = path.stat()
        stamps.append([str(path), stat.st_size, stat.st_mtime_ns])
    identity = {"source": kind, "files": stamps, **({"text_field": text_field} if kind != "text" else {})}
    read: Callable[[Path, str], Iterator[Piece]] = registry.load(registry.TEXT_FORMATS[kind].reader)

    def pieces() -> Iterator[Piece]:
        for path in files:
            yield from read(path, text_field)

    # Compressed files unpack to an unknown size: no total then.
    total = None if any(p.name.endswith(".gz") for p in files) else sum(stamp[1] for stamp in stamps)
    return TextSource(kind, identity, pieces, total)


# --- formats ----------------------------------------------------------------------------------


def _open_text(path: Path) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def text_pieces(path: Path, _field: str) -> Iterator[Piece]:
    """One document per file, in pieces cut at line ends (inside a line only when the line
    alone is longer than PIECE_CHARS, so a file without line ends streams too)."""
    buffer: list[str] = []
    size = 0
    try:
        with _open_text(path) as file:
            for line in iter(lambda: file.readline(PIECE_CHARS), ""):
                buffer.append(line)
                size += len(line)
                if size >= PIECE_CHARS:
                    yield Piece("".join(buffer), False, size)
                    buffer, size = [], 0
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text; convert it (for example with iconv) or leave it out") from None
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"{path}: cannot read ({error})") from None
    yield Piece("".join(buffer), True, size)


def jsonl_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    try:
        with _open_text(path) as file:
            for number, line in enumerate(file, 1):
                text = _jsonl_text(path, number, line, text_field) if line.strip() else None
                if text is not None:
                    yield Piece(text, True, len(line))
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"{path}: cannot read ({error})") from None


def _jsonl_text(path: Path, number: int, line: str, text_field: str) -> str | None:
    """The text of one row; None for a null (skipped, as Parquet's nulls are)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        at = "" if error.msg.endswith(" at") else " at"  # "Unterminated string starting at" needs no second "at"
        raise DataError(f"{path}:{number}: not valid JSON ({error.msg}{at} column {error.colno})") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{number}: expected a JSON object per line, got {type(row).__name__}")
    if text_field not in row:
        fields = ", ".join(sorted(row)) or "none"
        raise DataError(f"{path}:{number}: no field {text_field!r} (fields: {fields}); set data.text_field")
    text = row[text_field]
    if text is None:
        return None
    if not isinstance(text, str):
        raise DataError(
            f"{path}:{number}: field {text_field!r} holds {type(text).__name__}, not text; set data.text_field to a text field"
        )
    if "\\ud" in line or "\\uD" in line:
        # A lone surrogate escape (found in web dumps) decodes to a str no encoder accepts;
        # replace it like undecodable bytes. Valid pairs became one character already.
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def parquet_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as error:
        raise DataError(f"{path}: not a readable Parquet file ({first_line(error)})") from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); set data.text_field")
    column_type = parquet.schema_arrow.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{path}: column {text_field!r} holds {column_type}, not text; set data.text_field to a text column")
    # Parquet is compressed: each row stands for an equal share of the file's bytes.
    row_size = path.stat().st_size / max(1, parquet.metadata.num_rows)
    try:
        for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield Piece(text, True, round(row_size))
    except (OSError, pa.ArrowException) as error:
        raise DataError(f"{path}: cannot read ({first_line(error)})") from None


# --- Hugging Face Hub -------------------------------------------------------------------------


def hub_source(cfg: DataConfig, log: Callable[[str], None] | None = None) -> TextSource:
    """A Hub dataset's files (the first data.hub_max_files of those data.hub_files matches, see
    hub.py), downloaded into the Hub cache once and read from there."""
    from pretrain.data.hub import find_files
    from pretrain.data.hub_files import fetch, selected

    found = find_files(cfg)
    files = selected(cfg.hub_repo, cfg.hub_files, cfg.hub_max_files, found)
    folder = fetch(cfg.hub_repo, found, files, log)
    commit = found.commit  # the exact revision, also when hub_revision is a branch
    usable = [folder / name for name, _ in files]
    where = f"{cfg.hub_repo}@{cfg.hub_revision}"
    kinds = {file_format(p.name) for p in usable}
    if len(kinds) > 1:
        raise DataError(
            f"data.hub_files: {cfg.hub_files!r} matches files of several formats "
            f"({', '.join(sorted(k or '?' for k in kinds))}) in {where}; narrow it to one"
        )
    (kind,) = kinds
    assert kind is not None
    source = file_source(kind, usable, cfg.text_field)
    # The commit names the files' contents; sizes still guard against a damaged Hub cache.
    identity = {
        "source": "hub",
        "hub_repo": cfg.hub_repo,
        "commit": commit,
        "format": kind,
        "files": [[p.relative_to(folder).as_posix(), p.stat().st_size] for p in usable],
        **({"text_field": cfg.text_field} if kind != "text" else {}),
    }
    return TextSource("hub-" + cfg.hub_repo.replace("/", "-"), identity, source.pieces, source.total_bytes)
