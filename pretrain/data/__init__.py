"""Data: sources, tokenizers, prepare + cache (prepare.py), memory-mapped batches (loader.py).

Importing this package is cheap on purpose: the launcher imports prepare.py, which must not
pull in torch, so nothing here imports a submodule.
"""

from __future__ import annotations


class DataError(Exception):
    """A data problem the user can fix; the message is one line."""
