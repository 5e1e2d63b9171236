"""`python -m launcher`, and the installed `pretrain-launch` (pyproject.toml): the command line
(launcher/cli.py), its imports included, with running out of memory anywhere in the launcher's own
code said in one line, exit 2 (launcher/address_space.py). The launcher's top: no module imports this one."""

from __future__ import annotations

import os
import sys

from launcher.address_space import is_out_of_memory, refusal
from launcher.exit_codes import EXIT_NO_ADDRESS_SPACE


def start() -> None:
    """The command line, its imports inside the guard: a MemoryError while importing is ours too."""
    try:
        from launcher import cli

        cli.main()
    except BaseException as error:  # SystemExit and the rest pass on; only running out of memory is ours
        if isinstance(error, SystemExit | KeyboardInterrupt) or not is_out_of_memory(error):
            raise
        print(f"launcher: error: {refusal()}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_NO_ADDRESS_SPACE)


if __name__ == "__main__":
    start()
