"""The formats of text files, by their names: which files a directory contributes to a source,
and what a Hub dataset's file holds."""

from __future__ import annotations

FORMAT_SUFFIXES = {
    "text": (".txt", ".txt.gz", ".md", ".text"),
    "jsonl": (".jsonl", ".jsonl.gz", ".json", ".json.gz"),
    "parquet": (".parquet",),
    "llmc": (".bin",),
}
"""Files a directory contributes for each format (a single file or a glob is taken as named)."""


def file_format(path: str) -> str | None:
    """The format of a file by its name, None for files to leave out (README, scripts)."""
    for kind in ("parquet", "jsonl", "text"):
        if path.endswith(FORMAT_SUFFIXES[kind]):
            return kind
    return None
