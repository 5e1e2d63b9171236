"""Benchmark: this launcher's multi-node mode against torchrun, two "nodes" on one machine.

Run from the repository root:

    PYTHONPATH=. python benchmarks/multinode.py [--repeat N] [--quick] [--timeout S]

Each run starts two processes of one tool on 127.0.0.1, one CPU worker each, as two nodes:
- this launcher: `python -m launcher --device cpu --nproc 1 --nnodes 2 --node-rank {0,1}
  --master-addr 127.0.0.1 --master-port PORT --kill-grace 2 -- python worker.py`;
- torchrun: `python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d
  --rdzv-endpoint 127.0.0.1:PORT --rdzv-id bench-<uuid> --max-restarts 0 --shutdown-timeout 2
  worker.py`, the first with `--rdzv-conf is_host=1` and the second with `is_host=0` (on real
  machines only the endpoint's host matches; on one machine both would race to host the store).
  c10d numbers the nodes itself.
"Node 0" and "node 1" below are the tool processes whose worker is global rank 0 and 1 (found
from the process tree). Each worker, once up, writes a ready file in a shared directory and
polls until every worker's is there (the handshake; no sleep stands in for synchronization).
Measured, per scenario, each in two variants: "sleeping" workers (plain Python, no process
group: this measures the supervisors alone) and "gloo" workers (init_process_group("gloo"), then
all_reduce of 16 floats every 10 ms, so a dead peer also breaks the collectives: the realistic case):
1. cross-node failure: after the handshake, and once the benchmark has found which tool process
   is which node (it then creates a "go" file that rank 1 polls for), rank 1 writes its
   time.monotonic() to a file and os._exit(7)s. From that instant (one machine, so one clock)
   until waitpid has returned for both tool processes (a thread per process). Also each node's
   exit code.
2. node loss: after the handshake the benchmark SIGKILLs node 1's tool process (the process it
   started: our launcher, or torchrun's agent). From just before the kill until node 0's tool
   exits; node 0's exit code.
Survivors: every process of a run carries a unique marker in its environment (one per node).
Once the measurement is over, the marked processes of every node whose tool has ended (the
killed one included) are polled for up to SURVIVOR_POLL_S: survivors are those still alive then.
A node whose tool is still running at the timeout is not counted (it is killed).
Every run uses fresh ports and has a timeout (--timeout, default 60 s, from the crash or the
kill); a run that reaches it is reported as "> timeout", and then every marked process is
SIGKILLed, as after each run, so the benchmark leaves nothing behind. A cell (scenario, variant,
tool) that has timed out SLOW_RUNS times (--quick: once) is not run again.
Progress goes to stderr; the Markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
if Path(sys.path[0]).resolve() == REPO / "benchmarks":  # run as a script: the repository, not benchmarks/
    sys.path[0] = str(REPO)  # (launcher.py there would shadow the launcher package)
from benchmarks.harness import (  # noqa: E402
    MARKER_VAR,
    SURVIVOR_POLL_S,
    count_survivors,
    free_port,
    kill_marked,
    print_table,
    ratio,
    unwind_on_signals,
    yes_no,
)

KILL_GRACE_S = 2.0  # ours: --kill-grace; torchrun: --shutdown-timeout (parity)
CRASH_CODE = 7
# the launcher's exit codes for another node's failure and a lost node, copied: this benchmark
# runs the launcher only as a command, as it runs torchrun
EXIT_OTHER_NODE_FAILED = 75
EXIT_NODE_LOST = 76
LOSS_AFTER_S = 3.0
FAILURE_TARGET_S = 2.0  # issue 18: any node's failure tears down every node within 2 s
LOSS_TARGET_S = 5.0  # issue 18: node 1's launcher SIGKILLed, node 0 stops within 5 s
STARTUP_TIMEOUT_S = 120.0  # four processes importing torch on a small machine
SLOW_RUNS = 2
STEP_PAUSE_S = 0.01
TOOLS = ("ours", "torchrun")
SCENARIOS = {"crash": "cross-node failure → every launcher exits", "loss": "node 1 SIGKILLed → node 0 exits"}
VARIANTS = {False: "sleeping workers", True: "gloo workers"}

WORKER_SOURCE = r"""
import os, sys, time
from pathlib import Path

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
sync, scenario = Path(os.environ["BENCH_SYNC_DIR"]), os.environ["BENCH_SCENARIO"]
gloo = os.environ["BENCH_GLOO"] == "1"

