"""What the tests of several nodes share: launchers started as nodes on 127.0.0.1, and their output."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from support.processes import ROOT, free_port, launcher_env


STEP = re.compile(r"^(CPU\d):INFO \| \[CPU (\d)\] Step \[(\d+)/\d+\] \| Loss: (\d+\.\d{4})", re.M)
TRAIN = ["--debug", "--device", "cpu", "--nproc", "1", "--set", "data.context_length=64", "--set", "training.batch_size=4"]
MARKER = "MULTINODE_TEST_MARKER"


def worker_command(tmp_path: Path, source: str) -> list[str]:
    """`-- python <tmp_path>/worker.py <tmp_path>/shared`: a worker script (source) for every node's
    launcher, with a directory its ranks share to leave word in."""
    (tmp_path / "shared").mkdir()
    path = tmp_path / "worker.py"
    path.write_text(source)
    return ["--", sys.executable, str(path), str(tmp_path / "shared")]


@dataclass
class NodeRun:
    """One launcher started as one node; its output goes to a file (read while it runs)."""

    rank: int
    proc: subprocess.Popen
    out: Path

    @property
    def text(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def wait(self, timeout: float = 240) -> int:
        return self.proc.wait(timeout=timeout)


def start_nodes(
    tmp_path: Path,
    processes: Callable[..., subprocess.Popen],
    options: list[str],
    nnodes: int = 2,
    ranks: tuple[int, ...] | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> list[NodeRun]:
    """Launchers for ranks (default every node), node 1 first: node 0 need not be up first."""
    port = port or free_port()
    runs = []
    for rank in sorted(ranks if ranks is not None else range(nnodes), reverse=True):
        out = tmp_path / f"node{rank}-{uuid.uuid4().hex[:6]}.out"
        flags = ["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        argv = [sys.executable, "-m", "launcher", *flags, *options]
        with out.open("w") as handle:
            proc = processes(
                argv, cwd=ROOT, env=(env or launcher_env()) | runs_in(tmp_path), stdout=handle, stderr=subprocess.STDOUT
            )
        runs.append(NodeRun(rank, proc, out))
    return sorted(runs, key=lambda run: run.rank)


def runs_in(tmp_path: Path) -> dict[str, str]:
    """Run directories of generic commands go to the test's own directory, not the clone's runs/."""
    return {"PRETRAIN_RUNS_DIR": str(tmp_path / "runs")}


def losses(text: str) -> dict[tuple[str, int], str]:
    return {(label, int(step)): loss for label, _, step, loss in STEP.findall(text)}


def train_options(tmp_path: Path, run_dir: Path, *more: str) -> list[str]:
    return [*TRAIN, "--run-dir", str(run_dir), "--set", f"data.cache_dir={tmp_path / 'cache'}", *more]


def training_worker(launcher: subprocess.Popen) -> psutil.Process | None:
    for child in psutil.Process(launcher.pid).children():
        try:
            if "pretrain" in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            pass
    return None


def marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER) == marker:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found
