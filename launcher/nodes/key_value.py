"""The key-value store the launchers of one job share: node 0's launcher hosts it on --master-port,
and every launcher (node 0's too) reaches it through connections of its own. Standard library only,
so a launcher on several nodes starts without torch (whose import costs a node ~1.5 s of CPU, and
its exit ~0.5 s more). The workers still use torch's own store, which their rank 0 hosts on
MASTER_PORT.

The calls mean what torch.distributed's TCPStore's mean, which this store replaced for the
launchers: set, get (which waits for the key), add (a counter kept as decimal text), check (are
all these keys there), compare_set, multi_get (waits for every key) and delete_key; values come
back as bytes. PrefixedStore is torch's PrefixStore: a round's keys under `<prefix>/`.

On the wire, each request and each answer is one line of JSON (values as text; never pickle), and a
connection opens with a hello that names the protocol, so a port that is not a launcher's, or
a launcher of another version, is refused in one line. A connection's calls are answered in order,
one at a time (a waiting get holds its own connection only)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

PROTOCOL = 1
"""Raised whenever the messages change: launchers of different versions refuse each other."""
HELLO = "pretrain-launcher-store"
MAX_LINE = 16 * 1024 * 1024
"""The longest request or answer, in bytes: a node's plan is a few KiB."""
ANSWER_MARGIN = 5.0
"""Seconds a client waits for an answer beyond the call's own wait (the server times the wait)."""
CONNECT_RETRY = 0.2
HELLO_WAIT = 10.0
"""Seconds the first answer may take: a launcher's store answers at once; torch's own store (a
launcher of an older version, or another program) never does, and would hold the join until its timeout."""


class StoreError(RuntimeError):
    """A call on the store failed: the key never came within the wait, the connection closed, or
    the other end is not a launcher's store. One line."""


class StoreServer:
    """Node 0's store: listens on port (every interface, as torch's did) until closed or this
    process ends, either of which closes every connection. OSError (EADDRINUSE: the port is
    taken) when it cannot listen."""

    def __init__(self, port: int) -> None:
        if socket.has_dualstack_ipv6():
            self._listener = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self._listener = socket.create_server(("", port))
        self.port = self._listener.getsockname()[1]
        self._values: dict[str, str] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._connections: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True, name="store-accept").start()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()  # a waiting get ends now, unanswered
            connections, self._connections = list(self._connections), set()
        for connection in [self._listener, *connections]:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed
                return
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._changed:
                if self._closed:
                    connection.close()
                    return
                self._connections.add(connection)
            threading.Thread(target=self._serve, args=(connection,), daemon=True, name="store-serve").start()

    def _serve(self, connection: socket.socket) -> None:
        try:
            self._answer_each(connection)
        except OSError:  # closed by close(), or by the client
            pass
        finally:
            with self._changed:
                self._connections.discard(connection)
            connection.close()

    def _answer_each(self, connection: socket.socket) -> None:
        with connection.makefile("rwb") as stream:
            if stream.peek(1)[:1] != b"{":
                return  # not a launcher of ours (torch's binary store client, an HTTP probe): closed at once
            while line := stream.readline(MAX_LINE + 1):
                if not line.endswith(b"\n"):
                    return  # too long, or cut off: the client is gone or is not ours
                try:
                    answer = self._answer(json.loads(line))
                except (ValueError, KeyError, TypeError) as error:
                    answer = {"error": f"bad request ({error})"}
                stream.write(json.dumps(answer).encode() + b"\n")
                stream.flush()

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "hello":
            return {"ok": [HELLO, PROTOCOL]}
        with self._changed:
            if op == "set":
                self._values[request["key"]] = request["value"]
                self._changed.notify_all()
                return {"ok": None}
            if op == "add":
                total = int(self._values.get(request["key"], "0")) + int(request["amount"])
                self._values[request["key"]] = str(total)
                self._changed.notify_all()
                return {"ok": total}
            if op == "check":
                return {"ok": all(key in self._values for key in request["keys"])}
            if op == "compare_set":
                return {"ok": self._compare_set(request["key"], request["expected"], request["desired"])}
            if op == "delete":
                found = self._values.pop(request["key"], None) is not None
                return {"ok": found}
            if op == "get":
                keys = request["keys"]
                here = self._changed.wait_for(
                    lambda: self._closed or all(key in self._values for key in keys), float(request["wait"])
                )
                if self._closed:
                    return {"error": "the store closed"}
                if not here:
                    missing = [key for key in keys if key not in self._values]
                    return {"error": f"wait timeout after {float(request['wait']) * 1000:.0f}ms, keys: {', '.join(missing)}"}
                return {"ok": [self._values[key] for key in keys]}
        return {"error": f"unknown request {op!r}"}

    def _compare_set(self, key: str, expected: str, desired: str) -> str:
        """torch's compare_set: desired when the key holds expected (or is absent and expected is
        empty: the first to say wins); what it holds otherwise (absent: expected)."""
        current = self._values.get(key)
        if current is None:
            if expected:
                return expected
        elif current != expected:
            return current
        self._values[key] = desired
        self._changed.notify_all()
        return desired


