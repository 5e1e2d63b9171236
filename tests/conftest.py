"""Shared helpers: small real child processes for supervisor tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent

# One OpenMP thread in this process and every process a test starts (a launcher keeps it for
# its workers), unless the caller chose a count; set before torch is imported, since OpenMP reads
# it once. The tests' models are tiny, and two threads per process on two cores that something
# else also uses wait for each other at every parallel region: with another process busy, a test
# training 4 debug steps in this process took 7 s instead of 0.9 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def private_gpu_claims(monkeypatch):
    """No test claims a GPU of the machine it runs on, or meets another test's claims:
    each test has claim names of its own (launcher/gpus/claims.py)."""
    monkeypatch.setenv("LAUNCHER_CLAIMS_NAMESPACE", f"gpu-launcher-test-{uuid.uuid4().hex[:12]}")


# Processes a test may leave running on purpose, shared by the tests after it.
SHARED_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "compile_worker")


def live_children() -> dict[int, psutil.Process]:
    """This process's descendants that are running (a zombie is dead, only not yet reaped)."""
    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and not any(h in " ".join(child.cmdline()) for h in SHARED_HELPERS):
                found[child.pid] = child
        except psutil.NoSuchProcess:
            pass
    return found


def describe(process: psutil.Process) -> str:
    try:
        return f"pid {process.pid}: {' '.join(process.cmdline())[:200]}"
    except psutil.NoSuchProcess:
        return f"pid {process.pid} (gone)"


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """A test that leaves a process of its own running fails here, at its teardown, rather than
    a later test that counts processes; the leftovers are killed so that no later test sees them.
    Set up before and torn down after every other function-scoped fixture, so processes of
    longer-lived fixtures, and those a fixture of the test cleans up, are not counted."""
    before = set(live_children())
    yield

    def leftovers() -> list[psutil.Process]:
        return [p for pid, p in live_children().items() if pid not in before]

    # A child killed at the test's very end may take a moment to become a zombie.
    if wait_until(lambda: not leftovers(), timeout=5.0):
        return
    left = leftovers()
    names = "; ".join(describe(p) for p in left)
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)
    pytest.fail(f"the test left {len(left)} process(es) running: {names}", pytrace=False)


def stop_process_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process started in a group of its own, its group and everything below it, then
    reap it and wait for the rest to be gone (a launcher's workers and guardian included)."""
    if proc.poll() is not None:  # reaped: its pid may be another process's now; what it left is not below us
        tree = []
    else:
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            tree = []
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=60)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    psutil.wait_procs(tree, timeout=30)


@pytest.fixture
def processes() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start a process the test owns: processes(argv, **Popen options). Each starts in a session
    (so a process group) of its own unless own_group=False; when the test ends, passed or failed,
    it, its group and everything below it are killed and waited for, so that a launcher a failing
    test leaves running cannot leak into the next test."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str], own_group: bool = True, **options) -> subprocess.Popen:
        proc = subprocess.Popen(argv, start_new_session=own_group, **options)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop_process_tree(proc)


@pytest.fixture(params=["nvidia", "amd"])
def vendor(request) -> str:
    """A test that takes it runs twice: on NVIDIA GPUs (NVML), then on AMD ones (AMD SMI). The
    scripted_gpus machine is then that vendor's (tests/test_devices.py's gpu() makes its GPUs)."""
    return request.param


@pytest.fixture
def scripted_gpus(tmp_path, monkeypatch, request):
    """Make the launcher see a scripted machine (launcher/gpus/scripted_nvml.py; with "vendor":
    "amd", launcher/gpus/scripted_amdsmi.py), here and in the launchers a test starts:
    scripted_gpus([{}, {"utilization": [90]}]) is two H100s, one busy; in a test that takes the
    `vendor` fixture, two MI300Xs on its AMD run."""
    vendor = request.getfixturevalue("vendor") if "vendor" in request.fixturenames else "nvidia"

    def make(gpus: list[dict], driver: bool = True) -> Path:
        path = tmp_path / "machine.json"
        machine = {"driver": driver, "gpus": gpus} | ({"vendor": vendor} if vendor != "nvidia" else {})
        path.write_text(json.dumps(machine))
        monkeypatch.setenv("LAUNCHER_SCRIPTED_GPUS", str(path))
        return path

    return make


@pytest.fixture
def script(tmp_path):
    """Write a Python child script; return the argv that runs it."""

    def make(source: str, name: str = "child.py") -> list[str]:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return [sys.executable, str(path)]

    return make


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_as_a_user_would(
    proc: subprocess.Popen, stop_signal: int, timeout: float
) -> tuple[int, float, str, list[psutil.Process]]:
    """Send stop_signal as a user would (SIGINT: Ctrl-C, to the terminal's whole process group;
    any other: kill, to the process alone) and wait for it to end: its exit code, the seconds it
    took, the rest of its output, and the processes it had (to check that none outlives it)."""
    job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    sent = time.monotonic()
    if stop_signal == signal.SIGINT:
        os.killpg(proc.pid, stop_signal)
    else:
        proc.send_signal(stop_signal)
    code = proc.wait(timeout=timeout)
    took = time.monotonic() - sent
    assert proc.stdout is not None
    return code, took, proc.stdout.read(), job


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for MASTER_PORT of a test's process group.
    (Another process may take it before the group binds it: rare enough for tests.)"""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_gloo_ranks(worker: str, out: Path, timeout: float, world_size: int = 2) -> list[dict]:
    """Run tests/<worker> as world_size gloo ranks (one thread each); each writes
    out/rank<r>.json, returned in rank order. A rank that fails fails the test with its output."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / worker), str(out)],
            cwd=ROOT,
            env=dict(
                os.environ,
                PYTHONPATH=str(ROOT),
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def launcher_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    env.pop("NO_COLOR", None)
    return env


def one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    """The message of a raised error, after checking it is one non-empty line."""
    message = str(excinfo.value)
    assert message and "\n" not in message
    return message


def cache_leftovers(tmp_path: Path) -> list[str]:
    """Everything under tmp_path/cache but lock files and the folder of trained tokenizers:
    after a failed preparation, this must be empty."""
    cache = tmp_path / "cache"
    if not cache.exists():
        return []
    return sorted(
        str(p.relative_to(cache))
        for p in cache.rglob("*")
        if not p.name.endswith(".lock") and not (p.is_dir() and p.name == "tokenizers")
    )
