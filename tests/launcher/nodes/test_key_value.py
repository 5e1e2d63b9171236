"""The launchers' store (launcher/nodes/key_value.py): every call answers as torch's TCPStore (and
PrefixStore) does, which it replaced; a get waits for its key; a closed host, a port that is not a
launcher's store and a launcher of another protocol each give one line."""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from launcher.nodes import key_value
from launcher.nodes.key_value import PROTOCOL, PrefixedStore, StoreClient, StoreError, StoreServer


@pytest.fixture
def server() -> Iterator[StoreServer]:
    hosted = StoreServer(0)
    yield hosted
    hosted.close()


def connect(server: StoreServer, timeout: float = 10.0) -> StoreClient:
    return StoreClient("127.0.0.1", server.port, timeout)


def calls(store: Any) -> list[Any]:
    """Every call the launchers make, in an order that meets each case of compare_set and add."""
    return [
        store.set("a", "1"),
        store.get("a"),
        store.add("count", 2),
        store.add("count", 3),
        store.add("count", 0),
        store.get("count"),
        store.check(["a", "count"]),
        store.check(["a", "missing"]),
        store.compare_set("first", "", "x"),  # absent, expected empty: set
        store.compare_set("first", "", "y"),  # present: what it holds
        store.compare_set("first", "x", "z"),  # present and expected: set
        store.compare_set("absent", "expected", "w"),  # absent, expected given: the expected value back
        store.check(["absent"]),
        store.multi_get(["a", "first"]),
        store.delete_key("a"),
        store.delete_key("a"),
        store.check(["a"]),
        store.set("json", json.dumps({"host": "gpu01", "nodes": [0, 1]})),
        json.loads(store.get("json")),
    ]


def test_every_call_answers_as_torchs_tcpstore_and_prefixstore_do(server):
    dist = pytest.importorskip("torch.distributed")
    theirs = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    ours = connect(server)

    assert calls(ours) == calls(theirs)
    assert calls(PrefixedStore("round1", ours)) == calls(dist.PrefixStore("round1", theirs))
    # The prefix joins with a slash, as torch's does: the keys between_rounds.py reads bare.
    assert ours.get("round1/first") == theirs.get("round1/first") == b"z"


def test_a_get_waits_for_a_key_another_connection_sets(server):
    reader, writer = connect(server), connect(server)
    got: list[bytes] = []
    getting = threading.Thread(target=lambda: got.append(reader.get("plan/config")))
    getting.start()
    writer.set("plan/config", "{}")
    getting.join(timeout=30)
    assert got == [b"{}"]


def test_a_get_of_a_key_that_never_comes_fails_after_the_stores_timeout_naming_the_key(server):
    store = connect(server, timeout=0.2)
    with pytest.raises(StoreError, match=r"^wait timeout after 200ms, keys: never$"):
        store.get("never")
    assert store.check(["never"]) is False  # the connection still answers


def test_calls_on_a_store_whose_host_closed_fail_in_one_line_then_and_after(server):
    store = connect(server)
    store.set("a", "1")
    server.close()
    with pytest.raises(StoreError) as first:
        for _ in range(100):  # the first call after the close may still be answered by its thread
            store.set("a", "2")
    with pytest.raises(StoreError) as later:
        store.check(["a"])
    assert "\n" not in str(first.value) and str(later.value) == str(first.value)


def listening(answer: Callable[[socket.socket], None]) -> tuple[int, threading.Thread]:
    """A port that is not a launcher's store: it accepts one connection and does `answer` to it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            connection, _ = listener.accept()
            with connection:
                connection.recv(1024)
                answer(connection)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda c: c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n"), id="another protocol"),
        pytest.param(lambda c: None, id="closed at once"),
        pytest.param(lambda c: c.sendall(b'{"ok": ["something else", 1]}\n'), id="another JSON service"),
        pytest.param(lambda c: c.sendall(b'{"ok": ["pretrain-launcher-store"]}\n'), id="a hello without its protocol"),
    ],
)
def test_a_port_that_is_not_a_launchers_store_is_refused_in_one_line(answer):
    port, thread = listening(answer)
    with pytest.raises(StoreError) as refused:
        StoreClient("127.0.0.1", port, 10.0)
    assert re.fullmatch(
        rf"127\.0\.0\.1:{port} is not a launcher's store \(.+\); check --master-port, and run the same version on every node",
        str(refused.value),
    )
    thread.join(timeout=10)


def test_a_launcher_of_another_version_is_refused_naming_both_protocols():
    port, thread = listening(lambda c: c.sendall(json.dumps({"ok": ["pretrain-launcher-store", PROTOCOL + 1]}).encode() + b"\n"))
    with pytest.raises(StoreError) as refused:
        StoreClient("127.0.0.1", port, 10.0)
    assert str(refused.value) == (
        f"node 0's launcher speaks store protocol {PROTOCOL + 1}, this one {PROTOCOL}: run the same version on every node"
    )
    thread.join(timeout=10)


def test_a_port_nobody_listens_on_is_retried_until_the_timeout_then_named():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    with pytest.raises(StoreError, match=rf"^127\.0\.0\.1:{port} refused the connection for 0\.5 s$"):
        StoreClient("127.0.0.1", port, 0.5)


def test_a_request_that_is_not_json_is_answered_with_an_error_and_the_connection_goes_on(server):
    with socket.create_connection(("127.0.0.1", server.port)) as raw, raw.makefile("rwb") as stream:
        stream.write(b"{not json\n")
        stream.flush()
        assert "error" in json.loads(stream.readline())
        stream.write(b'{"op": "check", "keys": []}\n')
        stream.flush()
        assert json.loads(stream.readline()) == {"ok": True}


def test_a_client_that_does_not_speak_json_is_disconnected_at_once_instead_of_left_waiting(server):
    # A launcher of a version that used torch's TCPStore sends binary; it should fail now, not at its timeout.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw:
        raw.sendall(b"\x00\x01\x02\x03 binary store query")
        assert raw.recv(1024) == b""


def test_torchs_own_store_on_the_port_is_refused_within_the_hello_wait_not_the_join_timeout(monkeypatch):
    # Node 0 running a launcher of a version that hosted torch's TCPStore: it never answers the hello.
    dist = pytest.importorskip("torch.distributed")
    theirs = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setattr(key_value, "HELLO_WAIT", 0.5)
    with pytest.raises(StoreError, match=r"is not a launcher's store \(no answer within 0\.5 s\)"):
        StoreClient("127.0.0.1", theirs.port, 300.0)
