"""Data: sources, tokenizers, prepare + cache (prepare.py), memory-mapped batches (loader.py).

Importing this package is cheap on purpose: the launcher imports prepare.py, which must not
pull in torch, so nothing here imports a submodule.
"""

from __future__ import annotations

from pretrain.run.refusal import Refusal


class DataError(Refusal):
    """A data problem the user can fix; the message is one line."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of a library's error message, for quoting inside a one-line DataError
    (some messages span lines, some are empty: then the error's type name)."""
    lines = str(error).strip().splitlines()
    return lines[0][:limit] if lines else type(error).__name__
