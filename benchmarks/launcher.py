"""Benchmark: this launcher (`python -m launcher ... -- CMD`) against torchrun.

Run from the repository root:

    PYTHONPATH=. python benchmarks/launcher.py [--repeat N] [--quick]

Both tools run the same small worker script with 2 CPU workers. Measured, per scenario:
1. launch -> first worker line: from just before Popen of the tool until the first worker
   line arrives on this benchmark's pipe.
2. crash -> tool exit: rank 1 fails ~1 s after start, (a) raising, (b) os._exit(3),
   (c) exiting 7 while rank 0 ignores SIGTERM; from the crashing worker's own
   time.monotonic() (written to a file just before it dies) until waitpid on the tool
   returns. Also the tool's exit code.
3. console latency: rank 0 prints lines carrying their write time; a reader thread
   timestamps each line on arrival; p50 and p99 in ms.
4. survivors: every worker starts a setsid grandchild and a double-forked daemon (both
   `sleep 60`-like, stdio on /dev/null); a unique marker in the environment tags every process
   of a run. Survivors are marked processes still alive 1 s after the tool exited. Scenario
   "supervisor SIGKILLed" kills only the tool's own pid once both workers are ready.
Every marked process is SIGKILLed after each run, so the benchmark leaves nothing behind.
torchrun's scenario (c) always takes ~30 s (see SLOW_RUN), so it runs only twice (--quick: once).
Progress goes to stderr; the Markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parent.parent
if Path(sys.path[0]).resolve() == REPO / "benchmarks":  # run as a script: the repository, not benchmarks/
    sys.path[0] = str(REPO)  # (this file would shadow the launcher package there)
from benchmarks.harness import (  # noqa: E402
    MARKER_VAR,
    count_survivors,
    free_port,
    kill_marked,
    print_table,
    ratio,
    unwind_on_signals,
    yes_no,
)

KILL_GRACE_S = 2.0  # ours: --kill-grace; torchrun: --shutdown-timeout (parity)
CRASH_TARGET_S = 0.3
LATENCY_TARGET_MS = 5.0
LINE_PACE = (5, 0.005)  # the printing worker sleeps 5 ms after every 5 lines (~1000 lines/s)

WORKER_SOURCE = r"""
import os, signal, subprocess, sys, time

rank, mode = int(os.environ["RANK"]), os.environ["BENCH_MODE"]
print(f"BENCH start {rank}", flush=True)

def start_setsid_grandchild():
    subprocess.Popen(["sleep", "60"], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

def start_double_forked_daemon():
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            time.sleep(60)
        os._exit(0)
    os.waitpid(pid, 0)

def record_crash_time():
    with open(os.environ["BENCH_CRASH_FILE"], "w") as f:
        f.write(repr(time.monotonic()))

start_setsid_grandchild()
start_double_forked_daemon()
if mode == "crash-ignore-term" and rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # after spawning: SIG_IGN is inherited
print(f"BENCH ready {rank}", flush=True)
if mode == "first-line" or (mode == "lines" and rank == 1):
    sys.exit(0)
if mode == "lines":
    every, pause = int(os.environ["BENCH_PACE_EVERY"]), float(os.environ["BENCH_PACE_SLEEP"])
    for i in range(int(os.environ["BENCH_LINES"])):
        print(f"BENCH lat {time.monotonic():.6f}", flush=True)
        if i % every == every - 1:
            time.sleep(pause)
    sys.exit(0)
if mode.startswith("crash") and rank == 1:
    time.sleep(1.0)
    record_crash_time()
    if mode == "crash-raise":
        raise RuntimeError("benchmark crash")
    if mode == "crash-exit":
        os._exit(3)
    sys.exit(7)
time.sleep(60)
"""

CRASHES = {
    "crash-raise": ("(a) rank 1 raises", 1),
    "crash-exit": ("(b) rank 1 os._exit(3)", 3),
    "crash-ignore-term": ("(c) exit 7, peer ignores SIGTERM", 7),
}
# Tools: "ours" (python -m launcher), "torchrun" (--tee 3), "torchrun-notee" (reference rows only).
SCENARIO_TOOLS = {
    "first-line": ["ours", "torchrun", "torchrun-notee"],
    **{mode: ["ours", "torchrun"] for mode in CRASHES},
    "lines": ["ours", "torchrun", "torchrun-notee"],
    "supervisor-killed": ["ours", "torchrun"],
}
# torchrun's failure path stops the other workers with a hard-coded 30 s timeout
# (--shutdown-timeout only applies when torchrun itself is signalled): cap those runs.
SLOW_RUN = ("crash-ignore-term", "torchrun")


@dataclass
class RunResult:
    exit_code: int
    survivors: int
    first_line_s: float | None = None
    crash_to_exit_s: float | None = None
    latencies_ms: list[float] = field(default_factory=list)


class LineReader:
    """Reads a pipe in its own thread and timestamps every line on arrival."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.lines: list[tuple[float, bytes]] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        for line in iter(stream.readline, b""):
            arrived = time.monotonic()
            with self._changed:
                self.lines.append((arrived, line))
                self._changed.notify_all()

    def wait_for(self, token: bytes, count: int, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: sum(token in line for _, line in self.lines) >= count, timeout)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def tool_argv(tool: str, worker: Path, work: Path) -> list[str]:
    python = sys.executable
    if tool == "ours":
        return [
            python,
            "-m",
            "launcher",
            "--device",
            "cpu",
            "--nproc",
            "2",
            "--kill-grace",
            str(KILL_GRACE_S),
            "--run-dir",
            str(work / "run"),
            "--",
            python,
            str(worker),
        ]
    tee = ["--tee", "3"] if tool == "torchrun" else []
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        *tee,
        "--log-dir",
        str(work / "torchrun-logs"),
        "--master-port",
        str(free_port()),
        "--shutdown-timeout",
        f"{KILL_GRACE_S:g}",
        str(worker),
    ]


