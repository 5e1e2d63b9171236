"""Files of a run: the run directory and atomic writes. Standard library only."""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def project_path(path: str | Path) -> Path:
    """A path from the config: absolute as given, relative ones under the project root."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else PROJECT_ROOT / path


def os_error_message(error: OSError) -> str:
    """One line for a failed file operation: '/path: Permission denied'."""
    reason = error.strerror or str(error)
    return f"{error.filename}: {reason}" if error.filename else reason


def atomic_write_text(path: Path, text: str) -> None:
    """Write text to path so readers see the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def new_run_id() -> str:
    """Sortable and unique: 20261121-071502-3fa2."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def create_run_dir(run_dir: str | Path | None) -> Path:
    """Create the run directory (default runs/<run-id>/ under the project) and its logs/.

    Raises OSError with the path when it cannot be created or written."""
    path = Path(run_dir).expanduser().resolve() if run_dir else PROJECT_ROOT / "runs" / new_run_id()
    (path / "logs").mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK):
        raise PermissionError(f"{path}: run directory is not writable")
    return path
