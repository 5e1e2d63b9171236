"""A Hugging Face Hub cache filled in a temporary directory: the tests run offline
(HF_HUB_OFFLINE=1), as this machine does, and read snapshots the way the Hub writes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.datasets import write_parquet


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_snapshot(home: Path, kind: str, repo: str, commit: str, files: dict[str, object]) -> Path:
    """A snapshot of a dataset or model repo in the Hub cache home/hub, with its refs/main;
    files maps names to Parquet columns (a dict), bytes or text."""
    folder = home / "hub" / f"{kind}s--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit)  # no trailing newline, as the Hub writes it
    snapshot = folder / "snapshots" / commit
    for name, content in files.items():
        path = snapshot / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, dict):
            write_parquet(path, content)
        else:
            path.write_bytes(content if isinstance(content, bytes) else str(content).encode())
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hub cache in tmp_path; returns a function that adds a dataset snapshot to it."""
    constants = pytest.importorskip("huggingface_hub.constants")
    cache, home = tmp_path / "hf" / "hub", tmp_path / "hf" / "home"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these when it is imported: set them where it looks at call time too.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def add(repo: str, files: dict[str, object], commit: str = COMMIT) -> Path:
        return add_snapshot(cache.parent, "dataset", repo, commit, files)

    return add
