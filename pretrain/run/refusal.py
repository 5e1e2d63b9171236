"""The base of every one-line refusal: bad input that an entry point prints as one line naming
the problem and the fix, with no traceback, and exits with the refusal's exit code (2 unless a
subclass says otherwise). Torch-free, so the launcher's refusals derive from it too, and each
entry point (launcher/cli.py, pretrain/train.py, the tools' main()s) catches this one type."""

from __future__ import annotations

from pretrain.run.exit_codes import BAD_INPUT


class Refusal(Exception):
    """Bad input, refused in one line (the message says what is wrong and how to fix it)."""

    exit_code: int = BAD_INPUT
    """What the entry point exits with after printing the line."""
