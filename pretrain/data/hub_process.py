"""Snapshots of a Hugging Face Hub repository's files (hub_snapshot): found in the Hub cache, else
downloaded in a child process, so that a stop signal ends the download at once.

huggingface_hub's snapshot_download fetches the files in a thread pool (Xet storage in Rust), and
its main thread waits for the pool: Ctrl-C or SIGTERM during a download was acted on only once
every file in progress had been fetched (gigabytes each, for a real dataset). Here a child
process downloads (with its progress bars on the console, as before) and this process only waits
for it in a system call that a signal interrupts, so its handler runs at once; on the way out the
child is killed and reaped, and the partial files it was writing are removed (huggingface_hub
gives each download a name of its own: a partial file is never resumed, only left behind). The
files it finished stay in the Hub cache. Starting, waiting for and ending the child is
child_process.py's, shared with the BPE trainer; what is this one's own is here.

Only a download runs in the child: what is cached already is found, and the Hub asked which
commit a branch names, in this process (quick requests), so a run whose files are cached starts
no child. What runs against huggingface_hub itself, in either process, and the one-line errors
are hub_client.py's, below this module. Standard library only in this process: the launcher
must start fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from pretrain.data import DataError
from pretrain.data.child_process import (
    STOP_SIGNALS,
    Child,
    child_args,
    child_code,
    ended_on_the_way_out,
    how_it_failed,
    reap,
    start_child,
)
from pretrain.data.hub_client import access_error, download_here, is_commit

EXIT_DATA_ERROR = 2
"""The child's exit code for a download that failed as a DataError (its last stdout line, JSON,
holds the message)."""
_CHILD = child_code("pretrain.data.hub_process")

Log = Callable[[str], None]


def hub_snapshot(repo: str, revision: str, pattern: str | list[str], repo_type: str = "dataset", log: Log | None = None) -> Path:
    """The folder of repo's files matching pattern: found in the Hub cache, else downloaded into it
    in a child process that a stop signal ends at once (download_in_child), said first in one line
    (log; stderr when None). Where the Hub can be reached, a branch or tag is the commit it names
    now; where not, the one the cache last saw."""
    try:
        from huggingface_hub import constants, errors, snapshot_download
    except ImportError:
        raise DataError("the Hugging Face Hub needs the huggingface_hub package: pip install huggingface_hub") from None

    if constants.HF_HUB_OFFLINE:  # nothing can be downloaded: the cache answers, in this process
        return download_here(repo, revision, pattern, repo_type)
    commit = revision if is_commit(revision) else _commit_now(repo, revision, repo_type)
    if commit is None:  # the Hub cannot be reached now: what the cache holds of the revision, if any
        return download_here(repo, revision, pattern, repo_type)
    try:  # a commit never changes: when it is in the cache, no download is needed
        return Path(snapshot_download(repo, repo_type=repo_type, revision=commit, allow_patterns=pattern, local_files_only=True))
    except errors.LocalEntryNotFoundError:  # also a snapshot that lacks some of the files
        pass
    say = log or _to_stderr
    patterns = [pattern] if isinstance(pattern, str) else pattern
    what = patterns[0] if len(patterns) == 1 else f"{len(patterns)} files"
    say(f"dataset: downloading {what} of {repo_type} {repo}@{commit[:12]} into the Hugging Face cache ({constants.HF_HUB_CACHE})")
    # The revision as given: huggingface_hub records the commit a branch names (refs/), for offline runs.
    return download_in_child(repo, revision, pattern, repo_type, say)


def _commit_now(repo: str, revision: str, repo_type: str) -> str | None:
    """The commit a branch or tag names on the Hub now; None when the Hub cannot be reached.
    DataError for a repository or revision that is gated, missing or private."""
    from huggingface_hub import HfApi

    try:
        return HfApi().repo_info(repo, repo_type=repo_type, revision=revision).sha
    except Exception as error:  # offline, no network, the Hub down: the cache may hold it
        if found := access_error(error, f"{repo_type} {repo}@{revision}"):
            raise found from None
        return None


def download_in_child(repo: str, revision: str, pattern: str | list[str], repo_type: str, log: Log) -> Path:
    """The snapshot folder of repo at revision, after downloading the files matching pattern into
    the Hub cache in a child process. DataError as hub_client says it; a stop signal meanwhile is
    told in one line (log) and goes on as the exception it raised here."""
    request = json.dumps({"repo": repo, "revision": revision, "pattern": pattern, "repo_type": repo_type})
    child = start_child(_CHILD, [request], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        with ended_on_the_way_out(child, _end):
            assert child.stdout is not None
            said = child.stdout.read().decode("utf-8", errors="replace").strip().splitlines()
            returncode = child.wait()
    except BaseException as error:
        from pretrain.run.exit_codes import stop_signal

        if (signum := stop_signal(error)) is not None:
            log(
                f"dataset: download interrupted by {signum.name}; the files it finished stay in the Hugging Face "
                "cache for the next run, the partial ones are removed"
            )
        raise
    result = json.loads(said[-1]) if said and said[-1].startswith("{") else {}
    if returncode == 0 and "folder" in result:
        return Path(result["folder"])
    if returncode == EXIT_DATA_ERROR and "error" in result:
        raise DataError(result["error"])
    raise DataError(f"{repo_type} {repo}@{revision}: the download {how_it_failed(returncode)}; its error, if any, is above")


def _end(child: Child) -> None:
    """Kill the child at once, reap it, and remove the files it was writing: huggingface_hub
    downloads each into a name of its own (`blobs/<etag>.<random>.incomplete`), which it removes
    when a download fails but which a killed process leaves behind, never to be used again. The
    child is stopped first (SIGSTOP) so that it opens nothing between the look and the kill."""
    partial: list[str] = []
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGSTOP)
        partial = _open_partial_files(child.pid)
        child.kill()
    reap(child)
    for path in partial:
        with contextlib.suppress(OSError):
            os.unlink(path)
    with contextlib.suppress(OSError, ValueError):
        if sys.stderr.isatty():  # the child's progress bar ends without a newline
            print(file=sys.stderr, flush=True)


def _open_partial_files(pid: int) -> list[str]:
    """The `.incomplete` files process pid holds open (Linux's /proc; none found elsewhere)."""
    found = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if (target := os.readlink(f"/proc/{pid}/fd/{fd}")).endswith(".incomplete"):
                    found.append(target)
    return found


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- the child --------------------------------------------------------------------------------


def child_main() -> None:
    """The child: argv the request (JSON: repo, revision, pattern, repo_type), then the parent's pid;
    prints {"folder": ...} or {"error": ...} (a DataError) as its last stdout line."""
    # The parent decides what a stop signal means, and ends this process (_end): a Ctrl-C or a
    # hang-up that reaches the whole process group must not kill it first, which would leave its
    # partial files in the Hub cache.
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    request = json.loads(child_args()[0])
    try:
        folder = download_here(request["repo"], request["revision"], request["pattern"], request["repo_type"])
    except DataError as error:
        print(json.dumps({"error": str(error)}), flush=True)
        sys.exit(EXIT_DATA_ERROR)
    print(json.dumps({"folder": str(folder)}), flush=True)