def write_atomically(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

if gloo:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    tensor = torch.ones(16)
    dist.all_reduce(tensor)
write_atomically(sync / f"ready.{rank}", str(os.getpid()))
while sum(1 for p in sync.glob("ready.*") if not p.name.endswith(".tmp")) < world:
    time.sleep(0.005)  # polling the handshake, not waiting a fixed time
if scenario == "crash" and rank == 1:
    while not (sync / "go").exists():  # the benchmark has found which process is which node
        time.sleep(0.005)
    write_atomically(Path(os.environ["BENCH_CRASH_FILE"]), repr(time.monotonic()))
    os._exit(int(os.environ["BENCH_CRASH_CODE"]))
pause = float(os.environ["BENCH_STEP_PAUSE"])
while gloo:
    dist.all_reduce(tensor)
    time.sleep(pause)
time.sleep(600)
"""


@dataclass(frozen=True)
class Case:
    scenario: str  # "crash" or "loss"
    gloo: bool
    tool: str  # "ours" or "torchrun"


@dataclass
class RunResult:
    exit_codes: tuple[int | None, int | None]
    """Node 0's and node 1's tool exit codes (-N: killed by signal N; None: still running at the timeout)."""
    seconds: float | None
    """Crash -> both tools exited, or kill -> node 0 exited; None when the run timed out."""
    survivors: int
    exit_after: tuple[float | None, float | None]
    """Each node's tool exit, seconds after the crash or the kill (progress lines only)."""
    victim_hosted_store: bool = False


class BenchError(RuntimeError):
    """A run that never got as far as measuring (a tool failed to start its worker)."""


class Tool:
    """One tool process (one node), its output in a log file, its exit instant taken by a thread
    blocked in waitpid."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, marker: str) -> None:
        self.log, self.marker = log, marker
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.exited_at: float | None = None
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        self.proc.wait()
        self.exited_at = time.monotonic()

    def wait_until(self, deadline: float) -> bool:
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return self.exited_at is not None

    @property
    def exit_code(self) -> int | None:
        return self.proc.returncode if self.exited_at is not None else None

    def tail(self, lines: int = 8) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def reap(self) -> None:
        if self.exited_at is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        self._thread.join(5)


def tool_argv(tool: str, index: int, port: int, rdzv_id: str, worker: Path, work: Path) -> list[str]:
    python = sys.executable
    if tool == "ours":
        return [
            python,
            "-m",
            "launcher",
            "--device",
            "cpu",
            "--nproc",
            "1",
            "--nnodes",
            "2",
            "--node-rank",
            str(index),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--kill-grace",
            f"{KILL_GRACE_S:g}",
            "--",
            python,
            str(worker),
        ]
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        f"is_host={int(index == 0)}",
        "--max-restarts",
        "0",
        "--shutdown-timeout",
        f"{KILL_GRACE_S:g}",
        "--log-dir",
        str(work / f"torchrun-logs{index}"),
        str(worker),
    ]


def tool_env(marker: str, case: Case, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            MARKER_VAR: marker,
            "BENCH_SCENARIO": case.scenario,
            "BENCH_GLOO": str(int(case.gloo)),
            "BENCH_SYNC_DIR": str(work / "sync"),
            "BENCH_CRASH_FILE": str(work / "crash"),
            "BENCH_CRASH_CODE": str(CRASH_CODE),
            "BENCH_STEP_PAUSE": str(STEP_PAUSE_S),
            "PRETRAIN_RUNS_DIR": str(work / "runs"),
            "PRETRAIN_CACHE_DIR": str(work / "cache"),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        }
    )
    return env


def wait_ready(sync: Path, tools: list[Tool], deadline: float) -> dict[int, int]:
    """Every worker's pid by global rank, once all have written their ready file."""
    while time.monotonic() < deadline:
        ready = {int(p.name.split(".")[1]): p for p in sync.glob("ready.*") if not p.name.endswith(".tmp")}
        if len(ready) == len(tools):
            return {rank: int(path.read_text()) for rank, path in ready.items()}
        if any(tool.exited_at is not None for tool in tools):
            break
        time.sleep(0.01)
    logs = "\n".join(f"  node process {i} (exit {t.exit_code}):\n{t.tail()}" for i, t in enumerate(tools))
    raise BenchError(f"the workers never all became ready; the tools' last output:\n{logs}")


def owner(worker_pid: int, tools: list[Tool]) -> Tool:
    """The tool whose process tree holds this worker."""
    try:
        ancestors = {parent.pid for parent in psutil.Process(worker_pid).parents()}
    except psutil.Error as error:
        raise BenchError(f"worker {worker_pid} is gone before the measurement: {error}") from None
    for tool in tools:
        if tool.proc.pid in ancestors:
            return tool
    raise BenchError(f"worker {worker_pid} belongs to neither tool process")


def wait_for_file(path: Path, deadline: float) -> float | None:
    while time.monotonic() < deadline:
        if path.exists():
            return float(path.read_text())
        time.sleep(0.005)
    return None


def measure_crash(tools: list[Tool], crash_file: Path, timeout: float) -> tuple[float | None, float]:
    """Waits for both tools (each until the timeout); seconds until the later exit, and the crash instant."""
    crashed_at = wait_for_file(crash_file, time.monotonic() + timeout)
    if crashed_at is None:
        raise BenchError("rank 1 never recorded its crash")
    exits = [tool.exited_at for tool in tools if tool.wait_until(crashed_at + timeout) and tool.exited_at is not None]
    return (max(exits) - crashed_at if len(exits) == len(tools) else None), crashed_at


def measure_loss(node0: Tool, node1: Tool, timeout: float) -> tuple[float | None, float]:
    """SIGKILLs node 1's tool and waits for node 0's (until the timeout); seconds until it exited, and the kill instant."""
    killed_at = time.monotonic()
    node1.proc.kill()  # the tool's own pid only
    node1.wait_until(killed_at + timeout)
    node0.wait_until(killed_at + timeout)
    return (node0.exited_at - killed_at if node0.exited_at is not None else None), killed_at


def since(tool: Tool, start: float) -> float | None:
    return None if tool.exited_at is None else tool.exited_at - start


def run_once(case: Case, timeout: float) -> RunResult:
    """Start two nodes of the tool on the worker script, make node 1 fail or kill it, measure."""
    run = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="multinode-bench-") as tmp:
        work = Path(tmp)
        (work / "sync").mkdir()
        worker = work / "worker.py"
        worker.write_text(WORKER_SOURCE)
        port, rdzv_id = free_port(), f"bench-{run}"
        tools: list[Tool] = []
        try:
            for index in range(2):
                marker = f"{run}.{index}"
                argv = tool_argv(case.tool, index, port, rdzv_id, worker, work)
                tools.append(Tool(argv, tool_env(marker, case, work), work / f"node{index}.log", marker))
            workers = wait_ready(work / "sync", tools, time.monotonic() + STARTUP_TIMEOUT_S)
            node0, node1 = owner(workers[0], tools), owner(workers[1], tools)
            (work / "sync" / "go").touch()  # rank 1 crashes only now, once its node is known
            if case.scenario == "crash":
                seconds, start = measure_crash([node0, node1], work / "crash", timeout)
            else:
                seconds, start = measure_loss(node0, node1, timeout)
            return RunResult(
                exit_codes=(node0.exit_code, node1.exit_code),
                seconds=seconds,
                survivors=count_survivors({tool.marker for tool in tools if tool.exited_at is not None}),
                exit_after=(since(node0, start), since(node1, start)),
                victim_hosted_store=node1 is tools[0],
            )
        finally:
            kill_marked(run)
            for tool in tools:
                tool.reap()


