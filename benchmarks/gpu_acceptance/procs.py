"""The child processes of the GPU checks: each runs under a timeout in a process group of its
own, which is killed with it; a worker's JSON result; the step lines training prints; nvidia-smi's
answers; and CheckFailed, how a check says it could not measure what it measures."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "benchmarks" / "gpu_acceptance"
"""What the workers run: `python benchmarks/gpu_acceptance --worker NAME ARG...` (its __main__.py), by
path, so that a worker started by the launcher in any directory finds it."""
RESULT_MARK = "GPU_CHECK_RESULT "
"""Prefix of the one stdout line that carries a worker's JSON result."""
LAST_LINES = 25
"""Output lines kept for a failed check."""

STEP_LINE = re.compile(
    r"^(?P<prefix>GPU\d+):INFO \| \[GPU \d+\] Step \[(?P<step>\d+)/(?P<total>\d+)\] \| Loss: (?P<loss>\S+) \|"
    r".*? Tokens/s: (?P<tps>[\d,]+)(?: \| MFU: (?P<mfu>[\d.]+)%)?(?: \| Mem: (?P<mem>[\d.]+) GiB)?"
)


@dataclass
class Proc:
    argv: list[str]
    returncode: int | None
    """None: killed at the timeout."""
    out: str
    seconds: float
    first_match_s: float | None = None
    """Seconds from the start until the first line that matched (when one was asked for)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def how(self) -> str:
        return "timed out" if self.returncode is None else f"exit {self.returncode}"

    def tail(self, lines: int = LAST_LINES) -> str:
        return "$ " + " ".join(self.argv) + "\n" + "\n".join(self.out.splitlines()[-lines:])


class CheckFailed(Exception):
    """A check could not measure what it measures: the message is the result, tail the evidence."""

    def __init__(self, message: str, tail: str = "") -> None:
        super().__init__(message)
        self.tail = tail


def failed(what: str, proc: Proc) -> CheckFailed:
    return CheckFailed(f"{what}: {proc.how()} after {proc.seconds:.0f} s", proc.tail())


# --- processes -------------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
        **extra,
    )
    env.pop("NO_COLOR", None)
    return env


def run(
    argv: Sequence[str], timeout: float, env: dict[str, str] | None = None, first_match: re.Pattern[str] | None = None
) -> Proc:
    """argv in its own process group, output (stdout and stderr together) read as it comes;
    the whole group is killed at the timeout."""
    started = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        cwd=REPO,
        env=env or child_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []
    matched: list[float] = []

    def read() -> None:
        assert proc.stdout is not None  # opened as a pipe above
        for line in proc.stdout:
            if first_match is not None and not matched and first_match.search(line):
                matched.append(time.monotonic() - started)
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        returncode: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        returncode = None
        kill_group(proc)
    reader.join(timeout=10)
    return Proc(list(argv), returncode, "".join(lines), time.monotonic() - started, matched[0] if matched else None)


def kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def emit(result: Any) -> None:
    """A worker's result: one JSON line after RESULT_MARK."""
    print(RESULT_MARK + json.dumps(result), flush=True)


def results(out: str) -> list[Any]:
    """The results workers emitted, also from under the launcher's "GPU0:" prefixes."""
    return [json.loads(line.split(RESULT_MARK, 1)[1]) for line in out.splitlines() if RESULT_MARK in line]


def worker_argv(name: str, *args: str) -> list[str]:
    return [sys.executable, str(ENTRY), "--worker", name, *args]


def worker(name: str, timeout: float, *args: str, env: dict[str, str] | None = None) -> Any:
    """Run one of the workers (benchmarks/gpu_acceptance/workers.py) in a fresh Python process; its JSON result
    (an object or a list, as the worker prints it)."""
    proc = run(worker_argv(name, *args), timeout, env)
    found = results(proc.out)
    if not proc.ok or not found:
        raise failed(f"worker {name}", proc)
    return found[-1]