def tool_env(marker: str, mode: str, work: Path, lines: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            MARKER_VAR: marker,
            "BENCH_MODE": mode,
            "BENCH_CRASH_FILE": str(work / "crash"),
            "BENCH_LINES": str(lines),
            "BENCH_PACE_EVERY": str(LINE_PACE[0]),
            "BENCH_PACE_SLEEP": str(LINE_PACE[1]),
            # torchrun's own stdout is block-buffered on a pipe without this
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        }
    )
    return env


def run_once(tool: str, mode: str, lines: int) -> RunResult:
    """Start the tool on the worker script in `mode`, wait for its exit, measure."""
    marker = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="launcher-bench-") as tmp:
        work = Path(tmp)
        worker = work / "worker.py"
        worker.write_text(WORKER_SOURCE)
        proc, reader = None, None
        try:
            started = time.monotonic()
            proc = subprocess.Popen(
                tool_argv(tool, worker, work),
                env=tool_env(marker, mode, work, lines),
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            assert proc.stdout is not None  # a pipe
            reader = LineReader(proc.stdout)
            if mode == "supervisor-killed":
                if not reader.wait_for(b"BENCH ready", count=2, timeout=60):
                    raise RuntimeError(f"{tool}: workers never became ready")
                proc.kill()  # the tool's own pid only
            returncode = proc.wait(timeout=120)
            exited = time.monotonic()
            survivors = count_survivors({marker})
        finally:
            kill_marked(marker)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            if reader is not None:
                reader.join(timeout=5)
        result = RunResult(exit_code=128 - returncode if returncode < 0 else returncode, survivors=survivors)
        result.first_line_s = next((t - started for t, line in reader.lines if b"BENCH start" in line), None)
        if result.first_line_s is None:  # the tool never ran a worker: show why
            tail = b"".join(line for _, line in reader.lines[-5:]).decode(errors="replace")
            print(f"  warning: {tool} printed no worker line; its last output:\n{tail}", file=sys.stderr)
        crash_file = work / "crash"
        if mode in CRASHES and crash_file.exists():
            result.crash_to_exit_s = exited - float(crash_file.read_text())
        for arrived, line in reader.lines:
            if match := re.search(rb"BENCH lat (\d+\.\d+)", line):
                result.latencies_ms.append((arrived - float(match[1])) * 1000)
        if mode == "lines" and len(result.latencies_ms) != lines:
            print(f"  warning: {tool} delivered {len(result.latencies_ms)} of {lines} lines", file=sys.stderr)
        return result


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


Results = dict[tuple[str, str], list[RunResult]]


def run_all(repeat: int, lines: int, slow_runs: int) -> Results:
    results: Results = {}
    for i in range(repeat):  # tools interleaved, so drift on the machine hits both alike
        for mode, tools in SCENARIO_TOOLS.items():
            for tool in tools:
                if (mode, tool) == SLOW_RUN and i >= slow_runs:
                    continue
                result = run_once(tool, mode, lines)
                results.setdefault((mode, tool), []).append(result)
                print(
                    f"[{i + 1}/{repeat}] {mode:18} {tool:15} exit={result.exit_code} survivors={result.survivors}",
                    file=sys.stderr,
                )
    return results


def values(results: Results, mode: str, tool: str, pick: Callable[[RunResult], float | None]) -> list[float]:
    return [v for r in results[(mode, tool)] if (v := pick(r)) is not None]


def cell(vals: list[float], fmt: str = ".3f") -> str:
    return f"{statistics.median(vals):{fmt}} / {max(vals):{fmt}}" if vals else "n/a"


def comparison_row(name: str, ours: list[float], theirs: list[float], fmt: str, target: str, met: bool | None) -> list[str]:
    ok = "—" if met is None else yes_no(bool(ours) and met)
    return [name, cell(ours, fmt), cell(theirs, fmt), ratio(ours, theirs), target, ok]


def first_line_rows(results: Results) -> list[list[str]]:
    ours = values(results, "first-line", "ours", lambda r: r.first_line_s)
    rows = []
    for other, suffix in (("torchrun", ""), ("torchrun-notee", ", vs torchrun no --tee")):
        theirs = values(results, "first-line", other, lambda r: r.first_line_s)
        met = bool(ours and theirs) and statistics.median(ours) <= statistics.median(theirs)
        rows.append(comparison_row(f"launch → first worker line (s){suffix}", ours, theirs, ".3f", "≤ torchrun", met))
    return rows


def crash_rows(results: Results) -> list[list[str]]:
    rows = []
    for mode, (label, code) in CRASHES.items():
        ignores_term = mode == "crash-ignore-term"
        limit = KILL_GRACE_S + 0.5 if ignores_term else CRASH_TARGET_S
        target = f"≤ grace {KILL_GRACE_S:g} + 0.5 s" if ignores_term else f"≤ {limit} s"
        ours, theirs = (values(results, mode, tool, lambda r: r.crash_to_exit_s) for tool in ("ours", "torchrun"))
        rows.append(comparison_row(f"crash → exit {label} (s)", ours, theirs, ".3f", target, bool(ours) and max(ours) <= limit))
        codes = {tool: sorted({r.exit_code for r in results[(mode, tool)]}) for tool in ("ours", "torchrun")}
        rows.append(
            [
                f"exit code {label}",
                ", ".join(map(str, codes["ours"])),
                ", ".join(map(str, codes["torchrun"])),
                "—",
                f"{code} (worker's)",
                yes_no(codes["ours"] == [code]),
            ]
        )
    return rows


def latency_rows(results: Results) -> list[list[str]]:
    rows = []
    for q in (50, 99):

        def pick(r: RunResult, q: int = q) -> float | None:
            return percentile(r.latencies_ms, q) if len(r.latencies_ms) > 1 else None

        ours = values(results, "lines", "ours", pick)
        target = f"< {LATENCY_TARGET_MS:g} ms" if q == 99 else "—"
        met = (bool(ours) and max(ours) < LATENCY_TARGET_MS) if q == 99 else None
        for other, suffix in (("torchrun", ""), ("torchrun-notee", ", vs torchrun no --tee")):
            rows.append(
                comparison_row(f"line latency p{q} (ms){suffix}", ours, values(results, "lines", other, pick), ".2f", target, met)
            )
    return rows


def survivor_rows(results: Results) -> list[list[str]]:
    rows = []
    for mode in SCENARIO_TOOLS:
        ours, theirs = (values(results, mode, tool, lambda r: r.survivors) for tool in ("ours", "torchrun"))
        rows.append(
            [
                f"survivors after {mode} (processes)",
                cell(ours, ".0f"),
                cell(theirs, ".0f"),
                "—",
                "0",
                yes_no(bool(ours) and max(ours) == 0),
            ]
        )
    return rows


def print_results(results: Results, repeat: int, lines: int, elapsed: float) -> None:
    slow_runs = len(results[SLOW_RUN])
    note = (
        f"{repeat} repeats per cell, shown as median / max; `met?` judges the max, except first line "
        f"(median vs torchrun's median). Line latency: {lines} lines from rank 0, "
        f"{LINE_PACE[1] * 1000:g} ms sleep every {LINE_PACE[0]} lines. Grace: --kill-grace "
        f"{KILL_GRACE_S:g} (ours), --shutdown-timeout {KILL_GRACE_S:g} (torchrun; its failure path ignores it "
        f"and waits 30 s, so torchrun (c) ran {slow_runs} time(s)). "
        f"Total {elapsed:.0f} s."
    )
    print_table([note], first_line_rows(results) + crash_rows(results) + latency_rows(results) + survivor_rows(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per tool and scenario (default 5)")
    parser.add_argument("--lines", type=int, default=2000, help="lines printed in the latency scenario")
    parser.add_argument("--quick", action="store_true", help="2 repeats, 500 lines, torchrun (c) once")
    args = parser.parse_args()
    if args.repeat < 1 or args.lines < 2:
        parser.error("--repeat must be at least 1 and --lines at least 2")
    repeat, lines, slow_runs = (2, 500, 1) if args.quick else (args.repeat, args.lines, 2)
    unwind_on_signals()  # through run_once's cleanup
    started = time.monotonic()
    results = run_all(repeat, lines, slow_runs)
    print_results(results, repeat, lines, time.monotonic() - started)


if __name__ == "__main__":
    main()
