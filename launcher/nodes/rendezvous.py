"""Multi-node: the launchers of one job find each other and form the job through the store
node 0's launcher hosts on --master-port (launcher/nodes/key_value.py).

1. Join. Every launcher writes who it is (join/<node>: host, pid, process count, device, its
   config). Node 0 waits for every node for at most --join-timeout, checks that they agree
   (one process count, one device kind, one config) and writes "joined", or "refused" with the
   reason; the others wait for that word. A node rank taken twice is refused at once.
2. Plan. What every node must share is decided once, by node 0, and written to the store
   (share); the others read it (receive): the run directory, the checkpoint to resume, the port
   of the rank-0 worker, the config as prepared.
3. Watch and finish (launcher/nodes/watch.py): from the join to the end each launcher beats,
   node 0 finds the nodes lost, the first node to stop tells the others, and node 0 ends last.
4. After an attempt (launcher/nodes/restart_rounds.py): what restarts need to know, under after/.

The store is the standard library's sockets: no launcher imports torch, on one machine or several.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, NoReturn

from launcher.nodes.agreement import Member, differences, disagreement, joined_line
from launcher.nodes.key_value import PrefixedStore, StoreClient
from launcher.nodes.node import NodeSpec, NodeStop
from launcher.nodes.store import RendezvousError, bounded, client, first_line, host_store, wait_reachable
from launcher.nodes.watch import BEAT_INTERVAL, LOSS_AFTER, POLL_INTERVAL, NodeInterrupted, NodeStopped, WatchedNode

__all__ = [
    "BEAT_INTERVAL",
    "LOSS_AFTER",
    "POLL_INTERVAL",
    "Member",
    "Node",
    "NodeInterrupted",
    "NodeStopped",
    "RendezvousError",
    "connect",
    "differences",
    "in_namespace",
    "join",
]


def join(
    spec: NodeSpec,
    member: Member,
    timeout: float,
    say: Callable[[str], None],
    loss_after: float = LOSS_AFTER,
    namespace: str = "",
    hosted: Any = None,
) -> Node:
    """Host (node 0) or reach the store, join, and wait until every node has; the Node, watched
    from now on (a node silent for loss_after seconds is lost). RendezvousError when the nodes
    cannot form the job. namespace: a restart's round of the rendezvous ("round1/"), whose keys
    never meet an earlier round's (launcher/nodes/restart_rounds.py); hosted: node 0's store,
    which it keeps hosting from one round to the next."""
    deadline = time.monotonic() + timeout
    if spec.is_master:
        store = hosted if hosted is not None else host_store(spec, timeout)
        say(f"node 0 of {spec.nnodes}: rendezvous on {spec.endpoint}; waiting for {spec.nnodes - 1} more node(s)")
    else:
        store = connect(spec, deadline, timeout, loss_after)
    node = Node(spec, in_namespace(store, namespace), member, loss_after)
    node.hosted = store if spec.is_master else None
    try:
        node._join(deadline, timeout, say)
        watch = bounded(lambda: client(spec, loss_after * 2), loss_after * 3, "connect")
        node._watch_store = in_namespace(watch, namespace)
    except RendezvousError:
        node._withdraw()
        raise
    except Exception as error:  # StoreError, or a call that timed out: node 0's store went away or froze
        node._withdraw()
        raise RendezvousError(
            f"lost the rendezvous on {spec.endpoint} while joining ({first_line(error)}); see node 0's launcher"
        ) from None
    except BaseException:  # Ctrl-C, SIGTERM (SystemExit): this node leaves, and may join again
        node._withdraw()
        raise
    node._start_watching()
    say(joined_line(spec.nnodes, node.world_size, member.nproc))
    return node


def connect(spec: NodeSpec, deadline: float, timeout: float, loss_after: float) -> StoreClient:
    """Not node 0: a connection to node 0's store, once it listens (until the deadline)."""
    wait_reachable(spec, deadline, timeout)
    left = max(1.0, deadline - time.monotonic())
    try:
        return bounded(lambda: client(spec, left), left + loss_after, "connect")
    except TimeoutError:
        raise RendezvousError(f"node 0 at {spec.endpoint} accepts connections but does not answer (frozen?)") from None


def in_namespace(store: StoreClient, namespace: str) -> StoreClient | PrefixedStore:
    """The store as one round of the rendezvous sees it: its keys under namespace (the first round's bare)."""
    return PrefixedStore(namespace, store) if namespace else store


