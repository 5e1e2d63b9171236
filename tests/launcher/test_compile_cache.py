"""launcher/compile_cache.py: the workers' TORCHINDUCTOR_CACHE_DIR, checked before any worker starts.

A directory that cannot be written is a path under a regular file: unlike a read-only mount
(tests/pretrain/run/test_shared_cache.py), it needs no root and no mount."""

from __future__ import annotations

import os

import pytest

from support.processes import one_line_error
from support.runs import run_launcher
from launcher.compile_cache import VARIABLE, kernel_cache_dir
from launcher.errors import UsageError
from pretrain.config import Config


@pytest.fixture
def unwritable(tmp_path) -> str:
    """A TORCHINDUCTOR_CACHE_DIR no process can create: its parent is a regular file."""
    (tmp_path / "a-file").write_text("not a directory\n")
    return str(tmp_path / "a-file" / "kernels")


def refusal(unwritable: str) -> str:
    problem = f"{os.path.dirname(unwritable)} is not a directory"
    return f"{VARIABLE}={unwritable}: {problem}; point it at a writable directory, or unset it"


def test_an_unwritable_kernel_directory_the_user_set_is_refused_even_when_the_run_does_not_compile(unwritable, monkeypatch):
    monkeypatch.setenv(VARIABLE, unwritable)
    with pytest.raises(UsageError) as raised:
        kernel_cache_dir(Config(), "cpu", pytest.fail)  # the default config does not compile on CPU
    assert one_line_error(raised) == refusal(unwritable)


def test_a_writable_kernel_directory_the_user_set_is_theirs_whether_the_run_compiles_or_not(tmp_path, monkeypatch):
    monkeypatch.setenv(VARIABLE, str(tmp_path / "kernels"))
    assert kernel_cache_dir(Config(), "cpu", pytest.fail) == str(tmp_path / "kernels")


def test_a_training_launch_without_compile_refuses_an_unwritable_kernel_directory_before_any_worker_starts(unwritable, tmp_path):
    # Every worker creates the directory as it imports torch._dynamo, compile or not: each used
    # to fail with a bare "<dir>: Not a directory" that did not name the variable.
    result = run_launcher(
        "--debug", "--device", "cpu", "--nproc", "2", "--max-steps", "1", "--run-dir", str(tmp_path / "run"),
        "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "training.compile=false",
        timeout=180,
        **{VARIABLE: unwritable},
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == f"launcher: error: {refusal(unwritable)}\n"
    assert "CPU0:" not in result.stdout and "CPU1:" not in result.stdout  # no worker started
    assert not (tmp_path / "run").exists()
