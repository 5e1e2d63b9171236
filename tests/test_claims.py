"""Per-GPU claims (launcher/claims.py): flocks on <claims dir>/<UUID>.lock that other
processes see and the kernel drops when the holder dies, the holder record a table reads,
the shared directory's permissions, and the claim files and UUIDs that are refused."""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import launcher_env, one_line_error, wait_until
from launcher import claims

UUID = "GPU-12345678-aaaa-bbbb-cccc-dddddddddddd"

CLAIM_ONCE = """
import json, sys
from launcher import claims
result = claims.try_claim(sys.argv[1])
if isinstance(result, claims.Claim):
    print(json.dumps({"type": "Claim"}))
else:
    print(json.dumps({"type": "Holder", "pid": result.pid, "user": result.user, "since": result.since}))
"""

CLAIM_AND_SLEEP = """
import sys, time
from launcher import claims
assert isinstance(claims.try_claim(sys.argv[1]), claims.Claim)
time.sleep(30)
"""


@pytest.fixture
def claims_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private claims directory (never the machine's real one), not created yet."""
    directory = tmp_path / "claims"
    monkeypatch.setenv(claims.CLAIMS_DIR_VAR, str(directory))
    return directory


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen]]:
    """Child processes a test starts; each is killed at the end."""
    started: list[subprocess.Popen] = []
    yield started
    for child in started:
        child.kill()
        child.wait()


def claim_elsewhere(uuid: str = UUID) -> dict:
    """try_claim from another process, which exits (and so releases) right after."""
    done = subprocess.run([sys.executable, "-c", CLAIM_ONCE, uuid], env=launcher_env(),
                          capture_output=True, text=True, timeout=20, check=True)
    return json.loads(done.stdout)


def start_holder(children: list[subprocess.Popen], uuid: str = UUID, **popen) -> subprocess.Popen:
    """Another process that claims the GPU and sleeps; returns once the claim is seen."""
    child = subprocess.Popen([sys.executable, "-c", CLAIM_AND_SLEEP, uuid], env=launcher_env(), **popen)
    children.append(child)
    assert wait_until(lambda: (claims.holder_of(uuid) or claims.Holder()).pid == child.pid, timeout=10)
    return child


def claimed(uuid: str = UUID) -> claims.Claim:
    result = claims.try_claim(uuid)
    assert isinstance(result, claims.Claim), result
    return result


def test_a_second_process_is_told_who_holds_the_claim(claims_dir):
    claim = claimed()
    try:
        other = claim_elsewhere()
    finally:
        claim.release()
    assert other["type"] == "Holder"
    assert other["pid"] == os.getpid()
    assert other["user"] == getpass.getuser()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", other["since"])
    assert claim_elsewhere()["type"] == "Claim"  # released: free again


def test_a_second_claim_in_the_same_process_conflicts_too(claims_dir):
    claim = claimed()
    try:
        again = claims.try_claim(UUID)
        assert isinstance(again, claims.Holder) and again.pid == os.getpid()
    finally:
        claim.release()
    claimed().release()


def test_claims_on_different_gpus_do_not_conflict(claims_dir):
    first = claimed(UUID)
    try:
        assert claim_elsewhere("GPU-other")["type"] == "Claim"
    finally:
        first.release()


def test_releasing_twice_is_harmless(claims_dir):
    claim = claimed()
    claim.release()
    claim.release()
    assert claims.holder_of(UUID) is None


def test_holder_of_is_none_for_a_gpu_never_claimed_and_creates_nothing(claims_dir):
    assert claims.holder_of(UUID) is None
    assert not claims_dir.exists()
    claimed("GPU-other").release()
    assert claims.holder_of(UUID) is None
    assert not (claims_dir / f"{UUID}.lock").exists()


def test_holder_of_sees_a_held_claim_without_taking_it_away(claims_dir):
    claim = claimed()
    try:
        holder = claims.holder_of(UUID)
        assert holder is not None and holder.pid == os.getpid()
        assert holder.describe().startswith(f"claimed by launcher pid {os.getpid()} ({getpass.getuser()})")
        assert claim_elsewhere()["pid"] == os.getpid()  # still ours after the look
    finally:
        claim.release()
    assert claims.holder_of(UUID) is None
    assert claim_elsewhere()["type"] == "Claim"  # the look on a free claim left it free


def test_holder_of_names_a_claim_held_by_another_process(claims_dir, children):
    child = start_holder(children)
    holder = claims.holder_of(UUID)
    assert holder is not None and holder.pid == child.pid
    assert isinstance(claims.try_claim(UUID), claims.Holder)


def test_a_claim_is_released_when_its_holder_is_killed(claims_dir, children):
    child = start_holder(children)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    assert claims.holder_of(UUID) is None
    claimed().release()


def test_claim_files_and_directory_are_shared_with_every_user_despite_the_umask(claims_dir):
    old = os.umask(0o077)
    try:
        claimed().release()
    finally:
        os.umask(old)
    assert stat.S_IMODE(claims_dir.stat().st_mode) == 0o1777
    assert stat.S_IMODE((claims_dir / f"{UUID}.lock").stat().st_mode) == 0o666


