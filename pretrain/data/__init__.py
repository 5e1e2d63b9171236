"""Data: where a run's files come from, which of them it needs, and how they are read, prepared
(prepare.py, once, before any worker) and batched (loader.py, memory-mapped).

Imports run one way: each module imports only modules listed after it here (inside a function
or under TYPE_CHECKING too), top to bottom:
- entries: prepare_cli.py (prepare_dataset.py), fitting.py (the config fitted to the prepared dataset)
- preparing and loading: prepare.py, shard_index.py, encode.py, loader.py
- what a source reads: shard_files.py (pre-tokenized shards, local or hf://), sources.py (text:
  local files, the built-in corpus, a Hub dataset)
- which files a run needs: hub.py (a Hub text dataset's files, and the launcher's entry for
  both kinds: it hands an hf:// data.path to hub_shards.py), hub_shards.py, token_budget.py
- what reading needs, below them: cache.py (the prepared-dataset cache; a stop signal while
  preparing), tokenizer.py, bpe_process.py, splits.py, shards.py (a shard's tokens and header,
  which hub_shards.py reads to size a download)
- where files come from: hub_files.py (a Hub dataset's files: listed by the Hub, else found in
  its cache; fetched), hub_process.py (a snapshot: the Hub cache, else a download in a child
  process), hub_client.py (huggingface_hub in this process, one-line errors), child_process.py
- the ground: windows.py, formats.py, builtin.py, and this package (DataError, first_line)

Outside the folder they import pretrain.run, pretrain.config and pretrain.registry, nothing else
of pretrain. Importing this package is cheap on purpose: the launcher imports prepare.py, which
must not pull in torch, so nothing here imports a submodule (only loader.py imports torch).
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
