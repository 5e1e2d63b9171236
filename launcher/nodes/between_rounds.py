"""Between two attempts of a job of several nodes (launcher/nodes/restart_rounds.py): from the
moment a node's workers are gone until the next round of the rendezvous has formed, no supervisor
runs to pass a stop signal on. There a stop signal (SIGTERM, SIGHUP, Ctrl-C) to any node stops the
whole job:

- that node raises Halted at once, and says so in node 0's store (the key round<r>/halted of the
  round r the stretch comes before, so that no later round meets it; the first word counts, so
  with a signal to every node, as Slurm's scancel sends, the record names one);
- every node's watcher (a thread, for as long as the stretch lasts) reads that key every
  POLL_INTERVAL and hands it to its launcher's main thread, wherever it waits (the backoff, the
  devices, the round's check-in and join), as Halted too;
- node 0 records the attempt as not restarted, waits (briefly) until the round's other nodes have
  read the word (round<r>/halted_read/<node>), and every node exits with the signal's code
  (launcher/exit_codes.py by_signal).

A relaunched node waiting to rejoin (launcher/nodes/restart_rounds.py _rejoin) learns the round
from node 0's BETWEEN_KEY (`stretch`): while the job runs an attempt there is none, and a stop
signal to that node stops it alone.

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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import FrameType, TracebackType
from typing import Any

from launcher.exit_codes import STOP_SIGNALS
from launcher.nodes.store import bounded
from pretrain.run.raising_signals import DroppedStops

BETWEEN_KEY = "between"
"""A bare key of node 0's store: the round the job is between attempts for, from node 0's end of
the attempt before it until that round forms (its roster named)."""
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

    def alone(self) -> str:
        """What a relaunched node says when stopped while the job runs an attempt."""
        return f"this node (node {self.node}) was stopped by {self.name} before it rejoined the job; the job goes on without it"


def halt_key(number: int) -> str:
    """The key of round `number`'s halt (a PrefixedStore joins with a slash)."""
    return f"round{number}/halted"


def read_key(number: int, node: int) -> str:
    return f"round{number}/halted_read/{node}"


def stretch(store: Any) -> int | None:
    """The round the job is between attempts for (BETWEEN_KEY), None while the job runs an attempt."""
    if not store.check([BETWEEN_KEY]):
        return None
    number = int(store.get(BETWEEN_KEY))
    return None if store.check([f"round{number}/roster"]) else number


def stretch_of(connect: Callable[[], Any], seconds: float) -> int | None:
    """stretch, from a node not in the job (None when node 0's store is gone)."""
    try:
        return stretch(bounded(connect, seconds, "halt"))
    except Exception:
        return None


class Halted(BaseException):
    """A stop signal between attempts, to this node (here) or passed on from another; number: the
    round its key was read from (None: said here, not yet written). A BaseException, as SystemExit
    is, so that no `except Exception` on its way (a store call, the join's cleanup) takes it for a
    failure of the rendezvous."""

    def __init__(self, halt: Halt, here: bool, number: int | None = None) -> None:
        super().__init__(halt.why())
        self.halt = halt
        self.here = here
        self.number = number


