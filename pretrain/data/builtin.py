"""The embedded default source: the documentation topics that ship with every Python
(`pydoc_data.topics`). No network, no files to download."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def builtin_documents() -> list[str]:
    """One document per documentation topic, sorted by topic name so the order is stable."""
    from pydoc_data.topics import topics  # imported here: a 0.5 MB module, only needed to build

    return [topics[name] for name in sorted(topics)]


def content_digest(documents: Iterable[str]) -> str:
    """A sha256 over the documents, their boundaries included ("ab","c" differs from "a","bc")."""
    digest = hashlib.sha256()
    for document in documents:
        data = document.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return "sha256:" + digest.hexdigest()
