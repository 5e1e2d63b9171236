"""What the two launcher benchmarks (launcher.py: one node, multinode.py: two) share: a free
port, finding and killing the processes of a run by the marker in their environment, counting
the survivors, and the table that sets this launcher beside torchrun.

Every process a run starts inherits MARKER_VAR from the tool's environment, so the benchmark
finds them all, including those that left the process tree (setsid, double fork), and leaves
nothing behind.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable, Collection

import psutil

from pretrain.run.raising_signals import DroppedStops

MARKER_VAR = "LAUNCHER_BENCH_MARKER"
SURVIVOR_POLL_S = 1.0
"""How long a marked process may take to go after its tool has exited before it counts as a survivor."""
HEADER = ["metric", "this launcher", "torchrun", "ratio (ours/torchrun)", "target", "met?"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def marked_pids(matches: Callable[[str], bool]) -> list[int]:
    """Live (non-zombie) processes whose marker matches."""
    pids = []
    for proc in psutil.process_iter():
        try:
            marker = proc.environ().get(MARKER_VAR)
            if marker is not None and matches(marker) and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
        except psutil.Error:
            pass  # gone, zombie or not ours to read
    return pids


def count_survivors(markers: Collection[str]) -> int:
    """The processes carrying one of these markers still alive after up to SURVIVOR_POLL_S."""
    deadline = time.monotonic() + SURVIVOR_POLL_S
    while (survivors := len(marked_pids(markers.__contains__))) and time.monotonic() < deadline:
        time.sleep(0.05)
    return survivors


def kill_marked(prefix: str) -> None:
    """SIGKILL every process whose marker starts with prefix (a run's markers share its prefix)."""
    for pid in marked_pids(lambda marker: marker.startswith(prefix)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def unwind_on_signals() -> None:
    """Ctrl-C or SIGTERM unwinds through a run's cleanup instead of leaving processes behind, also
    one that lands in a finalizer, where Python drops what it raises (pretrain/run/raising_signals.py)."""
    dropped = DroppedStops().install()  # for the rest of the benchmark's process
    signal.signal(signal.SIGINT, dropped.raising(signal.default_int_handler))
    signal.signal(signal.SIGTERM, dropped.raising(lambda signum, _frame: sys.exit(128 + signum)))


def ratio(ours: list[float], theirs: list[float], timeout: float | None = None) -> str:
    """Medians, ours / torchrun's; where every torchrun run reached timeout, `< x`, a bound."""
    if not ours:
        return "—"
    if not theirs:
        return f"< {statistics.median(ours) / timeout:.3g}" if timeout else "—"
    if statistics.median(theirs) == 0:
        return "—"
    return f"{statistics.median(ours) / statistics.median(theirs):.3g}"


def yes_no(ok: bool) -> str:
    return "yes" if ok else "no"


def print_table(notes: list[str], rows: list[list[str]]) -> None:
    """The machine, each note as a paragraph, then the Markdown table (HEADER's columns) to stdout."""
    print(
        f"Machine: {os.cpu_count()} CPUs, {platform.platform()}; Python {platform.python_version()}; "
        f"torch {importlib.metadata.version('torch')}"
    )
    for note in notes:
        print(note, end="\n\n")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for row in rows:
        print("| " + " | ".join(row) + " |")
