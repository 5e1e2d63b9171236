"""Shared helpers: small real child processes for supervisor tests."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


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


def launcher_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    env.pop("NO_COLOR", None)
    return env
