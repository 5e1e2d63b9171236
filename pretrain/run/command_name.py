"""The name a command was invoked by, for its usage line and its errors: the console command that
pip installs (pyproject.toml's [project.scripts]: `pretrain-generate`), or `python -m MODULE` when
run as a module, so that what --help shows is what the user can type again. Torch-free: the
launcher uses it too."""

from __future__ import annotations

import sys
from pathlib import Path


def command_name(module: str, console_command: str) -> str:
    """console_command when the process is pip's wrapper of it (whose sys.argv[0] is the installed
    script, by that name, wherever it lives), else `python -m module`."""
    invoked = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return console_command if invoked == console_command else f"python -m {module}"
