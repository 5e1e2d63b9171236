"""What every section of the config checks with: ConfigError (one line naming the key), the
upper bounds of integer keys, and how a value that is none of the choices is described.
Nothing here imports torch."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from typing import Any

from pretrain.run.refusal import Refusal


class ConfigError(Refusal, ValueError):
    """A configuration problem the user can fix; the message is one line."""


def check(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}")


# Upper bounds of the integer keys, where a larger value means nothing a run could do: checked in
# each section's __post_init__ (check_at_most), which every layer passes through (a file,
# --max-steps, --set), and declared once, in each section's AT_MOST: the reference (config_reference.field_docs)
# appends "At most N." to the key's docstring from there.
MAX_STEPS = 10**12
"""Optimizer steps, and the intervals counted in them: 10^12 steps take 30 years at a millisecond each."""
MAX_SIZE = 1 << 16
"""A model width, batch or count of heads, layers or experts: 65536, past any model trained."""
MAX_LENGTH = 1 << 20
"""Tokens in a sequence, or ids in a vocabulary (1048576)."""
MAX_COUNT = 10**12
"""Documents, files or examples to read: more than any dataset holds."""


def check_at_most(section: Any, prefix: str) -> None:
    """Each integer key of section (a dataclass with AT_MOST) at most its bound: one line naming
    the key, the value, the bound and what to do."""
    for name, bound in section.AT_MOST.items():
        value = getattr(section, name)
        if isinstance(value, int):  # not None, nor a name such as "auto"
            check(value <= bound, f"{prefix}.{name}", f"must be at most {bound} (got {value}); use a value up to {bound}")


def describe(value: Any) -> str:
    """A value as the user wrote it, and its JSON type: '"gpu" (a string)'."""
    kind = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)
    return f"{json.dumps(value)} ({kind})"


def not_one_of(value: Any, choices: Iterable[str | bool]) -> str:
    """Why value is none of the choices (a Literal's, or a registry's names, or true and false
    with a Literal's names), with the closest name when it looks like a typo."""
    names = list(choices)
    strings = [name for name in names if isinstance(name, str)]
    close = difflib.get_close_matches(value, strings, n=1) if isinstance(value, str) else []
    hint = f"; did you mean {json.dumps(close[0])}?" if close else ""
    return f"{describe(value)} is not one of {', '.join(map(json.dumps, names))}{hint}"
