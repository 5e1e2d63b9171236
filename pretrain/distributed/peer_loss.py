"""A collective that failed because another rank went away: that rank's failure is the cause,
this one's only its consequence.

When one rank fails (a full disk while it saves, say) and exits, every rank waiting for it in a
collective gets an error of its own a moment later: gloo's "Connection closed by peer", a reset
connection, NCCL's remote error. Such a rank says so in one line and exits
exit_codes.PEER_LOST, which tells the launcher to wait for the cause rather than blame this rank.
Its traceback is written to its log only: the launcher names the line marker for that in
LAUNCHER_LOG_ONLY_MARK (docs/design.md, "Log format"), so the console keeps the failing rank's
story. Run without the launcher, the traceback is printed as usual."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

LOG_ONLY_VAR = "LAUNCHER_LOG_ONLY_MARK"
"""Set by the launcher's supervisor: a line that starts with its value goes to the logs only
(launcher/supervise/printer.py holds the same name)."""
PEER_GONE = (
    "Connection closed by peer",  # gloo: the peer closed its end (it exited)
    "Connection reset by peer",  # gloo, the TCP store: the peer's end was reset
    "Broken pipe",  # gloo, the TCP store: a write to a peer that is gone
    "remote process exited or there was a network error",  # NCCL's ncclRemoteError
)
"""What the distributed runtime's error says when the other end went away, as torch 2.13 words it."""
_PACKAGE = Path(__file__).resolve().parents[1]  # pretrain/


class PeerFailed(Exception):
    """This rank's work failed because another rank's had failed first and undone what they
    shared (rank 0 removes an unfinished checkpoint when its own part cannot be written); the
    message, one line, says so. Exits PEER_LOST, as a lost connection does."""


def peer_gone(error: BaseException) -> str | None:
    """The words in error (or an error it came from) that say a peer of this process's group went
    away, as PEER_GONE has them; None when it is anything else. Only errors of the distributed
    runtime count: a torch.distributed error, or a RuntimeError whose text names gloo or NCCL
    (gloo raises plain RuntimeError). A broken pipe on the console is no lost rank."""
    for link in _chain(error):
        text = str(link)
        from_distributed = isinstance(link, dist.DistError) or (
            isinstance(link, RuntimeError) and ("gloo" in text.lower() or "nccl" in text.lower())
        )
        if from_distributed:
            for words in PEER_GONE:
                if words.lower() in text.lower():
                    return words
    return None


def _chain(error: BaseException) -> Iterator[BaseException]:
    """error, then the errors it was raised from or while handling, each once."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def describe(error: BaseException, words: str) -> str:
    """One line: which collective broke, where in this package it was called, and why that is a
    consequence: 'lost the connection to another rank during barrier (pretrain/checkpoint/save_restore.py:196
    in _barrier): Connection closed by peer. A consequence of that rank's failure, ...'"""
    frames = traceback.extract_tb(error.__traceback__)
    collectives = [f.name for f in frames if f.filename.endswith("distributed_c10d.py") and f.name != "wrapper"]
    ours = [(Path(f.filename).resolve(), f) for f in frames if Path(f.filename).resolve().is_relative_to(_PACKAGE)]
    where = ""
    if ours:
        file, frame = ours[-1]
        where = f" ({file.relative_to(_PACKAGE.parent)}:{frame.lineno} in {frame.name})"
    traceback_at = "this worker's log has the traceback" if _log_only_mark() else "the traceback is above"
    return (
        f"lost the connection to another rank during {collectives[0] if collectives else 'a collective'}{where}: "
        f"{words}. A consequence of that rank's failure, which its own lines name; {traceback_at}"
    )


def report(error: BaseException, words: str, log: logging.Logger) -> None:
    """The traceback (to the log only, under the launcher), then the one line that says what happened."""
    mark = _log_only_mark()
    lines = "".join(traceback.format_exception(error)).rstrip("\n").split("\n")  # not splitlines: \x1c-\x1e split there
    sys.stderr.write("".join(f"{mark}{line}\n" for line in lines))
    sys.stderr.flush()
    log.error(describe(error, words))


def _log_only_mark() -> str:
    """The launcher's marker for lines meant for the logs only; '' without a launcher (or with a
    marker that would split a line)."""
    mark = os.environ.get(LOG_ONLY_VAR, "")
    return "" if "\n" in mark or "\r" in mark else mark
