"""Downloading from the Hugging Face Hub in a child process, so that a stop signal ends it at once.

huggingface_hub's snapshot_download fetches the files in a thread pool (Xet storage in Rust), and
its main thread waits for the pool: Ctrl-C or SIGTERM during a download was acted on only once
every file in progress had been fetched (gigabytes each, for a real dataset). Here a child
process downloads (with its progress bars on the console, as before) and this process only waits
for it in a system call that a signal interrupts, so its handler runs at once; on the way out the
child is killed and reaped, and the partial files it was writing are removed (huggingface_hub
gives each download a name of its own: a partial file is never resumed, only left behind). The
files it finished stay in the Hub cache. Starting, waiting for and ending the child is
child_process.py's, shared with the BPE trainer; what is this one's own is here.

Only a download runs here: hub_client.py finds what is cached already, and asks the Hub which
commit a branch names, in this process (quick requests), so a run whose files are cached starts
no child. Standard library only in this process: the launcher must start fast.
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

EXIT_DATA_ERROR = 2
"""The child's exit code for a download that failed as a DataError (its last stdout line, JSON,
holds the message)."""
_CHILD = child_code("pretrain.data.hub_process")

Log = Callable[[str], None]


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
    from pretrain.data.hub_client import download_here

    try:
        folder = download_here(request["repo"], request["revision"], request["pattern"], request["repo_type"])
    except DataError as error:
        print(json.dumps({"error": str(error)}), flush=True)
        sys.exit(EXIT_DATA_ERROR)
    print(json.dumps({"folder": str(folder)}), flush=True)
