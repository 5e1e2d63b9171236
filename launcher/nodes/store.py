"""Node 0's store (launcher/nodes/key_value.py), as the launchers reach it: hosted by node 0,
reached by the others (waiting for node 0 to listen), and every call bounded in time, since a store
whose host is frozen never answers. Errors are one line (RendezvousError)."""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from launcher.nodes.key_value import StoreClient, StoreError, StoreServer
from launcher.nodes.node import NodeSpec
from pretrain.run.refusal import Refusal

CONNECT_RETRY = 0.5
T = TypeVar("T")


class RendezvousError(Refusal):
    """The nodes could not form one job: one line saying why and what to do."""


def bounded(call: Callable[[], T], seconds: float, what: str) -> T:
    """call(), or TimeoutError after seconds: a store whose host is frozen never answers, and
    its client would wait for ever."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as error:  # handed to the caller's thread
            failure.append(error)

    thread = threading.Thread(target=run, daemon=True, name=f"store-{what}")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{what}: no answer within {seconds:g} s")
    if failure:
        raise failure[0]
    return result[0]


def host_store(spec: NodeSpec, timeout: float) -> StoreClient:
    """Node 0: listen on --master-port, and its own connection to the store."""
    try:
        server = StoreServer(spec.master_port)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise RendezvousError(
                f"--master-port {spec.master_port} is in use on this machine (node 0); choose a free port for every node"
            ) from None
        raise RendezvousError(f"cannot host the rendezvous on port {spec.master_port}: {error.strerror or error}") from None
    try:
        return StoreClient(spec.master_addr, server.port, timeout)
    except StoreError as error:
        server.close()
        raise RendezvousError(f"cannot host the rendezvous on port {spec.master_port}: {error}") from None


def wait_reachable(spec: NodeSpec, deadline: float, timeout: float) -> None:
    """Wait, until the deadline, for node 0 to listen: it may start after this node. One line
    instead of the store's own retries when it never does."""
    reason = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((spec.master_addr, spec.master_port), timeout=max(0.1, min(2.0, left))):
                return
        except (socket.gaierror, UnicodeError):  # UnicodeError: a name IDNA refuses (a..b, a label too long)
            raise RendezvousError(f"--master-addr {spec.master_addr}: unknown host; give node 0's name or address") from None
        except ConnectionRefusedError:
            reason = "connection refused"
        except OSError as error:
            reason = error.strerror or str(error) or "no answer"
        if time.monotonic() + CONNECT_RETRY >= deadline:
            raise RendezvousError(
                f"cannot reach node 0 at {spec.endpoint} within {timeout:g} s (--join-timeout): {reason}; "
                "start node 0's launcher, and check --master-addr and --master-port on every node"
            )
        time.sleep(CONNECT_RETRY)


def client(spec: NodeSpec, timeout: float) -> StoreClient:
    try:
        return StoreClient(spec.master_addr, spec.master_port, timeout)
    except StoreError as error:
        raise RendezvousError(f"cannot join the rendezvous on {spec.endpoint}: {error}") from None


def first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]
