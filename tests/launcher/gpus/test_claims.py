"""Per-GPU claims (launcher/gpus/claims.py): a listening Unix socket bound to the abstract name
`\\0<namespace>/<GPU UUID>`, which other processes see (holder_of, via SO_PEERCRED), which
exactly one of many claimers gets, which the kernel frees when the holder dies and which
children do not inherit; and the names that are refused."""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from support.processes import launcher_env, one_line_error, wait_until
from launcher.gpus import claims

UUID = "GPU-12345678-aaaa-bbbb-cccc-dddddddddddd"
USER = pwd.getpwuid(os.getuid()).pw_name

CLAIM_ONCE = """
import json, sys
from launcher.gpus import claims
result = claims.try_claim(sys.argv[1])
if isinstance(result, claims.Claim):
    print(json.dumps({"type": "Claim"}))
else:
    print(json.dumps({"type": "Holder", "pid": result.pid, "user": result.user, "since": result.since}))
"""

CLAIM_AND_SLEEP = """
import sys, time
from launcher.gpus import claims
assert isinstance(claims.try_claim(sys.argv[1]), claims.Claim)
time.sleep(30)
"""

# Started together: each says "ready" once imported, spins until the file `go` exists, claims,
# reports, then keeps what it got until the file `stop` exists.
CLAIM_ON_GO = """
import json, os, sys, time
from launcher.gpus import claims
go, stop, uuid = sys.argv[1:4]
print("ready", flush=True)
while not os.path.exists(go):
    pass
result = claims.try_claim(uuid)
print(json.dumps({"pid": os.getpid(), "type": type(result).__name__, "holder": getattr(result, "pid", None)}),
      flush=True)
while not os.path.exists(stop):
    time.sleep(0.01)
"""


@pytest.fixture(autouse=True)
def no_claim_thread_outlives_its_test() -> Iterator[None]:
    """Each test starts with no claim thread of an earlier one still winding down."""
    yield
    assert wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("claim-")], timeout=5)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen]]:
    """Child processes a test starts; each is killed (and its pipe closed) at the end."""
    started: list[subprocess.Popen] = []
    yield started
    for child in started:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def claim_elsewhere(uuid: str = UUID) -> dict:
    """try_claim from another process, which exits (and so releases) right after."""
    done = subprocess.run(
        [sys.executable, "-c", CLAIM_ONCE, uuid], env=launcher_env(), capture_output=True, text=True, timeout=20, check=True
    )
    return json.loads(done.stdout)


def start_holder(children: list[subprocess.Popen], uuid: str = UUID) -> subprocess.Popen:
    """Another process that claims the GPU and sleeps; returns once holder_of names it."""
    child = subprocess.Popen([sys.executable, "-c", CLAIM_AND_SLEEP, uuid], env=launcher_env())
    children.append(child)
    assert wait_until(lambda: (claims.holder_of(uuid) or claims.Holder()).pid == child.pid, timeout=10)
    return child


def claimed(uuid: str = UUID) -> claims.Claim:
    result = claims.try_claim(uuid)
    assert isinstance(result, claims.Claim), result
    return result


def release_and_wait(claim: claims.Claim) -> None:
    """Release; the claim's thread has ended when release() returns."""
    claim.release()
    assert not claim_threads(claim.uuid)


def started_at(pid: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(psutil.Process(pid).create_time()))


def look(uuid: str = UUID) -> claims.Holder | None:
    return claims.holder_of(uuid)


def claim_threads(uuid: str = UUID) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"claim-{uuid}"]


# --- holding and looking ------------------------------------------------------------------


def test_another_process_is_told_our_pid_user_and_start_time_until_we_release():
    claim = claimed()
    try:
        other = claim_elsewhere()
    finally:
        claim.release()
    assert other == {"type": "Holder", "pid": os.getpid(), "user": USER, "since": started_at(os.getpid())}
    assert claim_elsewhere() == {"type": "Claim"}  # released: free again