class BetweenRounds:
    """The stretch between two attempts on this node:

        with BetweenRounds(connect, node_rank, number):
            ...  # settle, decide, back off, the next round (Halted from any stop signal of the job)

    connect: a new connection to node 0's store (the watcher's own; None when it cannot be had);
    number: the round the stretch comes before (None: a relaunched node's wait, `stretch`)."""

    def __init__(self, connect: Callable[[], Any], node: int, number: int | None) -> None:
        self._connect = connect
        self._node = node
        self._number = number
        self._lock = threading.Lock()
        self._over = threading.Event()
        self._seen: tuple[Halt, int] | None = None
        self._late: int | None = None
        self._previous: dict[int, Any] = {}
        self._dropped = DroppedStops()
        """A halt raised where a finalizer drops it is sent again (pretrain/run/raising_signals.py)."""
        self.gives_back: dict[int, Any] = {}
        """The stop signals' handlers to give back at its end, when not those it replaced (HeldOnceSpawned.hand_over)."""

    def __enter__(self) -> BetweenRounds:
        self._dropped.install()
        self._previous = {sig: signal.signal(sig, self._dropped.raising(self._here)) for sig in STOP_SIGNALS}
        self._previous.update(self.gives_back)
        self._previous[RELAY] = signal.signal(RELAY, self._dropped.raising(self._relayed))
        threading.Thread(target=self._watch, daemon=True, name="between-rounds").start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        with self._lock:
            self._over.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._dropped.uninstall()
        if self._late is not None and kind is None:  # came while the stretch was ending: it still stops the job
            raise Halted(Halt(self._node, self._late), here=True)

    def _here(self, signum: int, _frame: FrameType | None) -> None:
        if self._over.is_set():
            self._late = signum
            return
        raise Halted(Halt(self._node, signum), here=True)

    def _relayed(self, _signum: int, _frame: FrameType | None) -> None:
        if self._seen is not None and not self._over.is_set():
            halt, number = self._seen
            # This node's own name: its supervisor took the signal, and node 0 passed it on (the round's interrupt).
            raise Halted(halt, here=halt.node == self._node, number=number)

    def _watch(self) -> None:
        try:
            store, number = self._connect(), self._number
            while not self._over.wait(POLL_INTERVAL):
                if self._number is None:  # a round once found stays watched: a halt there stops the job
                    number = stretch(store) or number
                if number is not None and store.check([halt_key(number)]):
                    halt = Halt(**json.loads(store.get(halt_key(number))))
                    with self._lock:
                        if not self._over.is_set():
                            self._seen = (halt, number)
                            _thread.interrupt_main(RELAY)
                    return
        except Exception:
            return  # node 0's store is gone: the main thread's own calls say so


class HeldOnceSpawned:
    """Around an attempt: a stop signal before its workers are spawned (spawned empty) does what it
    did (the launcher's handler); from then on the supervisor takes it, and one that comes after
    the supervisor has given the signals back goes into held until BetweenRounds takes the signals
    straight from this (hand_over: no moment in between where nothing would tell the others)."""

    def __init__(self, spawned: list[Any], held: list[int]) -> None:
        self._spawned = spawned
        self._held = held
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> HeldOnceSpawned:
        self._previous = {sig: signal.signal(sig, self._hold) for sig in STOP_SIGNALS}
        return self

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        if not self._spawned:
            handler = self._previous[signum]
            if callable(handler):
                handler(signum, frame)
            return
        self._held.append(signum)

    def hand_over(self, between: BetweenRounds) -> BetweenRounds:
        """between, to enter next: it replaces this one's handlers and gives back those before it."""
        between.gives_back, self._previous = self._previous, {}
        return between

    def __exit__(self, *_: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def tell(connect: Callable[[], Any], halt: Halt, number: int, seconds: float) -> Halt:
    """Say the halt to every node of round `number`'s stretch; the job's first halt (another
    node's, when its word came first). Unsaid when node 0's store is gone (nothing is left to tell)."""
    try:
        store = bounded(connect, seconds, "halt")
        first = bounded(lambda: store.compare_set(halt_key(number), "", json.dumps(asdict(halt))), seconds, "halt")
        return Halt(**json.loads(first))
    except Exception:
        return halt


def acknowledge(connect: Callable[[], Any], number: int, node: int, seconds: float) -> None:
    """Not node 0: this node (its launch rank) has read the halt and stops (node 0 may let its store go)."""
    try:
        store = bounded(connect, seconds, "halt")
        bounded(lambda: store.set(read_key(number, node), "1"), seconds, "halt")
    except Exception:
        pass  # node 0 is gone already


def wait_for_readers(store: Any, number: int, readers: list[int], seconds: float) -> None:
    """Node 0: wait (at most seconds) until the other nodes of the round (readers, launch ranks) have
    read the halt, so that none finds the store gone instead (and blames node 0). A node not among
    them (relaunched, not in the round) is not counted."""
    keys = [read_key(number, n) for n in readers]
    deadline = time.monotonic() + seconds
    while keys and not store.check(keys) and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL / 2)