Results = dict[Case, list[RunResult]]


def run_all(repeat: int, timeout: float, slow_runs: int) -> Results:
    results: Results = {}
    for i in range(repeat):  # tools interleaved, so drift on the machine hits both alike
        for scenario in SCENARIOS:
            for gloo in VARIANTS:
                for tool in TOOLS:
                    case = Case(scenario, gloo, tool)
                    done = results.setdefault(case, [])
                    if sum(r.seconds is None for r in done) >= slow_runs:
                        continue
                    prefix = f"[{i + 1}/{repeat}] {scenario:5} {'gloo' if gloo else 'sleep':5} {tool:8}"
                    try:
                        result = run_once(case, timeout)
                    except BenchError as error:
                        print(f"{prefix} not measured: {error}", file=sys.stderr)
                        continue
                    done.append(result)
                    took = f"{result.seconds:.3f} s" if result.seconds is not None else f"> {timeout:g} s (timeout)"
                    each = " / ".join("running" if t is None else f"{t:.3f}" for t in result.exit_after)
                    print(
                        f"{prefix} {took:>22}  exits after {each} s  exit={format_codes(result.exit_codes)} "
                        f"survivors={result.survivors}",
                        file=sys.stderr,
                    )
                    if result.victim_hosted_store:
                        print("  note: the killed torchrun hosted the rendezvous store", file=sys.stderr)
    return results


def format_code(code: int | None) -> str:
    if code is None:
        return "running"
    return f"killed ({signal.Signals(-code).name})" if code < 0 else str(code)


def format_codes(codes: tuple[int | None, int | None]) -> str:
    return " / ".join(map(format_code, codes))


