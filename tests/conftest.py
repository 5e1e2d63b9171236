"""Fixtures every test may take: the autouse guards (private GPU claims, no process outliving its
test), processes a test owns, scripted GPUs and child scripts. Plain helpers live in tests/support/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from pretrain.run.startup_gc import imports_frozen
from support.processes import describe, live_children, stop_process_tree, wait_until

pytest_plugins = ["support.cpu_cost"]  # --cpu-cost=N: the tests that cost the most CPU

# One OpenMP thread in this process and every process a test starts (a launcher keeps it for
# its workers), unless the caller chose a count; set before torch is imported, since OpenMP reads
# it once. The tests' models are tiny, and two threads per process on two cores that something
# else also uses wait for each other at every parallel region: with another process busy, a test
# training 4 debug steps in this process took 7 s instead of 0.9 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Collection imports every test module, and with them torch: ~300,000 objects that live as long as
# this process. They load as a training process loads them (pretrain/run/startup_gc.py): the
# cyclic garbage collector off, then frozen out of its walks, so that the collections during the
# tests (thousands of in-process model runs) walk only the tests' own objects: a fifth less CPU for
# the in-process tests of pretrain/model, config and optim (26.8 s to 21 s). Around
# pytest_collection, which xdist's controller answers without collecting, so its collector comes
# back on too.
@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[None]:
    with imports_frozen():
        yield


# Claims of a session's own until each test takes its own (below): a run made once for a whole
# module starts before any test's fixtures, and must not claim under the machine's namespace either.
os.environ["LAUNCHER_CLAIMS_NAMESPACE"] = f"gpu-launcher-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(autouse=True)
def private_gpu_claims(monkeypatch):
    """No test claims a GPU of the machine it runs on, or meets another test's claims:
    each test has claim names of its own (launcher/gpus/claims.py)."""
    monkeypatch.setenv("LAUNCHER_CLAIMS_NAMESPACE", f"gpu-launcher-test-{uuid.uuid4().hex[:12]}")


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
    scripted_gpus machine is then that vendor's (tests/launcher/gpus/test_devices.py's gpu() makes its GPUs)."""
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
