"""The Hugging Face Hub's client in this process, as the data code uses it: snapshot_download
(download_here: what the download's child process runs, and the Hub cache's answer when the Hub
cannot be reached), and the one-line errors for what goes wrong (gated, missing, offline) with
the `hf download` commands they quote.

The lowest of the Hub modules: it imports none of them and knows no config. A snapshot that may
need a download, which a stop signal must end at once, is hub_process.py's (hub_snapshot).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from pretrain.data import DataError, first_line


def is_commit(revision: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def download_here(repo: str, revision: str, pattern: str | list[str], repo_type: str) -> Path:
    """snapshot_download in this process, its errors as one line: what the child of hub_process.py
    runs, and the cache lookup when the Hub cannot be reached."""
    from huggingface_hub import errors, snapshot_download

    try:
        return Path(snapshot_download(repo, repo_type=repo_type, revision=revision, allow_patterns=pattern))
    except errors.LocalEntryNotFoundError:
        raise not_cached_error(repo, pattern, repo_type, revision) from None
    except (errors.HfHubHTTPError, OSError, ValueError) as error:
        where = f"{repo_type} {repo}@{revision}"
        raise access_error(error, where) or DataError(f"{where}: download failed ({first_line(error)})") from None


def access_error(error: Exception, where: str) -> DataError | None:
    """The one-line error for a Hub repository that is gated, missing or private, or a revision
    that does not exist; None for any other error."""
    from huggingface_hub import errors

    if isinstance(error, errors.GatedRepoError):  # before its base class, RepositoryNotFoundError
        return DataError(
            f"{where} is gated: accept its terms on huggingface.co, then log in with `hf auth login` or set HF_TOKEN"
        )
    if isinstance(error, errors.RepositoryNotFoundError):
        return DataError(
            f"{where} was not found, or it is private and you are not authorised: check the id, "
            "then log in with `hf auth login` or set HF_TOKEN"
        )
    if isinstance(error, errors.RevisionNotFoundError):
        return DataError(f"{where}: no such revision; set a branch, tag or commit that exists")
    return None


def not_cached_error(repo: str, pattern: str | list[str], repo_type: str, revision: str = "main") -> DataError:
    """Offline without the files: how to get them, or where else to point."""
    patterns = [pattern] if isinstance(pattern, str) else pattern
    if repo_type == "model":
        fetch = download_command(repo, revision, files=patterns)
        return offline_error(f"tokenizer {repo}", fetch, "set data.tokenizer_name to a local tokenizer.json")
    return offline_error(
        f"{repo_type} {repo}", download_command(repo, revision, repo_type, include=patterns), LOCAL_FILES_INSTEAD
    )


def download_command(
    repo: str, revision: str = "main", repo_type: str = "model", *, files: Sequence[str] = (), include: Sequence[str] = ()
) -> str:
    """The `hf download` command, in backquotes, that fetches files (by name) or what the include
    patterns match of repo at revision (said only when it is not main: a branch, tag or commit
    other than main is another snapshot). Every word is quoted for a shell: a repository, revision
    or pattern comes from the user's config, and the line is meant to be pasted."""
    words = ["hf", "download", repo, *files]
    if repo_type != "model":
        words += ["--repo-type", repo_type]
    if revision != "main":
        words += ["--revision", revision]
    if include:
        words += ["--include", *include]
    return f"`{shlex.join(words)}`"


LOCAL_FILES_INSTEAD = "train on local files: --set data.source=parquet --set data.path=DIR"


TRUE_VALUES = frozenset({"1", "ON", "YES", "TRUE"})
"""What huggingface_hub counts as true in a variable (constants.ENV_VARS_TRUE_VALUES), in any case."""


def offline_variable(environ: Mapping[str, str] = os.environ) -> str | None:
    """The variable that puts huggingface_hub offline, read as huggingface_hub reads it
    (constants.HF_HUB_OFFLINE): HF_HUB_OFFLINE, or TRANSFORMERS_OFFLINE where that is unset or
    empty, true for 1, ON, YES or TRUE in any case and false for anything else (HF_HUB_OFFLINE=0
    is online). None: neither puts it offline."""
    variable = "HF_HUB_OFFLINE" if environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    return variable if environ.get(variable, "").upper() in TRUE_VALUES else None


def offline_error(what: str, fetch: str, instead: str, reason: str = "no connection") -> DataError:
    """The one line for what the Hub cache lacks while the Hub cannot be reached: what, the
    command(s) that fetch it where there is network (fetch), and what to do instead."""
    from huggingface_hub import constants

    variable = offline_variable()
    why, unset = (f"{variable}={os.environ[variable]}", f", or unset {variable}") if variable else (reason, "")
    return DataError(
        f"{what} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub cannot be "
        f"reached (offline: {why}); on a machine with network run {fetch} and copy the cache (HF_HOME) "
        f"here{unset}; or {instead}"
    )
