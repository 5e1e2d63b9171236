"""Every console command of pyproject.toml names itself as the user invoked it: `pretrain-generate
--help` says `usage: pretrain-generate`, `python -m pretrain.generate --help` says `usage: python -m
pretrain.generate`, and so do their usage errors. The entry points run in this process with
sys.argv[0] as pip's wrapper script sets it (the installed script's path) or as `python -m` sets it
(the module's file)."""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import pytest

from support.processes import ROOT
from pretrain.run.command_name import command_name

# The module `python -m` runs for each console command (the launcher's entry point is
# launcher/__main__.py's start).
MODULES = {
    "pretrain-launch": "launcher",
    "pretrain-prepare": "pretrain.data.prepare_cli",
    "pretrain-generate": "pretrain.generate",
    "pretrain-export": "pretrain.export",
    "pretrain-plot": "pretrain.plot",
    "pretrain-evaluate": "pretrain.evaluate",
}


def console_commands() -> dict[str, str]:
    """pyproject.toml's [project.scripts]: command -> "module:function"."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def run_entry_point(command: str, argv0: str, args: list[str], monkeypatch, capsys) -> tuple[str, str]:
    """(stdout, stderr) of command's entry point run with sys.argv = [argv0, *args]."""
    module, function = console_commands()[command].split(":")
    monkeypatch.setattr(sys, "argv", [argv0, *args])
    with pytest.raises(SystemExit):  # --help and usage errors exit
        getattr(importlib.import_module(module), function)()
    captured = capsys.readouterr()
    return captured.out, captured.err


def module_file(module: str) -> str:
    """sys.argv[0] under `python -m module`: the module's file (a package's __main__.py)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin)
    return str(path.parent / "__main__.py" if path.name == "__init__.py" else path)


def test_every_console_command_has_its_python_m_spelling_here():
    assert sorted(console_commands()) == sorted(MODULES)


@pytest.mark.parametrize("command", sorted(MODULES))
def test_a_console_command_names_itself_in_its_help_and_its_usage_errors(command, tmp_path, monkeypatch, capsys):
    installed = str(tmp_path / "venv" / "bin" / command)  # pip's wrapper: its own path, .exe and -script.py removed
    out, _ = run_entry_point(command, installed, ["--help"], monkeypatch, capsys)
    assert out.startswith(f"usage: {command} "), out[:200]
    _, err = run_entry_point(command, installed, ["--no-such-option"], monkeypatch, capsys)
    assert err and "python -m" not in err, err


@pytest.mark.parametrize("command", sorted(MODULES))
def test_the_same_module_run_with_python_m_names_python_m_in_its_help(command, monkeypatch, capsys):
    out, _ = run_entry_point(command, module_file(MODULES[command]), ["--help"], monkeypatch, capsys)
    assert out.startswith(f"usage: python -m {MODULES[command]} "), out[:200]


def test_a_command_renamed_or_run_by_another_script_is_named_as_its_module(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/pretrain-generate-old"])
    assert command_name("pretrain.generate", "pretrain-generate") == "python -m pretrain.generate"
    monkeypatch.setattr(sys, "argv", [""])  # python -c, an embedded interpreter
    assert command_name("pretrain.generate", "pretrain-generate") == "python -m pretrain.generate"