def test_of_six_processes_claiming_at_once_exactly_one_wins_and_the_others_name_it(tmp_path, children):
    go, stop = tmp_path / "go", tmp_path / "stop"
    for _ in range(6):
        children.append(
            subprocess.Popen(
                [sys.executable, "-c", CLAIM_ON_GO, str(go), str(stop), UUID],
                env=launcher_env(),
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    for child in children:
        assert child.stdout.readline() == "ready\n"
    go.touch()
    try:
        reports = [json.loads(child.stdout.readline()) for child in children]
    finally:
        stop.touch()  # winners held their claims until every report was in
    winners = [r for r in reports if r["type"] == "Claim"]
    assert len(winners) == 1, reports
    assert [r for r in reports if r is not winners[0]] == [
        {"pid": r["pid"], "type": "Holder", "holder": winners[0]["pid"]} for r in reports if r is not winners[0]
    ]
    for child in children:
        assert child.wait(timeout=10) == 0


def test_holder_of_is_none_for_a_gpu_never_claimed_and_after_release():
    assert claims.holder_of(UUID) is None
    claim = claimed()
    holder = claims.holder_of(UUID)
    claim.release()
    assert holder == claims.Holder(pid=os.getpid(), user=USER, since=started_at(os.getpid()))
    assert claims.holder_of(UUID) is None


def test_holder_of_names_a_claim_held_by_another_process_which_keeps_it(children):
    child = start_holder(children)
    assert claims.holder_of(UUID) == claims.Holder(pid=child.pid, user=USER, since=started_at(child.pid))
    result = claims.try_claim(UUID)
    assert isinstance(result, claims.Holder) and result.pid == child.pid


def test_many_looks_are_answered_promptly_and_do_not_take_the_claim():
    """More looks than the listen backlog (64): only the claim's thread accepting them keeps
    them answered, each within LOOK_TIMEOUT, with the holder's pid."""
    claim = claimed()
    try:
        for _ in range(200):
            began = time.monotonic()
            holder = look()
            assert time.monotonic() - began < claims.LOOK_TIMEOUT + 0.5
            assert holder is not None and holder.pid == os.getpid()
        assert claim_elsewhere()["pid"] == os.getpid()  # still ours after the looks
    finally:
        claim.release()
    assert claim_elsewhere() == {"type": "Claim"}


def test_many_looks_at_another_process_s_claim_leave_it_held(children):
    child = start_holder(children)
    for _ in range(200):
        began = time.monotonic()
        assert (look() or claims.Holder()).pid == child.pid
        assert time.monotonic() - began < claims.LOOK_TIMEOUT + 0.5
    assert claim_elsewhere()["pid"] == child.pid


def test_a_look_waits_for_a_holder_too_busy_to_answer():
    """A holder (this process, listening as claims do) whose backlog is full for 0.3 s."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with listener, waiting:
        listener.bind(claims.claim_name(UUID))
        listener.listen(0)
        waiting.connect(claims.claim_name(UUID))  # fills the backlog

        def answer_late() -> None:
            time.sleep(0.3)
            for _ in range(2):
                connection, _ = listener.accept()
                connection.close()

        answerer = threading.Thread(target=answer_late)
        answerer.start()
        try:
            began = time.monotonic()
            holder = claims.holder_of(UUID)
            assert time.monotonic() - began < claims.LOOK_TIMEOUT
            assert holder == claims.Holder(pid=os.getpid(), user=USER, since=started_at(os.getpid()))
        finally:
            if answerer.is_alive():  # holder_of did not connect: let the answerer end
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as late:
                    late.connect(claims.claim_name(UUID))
            answerer.join()


# --- freeing ------------------------------------------------------------------------------


def test_a_claim_is_freed_when_its_holder_is_killed(children):
    child = start_holder(children)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    assert claims.holder_of(UUID) is None
    claimed().release()


def test_a_child_process_does_not_inherit_the_claim(children):
    claim = claimed()
    try:
        # close_fds=False: only the socket's close-on-exec keeps it out of the child. Released
        # once the child runs Python: until its exec has finished, the child still shares the
        # descriptor for an instant, whatever the flags.
        child = subprocess.Popen(
            [sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(30)"],
            close_fds=False,
            stdout=subprocess.PIPE,
            text=True,
        )
        children.append(child)
        assert child.stdout.readline() == "ready\n"
    finally:
        claim.release()
    assert child.poll() is None
    assert claims.holder_of(UUID) is None
    assert claim_elsewhere() == {"type": "Claim"}


def test_releasing_twice_is_harmless():
    claim = claimed()
    claim.release()
    claim.release()
    assert claims.holder_of(UUID) is None
    release_and_wait(claim)
    claimed().release()


def test_a_released_claim_s_thread_exits_within_a_second():
    claim = claimed()
    assert len(claim_threads()) == 1
    claim.release()
    assert wait_until(lambda: not claim_threads(), timeout=1.0)


def test_a_claim_released_right_after_a_look_is_free_and_its_thread_ends():
    for _ in range(20):
        claim = claimed()
        assert claims.holder_of(UUID).pid == os.getpid()
        claim.release()
        assert claims.holder_of(UUID) is None
        assert wait_until(lambda: not claim_threads(), timeout=1.0)


@pytest.mark.parametrize("look", [False, True], ids=["unseen", "after a look"])
def test_the_gpu_can_be_claimed_again_as_soon_as_release_returns(look):
    claim = claimed()
    for attempt in range(200):
        if look:
            claims.holder_of(UUID)
        claim.release()
        again = claims.try_claim(UUID)
        assert isinstance(again, claims.Claim), f"attempt {attempt}: {again}"
        claim = again
    claim.release()


# --- what conflicts -----------------------------------------------------------------------


def test_claims_on_different_gpus_do_not_conflict():
    first = claimed(UUID)
    try:
        assert claim_elsewhere("GPU-other") == {"type": "Claim"}
        second = claimed("GPU-other")
        assert claims.holder_of(UUID).pid == os.getpid()
        assert claims.holder_of("GPU-other").pid == os.getpid()
        second.release()
    finally:
        first.release()


def test_a_second_claim_in_the_same_process_names_this_process():
    claim = claimed()
    try:
        again = claims.try_claim(UUID)
        assert isinstance(again, claims.Holder) and again.pid == os.getpid()
    finally:
        release_and_wait(claim)
    claimed().release()


def test_a_claim_in_one_namespace_is_not_seen_in_another(monkeypatch):
    first = os.environ[claims.NAMESPACE_VAR]
    claim = claimed()
    try:
        monkeypatch.setenv(claims.NAMESPACE_VAR, f"{first}-b")
        assert claims.holder_of(UUID) is None
        other = claimed()
        assert claims.holder_of(UUID).pid == os.getpid()
        monkeypatch.setenv(claims.NAMESPACE_VAR, first)
        assert claims.holder_of(UUID).pid == os.getpid()
        other.release()
        assert claims.holder_of(UUID).pid == os.getpid()  # releasing B's left A's held
    finally:
        claim.release()
    assert claims.holder_of(UUID) is None


def test_an_empty_namespace_means_the_default_one(monkeypatch):
    monkeypatch.setenv(claims.NAMESPACE_VAR, "")
    assert claims.claim_name(UUID) == f"\0{claims.DEFAULT_NAMESPACE}/{UUID}".encode()


# --- names refused ------------------------------------------------------------------------


@pytest.mark.parametrize("uuid", ["", "GPU/../x", "a b", "\0x", "GPU-x\n"])
def test_a_uuid_that_is_not_a_plain_name_is_refused(uuid):
    with pytest.raises(claims.ClaimError) as excinfo:
        claims.try_claim(uuid)
    assert repr(uuid) in one_line_error(excinfo)


@pytest.mark.parametrize("uuid", ["", "a b"])
def test_holder_of_refuses_a_uuid_that_is_not_a_plain_name_too(uuid):
    with pytest.raises(claims.ClaimError):
        print(claims.holder_of(uuid))


def fit_namespace(monkeypatch, name_bytes: int) -> None:
    """A namespace with which `\\0<namespace>/<UUID>` is name_bytes long."""
    base = os.environ[claims.NAMESPACE_VAR]
    pad = name_bytes - len(f"\0{base}/{UUID}")
    assert pad >= 0
    monkeypatch.setenv(claims.NAMESPACE_VAR, base + "x" * pad)


def test_the_longest_name_that_fits_the_socket_address_is_claimed(monkeypatch):
    fit_namespace(monkeypatch, claims.MAX_NAME_BYTES + 1)  # all of sun_path
    claim = claimed()
    try:
        assert claims.holder_of(UUID).pid == os.getpid()
    finally:
        claim.release()


def test_a_name_one_byte_too_long_is_refused_naming_the_variable_to_shorten(monkeypatch):
    fit_namespace(monkeypatch, claims.MAX_NAME_BYTES + 2)
    with pytest.raises(claims.ClaimError) as excinfo:
        claims.try_claim(UUID)
    message = one_line_error(excinfo)
    assert UUID in message and claims.NAMESPACE_VAR in message


def test_holder_of_refuses_a_name_too_long_naming_the_variable_to_shorten(monkeypatch):
    fit_namespace(monkeypatch, claims.MAX_NAME_BYTES + 2)
    with pytest.raises(claims.ClaimError, match=claims.NAMESPACE_VAR):
        print(claims.holder_of(UUID))


# --- describing a holder ------------------------------------------------------------------


def test_a_holder_with_a_pid_is_described_with_user_and_start_time():
    holder = claims._holder(os.getpid(), os.getuid())
    assert holder.describe() == f"claimed by launcher pid {os.getpid()} ({USER}) since {started_at(os.getpid())}"


def test_a_holder_that_has_exited_is_described_without_a_start_time():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=10)
    gone = child.pid  # exited and reaped
    assert claims._holder(gone, os.getuid()).describe() == f"claimed by launcher pid {gone} ({USER}) since ?"


def test_a_holder_in_another_pid_namespace_is_described_by_user():
    holder = claims._holder(0, os.getuid())
    assert holder == claims.Holder(user=USER)
    assert holder.describe() == f"claimed by another launcher ({USER})"


def _known_uid(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_a_holder_with_an_unknown_uid_is_described_by_number():
    uid = next(u for u in range(2**31 - 2, 0, -1) if not _known_uid(u))
    assert claims._holder(0, uid).describe() == f"claimed by another launcher (uid {uid})"


def test_a_holder_the_kernel_cannot_name_is_described_plainly():
    assert claims.Holder().describe() == "claimed by another launcher"
    assert claims.Holder(pid=5).describe() == "claimed by launcher pid 5 (?) since ?"


def test_a_claim_name_is_the_abstract_namespace_slash_uuid():
    namespace = os.environ[claims.NAMESPACE_VAR]
    assert namespace.startswith("gpu-launcher-test-")  # conftest's, never the machine's
    assert claims.claim_name(UUID) == f"\0{namespace}/{UUID}".encode()
