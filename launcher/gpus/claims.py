"""Claims: a launcher holds one claim per GPU it runs on, for the life of the run, so two
launches on one machine never get the same GPU, even when they choose at the same moment.

A claim is a listening Unix socket bound to an abstract name, `@gpu-launcher/<GPU UUID>`
(Linux). Binding is atomic: of two launchers, exactly one gets the name. The kernel frees
the name when the holder exits, however it exits (SIGKILL included), so a crashed launcher
leaves nothing stale; and unlike a lock file in /tmp, no other user can delete, replace
or rewrite a held claim. Who holds a claim comes from the kernel too (SO_PEERCRED: pid and
uid), never from text another user could have written. (Any local process can bind a free
name and so keep launchers off that GPU, as it could by simply using the GPU.)

Abstract names live in the network namespace: launchers in containers that share the host's
network (`--network host`) share claims; containers with networks of their own do not.
LAUNCHER_CLAIMS_NAMESPACE changes the prefix (the tests use it to keep to themselves).
"""

from __future__ import annotations

import errno
import os
import pwd
import socket
import struct
import threading
import time
from dataclasses import dataclass

import psutil

from pretrain.run.refusal import Refusal

NAMESPACE_VAR = "LAUNCHER_CLAIMS_NAMESPACE"
DEFAULT_NAMESPACE = "gpu-launcher"
MAX_NAME_BYTES = 107  # sun_path is 108 bytes, the first of them the abstract marker \0
LOOK_TIMEOUT = 1.0  # seconds a look at a claim waits for the holder's socket


class ClaimError(Refusal, OSError):
    """A claim cannot be made or looked at (one line)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a claim, as the kernel reports it; None where it cannot say."""

    pid: int | None = None
    user: str | None = None
    since: str | None = None

    def describe(self) -> str:
        if self.pid is None:
            return "claimed by another launcher" + (f" ({self.user})" if self.user else "")
        return f"claimed by launcher pid {self.pid} ({self.user or '?'}) since {self.since or '?'}"


class Claim:
    """One held GPU claim; release() (or the process's exit) gives it back."""

    def __init__(self, uuid: str, sock: socket.socket) -> None:
        self.uuid = uuid
        self._socket: socket.socket | None = sock
        # Looks at the claim connect to it; answer them by closing, so none waits.
        self._answerer = threading.Thread(target=self._answer_looks, daemon=True, name=f"claim-{uuid}")
        self._answerer.start()

    def _answer_looks(self) -> None:
        sock = self._socket
        while sock is not None:
            try:
                connection, _ = sock.accept()
            except OSError:
                if self._socket is None:  # released: shut down
                    return
                time.sleep(0.05)  # out of descriptors, say: keep answering once it passes
                continue
            connection.close()

    def release(self) -> None:
        """Give the claim back; when this returns, the GPU can be claimed again."""
        sock, self._socket = self._socket, None
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._answerer.join()  # until it leaves accept(), it keeps the socket, and so the name, alive
        sock.close()


def claim_name(uuid: str) -> bytes:
    if not uuid or any(not (c.isascii() and c.isalnum() or c in "-_.") for c in uuid):
        raise ClaimError(f"cannot claim a GPU with UUID {uuid!r}")
    namespace = os.environ.get(NAMESPACE_VAR) or DEFAULT_NAMESPACE
    try:
        name = f"\0{namespace}/{uuid}".encode()
    except UnicodeEncodeError:
        raise ClaimError(f"{NAMESPACE_VAR} must be text (UTF-8)") from None
    if len(name) > MAX_NAME_BYTES + 1:
        raise ClaimError(f"claim name for {uuid} is too long; shorten {NAMESPACE_VAR}")
    return name


def try_claim(uuid: str) -> Claim | Holder:
    """Claim the GPU with this UUID, or say who holds it."""
    name = claim_name(uuid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # not inherited by children (PEP 446)
    try:
        sock.bind(name)
    except OSError as error:
        sock.close()
        if error.errno != errno.EADDRINUSE:
            raise ClaimError(f"cannot claim GPU {uuid}: {error.strerror or error}") from None
        return holder_of(uuid) or Holder()  # None: the holder exited just now; still not ours
    sock.listen(64)
    return Claim(uuid, sock)


def holder_of(uuid: str) -> Holder | None:
    """Who holds the claim on this GPU, or None when it is free (a look, not a claim)."""
    name = claim_name(uuid)
    deadline = time.monotonic() + LOOK_TIMEOUT
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        while True:
            try:
                sock.connect(name)
                break
            except ConnectionRefusedError:  # no such name (or bound, not yet listening: not held yet)
                return None
            except BlockingIOError:  # the holder's queue of looks is full: it is busy; wait a little
                if time.monotonic() > deadline:
                    return Holder()
                time.sleep(0.01)
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return _holder(pid, uid)
    finally:
        sock.close()


def _holder(pid: int, uid: int) -> Holder:
    """pid is 0 when the holder is in a PID namespace this process cannot see."""
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = f"uid {uid}"
    if pid <= 0:
        return Holder(user=user)
    return Holder(pid=pid, user=user, since=started_at(pid))


def started_at(pid: int) -> str | None:
    """When the process started, in local time (2026-11-23 21:03:07); None when it is gone.
    (Also how launcher/rundir/lock.py describes the holder of a run directory.)"""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(psutil.Process(pid).create_time()))
    except psutil.Error:
        return None
