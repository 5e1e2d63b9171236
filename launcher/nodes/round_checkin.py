"""The check-in of a restart's round of the rendezvous (launcher/nodes/restart_rounds.py): node 0
opens round r (the bare key ROUND_KEY), every node of the last round says it is back
(round<r>/back/<node>), and node 0 names the round's nodes (round<r>/roster), or why the job stops:
a node that did not come back within --join-timeout, with fewer than --min-nnodes left. A launcher
started again while the job runs finds the open round by ROUND_KEY (open_round)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

from launcher.nodes.key_value import StoreClient
from launcher.nodes.node import NodeSpec
from launcher.nodes.rendezvous import POLL_INTERVAL, RendezvousError, connect, in_namespace
from launcher.nodes.store import first_line

ROUND_KEY = "round"
"""A bare key of node 0's store: the round whose check-in is open (absent: the first round)."""


def gather_round(
    hosted: StoreClient,
    spec: NodeSpec,
    roster: list[int],
    number: int,
    join_timeout: float,
    min_nnodes: int | None,
    say: Callable[[str], None],
) -> list[int] | None:
    """Node 0: open the round, wait for the last round's nodes (roster) up to --join-timeout, and
    name the round's nodes (or why the job stops: None)."""
    store = in_namespace(hosted, f"round{number}")
    store.set(f"back/{spec.node_rank}", socket.gethostname())
    hosted.set(ROUND_KEY, str(number))
    deadline, said = time.monotonic() + join_timeout, False
    while True:
        back = [n for n in range(spec.nnodes) if store.check([f"back/{n}"])]
        missing = [n for n in roster if n not in back]
        if not missing or time.monotonic() >= deadline:
            break
        if not said:
            say(f"waiting up to {join_timeout:g} s (--join-timeout) for node(s) {', '.join(map(str, missing))} to come back")
            said = True
        time.sleep(POLL_INTERVAL)
    least = min_nnodes or spec.nnodes
    if len(back) < least:
        gone = ", ".join(str(n) for n in range(spec.nnodes) if n not in back)
        why = f"node(s) {gone} did not come back within {join_timeout:g} s (--join-timeout)"
        why += f"; fewer than --min-nnodes {least} are left" if min_nnodes else "; the job stops"
        store.set("roster", json.dumps({"stop": why}))
        say(f"no restart: {why}")
        return None
    store.set("roster", json.dumps({"nodes": back}))
    if len(back) < spec.nnodes:
        say(f"going on with {len(back)} of {spec.nnodes} node(s) (--min-nnodes {least})")
    return back


def check_in(
    spec: NodeSpec, number: int, join_timeout: float, node_timeout: float, say: Callable[[str], None]
) -> list[int] | None:
    """Not node 0: say this node is back for the round, and take node 0's roster (None: the job
    stops, or went on without this node)."""
    patience = 2 * join_timeout + node_timeout  # node 0 may wait for its devices first
    deadline = time.monotonic() + patience
    try:
        raw = connect(spec, deadline, join_timeout, node_timeout)
        store = in_namespace(raw, f"round{number}")
        store.set(f"back/{spec.node_rank}", socket.gethostname())
        while not store.check(["roster"]):
            if time.monotonic() >= deadline:
                raise RendezvousError(f"node 0 did not form round {number} of the rendezvous within {patience:g} s")
            time.sleep(POLL_INTERVAL)
        roster = json.loads(store.get("roster"))
    except RendezvousError:
        raise
    except Exception as error:
        raise RendezvousError(f"node 0, which hosts the rendezvous, is gone ({first_line(error)}): the job stops") from None
    if "stop" in roster:
        say(f"no restart: {roster['stop']}")
        return None
    if spec.node_rank not in roster["nodes"]:
        say(f"no restart: round {number} went on without this node")
        return None
    return roster["nodes"]


def open_round(raw: StoreClient) -> int | None:
    """The round of the rendezvous node 0 has opened and not yet formed (a restart's), else None."""
    if not raw.check([ROUND_KEY]):
        return None
    number = int(raw.get(ROUND_KEY))
    return None if in_namespace(raw, f"round{number}").check(["roster"]) else number