class StoreClient:
    """A connection to a launcher's store. timeout: how long get and multi_get wait for their
    keys, and connecting waits for the port to accept (torch's store timeout). Calls from several
    threads take turns."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._broken = ""
        self._socket = _connect(host, port, timeout)
        self._socket.settimeout(min(timeout, HELLO_WAIT))
        self._stream = self._socket.makefile("rwb")
        not_ours = f"{host}:{port} is not a launcher's store ({{}}); check --master-port, and run the same version on every node"
        try:
            answer = self._call({"op": "hello", "protocol": PROTOCOL})
        except StoreError as error:
            self.close()
            raise StoreError(not_ours.format(error)) from None
        if not isinstance(answer, list) or len(answer) != 2 or answer[0] != HELLO:
            self.close()
            raise StoreError(not_ours.format("it answered something else"))
        self._socket.settimeout(timeout + ANSWER_MARGIN)
        if answer[1] != PROTOCOL:
            self.close()
            raise StoreError(
                f"node 0's launcher speaks store protocol {answer[1]}, this one {PROTOCOL}: run the same version on every node"
            )

    def _break(self, why: str) -> StoreError:
        """This connection is done: an answer may still be on its way, and would be taken for the
        next call's. Every later call fails with why."""
        self._broken = why
        self.close()
        return StoreError(why)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.close()
        with contextlib.suppress(OSError):
            self._socket.close()

    def set(self, key: str, value: str | bytes) -> None:
        self._call({"op": "set", "key": key, "value": _text(value)})

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: Iterable[str]) -> list[bytes]:
        values = self._call({"op": "get", "keys": list(keys), "wait": self.timeout})
        return [value.encode() for value in values]

    def add(self, key: str, amount: int) -> int:
        return int(self._call({"op": "add", "key": key, "amount": int(amount)}))

    def check(self, keys: Iterable[str]) -> bool:
        return bool(self._call({"op": "check", "keys": list(keys)}))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return str(self._call({"op": "compare_set", "key": key, "expected": _text(expected), "desired": _text(desired)})).encode()

    def delete_key(self, key: str) -> bool:
        return bool(self._call({"op": "delete", "key": key}))

    def _call(self, request: dict[str, Any]) -> Any:
        with self._lock:
            if self._broken:
                raise StoreError(self._broken)
            try:
                self._stream.write(json.dumps(request).encode() + b"\n")
                self._stream.flush()
                line = self._stream.readline(MAX_LINE + 1)
                if not line.endswith(b"\n"):
                    raise self._break("the other end closed the connection")
                answer = json.loads(line)
            except TimeoutError:
                raise self._break(f"no answer within {self._socket.gettimeout():g} s") from None
            except ValueError:  # not JSON, or a stream closed by close()
                raise self._break("an answer that is not the store's, or a closed connection") from None
            except OSError as error:
                raise self._break(f"the connection failed: {error.strerror or error}") from None
        if not isinstance(answer, dict):
            raise StoreError("an answer that is not the store's")
        if "error" in answer:
            raise StoreError(str(answer["error"]))
        return answer.get("ok")


class PrefixedStore:
    """The keys of store under `<prefix>/` (torch's PrefixStore: one round's keys never meet another's)."""

    def __init__(self, prefix: str, store: StoreClient) -> None:
        self.prefix = prefix
        self.store = store

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self.store.get(self._key(key))

    def multi_get(self, keys: Iterable[str]) -> list[bytes]:
        return self.store.multi_get([self._key(key) for key in keys])

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._key(key), amount)

    def check(self, keys: Iterable[str]) -> bool:
        return self.store.check([self._key(key) for key in keys])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.store.compare_set(self._key(key), expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(self._key(key))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    """A connection to host:port, retried while it is refused (node 0 may not listen yet) for
    up to timeout seconds. StoreError with the last reason when it never accepts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            connection = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except ConnectionRefusedError:
            if time.monotonic() + CONNECT_RETRY >= deadline:
                raise StoreError(f"{host}:{port} refused the connection for {timeout:g} s") from None
            time.sleep(CONNECT_RETRY)
            continue
        except OSError as error:
            raise StoreError(f"cannot connect to {host}:{port}: {error.strerror or error}") from None
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return connection
