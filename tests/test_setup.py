"""The setup shared by run_training.sh and run_tests.sh (scripts/setup.sh)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import check_requirements  # noqa: E402


def project_copy(tmp_path):
    """The setup's inputs in a scratch root, so a .venv it might make lands there."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    for name in ("requirements.txt", "requirements-dev.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def setup_python(root, python: str) -> subprocess.CompletedProcess:
    script = f'source "{root}/scripts/setup.sh" && setup_python "{root}" "{root}/requirements.txt" && echo "$PYTHON"'
    return subprocess.run(["bash", "-c", script], env={"PATH": "/usr/bin:/bin", "PYTHON": python},
                          capture_output=True, text=True, timeout=60)


def test_an_interpreter_that_has_everything_is_used_as_it_is(tmp_path):
    root = project_copy(tmp_path)
    result = setup_python(root, sys.executable)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == sys.executable
    assert result.stderr == ""  # nothing installed, nothing said
    assert not (root / ".venv").exists()


def test_a_python_older_than_3_10_is_refused_with_one_line(tmp_path):
    root = project_copy(tmp_path)
    fake = tmp_path / "python3.8"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Python 3.8.10" && exit 0\nexit 1\n')
    fake.chmod(0o755)
    result = setup_python(root, str(fake))
    assert result.returncode != 0
    assert result.stderr.strip() == (f"setup: error: Python 3.10 or newer is needed, {fake} is Python 3.8.10; "
                                     "set PYTHON=/path/to/python3")


def test_a_missing_interpreter_is_refused_with_one_line(tmp_path):
    result = setup_python(project_copy(tmp_path), "no-such-python")
    assert result.returncode != 0 and "setup: error: no-such-python not found" in result.stderr


def test_check_requirements_lists_exactly_the_missing_and_too_old_lines(tmp_path):
    requirements = tmp_path / "req.txt"
    requirements.write_text("# comment\npytest>=7  # installed\nno-such-package-xyz>=1.0\n\nnumpy\n"
                            "numpy>=999.0\n")
    assert check_requirements.unsatisfied([requirements]) == ["no-such-package-xyz>=1.0", "numpy>=999.0"]


@pytest.mark.parametrize("version, release", [("2.13.0+cpu", (2, 13, 0)), ("2.5.0rc1", (2, 5, 0)),
                                              ("12.535.161", (12, 535, 161)), ("4.60", (4, 60))])
def test_versions_compare_by_their_numeric_release(version, release):
    assert check_requirements.release(version) == release


def test_every_runtime_requirement_is_installed_here():
    assert check_requirements.unsatisfied([ROOT / "requirements.txt", ROOT / "requirements-dev.txt"]) == []
