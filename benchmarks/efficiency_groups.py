"""The processes of benchmarks/efficiency.py: the FLOP count (one process of its own) and the real
runs (one group of ranks per nodes x ranks, efficiency_worker.py run), on loopback: N "nodes" of M
gloo ranks are N x M processes on this machine, numbered node-major with the environment torchrun
gives each worker (LOCAL_WORLD_SIZE=M, LOCAL_RANK, GROUP_RANK, ...), so the trainer and the
counters see the nodes a real job has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.efficiency_links import node_env
from launcher.launch import free_port

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "efficiency_worker.py"


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def worker_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("TORCH_LOGS", None)  # the counts come from dynamo's counters, not its logs
    return env


def run_group(
    jobs: list[dict[str, Any]], ranks: int, work: Path, timeout: float, nodes: int = 1
) -> tuple[list[list[dict[str, Any]]], str]:
    """Run the rows of jobs in one group of nodes x ranks processes (efficiency_worker.py); (each
    rank's results, in job order; an error that stopped them all, else ""). Rank 0's stderr
    (progress) comes through; the others' go to files, shown when a rank fails."""
    world, tag = nodes * ranks, f"{nodes}x{ranks}"
    jobs_file, results = work / f"jobs-{tag}.json", work / f"results-{tag}"
    jobs_file.write_text(json.dumps(jobs))
    port = free_port()
    env = worker_env()
    processes, logs = [], []
    for rank in range(world):
        rank_env = env | node_env(rank, nodes, ranks) | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        log = open(work / f"rank{tag}-{rank}.log", "w")  # noqa: SIM115 (closed below)
        logs.append(log)
        argv = [sys.executable, str(WORKER), "run", str(jobs_file), str(results)]
        processes.append(subprocess.Popen(argv, cwd=REPO, env=rank_env, stdout=log, stderr=None if rank == 0 else log))
    error, deadline = "", time.monotonic() + timeout * len(jobs)
    for rank, process in enumerate(processes):
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            error = error or f"timed out after {timeout * len(jobs):.0f} s"
            for other in processes:
                other.kill()
            process.wait()
        if process.returncode and not error:
            error = f"rank {rank} exited with status {process.returncode}"
    for log in logs:
        log.close()
    files = [Path(f"{results}.rank{r}") for r in range(world)]
    if error or not all(f.exists() for f in files):
        tail = (work / f"rank{tag}-{world - 1}.log").read_text().strip().splitlines()[-12:]
        progress("  the group failed; the last rank's last output:\n" + "\n".join(tail))
        return [], error or "no results written"
    return [json.loads(f.read_text()) for f in files], ""


def count_all(jobs: list[dict[str, Any]], work: Path, timeout: float) -> list[dict[str, Any]]:
    """Every job's FLOP count from one efficiency_worker.py count process ({"error": ...} each when it failed)."""
    jobs_file, results = work / "count-jobs.json", work / "counts.json"
    jobs_file.write_text(json.dumps(jobs))
    argv = [sys.executable, str(WORKER), "count", str(jobs_file), str(results)]
    try:
        done = subprocess.run(argv, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"error": f"the FLOP count timed out after {timeout:.0f} s"}] * len(jobs)
    if done.returncode or not results.exists():
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        progress("  the FLOP count failed; its last output:\n" + "\n".join(lines[-12:]))
        return [{"error": lines[-1][:200]}] * len(jobs)
    return json.loads(results.read_text())
