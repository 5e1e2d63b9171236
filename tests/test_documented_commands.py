"""Every command the README and docs/ tell a user to type still runs: `python -m MODULE`, `python
PATH.py` and `bash SCRIPT.sh` of this project, each answering --help with exit 0. Modules moved
into folders keep their old command through a thin entry module (pretrain/generate.py and the
like); this test is what notices a command the docs name and the code no longer has."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from support.processes import ROOT, launcher_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OUR_PACKAGES = ("launcher", "pretrain", "benchmarks")
PYTHON_M = re.compile(r"\bpython3? -m ([A-Za-z_][\w.]*)")
PYTHON_FILE = re.compile(r"\bpython3? ([\w/.-]+\.py)\b")
BASH_SCRIPT = re.compile(r"\bbash ([\w/.-]+\.sh)\b")
NOT_RUN = {("bash", "run_tests.sh")}  # its --help would be pytest's, after running nothing useful: it is the test command


def documented_commands() -> set[tuple[str, str]]:
    """("-m", module), ("file", path) and ("bash", path) for each command of this project the pages name."""
    commands: set[tuple[str, str]] = set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        commands |= {("-m", m) for m in PYTHON_M.findall(text) if m.split(".")[0] in OUR_PACKAGES}
        commands |= {("file", p) for p in PYTHON_FILE.findall(text) if (ROOT / p).is_file()}
        commands |= {("bash", p) for p in BASH_SCRIPT.findall(text) if (ROOT / p).is_file()}
    return commands - NOT_RUN


def argv(kind: str, name: str) -> list[str]:
    if kind == "-m":
        return [sys.executable, "-m", name, "--help"]
    if kind == "file":
        return [sys.executable, str(ROOT / name), "--help"]
    return ["bash", str(ROOT / name), "--help"]


def answers_help(command: tuple[str, str]) -> str | None:
    """None when the command's --help exits 0, else what went wrong."""
    result = subprocess.run(argv(*command), cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=120)
    if result.returncode == 0:
        return None
    return f"{' '.join(command)} --help: exit {result.returncode}: {(result.stderr or result.stdout).strip()[-300:]}"


def test_the_docs_name_the_commands_a_user_runs():
    commands = documented_commands()
    for expected in [
        ("-m", "launcher"),
        ("-m", "pretrain.generate"),
        ("-m", "pretrain.evaluate"),
        ("-m", "pretrain.export"),
        ("-m", "pretrain.plot"),
        ("-m", "pretrain.config_reference"),
        ("file", "prepare_dataset.py"),
        ("file", "benchmarks/train.py"),
        ("bash", "run_training.sh"),
    ]:
        assert expected in commands, f"{expected} is no longer found in the docs: the collection broke"


def test_every_command_the_readme_and_docs_name_answers_help():
    commands = sorted(documented_commands())
    with ThreadPoolExecutor(max_workers=2) as pool:  # two cores; several import torch
        problems = [problem for problem in pool.map(answers_help, commands) if problem]
    assert not problems, "\n".join(problems)
