"""Exit codes in one module per side and refusals under one base (issue 30, item 3): the table in
docs/failures.md ("Exit codes") names exactly the codes launcher/exit_codes.py and
pretrain/run/exit_codes.py define, with their values; 128 + a signal is written only there; every
one-line refusal an entry point prints derives from pretrain.run.refusal.Refusal and keeps its code."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

from support.processes import ROOT
from launcher import cli
from launcher import exit_codes as launcher_codes
from launcher.gpus.claims import ClaimError
from launcher.gpus.request import DeviceError
from launcher.errors import UsageError
from launcher.nodes.node import NodeSpecError
from launcher.gpus.nvml import NvmlFailure
from launcher.rundir.lock import RunDirLost
from launcher.gpus.scripted_nvml import BadScript
from launcher.nodes.store import RendezvousError
from launcher.processes.worker import StartError
from pretrain.run import exit_codes as worker_codes
from pretrain.checkpoint.files import CheckpointError
from pretrain.config import ConfigError
from pretrain.data import DataError
from pretrain.evaluation.hellaswag import HellaSwagError
from pretrain.observe.plot import PlotError
from pretrain.run.refusal import Refusal
from pretrain.checkpoint.resume import ResumeError

EXIT_CODE_MODULES = {Path("launcher/exit_codes.py"), Path("pretrain/run/exit_codes.py")}


def documented_codes() -> dict[str, str]:
    """name -> code of every row of the exit-code table in docs/failures.md."""
    text = (ROOT / "docs" / "failures.md").read_text()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([^|]+?) \| `(\w+)` \|", section, flags=re.MULTILINE)
    assert rows, "no exit-code table in docs/failures.md"
    return {name: code for code, name in rows if code != "code"}


def defined_codes() -> dict[str, int]:
    """name -> value of every exit code the two modules define."""
    return {
        name: value
        for module in (launcher_codes, worker_codes)
        for name, value in vars(module).items()
        if name.isupper() and isinstance(value, int)
    }


def test_exit_code_table_matches_the_two_modules_both_ways() -> None:
    documented = documented_codes()
    assert documented.pop("by_signal") == "128 + n"
    assert {name: int(code) for name, code in documented.items()} == defined_codes()


def test_signal_exit_codes_are_summed_only_in_the_exit_code_modules() -> None:
    written = {
        path.relative_to(ROOT)
        for package in ("launcher", "pretrain")
        for path in (ROOT / package).rglob("*.py")
        if re.search(r"128 *\+", path.read_text())
    }
    assert written == EXIT_CODE_MODULES
    assert worker_codes.by_signal(signal.SIGTERM) == 143 and launcher_codes.EXIT_BROKEN_PIPE == 141


@pytest.mark.parametrize(
    "refusal, code",
    [
        (UsageError, 2),
        (RunDirLost, 74),
        (DeviceError, 2),
        (BadScript, 2),
        (ClaimError, 2),
        (NvmlFailure, 2),
        (NodeSpecError, 2),
        (RendezvousError, 2),
        (ConfigError, 2),
        (DataError, 2),
        (ResumeError, 2),
        (CheckpointError, 2),
        (HellaSwagError, 2),
        (PlotError, 2),
    ],
)
def test_one_line_refusals_share_one_base_with_their_exit_code(refusal: type[Refusal], code: int) -> None:
    assert issubclass(refusal, Refusal) and refusal.exit_code == code


def test_a_start_error_is_a_refusal_with_the_shells_exit_code() -> None:
    error = StartError("no-such-command-here", FileNotFoundError(2, "No such file or directory"))
    assert isinstance(error, Refusal) and isinstance(error, OSError)
    assert error.exit_code == launcher_codes.EXIT_COMMAND_NOT_FOUND


@pytest.mark.parametrize("refusal", [DataError("no such dataset: x"), RunDirLost("run directory gone: x")])
def test_launcher_prints_any_refusal_as_one_line_with_its_exit_code(
    refusal: Refusal, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(argv: object) -> int:
        raise refusal

    monkeypatch.setattr(cli, "run", refuse)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # else main ends this process with os._exit
    with pytest.raises(SystemExit) as exited:
        cli.main([])
    assert exited.value.code == refusal.exit_code
    assert capsys.readouterr().err == f"launcher: error: {refusal}\n"
