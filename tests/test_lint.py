"""The tree stays clean under ruff's linter (pycodestyle, pyflakes, bugbear) and formatter, and
under mypy: pyproject.toml's [tool.ruff] and [tool.mypy] say what is checked. These run with the
tests, so `bash run_tests.sh` (and CI, which calls it) refuses a change that breaks them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from support.processes import ROOT

INSTALL_HINT = "is not installed: bash run_tests.sh installs it (or pip install -r requirements-dev.txt)"


def run_tool(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    assert importlib.util.find_spec(module) is not None, f"{module} {INSTALL_HINT}"
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_ruff_finds_nothing_in_the_tree():
    result = run_tool("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tree_is_formatted_as_ruff_formats_it():
    result = run_tool("ruff", "format", "--no-cache", "--check", ".")
    assert result.returncode == 0, f"{result.stdout}{result.stderr}run `python -m ruff format .` to format these files"


@pytest.mark.slow  # about 15 s with a warm cache, a minute without
def test_mypy_finds_no_type_errors():
    result = run_tool("mypy")  # the files and settings come from pyproject.toml [tool.mypy]
    assert result.returncode == 0, result.stdout + result.stderr
