"""GPU check `gpus`: the launcher's GPU list (`python -m launcher gpus`, and launcher.gpus.nvml as its
workers read it) against nvidia-smi's, while a process of ours holds 1 GiB on the first GPU.

NVML names processes by their pid in the host's pid namespace; inside a container our holder
has another pid there, so its own os pid cannot be looked up in NVML's list. find_holder decides
which of NVML's processes is ours without mapping pids across namespaces: the processes NVML
lists on the holder's GPU while it holds its memory, less those listed before it started. Our
own pid among them means one pid namespace; otherwise the one new process (holding at least the
1 GiB we allocated, where NVML reports memory) is ours under its host pid. Where NVML lists no
process at all (a container whose driver hides other namespaces' processes), the GPU's used
memory must have risen by what the holder holds. The launcher's table must then show the pid
NVML gave our holder, whichever namespace it belongs to.
"""

from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from benchmarks.gpu_acceptance.context import Context, Row
from benchmarks.gpu_acceptance.procs import (
    ENTRY,
    REPO,
    CheckFailed,
    child_env,
    compute_apps,
    failed,
    kill_group,
    launcher,
    smi_query,
    worker,
)

HELD_MIB = 1024
"""What the hold worker allocates (workers.worker_hold: 2^30 bytes); NVML counts its CUDA context on top."""
READY_S = 180
"""How long the holder may take to start (import torch, create its context, allocate)."""


@dataclass(frozen=True)
class HolderFinding:
    """Which of NVML's processes is our holder, and whether that is what it should be."""

    pid: int | None
    """The pid NVML lists our holder under (a host pid inside a container); None: not identified."""
    ok: bool
    how: str
    """One clause saying how it was found, or why not."""


def on_gpu(apps: Mapping[tuple[str, int], int | None], uuid: str) -> dict[int, int | None]:
    """The processes of one GPU: pid -> MiB."""
    return {pid: mib for (gpu, pid), mib in apps.items() if gpu == uuid}


def find_holder(
    before: Mapping[int, int | None],
    during: Mapping[int, int | None],
    own_pid: int,
    used_rise_mib: int | None,
    held_mib: int = HELD_MIB,
) -> HolderFinding:
    """Our holder among NVML's processes of its GPU (pid -> MiB, before it started and while it
    holds held_mib), own_pid being its pid as this process sees it, used_rise_mib how much the
    GPU's used memory rose meanwhile (None: not read). See the module's docstring."""
    new = {pid: mib for pid, mib in during.items() if pid not in before}

    def holds(mib: int | None) -> bool:
        return mib is None or mib >= held_mib

    def too_little(mib: int | None) -> str:
        return "" if holds(mib) else f", but with {mib} MiB, below the {held_mib} MiB it holds"

    if own_pid in new:
        mib = new[own_pid]
        return HolderFinding(
            own_pid, holds(mib), f"NVML lists our holder under its own pid {own_pid} (one pid namespace){too_little(mib)}"
        )
    big = {pid: mib for pid, mib in new.items() if holds(mib)}
    if len(new) == 1 or len(big) == 1:
        ((pid, mib),) = (new if len(new) == 1 else big).items()
        return HolderFinding(
            pid,
            holds(mib),
            f"NVML lists our holder (pid {own_pid} here) as host pid {pid}: another pid namespace, a container{too_little(mib)}",
        )
    if new:
        return HolderFinding(
            None, False, f"{len(new)} processes appeared on the GPU while ours held it, none alone with {held_mib} MiB"
        )
    if not during:
        rose = used_rise_mib is not None and used_rise_mib >= held_mib
        seen = "not read" if used_rise_mib is None else f"rose by {used_rise_mib} MiB"
        return HolderFinding(
            None,
            rose,
            f"NVML lists no process on the GPU (this container cannot see them); its used memory {seen}"
            + ("" if rose else f", not the {held_mib} MiB our holder holds"),
        )
    return HolderFinding(None, False, f"NVML lists {len(during)} process(es) on the GPU, none new while ours held {held_mib} MiB")


def start_holder(index: int) -> subprocess.Popen:
    """The hold worker on GPU index, once it says it holds its memory."""
    holder = subprocess.Popen(
        [sys.executable, str(ENTRY), "--worker", "hold", str(index)],
        cwd=REPO,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert holder.stdout is not None  # a pipe
    ready = holder.stdout.readline() if select.select([holder.stdout], [], [], READY_S)[0] else f"(no answer in {READY_S} s)"
    if "ready" not in ready:
        kill_group(holder)
        raise CheckFailed(f"the process that holds {HELD_MIB} MiB on the GPU did not start", ready)
    return holder


def used_mib(index: int) -> int:
    return int(smi_query("memory.used", index=index)[0][0])


def check_gpus(ctx: Context) -> list[Row]:
    """The launcher's GPU list against nvidia-smi's, with a process of ours holding memory."""
    index = ctx.gpus[0]
    apps_before, used_before = compute_apps(smi_query("gpu_uuid", "pid", "used_memory", what="compute-apps")), used_mib(index)
    holder = start_holder(index)
    assert holder.stdin is not None  # a pipe: closing it releases the memory
    try:
        ours = worker("nvml", 120)
        smi = {
            int(i): (uuid, int(total), int(used))
            for i, uuid, total, used in smi_query("index", "uuid", "memory.total", "memory.used")
        }
        apps = compute_apps(smi_query("gpu_uuid", "pid", "used_memory", what="compute-apps"))
        table = launcher("gpus", timeout=120)
    finally:
        holder.stdin.close()
        kill_group(holder)
    problems = []
    mine = {g["index"]: g for g in ours if not g["mig"]}
    if sorted(mine) != sorted(smi):
        problems.append(f"indices {sorted(mine)} vs nvidia-smi {sorted(smi)}")
    for i, (uuid, total, _) in smi.items():
        gpu = mine.get(i)
        if gpu and (gpu["uuid"] != uuid or gpu["memory_total"] // 2**20 != total):
            problems.append(f"GPU {i}: {gpu['uuid']} {gpu['memory_total'] // 2**20} MiB vs {uuid} {total} MiB")
    processes = {(g["uuid"], pid): None if memory is None else memory // 2**20 for g in ours for pid, memory in g["processes"]}
    if processes != apps:
        problems.append(f"processes (GPU, PID): MiB {sorted(processes.items())} vs nvidia-smi {sorted(apps.items())}")
    uuid, _, used = smi.get(index, ("", 0, None))
    rise = None if used is None else used - used_before
    found = find_holder(on_gpu(apps_before, uuid), on_gpu(apps, uuid), holder.pid, rise)
    if not found.ok:
        problems.append(found.how)
    if not table.ok:
        raise failed("python -m launcher gpus", table)
    shown = [line.split()[0] for line in table.out.splitlines()[1:] if line.strip() and line.split()[0].isdigit()]
    if sorted(map(int, shown)) != sorted(smi):
        problems.append(f"the table shows GPUs {shown}")
    if found.pid is not None and str(found.pid) not in table.out:
        problems.append(f"the table does not show our holder (pid {found.pid} in NVML)")
    result = (
        f"{len(smi)} GPU(s): index, UUID, memory and {len(apps)} process(es) with their memory agree; {found.how}"
        if not problems
        else "; ".join(problems)
    )
    return [
        Row(
            "`launcher gpus` = nvidia-smi (index, UUID, memory, processes)",
            result,
            "identical; our holder found (by GPU, so also in a container)",
            "no" if problems else "yes",
            failure="" if not problems else table.tail(),
        )
    ]
