"""The formats of text files, by their names: which files a directory contributes to a source,
and what a Hub dataset's file holds. The text formats are pretrain/registry.py's TEXT_FORMATS."""

from __future__ import annotations

from pretrain import registry

SHARD_SUFFIXES = {"llmc": (".bin",), "nanogpt": (".bin",)}


def format_suffixes(kind: str) -> tuple[str, ...]:
    """Files a directory contributes for a format (a single file or a glob is taken as named)."""
    return registry.TEXT_FORMATS[kind].suffixes if kind in registry.TEXT_FORMATS else SHARD_SUFFIXES[kind]


def file_format(path: str) -> str | None:
    """The format of a file by its name, None for files to leave out (README, scripts)."""
    for kind, text_format in registry.TEXT_FORMATS.items():
        if path.endswith(text_format.suffixes):
            return kind
    return None
