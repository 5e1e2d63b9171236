"""Processes for tests: starting, waiting for and stopping real child processes, the
environment a launcher runs in, and the gloo ranks of tests/support/workers/."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

# Processes a test may leave running on purpose, shared by the tests after it.
SHARED_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "compile_worker")


def _child_pids(pid: int) -> list[int]:
    """The children of pid, as its threads' /proc children files list them (none if it is gone)."""
    children: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as listed:
                children += [int(child) for child in listed.read().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return children


def _descendants() -> list[psutil.Process]:
    """This process's descendants, read down from its /proc children files: it costs what the few
    descendants cost, where psutil's recursive children() reads every process of the machine (3.6 ms
    against 0.29 ms a call with 270 processes; this runs twice per test). psutil's walk where the
    kernel has no children files (built without CONFIG_PROC_CHILDREN)."""
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        return psutil.Process().children(recursive=True)
    pending, found = [os.getpid()], []
    while pending:
        for pid in _child_pids(pending.pop()):
            try:
                found.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
            pending.append(pid)
    return found


def live_children() -> dict[int, psutil.Process]:
    """This process's descendants that are running (a zombie is dead, only not yet reaped)."""
    found = {}
    for child in _descendants():
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


GLOO_PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "pretrain.distributed.parallel",
    "pretrain.model.transformer",
    "support.gloo_rank",
)
"""What the gloo ranks' fork server imports once, so that each rank forked from it starts with
torch loaded: about 2.4 s of CPU less per rank than a fresh interpreter (27 ranks in the suite).
Only these test ranks start so: what a launcher starts is always a process of its own."""


def _gloo_rank(script: str, out: str, env: dict[str, str], log: str) -> None:
    """One rank, in a process forked from the fork server: the test's environment, its output in
    log, then the worker script run as `python script out` would run it."""
    import runpy

    import torch

    torch.set_num_threads(1)  # one thread each, whatever the fork server's OMP_NUM_THREADS was when it loaded torch
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    sys.argv = [script, out]
    runpy.run_path(script, run_name="__main__")


def run_gloo_ranks(worker: str, out: Path, timeout: float, world_size: int = 2) -> list[dict]:
    """Run tests/support/workers/<worker> as world_size gloo ranks (one thread each), forked from
    a fork server that has torch loaded (GLOO_PRELOAD); each writes out/rank<r>.json, returned in
    rank order. A rank that fails fails the test with its output."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(GLOO_PRELOAD))
    port = str(free_port())
    script = str(TESTS / "support" / "workers" / worker)
    ranks = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]),  # for any process the rank starts
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        log = str(out / f"rank{rank}.log")
        ranks.append((context.Process(target=_gloo_rank, args=(script, str(out), env, log)), log))
        ranks[-1][0].start()
    deadline = time.monotonic() + timeout
    for process, _ in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
    for process, _ in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    for rank, (process, log) in enumerate(ranks):
        output = Path(log).read_text(errors="replace") if Path(log).exists() else "(it wrote nothing)"
        assert process.exitcode == 0, f"rank {rank} ended with {process.exitcode}:\n{output[-3000:]}"
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
