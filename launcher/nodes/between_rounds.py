"""Between two attempts of a job of several nodes (launcher/nodes/restart_rounds.py): from the
moment a node's workers are gone until the next round of the rendezvous has formed, no supervisor
runs to pass a stop signal on. There a stop signal (SIGTERM, SIGHUP, Ctrl-C) to any node stops the
whole job:

- that node raises Halted at once, and says so in node 0's store (the bare key HALT_KEY; the first
  word counts, so with a signal to every node, as Slurm's scancel sends, the record names one);
- every node's watcher (a thread, for as long as the stretch lasts) reads that key every
  POLL_INTERVAL and hands it to its launcher's main thread, wherever it waits (the backoff, the
  devices, the round's check-in and join), as Halted too;
- node 0 records the attempt as not restarted, waits (briefly) until the others have read the
  word, and every node exits with the signal's code (launcher/exit_codes.py by_signal).

The watcher hands the word over by simulating RELAY in the main thread (_thread.interrupt_main):
a signal nothing else in the launcher handles, so a hand-over that lands just after the stretch,
once its handler is gone, does nothing (Python ignores a simulated signal left at SIG_DFL).
"""

from __future__ import annotations

import _thread
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from types import FrameType, TracebackType
from typing import Any

from launcher.exit_codes import STOP_SIGNALS
from launcher.nodes.store import bounded

HALT_KEY = "halted"
"""A bare key of node 0's store: the stop signal that ended the job between two attempts."""
HALT_READ = "halted_read"
"""How many other nodes have read it (node 0 waits for them before its store goes)."""
RELAY = signal.SIGUSR2
POLL_INTERVAL = 0.1


@dataclass(frozen=True)
class Halt:
    """A stop signal to one node between attempts; node: the rank it was launched with (--node-rank)."""

    node: int
    signum: int

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def why(self) -> str:
        """restarts.jsonl's reason."""
        return f"stopped by {self.name} on node {self.node} before the restart"

    def line(self, here: bool) -> str:
        """What a node says as it stops: which node was stopped, and that no restart follows."""
        who = f"this node (node {self.node}) was stopped" if here else f"node {self.node} was stopped"
        also = "every node stops" if here else "so is this node"
        return f"{who} by {self.name} before the restart; {also}: no restart; the run's checkpoints are kept"


class Halted(BaseException):
    """A stop signal between attempts, to this node (here) or passed on from another. A
    BaseException, as SystemExit is, so that no `except Exception` on its way (a store call, the
    join's cleanup) takes it for a failure of the rendezvous."""

    def __init__(self, halt: Halt, here: bool) -> None:
        super().__init__(halt.why())
        self.halt = halt
        self.here = here


class BetweenRounds:
    """The stretch between two attempts on this node:

        with BetweenRounds(connect, node_rank):
            ...  # settle, decide, back off, the next round (Halted from any stop signal of the job)

    connect: a new connection to node 0's store (the watcher's own; None when it cannot be had)."""

    def __init__(self, connect: Callable[[], Any], node: int) -> None:
        self._connect = connect
        self._node = node
        self._lock = threading.Lock()
        self._over = threading.Event()
        self._seen: Halt | None = None
        self._late: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> BetweenRounds:
        self._previous = {sig: signal.signal(sig, self._here) for sig in STOP_SIGNALS}
        self._previous[RELAY] = signal.signal(RELAY, self._relayed)
        threading.Thread(target=self._watch, daemon=True, name="between-rounds").start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        with self._lock:
            self._over.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._late is not None and kind is None:  # came while the stretch was ending: it still stops the job
            raise Halted(Halt(self._node, self._late), here=True)

    def _here(self, signum: int, _frame: FrameType | None) -> None:
        if self._over.is_set():
            self._late = signum
            return
        raise Halted(Halt(self._node, signum), here=True)

    def _relayed(self, _signum: int, _frame: FrameType | None) -> None:
        if self._seen is not None and not self._over.is_set():
            raise Halted(self._seen, here=False)

    def _watch(self) -> None:
        try:
            store = self._connect()
            while not self._over.wait(POLL_INTERVAL):
                if store.check([HALT_KEY]):
                    halt = Halt(**json.loads(store.get(HALT_KEY)))
                    if halt.node == self._node:
                        return  # this node's own word: it has raised already
                    with self._lock:
                        if not self._over.is_set():
                            self._seen = halt
                            _thread.interrupt_main(RELAY)
                    return
        except Exception:
            return  # node 0's store is gone: the main thread's own calls say so


@contextmanager
def held_once_spawned(spawned: list[Any], held: list[int]) -> Iterator[None]:
    """Around an attempt: a stop signal before its workers are spawned (spawned empty) does what it
    did (the launcher's handler); from then on the supervisor takes it, and one that comes after
    the supervisor has given the signals back, before BetweenRounds takes them, goes into held (the
    attempt's end is still to be said; BetweenRounds then stops every node)."""

    def hold(signum: int, frame: FrameType | None) -> None:
        if not spawned:
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            return
        held.append(signum)

    previous: dict[int, Any] = {sig: signal.signal(sig, hold) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def tell(connect: Callable[[], Any], halt: Halt, seconds: float) -> Halt:
    """This node was stopped: say so to every node; the job's first halt (another node's, when
    its word came first). Unsaid when node 0's store is gone (nothing is left to tell)."""
    try:
        store = bounded(connect, seconds, "halt")
        first = bounded(lambda: store.compare_set(HALT_KEY, "", json.dumps(asdict(halt))), seconds, "halt")
        return Halt(**json.loads(first))
    except Exception:
        return halt


def acknowledge(connect: Callable[[], Any], seconds: float) -> None:
    """Not node 0: this node has read the halt and stops (node 0 may let its store go)."""
    try:
        store = bounded(connect, seconds, "halt")
        bounded(lambda: store.add(HALT_READ, 1), seconds, "halt")
    except Exception:
        pass  # node 0 is gone already


def wait_for_readers(store: Any, readers: int, seconds: float) -> None:
    """Node 0: wait (at most seconds) until `readers` other nodes have read the halt, so that none
    finds the store gone instead (and blames node 0)."""
    deadline = time.monotonic() + seconds
    while int(store.add(HALT_READ, 0)) < readers and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL / 2)
