"""Runs several test folders share: data configs and prepared datasets, one-line errors, real
launcher and debug-training runs (fixtures are in conftest.py, processes in support/processes.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pretrain.config import DataConfig
from pretrain.data.prepare import prepare, read_meta
from pretrain.data.windows import DTYPES
from support.processes import ROOT, launcher_env

# --- prepared datasets ----------------------------------------------------------------


def data_config(tmp_path: Path, **changes) -> DataConfig:
    """A data config whose cache is the test's own."""
    return DataConfig(cache_dir=str(tmp_path / "cache"), **changes)


def prepared(cfg: DataConfig, **kwargs) -> Path:
    """Prepare (or find) the dataset, dropping the progress lines."""
    return prepare(cfg, log=lambda line: None, **kwargs)


def split_tokens(dataset: Path, split: str) -> np.ndarray:
    """The tokens of one split, read through its segments in meta.json (a shard's file is absolute)."""
    parts = [
        np.fromfile(dataset / segment["file"], dtype=DTYPES[segment["dtype"]], count=segment["tokens"], offset=segment["offset"])
        for segment in read_meta(dataset)["splits"][split]
    ]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def all_tokens(dataset: Path) -> np.ndarray:
    """The training tokens, then the validation tokens."""
    return np.concatenate([split_tokens(dataset, "train"), split_tokens(dataset, "val")])


# --- commands -------------------------------------------------------------------------


def assert_one_line_error(
    result: subprocess.CompletedProcess, *fragments: str, code: int = 2, prefix: str = "", quiet_stdout: bool = True
) -> None:
    """A refusal: exit `code`, one line on stderr (starting with prefix, holding every fragment),
    no traceback, and, where quiet_stdout, nothing on stdout."""
    assert result.returncode == code, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(prefix), result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    if quiet_stdout:
        assert result.stdout == ""


def run_in_process(main: Callable[[list[str]], int], argv: list[str], capsys) -> subprocess.CompletedProcess:
    """A command's main(argv) run in this process: its exit code and what it printed."""
    try:
        code = main(argv)
    except SystemExit as exit:  # argument errors leave through argparse
        code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)  # as the interpreter does
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def run_launcher(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """`python -m launcher ARGS...` from the repository, with env added to its environment, its
    output captured as text."""
    argv = [sys.executable, "-m", "launcher", *args]
    return subprocess.run(argv, cwd=ROOT, env=launcher_env(**env), capture_output=True, text=True, timeout=timeout)


def run_debug_training(tmp_path: Path, command: list[str], run_dir: Path, *options: str) -> subprocess.CompletedProcess:
    """A short debug-preset training run (`python <command> --debug ...`, a small batch and context,
    a log line every step) into run_dir, with the test's own data cache; it must succeed."""
    result = subprocess.run(
        [
            sys.executable,
            *command,
            "--debug",
            "--run-dir",
            str(run_dir),
            "--set",
            f"data.cache_dir={tmp_path / 'cache'}",
            "--set",
            "data.context_length=64",
            "--set",
            "training.batch_size=4",
            "--set",
            "logging.log_interval=1",
            *options,
        ],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


NOBODY = 65534
"""A second user's uid and gid (nobody), for tests of what another user of a shared file meets."""


def as_nobody(function: Callable[[], str]) -> str:
    """What function returns when run as uid and gid NOBODY in a forked child, or 'raised Type:
    message': forked, since the interpreter may live where that user cannot reach it. Needs root."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                result = function()
            except BaseException as error:
                result = f"raised {type(error).__name__}: {error}"
            os.write(write, result.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        result = pipe.read().decode()
    os.waitpid(pid, 0)
    return result


def losses(run_dir: Path) -> dict[int, list[float]]:
    """Every training loss a run's metrics.jsonl holds, by step (a step redone after a restart twice)."""
    found: dict[int, list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["kind"] == "train":
            found.setdefault(row["step"], []).append(row["loss"])
    return found