def time_cell(runs: list[RunResult], timeout: float) -> str:
    times = finished(runs)
    timed_out = len(runs) - len(times)
    parts = [f"{statistics.median(times):.3f} / {max(times):.3f}"] if times else []
    if timed_out:
        parts.append(f"{timed_out} of {len(runs)} > {timeout:g} (timeout)")
    return "; ".join(parts) or "n/a"


def finished(runs: list[RunResult]) -> list[float]:
    """The times of the runs that ended before the timeout."""
    return [r.seconds for r in runs if r.seconds is not None]


def codes_cell(runs: list[RunResult]) -> str:
    return ", ".join(sorted({format_codes(r.exit_codes) for r in runs})) or "n/a"


def case_rows(results: Results, scenario: str, gloo: bool, timeout: float) -> list[list[str]]:
    ours, theirs = results.get(Case(scenario, gloo, "ours"), []), results.get(Case(scenario, gloo, "torchrun"), [])
    label = f"{SCENARIOS[scenario]}, {VARIANTS[gloo]}"
    limit = FAILURE_TARGET_S if scenario == "crash" else LOSS_TARGET_S
    met_time = bool(ours) and all(r.seconds is not None and r.seconds <= limit for r in ours)
    if scenario == "crash":
        expected = (EXIT_OTHER_NODE_FAILED, CRASH_CODE)
        code_target = f"{EXIT_OTHER_NODE_FAILED} / {CRASH_CODE} (worker's)"
    else:
        expected = (EXIT_NODE_LOST, -signal.SIGKILL)
        code_target = f"{EXIT_NODE_LOST} / killed"
    return [
        [
            f"{label} (s)",
            time_cell(ours, timeout),
            time_cell(theirs, timeout),
            ratio(finished(ours), finished(theirs), timeout),
            f"≤ {limit:g} s",
            yes_no(met_time),
        ],
        [
            f"{label}: exit codes node 0 / node 1",
            codes_cell(ours),
            codes_cell(theirs),
            "—",
            code_target,
            yes_no(bool(ours) and all(r.exit_codes == expected for r in ours)),
        ],
        [
            f"{label}: survivors (processes)",
            survivors_cell(ours),
            survivors_cell(theirs),
            "—",
            "0",
            yes_no(bool(ours) and all(r.survivors == 0 for r in ours)),
        ],
    ]


def survivors_cell(runs: list[RunResult]) -> str:
    counts = [r.survivors for r in runs]
    return f"{statistics.median(counts):.0f} / {max(counts)}" if counts else "n/a"


def print_results(results: Results, repeat: int, timeout: float, slow_runs: int, elapsed: float) -> None:
    setup = (
        f"Two nodes on 127.0.0.1, one CPU worker each; {repeat} repeats per cell, except that a cell stops "
        f"after {slow_runs} timed-out run(s) (timeout {timeout:g} s). Grace: --kill-grace {KILL_GRACE_S:g} (ours), "
        f"--shutdown-timeout {KILL_GRACE_S:g} (torchrun, --max-restarts 0, c10d rendezvous). Total {elapsed:.0f} s."
    )
    columns = (
        "Columns: times are median / max over the runs that finished (s), and how many reached the timeout. "
        "Cross-node failure: from rank 1's os._exit(7) until both tool processes have exited. Node loss: from "
        "SIGKILL of node 1's tool process until node 0's has exited. Exit codes: node 0 / node 1 (the nodes of "
        "global ranks 0 and 1), each distinct pair seen; `running` = still running at the timeout. Survivors: "
        f"marked processes still alive once the measurement is over (polled for up to {SURVIVOR_POLL_S:g} s) whose "
        "tool has ended, the killed one included (a tool killed at the timeout is not counted), median / max. "
        "Ratio: medians, ours / torchrun (`< x` when every torchrun run timed out). "
        "`met?` judges every run of this launcher against the target."
    )
    rows = [row for scenario in SCENARIOS for gloo in VARIANTS for row in case_rows(results, scenario, gloo, timeout)]
    print_table([setup, columns], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per tool, scenario and variant (default 5)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a run may take after the crash or kill (default 60)")
    parser.add_argument("--quick", action="store_true", help="2 repeats; a cell that times out runs once")
    args = parser.parse_args()
    if args.repeat < 1 or args.timeout <= 0:
        parser.error("--repeat must be at least 1 and --timeout positive")
    repeat, slow_runs = (2, 1) if args.quick else (args.repeat, SLOW_RUNS)
    unwind_on_signals()  # through run_once's cleanup
    started = time.monotonic()
    results = run_all(repeat, args.timeout, slow_runs)
    print_results(results, repeat, args.timeout, slow_runs, time.monotonic() - started)


if __name__ == "__main__":
    main()
