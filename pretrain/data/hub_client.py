"""The Hugging Face Hub's client, as the data code uses it: snapshots of a repository's files
through the Hub cache, and one-line errors for what goes wrong (gated, missing, offline).

Below both sources.py and hub.py; it knows no config.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from pretrain.data import DataError, first_line


def is_commit(revision: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def hub_snapshot(repo: str, revision: str, pattern: str | list[str], repo_type: str = "dataset") -> Path:
    """Download (or find in the Hub cache) the files of repo matching pattern; their folder."""
    try:
        from huggingface_hub import errors, snapshot_download
    except ImportError:
        raise DataError("the Hugging Face Hub needs the huggingface_hub package: pip install huggingface_hub") from None

    where = f"{repo_type} {repo}@{revision}"
    if is_commit(revision):
        # A commit never changes: when it is in the cache, no request to the Hub is needed.
        try:
            return Path(
                snapshot_download(repo, repo_type=repo_type, revision=revision, allow_patterns=pattern, local_files_only=True)
            )
        except errors.LocalEntryNotFoundError:  # also a snapshot that lacks some of the files
            pass
    try:
        return Path(snapshot_download(repo, repo_type=repo_type, revision=revision, allow_patterns=pattern))
    except errors.LocalEntryNotFoundError:
        raise not_cached_error(repo, pattern, repo_type) from None
    except (errors.HfHubHTTPError, OSError, ValueError) as error:
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


def not_cached_error(repo: str, pattern: str | list[str], repo_type: str) -> DataError:
    """Offline without the files: how to get them, or where else to point."""
    files = " ".join(map(shlex.quote, [pattern] if isinstance(pattern, str) else pattern))
    if repo_type == "model":
        return offline_error(
            f"tokenizer {repo}", f"`hf download {repo} {files}`", "set data.tokenizer_name to a local tokenizer.json"
        )
    return offline_error(
        f"{repo_type} {repo}", f"`hf download {repo} --repo-type {repo_type} --include {files}`", LOCAL_FILES_INSTEAD
    )


LOCAL_FILES_INSTEAD = "train on local files: --set data.source=parquet --set data.path=DIR"


def offline_error(what: str, fetch: str, instead: str, reason: str = "no connection") -> DataError:
    """The one line for what the Hub cache lacks while the Hub cannot be reached: what, the
    command(s) that fetch it where there is network (fetch), and what to do instead."""
    from huggingface_hub import constants

    offline = bool(os.environ.get("HF_HUB_OFFLINE"))
    why, unset = ("HF_HUB_OFFLINE is set", ", or unset HF_HUB_OFFLINE") if offline else (reason, "")
    return DataError(
        f"{what} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub cannot be "
        f"reached (offline: {why}); on a machine with network run {fetch} and copy the cache (HF_HOME) "
        f"here{unset}; or {instead}"
    )