class GpuMemory:
    """nvidia-smi's memory.used of one GPU, sampled every interval_ms while a run goes on (with
    GpuMemory(i) as used: ...; used.peak_gib): what the run takes as the driver counts it (torch's
    reserved memory, the CUDA context, NCCL's buffers), above what was used when it started. By
    GPU, not by PID: in a container nvidia-smi may show other PIDs, or none."""

    def __init__(self, index: int, interval_ms: int = 200) -> None:
        self.index, self.interval_ms = index, interval_ms
        self.baseline_mib = 0
        self.peak_mib: int | None = None
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> GpuMemory:
        self.baseline_mib = int(smi_query("memory.used", index=self.index)[0][0])
        self._proc = subprocess.Popen(
            [
                "nvidia-smi",
                "-i",
                str(self.index),
                "--query-gpu=memory.used",
                "--format=csv,noheader,nounits",
                "-lms",
                str(self.interval_ms),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None  # started by __enter__, stdout a pipe
        for line in self._proc.stdout:
            if line.strip().isdigit():
                self.peak_mib = max(self.peak_mib or 0, int(line))

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None and self._reader is not None  # started by __enter__
        kill_group(self._proc)
        self._reader.join(timeout=5)

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_mib is None else max(0, self.peak_mib - self.baseline_mib) / 1024


def launcher(*args: str, timeout: float, env: dict[str, str] | None = None, first_match: re.Pattern[str] | None = None) -> Proc:
    return run([sys.executable, "-m", "launcher", *args], timeout, env, first_match)


def step_lines(out: str) -> list[dict[str, Any]]:
    steps = []
    for line in out.splitlines():
        if match := STEP_LINE.match(line):
            steps.append(
                {
                    "prefix": match["prefix"],
                    "step": int(match["step"]),
                    "loss": float(match["loss"]),
                    "tokens_per_s": float(match["tps"].replace(",", "")),
                    "mfu": float(match["mfu"]) if match["mfu"] else None,
                    "mem": float(match["mem"]) if match["mem"] else None,
                }
            )
    return steps


def losses_by_step(out: str, prefix: str | None = None) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in step_lines(out) if prefix is None or s["prefix"] == prefix}


def falling(losses: dict[int, float]) -> bool:
    steps = sorted(losses)
    return len(steps) >= 2 and losses[steps[-1]] < losses[steps[0]]


def smi_query(*fields: str, what: str = "gpu", index: int | None = None) -> list[list[str]]:
    only = [] if index is None else ["-i", str(index)]
    out = subprocess.run(
        ["nvidia-smi", *only, f"--query-{what}={','.join(fields)}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


@dataclass
class Watched:
    """A launch whose output a thread collects, and the moment a marker line appeared."""

    proc: subprocess.Popen
    lines: list[str]
    seen: threading.Event
    reader: threading.Thread


def watch(argv: Sequence[str], marker: str = "] Step [5/", env: dict[str, str] | None = None) -> Watched:
    """Start argv in a session of its own and collect its output; seen is set at the first line
    holding marker (by default: training reached step 5)."""
    proc = subprocess.Popen(
        list(argv),
        cwd=REPO,
        env=env or child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None  # opened as a pipe above
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return Watched(proc, lines, seen, reader)


def compute_apps(rows: Sequence[Sequence[str]]) -> dict[tuple[str, int], int | None]:
    """nvidia-smi --query-compute-apps=gpu_uuid,pid[,used_memory] rows as (GPU UUID, pid) -> MiB
    (None where the memory was not asked for, or the driver reports no figure: "[N/A]" in some
    containers); other rows ("No running processes found") skipped."""
    return {
        (row[0], int(row[1])): int(row[2]) if len(row) == 3 and row[2].isdigit() else None
        for row in rows
        if len(row) in (2, 3) and row[1].isdigit()
    }
