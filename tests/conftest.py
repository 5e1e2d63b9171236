"""Shared helpers: small real child processes for supervisor tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def private_gpu_claims(monkeypatch):
    """No test claims a GPU of the machine it runs on, or meets another test's claims:
    each test has claim names of its own (launcher/claims.py)."""
    monkeypatch.setenv("LAUNCHER_CLAIMS_NAMESPACE", f"gpu-launcher-test-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def scripted_gpus(tmp_path, monkeypatch):
    """Make NVML see a scripted machine (launcher/scripted_nvml.py), here and in the
    launchers a test starts: scripted_gpus([{}, {"utilization": [90]}]) is two H100s, one busy."""
    def make(gpus: list[dict], driver: bool = True) -> Path:
        path = tmp_path / "machine.json"
        path.write_text(json.dumps({"driver": driver, "gpus": gpus}))
        monkeypatch.setenv("LAUNCHER_SCRIPTED_GPUS", str(path))
        return path
    return make


@pytest.fixture
def script(tmp_path):
    """Write a Python child script; return the argv that runs it."""
    def make(source: str, name: str = "child.py") -> list[str]:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return [sys.executable, str(path)]
    return make


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for MASTER_PORT of a test's process group.
    (Another process may take it before the group binds it: rare enough for tests.)"""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_gloo_ranks(worker: str, out: Path, timeout: float, world_size: int = 2) -> list[dict]:
    """Run tests/<worker> as world_size gloo ranks (one thread each); each writes
    out/rank<r>.json, returned in rank order. A rank that fails fails the test with its output."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / worker), str(out)], cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(rank), WORLD_SIZE=str(world_size),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world_size)]
    outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def launcher_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    env.pop("NO_COLOR", None)
    return env


def one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    """The message of a raised error, after checking it is one non-empty line."""
    message = str(excinfo.value)
    assert message and "\n" not in message
    return message


def cache_leftovers(tmp_path: Path) -> list[str]:
    """Everything under tmp_path/cache but lock files and the folder of trained tokenizers:
    after a failed preparation, this must be empty."""
    cache = tmp_path / "cache"
    if not cache.exists():
        return []
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*")
                  if not p.name.endswith(".lock") and not (p.is_dir() and p.name == "tokenizers"))
