"""The tree stays clean under ruff (pycodestyle, pyflakes, bugbear; pyproject.toml [tool.ruff])."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from conftest import ROOT


def test_ruff_finds_nothing_in_the_tree():
    assert importlib.util.find_spec("ruff") is not None, \
        "ruff is not installed: bash run_tests.sh installs it (or pip install -r requirements-dev.txt)"
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