def test_an_existing_private_claims_directory_of_ours_is_opened_up(claims_dir):
    claims_dir.mkdir(mode=0o700)
    claimed().release()
    assert stat.S_IMODE(claims_dir.stat().st_mode) == 0o1777


def test_a_child_process_does_not_inherit_the_claim(claims_dir, children):
    claim = claimed()
    # close_fds=False: only O_CLOEXEC keeps the claim's descriptor out of the child. Released
    # once the child runs Python: until its exec has finished, the child still shares the
    # descriptor for an instant, whatever the flags.
    child = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(30)"],
                             close_fds=False, stdout=subprocess.PIPE, text=True)
    children.append(child)
    assert child.stdout.readline() == "ready\n"
    claim.release()
    assert child.poll() is None
    assert claims.holder_of(UUID) is None
    assert claim_elsewhere()["type"] == "Claim"


def test_a_claim_file_that_is_a_symlink_is_refused(claims_dir, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("precious")
    claims_dir.mkdir()
    link = claims_dir / f"{UUID}.lock"
    link.symlink_to(target)
    for attempt in (lambda: claims.try_claim(UUID), lambda: claims.holder_of(UUID)):
        with pytest.raises(claims.ClaimError) as excinfo:
            attempt()
        message = one_line_error(excinfo)
        assert str(link) in message and "symlink" in message and claims.CLAIMS_DIR_VAR in message
    assert target.read_text() == "precious"


def test_a_dangling_symlink_is_not_followed_to_create_a_file(claims_dir, tmp_path):
    target = tmp_path / "created-through-the-link"
    claims_dir.mkdir()
    (claims_dir / f"{UUID}.lock").symlink_to(target)
    with pytest.raises(claims.ClaimError):
        claims.try_claim(UUID)
    assert not target.exists()


def test_a_claims_dir_that_is_a_regular_file_is_refused(claims_dir):
    claims_dir.write_text("not a directory")
    with pytest.raises(claims.ClaimError) as excinfo:
        claims.try_claim(UUID)
    assert str(claims_dir) in one_line_error(excinfo)
    assert claims_dir.read_text() == "not a directory"


def test_a_claims_dir_whose_parent_is_missing_is_refused_rather_than_made_private(tmp_path, monkeypatch):
    monkeypatch.setenv(claims.CLAIMS_DIR_VAR, str(tmp_path / "absent" / "claims"))
    with pytest.raises(claims.ClaimError, match="cannot use the GPU claims directory .*: No such file or directory"):
        claims.try_claim(UUID)
    assert not (tmp_path / "absent").exists()


def test_a_claims_dir_that_is_a_symlink_is_refused_with_the_fix(claims_dir, tmp_path):
    (tmp_path / "real").mkdir()
    claims_dir.symlink_to(tmp_path / "real")
    with pytest.raises(claims.ClaimError, match="is a symlink; set LAUNCHER_CLAIMS_DIR to the directory itself"):
        claims.try_claim(UUID)


def test_a_record_without_user_or_time_shows_question_marks(claims_dir):
    claim = claimed()
    try:
        (claims_dir / f"{UUID}.lock").write_text(json.dumps({"pid": 5}))
        assert claims.holder_of(UUID).describe() == "claimed by launcher pid 5 (?) since ?"
    finally:
        claim.release()


@pytest.mark.parametrize("uuid", ["GPU/../../GPU-escape", "../GPU-escape", "", ".hidden"])
def test_a_uuid_that_is_not_a_plain_file_name_is_refused(claims_dir, tmp_path, uuid):
    (claims_dir / "GPU").mkdir(parents=True)  # so that the path would resolve, outside the claims dir
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(claims.ClaimError) as excinfo:
        claims.try_claim(uuid)
    one_line_error(excinfo)
    assert sorted(tmp_path.rglob("*")) == before


def test_a_held_claim_with_a_garbage_record_is_held_by_another_launcher(claims_dir):
    claim = claimed()
    try:
        (claims_dir / f"{UUID}.lock").write_bytes(b"\x00garbage{")  # no lock taken: flock is advisory
        holder = claims.holder_of(UUID)
        assert holder == claims.Holder()
        assert holder.describe() == "claimed by another launcher"
        assert claim_elsewhere() == {"type": "Holder", "pid": None, "user": None, "since": None}
    finally:
        claim.release()


def test_a_claimer_retries_while_a_reader_holds_the_shared_lock_for_an_instant(claims_dir):
    claimed().release()  # the file exists
    locked = threading.Event()

    def reader() -> None:
        fd = os.open(claims_dir / f"{UUID}.lock", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            locked.set()
            time.sleep(0.02)
        finally:
            os.close(fd)

    thread = threading.Thread(target=reader)
    thread.start()
    assert locked.wait(5)
    try:
        result = claims.try_claim(UUID)
        assert isinstance(result, claims.Claim)
        result.release()
    finally:
        thread.join()


def test_without_retries_the_same_reader_would_have_refused_the_claim(claims_dir, monkeypatch):
    claimed().release()
    fd = os.open(claims_dir / f"{UUID}.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        monkeypatch.setattr(claims, "CLAIM_ATTEMPTS", 1)
        result = claims.try_claim(UUID)
    finally:
        os.close(fd)
    assert isinstance(result, claims.Holder)
