"""A cache that is read-only, or that several users share (issue 28, items 4 and 10).

A read-only cache is a bind mount remounted read-only (root ignores permission bits, so chmod
would not do); the second user is uid 65534 ('nobody'), in a forked child: forked, not started
anew, because the interpreter may live where that user cannot reach it (/root/.pyenv here), and
the modules the child needs are imported by then (the test prepares once as root first)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from support.processes import one_line_error
from support.runs import NOBODY, as_nobody, data_config, prepared, run_launcher
from launcher.compile_cache import kernel_cache_dir
from launcher.errors import UsageError
from pretrain.config import Config, DataConfig
from pretrain.config.presets import debug
from pretrain.data import DataError
from pretrain.data.cache import build_lock
from pretrain.data.prepare import read_meta, recipe_for
from pretrain.run.files import CACHE_DIR_VAR

DOCUMENTS = ["the first user's text, " * 20, "and more of it. " * 30]
OTHER_DOCUMENTS = ["the second user's own text, " * 20, "different words. " * 30]

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user (and mounting) needs root")


@contextmanager
def read_only(directory: Path) -> Iterator[Path]:
    """directory, bind-mounted read-only onto itself until the end; skipped where mount is not permitted."""
    bound = subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True, text=True)
    if bound.returncode != 0:
        pytest.skip(f"bind mounts are not permitted here: {bound.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True, capture_output=True)
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A cache root anyone may add to, sticky like /tmp (mode 1777), where uid 65534 can reach it
    (pytest's own temporary directories are root's alone)."""
    root = Path(tempfile.mkdtemp(prefix="shared-cache-", dir=tempfile.gettempdir()))
    root.chmod(0o1777)
    yield root
    shutil.rmtree(root)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextmanager
def umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def compiling() -> Config:
    config = Config()
    return replace(config, training=replace(config.training, compile=True))


# --- a read-only cache (item 4) ---------------------------------------------------------------


@needs_root
def test_a_read_only_cache_that_holds_the_dataset_trains_without_writing_anything(tmp_path):
    cache = tmp_path / "cache"
    options = ("--debug", "--nproc", "1", "--max-steps", "1", "--runs-dir", str(tmp_path / "runs"), "--cache-dir", str(cache))
    prepared(replace(debug().data, cache_dir=str(cache / "datasets")))
    with read_only(cache):
        result = run_launcher(*options)
    assert result.returncode == 0, result.stdout + result.stderr  # the workers wrote nothing there, compiled kernels included
    assert "launcher: dataset: reusing" in result.stdout and "Training complete: 1 steps" in result.stdout


@needs_root
def test_a_read_only_cache_without_the_dataset_is_one_line_naming_the_directory_and_the_fix(tmp_path):
    cache = tmp_path / "cache"
    (cache / "datasets").mkdir(parents=True)
    for cfg in (data_config(tmp_path), DataConfig(cache_dir=str(cache / "new" / "datasets"))):
        with read_only(cache), pytest.raises(DataError) as raised:
            prepared(cfg, documents=DOCUMENTS)
        message = one_line_error(raised)
        assert message.startswith(str(cache)) and "Read-only file system" in message
        assert "preparing the dataset (not built)" in message and f"--cache-dir DIR or {CACHE_DIR_VAR}=DIR" in message


