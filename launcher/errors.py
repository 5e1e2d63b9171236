"""The launcher's own refusals: bad input, printed as one line by the command line (cli.main)."""

from __future__ import annotations

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input: printed as one line, exit 2."""

    exit_code = EXIT_USAGE
