"""Where a training run's compiled kernels go (the workers' TORCHINDUCTOR_CACHE_DIR), chosen and
checked before any worker starts.

Only a run that compiles names one. torch creates the directory the variable names as soon as any
worker imports torch._dynamo (DDP does; torch/_dynamo/package.py makes its dynamo/ cache there),
compile or not: a cache root on a read-only disk, there only to supply a prepared dataset, failed
every worker of a run that never compiles. Without the variable torch uses its own per-user
directory under the system temp dir.

The directory is per user, `<cache root>/inductor-<user>/` (0700), never shared between users:
inductor's cache holds compiled code that each process loads and runs, so a directory another
user can write into would let them run code as you (and inductor writes its files for its user
alone, so the second user's kernels would fail to save anyway). The ranks of one user share it,
and reuse each other's kernels. A cache root that cannot hold it (read-only, another user's)
costs the persistence, not the run: one warning line, and the kernels go to the per-user
directory under the system temp dir. A TORCHINDUCTOR_CACHE_DIR the user set is theirs: used as
set, and refused in one line when it cannot be written, whether the run compiles or not (the
workers create it either way), before any worker starts.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from launcher.errors import UsageError
from pretrain.config import Config
from pretrain.run.files import CACHE_DIR_VAR, cache_root
from pretrain.run.shared_cache import make_dirs, user_name

VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def kernel_cache_dir(config: Config, device: str, warn: Callable[[str], None]) -> str | None:
    """The compiled-kernel directory the workers of config get, created: the user's own
    TORCHINDUCTOR_CACHE_DIR, else ours when the run compiles, else None (torch's default then).
    UsageError when a user-set directory cannot be written, compile or not: every training worker
    creates it as it imports torch._dynamo, and would fail there with a bare OS error instead."""
    from pretrain.plan.compile_prerequisites import compile_requested

    chosen = os.environ.get(VARIABLE)
    if chosen:
        if problem := _unwritable(Path(chosen).expanduser(), own=False):
            raise UsageError(f"{VARIABLE}={chosen}: {problem}; point it at a writable directory, or unset it")
        return chosen
    if not compile_requested(config, device):
        return None
    me = user_name(os.geteuid())
    preferred = cache_root() / f"inductor-{me}"
    if not (problem := _unwritable(preferred, own=True)):
        return str(preferred)
    fallback = Path(tempfile.gettempdir()) / f"torchinductor_{me}"
    if fallback_problem := _unwritable(fallback, own=True):
        raise UsageError(
            f"compiled kernels can go neither to {preferred} ({problem}) nor to {fallback} ({fallback_problem}); "
            f"use a writable cache: --cache-dir DIR or {CACHE_DIR_VAR}=DIR (or {VARIABLE}=DIR), or training.compile=false"
        )
    warn(
        f"warning: compiled kernels cannot be kept in {preferred} ({problem}); they go to {fallback}, "
        f"which this machine may clear; a writable --cache-dir (or {VARIABLE}) keeps them"
    )
    return str(fallback)


def _unwritable(directory: Path, own: bool) -> str | None:
    """Why directory cannot hold compiled kernels, after creating it (0700, only for its user,
    where own); None when it can."""
    try:
        make_dirs(directory.parent)
        directory.mkdir(mode=0o700 if own else 0o777, exist_ok=True)
        if own and (owner := directory.stat().st_uid) != os.geteuid():
            return f"it belongs to user {user_name(owner)}"
    except FileExistsError as error:  # a file where the path needs a directory ("File exists" would not say so)
        return f"{error.filename} is not a directory"
    except OSError as error:
        return error.strerror or str(error)
    if not os.access(directory, os.W_OK | os.X_OK):
        return "not writable"
    return None
