"""Multi-node: a node's account of its own silence. A launcher that was itself stopped (SIGSTOP
or Ctrl-Z, suspended, starved: launcher/nodes/pulse.py) past --node-timeout stopped answering first,
and the others were right to find it lost: once it runs again it says so, rather than blame
them. One found lost that never paused was late for another reason (its heartbeats were held up
on the way): it says that instead.

launcher/nodes/rendezvous.py's Node asks this before it names another node lost, and when it is named
lost: the stories here are about the node that tells them (NodeStop's here), never sent as such.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from launcher.nodes.node import NodeStop
from launcher.nodes.pulse import Pulse

__all__ = ["ENDED_MEANWHILE", "OTHERS_STOPPED", "OwnSilence"]

# What the others did while this node was stopped: the end of its story.
OTHERS_STOPPED = "the other nodes found it lost and stopped the job"  # node 0's
NODE0_STOPPED = "node 0 found it lost and stopped the job"  # another node's, told node 0's word
ENDED_MEANWHILE = "node 0 found it lost and ended the job meanwhile (its rendezvous has closed)"  # another's, node 0 gone


class OwnSilence:
    """This node's pauses (its pulse, once watched) and the stories it tells of them."""

    def __init__(self, node: int, host: str, is_master: bool, loss_after: float, last_contact: Callable[[], float]) -> None:
        """last_contact: when this node last heard from node 0's store (the watch keeps it)."""
        self.node = node
        self.host = host
        self.is_master = is_master
        self.loss_after = loss_after
        self._last_contact = last_contact
        self.pulse: Pulse | None = None
        """Once watched: this process's own pauses (the turns of node 0's watch, the others' alarm)."""

    def watch(self, long_pause: float) -> Pulse:
        """From now on, count pauses of long_pause or more (the join before it may have lasted minutes)."""
        self.pulse = Pulse(long_pause)
        return self.pulse

    @property
    def resumed_at(self) -> float:
        """When this process ran again after its latest long pause (0.0 if none, or not watched)."""
        return self.pulse.resumed_at if self.pulse is not None else 0.0

    def frozen(self, then: str, since: float | None = None) -> NodeStop | None:
        """This node's story when it was itself stopped (a pause that ended after since; by
        default just now), long enough for the others to find it lost (its beats, or node 0's
        store, stalled past loss_after); then says what the others did meanwhile. None when it
        was not, or is not watched yet."""
        if self.pulse is None:
            return None
        recent = since if since is not None else min(self._last_contact(), time.monotonic() - 2 * self.loss_after)
        paused = self.pulse.paused_since(recent)
        if paused < self.pulse.long_pause:
            return None
        return self._here(
            f"stopped answering for {paused:.1f} s (frozen, suspended or starved; --node-timeout {self.loss_after:g} s): {then}"
        )

    def found_lost(self, how: str) -> NodeStop:
        """The others found this node lost (how: node 0's word, or for node 0 a node that ended
        with EXIT_NODE_LOST), as this node tells it: it was frozen, or its heartbeats were late.
        Node 0 counts any pause since its watch began (the others' word may come long after)."""
        if self.is_master:
            return self.frozen(OTHERS_STOPPED, since=0.0) or self._late("the other nodes", how)
        return self.frozen(NODE0_STOPPED) or self._late("node 0", how)

    def _late(self, finder: str, how: str) -> NodeStop:
        """Found lost by finder (how) although this node never stopped: its heartbeats were late."""
        return self._here(
            f"was found lost by {finder} ({how}): its heartbeats did not reach {finder} in time "
            "(a network stall? raise --node-timeout)"
        )

    def _here(self, detail: str) -> NodeStop:
        return NodeStop(self.node, self.host, "lost", detail, here=True)