class Node(WatchedNode):
    """This launcher's membership in a job of several nodes: the join and the plan here, the
    watch from the join to the end in WatchedNode (launcher/nodes/watch.py)."""

    def __init__(self, spec: NodeSpec, store: Any, member: Member, loss_after: float = LOSS_AFTER) -> None:
        super().__init__(spec, store, member, loss_after)
        self._claimed = False

    # --- join -----------------------------------------------------------------------------

    def _has(self, key: str) -> bool:
        return bool(self._call(lambda: self._store.check([key]), "check"))

    def _join(self, deadline: float, timeout: float, say: Callable[[str], None]) -> None:
        store, rank = self._store, self.rank
        taken = int(self._call(lambda: store.add(f"claim/{rank}", 1), "join"))
        if taken > 1:
            raise RendezvousError(
                f"node rank {rank} has already joined from another launcher; give each node its own --node-rank"
            )
        self._claimed = True
        self._call(lambda: store.add(f"beat/{rank}", 1), "join")
        self._call(lambda: store.set(f"join/{rank}", json.dumps(asdict(self.member))), "join")
        if not self.spec.is_master:  # said once node 0 can see it: a launcher killed from now on is evicted
            say(f"node {rank} of {self.spec.nnodes}: joined the rendezvous on {self.spec.endpoint}")
        while True:
            self._call(lambda: store.add(f"beat/{rank}", 1), "join")
            if self._call(lambda: store.check(["refused"]), "join"):
                reason = self._call(lambda: store.get("refused"), "join").decode()
                self._call(lambda: store.add("refusal_read", 1), "join")
                raise RendezvousError(f"node 0 refused the job: {reason}")
            if self._call(lambda: store.check(["joined"]), "join"):
                break
            missing = [n for n in range(self.spec.nnodes) if not self._has(f"join/{n}")]
            if self.spec.is_master:
                self._evict_departed([n for n in range(1, self.spec.nnodes) if n not in missing], say)
            if not missing and self.spec.is_master:
                self.members = self._read_members()
                if problem := disagreement(self.members):
                    self._refuse(problem)
                store.set("joined", "1")
                break
            # Node 0 names the nodes that never came; the others wait a little longer for its word.
            if time.monotonic() >= deadline + (0 if self.spec.is_master else self.loss_after):
                if self.spec.is_master:
                    self._refuse(self._never_joined(missing, timeout))
                raise RendezvousError(self._never_joined(missing, timeout))
            time.sleep(POLL_INTERVAL)
        if not self.members:
            self.members = self._call(self._read_members, "join")

    def _evict_departed(self, joined: list[int], say: Callable[[str], None]) -> None:
        """Node 0, while waiting: a node that joined and then fell silent (its launcher was
        killed before the job formed) gives its rank back, so its relaunch can take it."""
        now, store = time.monotonic(), self._store
        for node in joined:
            count = int(store.add(f"beat/{node}", 0))
            seen, since = self._beats.get(node, (-1, now))
            if count != seen:
                self._beats[node] = (count, now)
            elif now - since >= self.loss_after:
                host = json.loads(store.get(f"join/{node}")).get("host", "")
                for key in (f"join/{node}", f"claim/{node}"):
                    store.delete_key(key)
                self._beats.pop(node, None)
                say(f"node {node} ({host}) left before the job formed (silent for {now - since:.1f} s); waiting for it again")

    def _withdraw(self) -> None:
        """This node leaves before the job formed: give its rank back, so it can join again."""
        self.close()
        if not self._claimed or self.spec.is_master:
            return
        try:
            self._call(lambda: [self._store.delete_key(f"{key}/{self.rank}") for key in ("join", "claim")], "leave")
        except Exception:
            pass  # node 0 is gone: nothing to give back

    def _read_members(self) -> list[Member]:
        keys = [f"join/{n}" for n in range(self.spec.nnodes)]
        return [Member(**json.loads(value)) for value in self._store.multi_get(keys)]

    def _refuse(self, problem: str) -> NoReturn:
        """Node 0: say why to every node, wait (briefly) until they have read it, and stop."""
        self._store.set("refused", problem)
        deadline = time.monotonic() + self.loss_after
        while int(self._store.add("refusal_read", 0)) < self.spec.nnodes - 1 and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL)
        raise RendezvousError(problem)

    def _never_joined(self, missing: list[int], timeout: float) -> str:
        nodes = ", ".join(str(n) for n in missing)
        if self.spec.is_master:
            return (
                f"node(s) {nodes} of {self.spec.nnodes} never joined within {timeout:g} s (--join-timeout); "
                f"start their launchers with --node-rank {nodes.split(',')[0]}, --nnodes {self.spec.nnodes} "
                f"and --master-addr/--master-port pointing here ({self.spec.endpoint})"
            )
        return f"node(s) {nodes} of {self.spec.nnodes} never joined within {timeout:g} s (--join-timeout)"

    # --- the plan -------------------------------------------------------------------------

    def share(self, key: str, value: dict[str, Any]) -> None:
        """Node 0: what every node must use (plan/<key>)."""
        bounded(lambda: self._store.set(f"plan/{key}", json.dumps(value)), self.loss_after, "share")

    def receive(self, key: str) -> dict[str, Any]:
        """What node 0 shared under key, once it has; NodeStopped or NodeInterrupted if the job
        stops first (node 0 lost included)."""
        while True:
            self.check_going()
            try:
                if self._call(lambda: self._store.check([f"plan/{key}"]), "receive"):
                    return json.loads(self._call(lambda: self._store.get(f"plan/{key}"), "receive"))
            except Exception as error:
                raise NodeStopped(self._contact_lost(f"its store stopped answering ({first_line(error)})")) from None
            time.sleep(POLL_INTERVAL)

    # --- after the attempt (launcher/nodes/restart_rounds.py) -----------------------------

    def post(self, key: str, value: dict[str, Any]) -> None:
        """Say what restarts need to know (after/<key>): how this node's attempt ended, node 0's decision."""
        self._call(lambda: self._store.set(f"after/{key}", json.dumps(value)), "post")

    def read(self, key: str) -> dict[str, Any] | None:
        """after/<key>, None while nobody has said it."""
        if not self._call(lambda: self._store.check([f"after/{key}"]), "read"):
            return None
        return json.loads(self._call(lambda: self._store.get(f"after/{key}"), "read"))

    def tally(self, key: str, add: int = 1) -> int:
        """Count to after/<key> (add 0 to read the count)."""
        return int(self._call(lambda: self._store.add(f"after/{key}", add), "tally"))

    def first_stop(self) -> NodeStop | None:
        """The word that stopped the job's attempt (the abort key), None when none did."""
        if not self._call(lambda: self._store.check(["abort"]), "abort"):
            return None
        return NodeStop.from_json(self._call(lambda: self._store.get("abort"), "abort"))
