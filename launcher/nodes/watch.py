"""Multi-node: the watch of a job of several nodes once it has formed (launcher/nodes/rendezvous.py
forms it: the join, the agreement, the plan), through node 0's store (launcher/nodes/key_value.py).

1. Watch. From the join to the end each launcher adds to beat/<node> every BEAT_INTERVAL and
   looks at the abort key every POLL_INTERVAL. The first node to stop writes the abort key
   (compare-and-set: only the first write counts); every other launcher sees it within
   POLL_INTERVAL and stops its workers. Node 0 reads every node's beat: a node whose count has
   not moved for LOSS_AFTER seconds is lost, and node 0 writes that into the abort key. The
   others notice node 0's loss themselves: its store closes their connection (its launcher was
   killed) or stops answering for LOSS_AFTER seconds (frozen, or its machine gone). A node
   that was itself stopped (SIGSTOP, suspended, starved) past LOSS_AFTER says so once it runs
   again (launcher/nodes/own_silence.py): the others found it lost, and its silence is not theirs. Node 0
   learns it from a node that ended with EXIT_NODE_LOST (only a node that lost node 0 does,
   while node 0 names no node lost) or fell silent during node 0's own pause, or from its own
   worker failing just after it; it stops every node still running (the abort key names node 0
   lost) and exits EXIT_NODE_LOST too.
2. Finish. Each launcher writes done/<node>. Node 0, which hosts the store, waits for every
   other node's done (or its loss) before it exits, so no node loses the store it still needs.

Torch-free: the store comes in already made (launcher/nodes/rendezvous.py connects).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from launcher.exit_codes import EXIT_NODE_LOST
from launcher.nodes.agreement import Member
from launcher.nodes.node import NodeInterrupt, NodeSpec, NodeStop
from launcher.nodes.own_silence import ENDED_MEANWHILE, OTHERS_STOPPED, OwnSilence
from launcher.nodes.store import bounded, first_line

__all__ = ["BEAT_INTERVAL", "LOSS_AFTER", "POLL_INTERVAL", "NodeInterrupted", "NodeStopped", "WatchedNode"]

POLL_INTERVAL = 0.1  # how often each launcher looks for the abort key
BEAT_INTERVAL = 0.5
LOSS_AFTER = 3.0  # a node silent this long is lost (--node-timeout)
T = TypeVar("T")


class NodeStopped(Exception):
    """Another node stopped the job while this one was getting ready."""

    def __init__(self, stop: NodeStop) -> None:
        super().__init__(stop.describe())
        self.stop = stop


class NodeInterrupted(Exception):
    """Another node was asked to stop (Ctrl-C, SIGTERM) before this one started its workers."""

    def __init__(self, interrupt: NodeInterrupt) -> None:
        name = signal.Signals(interrupt.signum).name
        super().__init__(f"node {interrupt.node} was asked to stop ({name}) before the workers started; so is this node")
        self.interrupt = interrupt


class WatchedNode:
    """This launcher's membership in a job of several nodes, watched: its beats, the others'
    losses, the words that stop the job, its end (launcher/nodes/rendezvous.py's Node adds the join)."""

    def __init__(self, spec: NodeSpec, store: Any, member: Member, loss_after: float = LOSS_AFTER) -> None:
        self.spec = spec
        self.loss_after = loss_after
        self.member = member
        self.members: list[Member] = []
        self._store = store
        self._watch_store: Any = None
        self.hosted: Any = None
        """Node 0: the store it hosts (kept for a restart's next round)."""
        self._lock = threading.Lock()
        self._stop: NodeStop | None = None
        self._emit: Callable[[NodeStop | NodeInterrupt], None] | None = None
        self._interrupt_seen = False
        self._interrupt: NodeInterrupt | None = None
        self._stopping = threading.Event()
        self._last_contact = time.monotonic()
        self._own = OwnSilence(self.rank, member.host, spec.is_master, loss_after, lambda: self._last_contact)
        self._beats: dict[int, tuple[int, float]] = {}
        """Node 0: each node's beat count and when it last moved."""
        self._left: set[int] = set()
        """Node 0: nodes that fell silent while node 0 was stopped (they found it lost): not waited for."""
        self.others_done: dict[int, int] = {}
        """Node 0, once finished: the exit code each other node reported (those not lost)."""
        self._done_seen: set[int] = set()
        self.lost: dict[int, NodeStop] = {}
        """Node 0: the nodes found lost."""
        self.failed_at: float | None = None
        """When this node's worker failed, if that was the job's first word to stop."""

    # --- facts ----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.spec.node_rank

    @property
    def nproc(self) -> int:
        return self.member.nproc

    @property
    def world_size(self) -> int:
        return self.nproc * self.spec.nnodes

    @property
    def smallest_gpu_memory(self) -> int | None:
        sizes = [m.gpu_memory for m in self.members if m.gpu_memory is not None]
        return min(sizes) if sizes else None

    def host_of(self, node: int) -> str:
        return next((m.host for m in self.members if m.node == node), "")

    def _call(self, call: Callable[[], T], what: str) -> T:
        """A call on the store, bounded: node 0's store may freeze, and an unbounded call would
        wait for ever (Ctrl-C included: the signal waits for the call to return)."""
        return bounded(call, self.loss_after, what)

    # --- stopping -------------------------------------------------------------------------

    @property
    def stopped(self) -> NodeStop | None:
        """Why the job stops, once another node has said so (or has been lost)."""
        return self._stop

    def check_going(self) -> None:
        """NodeStopped or NodeInterrupted when another node has stopped the job, or asked it to stop."""
        if (stop := self.stopped) is not None:
            raise NodeStopped(stop)
        if (interrupt := self._interrupt) is not None:
            raise NodeInterrupted(interrupt)

    def publish_stop(self, stop: NodeStop) -> NodeStop | None:
        """Tell every node to stop because of this node; None when this is the first word, else
        the earlier stop (this node's failure then followed another's)."""
        with self._lock:
            if self._stop is not None:
                return self._stop
        if self._stopped_as_lost():  # its failure followed this node's pause: the others have stopped
            return self._stop
        try:
            first = bounded(lambda: self._store.compare_set("abort", "", stop.to_json()), self.loss_after, "abort")
        except Exception:  # node 0 is gone; the watch says so, unless this node was the one stopped
            if (frozen := self._own.frozen(ENDED_MEANWHILE)) is not None:
                self._deliver(frozen)
            return self._stop
        earlier = NodeStop.from_json(first)
        if earlier.node == self.rank and earlier.kind != "lost":
            return None
        self._deliver(earlier)
        return self._stop

    def report_failure(self, label: str, rank: int, exit_code: int, how: str) -> NodeStop | None:
        """This node's worker failed (the supervisor's first failure): publish_stop."""
        earlier = self.publish_stop(NodeStop(self.rank, self.member.host, "failed", how, label, rank, exit_code))
        if earlier is None:
            self.failed_at = time.monotonic()
        return earlier

    def report_interrupt(self, signum: int) -> None:
        """This node was asked to stop gracefully: so are the others (the first word counts)."""
        record = json.dumps({"node": self.rank, "signum": signum})
        try:
            bounded(lambda: self._store.compare_set("interrupt", "", record), self.loss_after, "interrupt")
        except Exception:
            pass  # node 0 is gone; the watch says so

    def interrupted(self) -> NodeInterrupt | None:
        try:
            if not bounded(lambda: self._store.check(["interrupt"]), self.loss_after, "interrupted"):
                return None
            record = json.loads(bounded(lambda: self._store.get("interrupt"), self.loss_after, "interrupted"))
            return NodeInterrupt(int(record["node"]), int(record["signum"]))
        except Exception:
            return None

    def on_stop(self, emit: Callable[[NodeStop | NodeInterrupt], None]) -> None:
        """Call emit (from the watch thread) when another node stops the job; at once if it has."""
        with self._lock:
            self._emit = emit
            stop, interrupt = self._stop, self._interrupt
        if stop is not None:
            emit(stop)
        elif interrupt is not None:
            emit(interrupt)

    def _pass_on(self, interrupt: NodeInterrupt) -> None:
        with self._lock:
            self._interrupt = interrupt
            emit = self._emit
        if emit is not None:
            emit(interrupt)

    def _deliver(self, stop: NodeStop) -> None:
        if stop.node == self.rank and not stop.here:
            if stop.kind != "lost":
                return
            stop = self._own.found_lost(stop.detail)
        with self._lock:
            if self._stop is not None:
                return
            self._stop = stop
            emit = self._emit
        if emit is not None:
            emit(stop)

    # --- the watch ------------------------------------------------------------------------

    def _start_watching(self) -> None:
        self._last_contact = time.monotonic()  # the join may have lasted minutes
        self._own.watch(long_pause=max(self.loss_after - BEAT_INTERVAL, self.loss_after / 2))
        threading.Thread(target=self._watch, daemon=True, name="node-watch").start()
        if not self.spec.is_master:
            threading.Thread(target=self._alarm, daemon=True, name="node-alarm").start()

    def _watch(self) -> None:
        """Beat, and look for the abort key; node 0 also reads the others' beats. Node 0's turns
        here are its pulse (its store is in this process: the calls do not wait on the network)."""
        store, next_beat, pulse = self._watch_store, 0.0, self._own.pulse
        now = time.monotonic()
        self._beats = {n: (1, now) for n in range(self.spec.nnodes)}
        while not self._stopping.is_set():
            if self.spec.is_master and pulse is not None:
                pulse.beat()
            try:
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + BEAT_INTERVAL
                    store.add(f"beat/{self.rank}", 1)
                if self.spec.is_master:
                    self._check_beats(store, now)
                if store.check(["abort"]):
                    self._deliver(NodeStop.from_json(store.get("abort")))
                if not self._interrupt_seen and store.check(["interrupt"]):
                    self._interrupt_seen = True
                    record = json.loads(store.get("interrupt"))
                    if int(record["node"]) != self.rank:
                        self._pass_on(NodeInterrupt(int(record["node"]), int(record["signum"])))
                self._last_contact = time.monotonic()
            except Exception as error:  # node 0's store closed the connection: it is gone
                if self._stopping.is_set():
                    return
                if self._stopped_as_lost():  # a call that timed out while this process was stopped
                    return
                self._deliver(self._contact_lost(f"its launcher closed the rendezvous connection ({first_line(error)})"))
                return
            self._stopping.wait(POLL_INTERVAL)

    def _check_beats(self, store: Any, now: float) -> None:
        """Node 0: a node whose beat has not moved for loss_after seconds while this node ran, and
        has not finished, is lost; one that finished with an error code while this node runs has
        stopped the job. One that ended with EXIT_NODE_LOST (no other word said) found this node
        lost, as did one that fell silent while this node was stopped: this node stopped answering."""
        others = [n for n in range(1, self.spec.nnodes) if n not in self.lost and n not in self._left]
        if not others:
            return
        counts = store.multi_get([f"beat/{n}" for n in others])
        for node, raw in zip(others, counts, strict=True):
            count = int(raw)
            seen, since = self._beats.get(node, (count, now))
            if count != seen or node not in self._beats:
                self._beats[node] = (count, now)
            elif node not in self._done_seen and store.check([f"done/{node}"]):
                self._done_seen.add(node)
                code = int(store.get(f"done/{node}"))
                if store.check(["abort"]):  # its own word, or the one it followed, says more
                    self._deliver(NodeStop.from_json(store.get("abort")))
                elif code == EXIT_NODE_LOST and not store.check(["interrupt"]):  # an interrupted join ends 76 too
                    self._stop_as_lost(self._own.found_lost(f"node {node} ended with exit code {code} while this node ran"))
                elif code != 0 and not self._interrupt_seen:  # a graceful stop ends every node with by_signal(n)
                    detail = f"its launcher ended with exit code {code} while this node ran"
                    self._deliver(NodeStop(node, self.host_of(node), "error", detail))
            elif now - max(since, self._own.resumed_at) >= self.loss_after and node not in self._done_seen:
                if (frozen := self._own.frozen(OTHERS_STOPPED, since)) is not None:  # silent since this node's pause
                    self._left.add(node)
                    self._stop_as_lost(frozen)
                    continue
                lost = NodeStop(node, self.host_of(node), "lost", f"its launcher stopped answering {now - since:.1f} s ago")
                self.lost[node] = lost
                store.set(f"lost/{node}", lost.to_json())
                first = store.compare_set("abort", "", lost.to_json())
                self._deliver(NodeStop.from_json(first))

    def _alarm(self) -> None:
        """Not node 0: its store stopped answering (frozen, or its machine gone) while this node
        ran. The alarm's turns are this process's pulse: a pause of its own is not node 0's silence."""
        pulse = self._own.pulse
        assert pulse is not None
        while not self._stopping.wait(POLL_INTERVAL * 2):
            pulse.beat()
            silent = time.monotonic() - max(self._last_contact, pulse.resumed_at)
            if silent >= self.loss_after:
                self._deliver(NodeStop(0, self.host_of(0), "lost", f"its launcher stopped answering for {silent:.1f} s"))
                return

    # --- this node's own silence (launcher/nodes/own_silence.py) -------------------------------

    def _contact_lost(self, how: str) -> NodeStop:
        """Not node 0: its store closed or failed (how). Node 0 is lost, unless this node was
        the one stopped: then node 0 found it lost and ended the job meanwhile."""
        return self._own.frozen(ENDED_MEANWHILE) or NodeStop(0, self.host_of(0), "lost", how)

    def _stopped_as_lost(self) -> bool:
        """Node 0, just stopped itself past loss_after: the others found it lost and stopped the
        job, so it stops every node still running too (_stop_as_lost); True then."""
        if not self.spec.is_master or (frozen := self._own.frozen(OTHERS_STOPPED)) is None:
            return False
        self._stop_as_lost(frozen)
        return True

    def _stop_as_lost(self, here: NodeStop) -> None:
        """Node 0, found lost by the others: every node still running stops (the abort key names
        node 0 lost; the first word counts), and this node tells its own story (here)."""
        record = NodeStop(self.rank, self.member.host, "lost", f"its launcher {here.detail}")
        try:
            self._call(lambda: self._store.compare_set("abort", "", record.to_json()), "abort")
        except Exception:
            pass  # its own store: it answers unless this process ends
        self._deliver(here)

    # --- the end --------------------------------------------------------------------------

    def finish(self, exit_code: int, wait: float) -> None:
        """Say this node is done, and learn which nodes were lost (self.lost). Node 0 waits (at
        most wait seconds) until every other node is done or lost, then writes the verdict: the
        lost nodes, which every node names (a node lost outranks the failures that followed it).
        Node 0 ends last: the store it hosts ends with it."""
        try:
            self._call(lambda: self._store.set(f"done/{self.rank}", str(exit_code)), "done")
        except Exception:
            pass  # node 0 is gone already
        if self.spec.is_master:
            self._gather(wait)
        elif exit_code != 0:
            self._read_verdict()
        self.close()

    def _gather(self, wait: float) -> None:
        deadline = time.monotonic() + wait
        others = range(1, self.spec.nnodes)
        while time.monotonic() < deadline:
            if all(n in self.lost or n in self._left or self._store.check([f"done/{n}"]) for n in others):
                break
            time.sleep(POLL_INTERVAL)
        self._store.set("verdict", json.dumps([stop.to_json() for stop in self.lost.values()]))
        done = [n for n in others if n not in self.lost and self._store.check([f"done/{n}"])]
        self.others_done = {n: int(self._store.get(f"done/{n}")) for n in done}
        readers = len([n for n in done if self.others_done[n] != 0])  # they wait for the verdict
        deadline = time.monotonic() + 1.0
        while int(self._store.add("verdict_read", 0)) < readers and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL / 2)

    def _read_verdict(self) -> None:
        """Not node 0: wait for node 0's verdict (it comes once every node is done or lost)."""
        deadline = time.monotonic() + self.loss_after + 2.0
        try:
            while not self._call(lambda: self._store.check(["verdict"]), "verdict"):
                if time.monotonic() >= deadline:
                    return
                time.sleep(POLL_INTERVAL)
            records = json.loads(self._call(lambda: self._store.get("verdict"), "verdict"))
            self._call(lambda: self._store.add("verdict_read", 1), "verdict")
        except Exception:
            return  # node 0 is gone: this node has said so already
        for record in records:
            stop = NodeStop.from_json(record)
            self.lost.setdefault(stop.node, self._own.found_lost(stop.detail) if stop.node == self.rank else stop)

    def close(self) -> None:
        self._stopping.set()