def test_a_run_that_does_not_compile_names_no_kernel_directory_and_creates_none(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_VAR, str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert kernel_cache_dir(Config(), "cpu", pytest.fail) is None
    assert not (tmp_path / "cache").exists()


@needs_root
def test_compile_with_a_read_only_cache_keeps_kernels_in_a_private_temp_dir_with_one_warning(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv(CACHE_DIR_VAR, str(cache))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    warnings: list[str] = []
    with read_only(cache):
        chosen = kernel_cache_dir(compiling(), "cpu", warnings.append)
    assert chosen == str(tmp_path / "tmp" / "torchinductor_root") and mode(Path(chosen)) == 0o700
    (warning,) = warnings
    assert warning.startswith(f"warning: compiled kernels cannot be kept in {cache}/inductor-root (Read-only file system)")
    assert "--cache-dir" in warning


@needs_root
def test_a_kernel_directory_the_user_set_that_cannot_be_written_is_refused_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "ro").mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ro" / "kernels"))
    with read_only(tmp_path / "ro"), pytest.raises(UsageError) as raised:
        kernel_cache_dir(compiling(), "cpu", pytest.fail)
    assert one_line_error(raised) == (
        f"TORCHINDUCTOR_CACHE_DIR={tmp_path}/ro/kernels: Read-only file system; point it at a writable directory, or unset it"
    )


# --- a cache several users share (item 10) ----------------------------------------------------


@needs_root
@pytest.mark.parametrize("first_users_umask", [0o022, 0o077], ids=["umask 022", "umask 077 (shares nothing)"])
def test_a_second_user_adds_a_dataset_to_a_shared_cache_and_reads_the_first_users(shared_root, tmp_path, first_users_umask):
    prepared(data_config(tmp_path), documents=OTHER_DOCUMENTS)  # every module a build needs, imported
    cfg = DataConfig(cache_dir=str(shared_root / "datasets"))
    with umask(first_users_umask):
        first = prepared(cfg, documents=DOCUMENTS)

    def add_and_read() -> str:
        second = prepared(cfg, documents=OTHER_DOCUMENTS)
        reused = prepared(cfg, documents=DOCUMENTS)
        return f"{second.stat().st_uid} {read_meta(second)['tokens']['train']} {read_meta(reused)['tokens']['train']}"

    result = as_nobody(add_and_read)
    assert not result.startswith("raised"), result
    second_uid, second_tokens, first_tokens = result.split()
    assert second_uid == str(NOBODY) and int(second_tokens) > 0
    assert int(first_tokens) == read_meta(first)["tokens"]["train"]
    assert mode(shared_root / "datasets") == mode(first) == 0o1777 and mode(first / "meta.json") == 0o644


@needs_root
def test_a_build_lock_another_user_holds_in_a_shared_cache_is_waited_for(shared_root):
    datasets = shared_root / "datasets"
    datasets.mkdir(mode=0o1777)
    datasets.chmod(0o1777)
    final = recipe_for(DataConfig(cache_dir=str(datasets)), DOCUMENTS).path

    class Waiting(Exception):
        pass

    def wait() -> str:
        def log(line: str) -> None:
            raise Waiting(line)

        with build_lock(final, log):
            return "got the lock"

    with umask(0o077), build_lock(final, print):
        result = as_nobody(wait)
        lock_mode = mode(Path(f"{final}.lock"))
    assert result.startswith("raised Waiting: dataset: waiting for another process to finish preparing"), result
    assert lock_mode == 0o644


@needs_root
def test_another_users_private_cache_is_refused_naming_its_owner_and_a_cache_of_ones_own(shared_root, tmp_path):
    prepared(data_config(tmp_path), documents=OTHER_DOCUMENTS)
    private = shared_root / "root's"
    cfg = DataConfig(cache_dir=str(private / "datasets"))
    private.mkdir(mode=0o755)
    prepared(cfg, documents=DOCUMENTS)
    result = as_nobody(lambda: str(prepared(cfg, documents=OTHER_DOCUMENTS)))
    assert result.startswith(f"raised DataError: {private}/datasets/") and result.count("\n") == 0
    assert "belongs to user root and is not shared with nobody" in result
    assert f"use a cache of your own: --cache-dir DIR or {CACHE_DIR_VAR}=DIR" in result


@needs_root
def test_each_user_of_a_shared_cache_gets_a_kernel_directory_of_their_own(shared_root, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_VAR, str(shared_root))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    mine = kernel_cache_dir(compiling(), "cpu", pytest.fail)
    theirs = as_nobody(lambda: str(kernel_cache_dir(compiling(), "cpu", print)))
    assert (mine, theirs) == (str(shared_root / "inductor-root"), str(shared_root / "inductor-nobody"))
    assert mode(Path(mine)) == mode(Path(theirs)) == 0o700 and Path(theirs).stat().st_uid == NOBODY


@needs_root
def test_a_damaged_dataset_of_another_user_in_a_sticky_cache_is_refused_naming_its_owner(shared_root, tmp_path):
    prepared(data_config(tmp_path), documents=OTHER_DOCUMENTS)
    cfg = DataConfig(cache_dir=str(shared_root / "datasets"))
    first = prepared(cfg, documents=DOCUMENTS)
    with open(first / "tokens.bin", "r+b") as tokens:
        tokens.truncate(10)
    result = as_nobody(lambda: str(prepared(cfg, documents=DOCUMENTS)))
    assert result.startswith(
        f"raised DataError: {first}: Operation not permitted: preparing the dataset (tokens.bin has 10 bytes"
    )
    assert "only its owner, user root, may; ask them to rebuild it (--force), or use a cache of your own" in result
    assert sorted(p.name for p in (shared_root / "datasets").iterdir()) == [first.name]  # nothing left behind
