"""GPU check of how NCCL reaches the other GPU: two launched workers all-reduce once seeing only
their own GPU and once seeing both (LAUNCHER_GPU_VISIBILITY=own, node), with NCCL_DEBUG=INFO
naming the transport it chose (P2P, NVLS, SHM), the bus bandwidth measured, and NVML's process
lists read while the workers hold their GPUs: no worker may have a context on the other's GPU.
The way the launcher chooses for training (launcher/gpus/visibility.py) must be at least as fast.
Reported as skipped on a machine with one GPU."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

from benchmarks.gpu_acceptance.context import Context, Row
from benchmarks.gpu_acceptance.procs import LAST_LINES, child_env, kill_group, results, smi_query, watch, worker_argv
from benchmarks.gpu_acceptance.workers_runtime import ALL_REDUCE_MIB, HOLD_S, HOLDING
from benchmarks.gpu_acceptance.nccl_transport import Contexts, Transport, bus_bandwidth, run_contexts, smi_processes, transport

NAME = "nccl-transport"
SLOWER_ALLOWED = 0.9
"""The launcher's choice may measure down to this share of the other way's bus bandwidth (noise)."""
SEES = {"own": "each worker sees only its own GPU", "node": "each worker sees both GPUs"}


@dataclass
class Measured:
    """One launch of the two workers, with one way of showing them the GPUs."""

    mode: str
    transport: Transport
    bus_gbps: float
    contexts: Contexts
    other_contexts: list[int] | None
    """Other visible GPUs with a primary context in some worker (None: this torch cannot say)."""
    devices: list[str]
    worker_pids: list[int]
    compiled: str
    """Whether the workers' small torch.compile ran (its compile processes count among the run's)."""


def check_nccl_transport(ctx: Context) -> list[Row]:
    name = "NCCL all-reduce between 2 GPUs: transport, bus bandwidth, contexts"
    if len(ctx.gpus) < 2:
        return [Row(name, "skipped: one GPU", "2+ GPUs", "n.a.")]
    uuids, link, shared = _pair(ctx.gpus[:2])
    chosen = "node" if shared else "own"
    measured: dict[str, Measured | Row] = {}
    for mode in ("own", "node"):
        measured[mode] = _measure(ctx, uuids, mode, f"NCCL all-reduce, GPUs {_ids(ctx)} ({link}), {SEES[mode]}")
    rows = []
    for mode, other in (("own", "node"), ("node", "own")):
        this = measured[mode]
        if isinstance(this, Row):
            rows.append(this)
            continue
        rival = measured[other]
        rows.append(_row(this, _ids(ctx), link, mode == chosen, None if isinstance(rival, Row) else rival.bus_gbps))
    return rows


def _ids(ctx: Context) -> str:
    return ",".join(map(str, ctx.gpus[:2]))


def _pair(indices: list[int]) -> tuple[list[str], str, bool]:
    """The two GPUs' UUIDs, how NVML says they reach each other, and whether the launcher shows
    training workers both (as it would for these two)."""
    from launcher.gpus import nvml, visibility

    gpus = [g for g in nvml.discover(window=0, samples=1) if not g.mig and g.index in indices]
    links = nvml.peer_links(gpus)
    shared = visibility.choose(gpus, links, own_command=False, wanted="auto").shared
    return [g.uuid for g in gpus], "/".join(sorted(set(links.values()))) or "?", shared


def _gpu_processes() -> dict[str, set[int]]:
    return smi_processes(smi_query("gpu_uuid", "pid", what="compute-apps"))


def _measure(ctx: Context, uuids: list[str], mode: str, name: str) -> Measured | Row:
    """Launch the two workers with LAUNCHER_GPU_VISIBILITY=mode; NVML's processes are read
    before the launch and while both workers hold their GPUs (then released)."""
    release = ctx.tmp / f"{NAME}-{mode}.release"
    env = child_env(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P,SHM,NET", LAUNCHER_GPU_VISIBILITY=mode)
    argv = [
        sys.executable,
        "-m",
        "launcher",
        "--gpus",
        _ids(ctx),
        "--run-dir",
        ctx.run_dir(f"{NAME}-{mode}"),
        "--",
        *worker_argv("nccl-transport", str(release)),
    ]
    before = _gpu_processes()
    watched = watch(argv, marker=HOLDING, env=env)
    during: dict[str, set[int]] = {}
    try:
        deadline = time.monotonic() + HOLD_S + 180
        while time.monotonic() < deadline and watched.proc.poll() is None:
            if sum(HOLDING in line for line in watched.lines) >= 2:
                during = _gpu_processes()
                break
            time.sleep(0.2)
    finally:
        release.touch()
        try:
            code: int | None = watched.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            code = None
        kill_group(watched.proc)
        watched.reader.join(timeout=10)
    out = "".join(watched.lines)
    found = sorted(results(out), key=lambda r: r["rank"])
    if code != 0 or len(found) != 2 or not during:
        tail = "$ " + " ".join(argv) + "\n" + "".join(watched.lines[-LAST_LINES:])
        how = "timed out" if code is None else f"exit {code}"
        return Row(name, f"FAILED: {how}; {len(found)} of 2 results", "-", "no", failure=tail)
    reported = [r["other_contexts"] for r in found]
    return Measured(
        mode=mode,
        transport=transport(out),
        bus_gbps=bus_bandwidth(found[0]["bytes"], max(r["seconds"] for r in found), found[0]["ranks"]),
        contexts=run_contexts(before, during, uuids),
        other_contexts=None if None in reported else sorted({i for r in reported for i in r}),
        devices=[r["device"] for r in found],
        worker_pids=[r["pid"] for r in found],
        compiled=", ".join(sorted({r.get("compiled", "?") for r in found})),
    )


def _row(m: Measured, ids: str, link: str, chosen: bool, rival_gbps: float | None) -> Row:
    in_process = "not reported by this torch" if m.other_contexts is None else ", ".join(map(str, m.other_contexts)) or "none"
    faster = rival_gbps is None or m.bus_gbps >= SLOWER_ALLOWED * rival_gbps
    ok = m.contexts.ok is not False and not m.other_contexts and (faster or not chosen)
    target = "no worker with a context on the other's GPU"
    if chosen:
        target = f"the launcher's choice for training: {target}; bus bandwidth >= {SLOWER_ALLOWED:g} x the other way's"
    return Row(
        f"NCCL all-reduce, GPUs {ids} ({link}), {SEES[m.mode]}" + (" (training's choice)" if chosen else ""),
        f"{m.transport.describe()}; bus bandwidth {m.bus_gbps:.1f} GB/s ({ALL_REDUCE_MIB} MiB fp32); workers on "
        f"{', '.join(m.devices)}; {m.contexts.describe(m.worker_pids)}; other GPUs with a context in a worker: {in_process}; "
        f"torch.compile: {m.compiled}",
        target,
        "yes" if ok else "no",
    )
