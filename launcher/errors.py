"""The launcher's own refusals: bad input, printed as one line by the command line (cli.main)."""

from __future__ import annotations

from pretrain.run.refusal import Refusal


class UsageError(Refusal):
    """Bad input: printed as one line, exit 2 (launcher/exit_codes.py EXIT_USAGE)."""
