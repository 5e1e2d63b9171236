"""AMD GPUs read through the `amd-smi` command's JSON, where ROCm's amdsmi Python package is missing
but its command is installed (launcher/gpus/amd.py falls back to this). The same records as amd.py.

Each reading is one `amd-smi <command> --json` run (argument lists, never a shell; TIMEOUT each):
`list` (UUID, BDF, partition id, KFD node id), `static` (name, unique id, maximum PCIe width, partition modes),
`metric` (memory, gfx_activity, ECC, PCIe width, throttle), `process`, `bad-pages`, and `topology`
for the links. The JSON's shapes, from ROCm/amdsmi amdsmi_cli/amdsmi_commands.py (snapshot 0ceca28)
and the amd-smi outputs quoted in public projects: a list of one object per GPU ({"gpu": 0, ...}),
which amd-smi 25 and later (ROCm 6.4+) wrap in {"gpu_data": [...]}; every leaf is a bare value or
{"value": v, "unit": u}; "N/A" where a reading is not supported. Memory is in MB (amd-smi divides
bytes by 1024 * 1024, so MiB), process memory in B. Test outputs, built from AMD's documented shapes
(not recorded on hardware): tests/launcher/gpus/data/amd_smi/.

Discovery runs six processes (list, static, metric, one more `metric --usage`, process, bad-pages);
the health watch two every HEALTH_INTERVAL_S.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from launcher.gpus.amd_common import (
    PERMISSION_FIX,
    THROTTLE_REASONS,
    AmdSmiFailure,
    AmdSmiPermission,
    partition_memory,
    runtime_indices,
)
from launcher.gpus.devices import Gpu, GpuProcess, Health, NoGpuDriver, PeerLink
from launcher.gpus.owners import owner

AMD_SMI = "amd-smi"
TIMEOUT = 60.0
"""Seconds one amd-smi run may take (it starts Python and AMD SMI each time: about a second, more on
a box with many partitions)."""
UTILIZATION_SAMPLES = 2
"""Utilization readings at discovery over the window: the first from the full `metric` output, one
more `metric --usage` at its end. Fewer than through the amdsmi package (amd.UTILIZATION_SAMPLES):
each reading here starts a process that loads Python and AMD SMI."""
HEALTH_INTERVAL_S = 30.0
"""Seconds the run-time health watch leaves between two readings on this path (HealthReader's
min_interval_s; through the amdsmi package it reads every 5 s): each reading is two amd-smi
processes, about a second of a CPU core each, for as long as the run lasts."""
UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
Runner = Callable[[list[str]], Any]
"""Runs amd-smi with these arguments and gives its parsed JSON (run; a test's recorded outputs)."""


def run(args: list[str]) -> Any:
    """`amd-smi ARGS --json`, parsed. NoGpuDriver when the command is missing, AmdSmiPermission when
    it is refused the GPUs, AmdSmiFailure when it fails, times out or prints no JSON."""
    command = [AMD_SMI, *args, "--json"]
    where = f"`{' '.join(command)}`"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    except FileNotFoundError:
        raise NoGpuDriver("amd-smi is not installed") from None
    except subprocess.TimeoutExpired:
        raise AmdSmiFailure(f"{where} took over {TIMEOUT:g} s; check `amd-smi list`, or use --device cpu") from None
    said = " ".join((done.stderr or "").split())
    if "permission" in said.lower() or "elevation" in said.lower():
        raise AmdSmiPermission(f"{where} cannot open the GPUs ({said}); {PERMISSION_FIX}")
    try:
        return json.loads(done.stdout)
    except ValueError:
        raise AmdSmiFailure(
            f"{where} printed no JSON (exit {done.returncode}: {said or 'no message'}); check `amd-smi list`, or use --device cpu"
        ) from None


def records(payload: Any) -> list[dict[str, Any]]:
    """The per-GPU objects of an amd-smi JSON output, bare or wrapped in {"gpu_data": [...]}."""
    if isinstance(payload, dict):
        payload = payload.get("gpu_data", [])
    return [r for r in payload if isinstance(r, dict)] if isinstance(payload, list) else []


def by_gpu(payload: Any) -> dict[int, dict[str, Any]]:
    return {r["gpu"]: r for r in records(payload) if isinstance(r.get("gpu"), int)}


def section(record: dict[str, Any], key: str) -> dict[str, Any]:
    """One part of a GPU's record ("asic", "usage"...); {} where amd-smi says N/A instead."""
    part = record.get(key)
    return part if isinstance(part, dict) else {}


def value(leaf: Any) -> Any:
    """A leaf's value: {"value": v, "unit": u} -> v; "N/A" (and the like) -> None."""
    if isinstance(leaf, dict) and "value" in leaf:
        leaf = leaf["value"]
    return None if isinstance(leaf, str) and leaf.strip().upper() in ("N/A", "NA", "") else leaf


def amount(leaf: Any, unit: str) -> int | None:
    """A memory leaf in bytes: its own unit where it gives one, else `unit`."""
    number = value(leaf)
    if not isinstance(number, (int, float)) or isinstance(number, bool):
        return None
    given = leaf.get("unit", unit) if isinstance(leaf, dict) else unit
    return int(number * UNITS.get(str(given).upper(), UNITS[unit]))


def _whole(leaf: Any) -> int | None:
    number = value(leaf)
    return number if isinstance(number, int) and not isinstance(number, bool) else None


def layout(listing: Any) -> list[tuple[str, int, int, str]]:
    """(id, index, amd-smi's gpu number, kind) of every device `amd-smi list` shows, as
    amd.py's _layout makes them: partition id 0 (or none) starts a GPU; kind "gpu", "parent"
    (gpu number: its first partition's) or "partition" ("index.slot")."""
    groups: list[list[tuple[int, int]]] = []
    for record in records(listing):
        slot = _whole(record.get("partition_id"))
        if slot and groups:
            groups[-1].append((slot, record["gpu"]))
        else:
            groups.append([(0, record["gpu"])])
    devices = []
    for index, group in enumerate(groups):
        if len(group) == 1:
            devices.append((str(index), index, group[0][1], "gpu"))
            continue
        devices.append((str(index), index, group[0][1], "parent"))
        devices += [(f"{index}.{slot}", index, number, "partition") for slot, number in group]
    return devices


def parse(
    listing: Any, static: Any, metric: Any, processes: Any, bad_pages: Any, utilization: dict[int, float | None]
) -> list[Gpu]:
    """The devices these amd-smi outputs describe (utilization: mean gfx_activity by gpu number)."""
    lists, statics, metrics, procs = by_gpu(listing), by_gpu(static), by_gpu(metric), by_gpu(processes)
    devices = layout(listing)
    numbers = [n for _, _, n, kind in devices if kind != "parent"]
    runtime = dict(zip(numbers, runtime_indices([_whole(lists.get(n, {}).get("node_id")) for n in numbers]), strict=True))
    memory = {n: section(metrics.get(n, {}), "mem_usage") for n in numbers}
    totals = {n: amount(m.get("total_vram"), "MB") or 0 for n, m in memory.items()}
    for _, index, number, kind in devices:
        if kind == "parent":  # partitions sharing a memory pool get a share each (amd_common.partition_memory)
            parts = [n for _, i, n, k in devices if i == index and k == "partition"]
            nps = value(section(statics.get(number, {}), "partition").get("memory_partition"))
            totals |= dict(zip(parts, partition_memory([totals[n] for n in parts], nps), strict=True))
    gpus = []
    for gpu_id, index, number, kind in devices:
        parts = [n for _, i, n, k in devices if i == index and k == "partition"]
        own = parts if kind == "parent" else [number]
        used = [amount(memory[n].get("used_vram"), "MB") for n in own]
        primary = parts[0] if kind != "gpu" else number
        info = statics.get(primary, {})
        asic = section(info, "asic")
        mode = value(section(info, "partition").get("compute_partition"))
        nps = value(section(info, "partition").get("memory_partition"))
        name = str(value(asic.get("market_name")) or "AMD GPU")
        gpus.append(
            Gpu(
                id=gpu_id,
                index=index,
                uuid="" if kind == "parent" else _uuid(lists.get(number, {}), asic if kind == "gpu" else {}),
                name=f"{name} ({mode}{'/' + nps if nps else ''})" if kind == "parent" else name,
                pci_bus_id=str(lists.get(primary, {}).get("bdf") or section(info, "bus").get("bdf") or "?"),
                memory_total=sum(totals[n] for n in own),
                memory_used=sum(u or 0 for u in used),
                utilization=None if kind == "parent" else utilization.get(number),
                processes=() if kind == "parent" else _processes(procs.get(number, {})),
                mig=kind == "partition",
                mig_enabled=kind == "parent",
                health=parse_health(metrics.get(primary, {}), info, by_gpu(bad_pages).get(primary, {})),
                vendor="amd",
                runtime_index=None if kind == "parent" else runtime[number],
            )
        )
    return gpus


def _uuid(listed: dict[str, Any], asic: dict[str, Any]) -> str:
    """As amd._uuid: GPU-<unique id> for a whole GPU (ROCr's form), else amd-smi's UUID."""
    try:
        unique = int(str(value(asic.get("asic_serial"))), 16)
    except ValueError:
        unique = 0
    return f"GPU-{unique:016x}" if unique else str(listed.get("uuid") or "")


def _processes(record: dict[str, Any]) -> tuple[GpuProcess, ...]:
    found = []
    for entry in record.get("process_list") or []:
        info = entry.get("process_info") if isinstance(entry, dict) else None
        if not isinstance(info, dict) or not isinstance(_whole(info.get("pid")), int):
            continue  # "No running processes detected", "N/A"
        memory = amount(section(info, "memory_usage").get("vram_mem"), "B")
        memory = amount(info.get("mem_usage"), "B") if memory is None else memory
        pid = int(info["pid"])
        found.append(GpuProcess(pid, memory, owner(pid)))
    return tuple(found)


def parse_health(metric: dict[str, Any], static: dict[str, Any], bad_pages: dict[str, Any]) -> Health:
    """One GPU's Health from its `metric`, `static` and `bad-pages` records (amd_readings.read_health's)."""
    ecc = metric.get("ecc")
    pcie = metric.get("pcie")
    throttle = metric.get("throttle")
    flags = {}
    if isinstance(throttle, dict):
        flags = {name: value(throttle.get(f"{name}_violation_status")) for name in THROTTLE_REASONS}
    known = {name: str(flag).upper() == "ACTIVE" for name, flag in flags.items() if flag is not None}
    return Health(
        ecc_uncorrected=_whole(ecc.get("total_uncorrectable_count")) if isinstance(ecc, dict) else None,
        retired_pages_pending=None if _pages(bad_pages, "pending") is None else bool(_pages(bad_pages, "pending")),
        clock_reasons=frozenset(THROTTLE_REASONS[n][1] for n, on in known.items() if on) if known else None,
        pcie_width=_whole(pcie.get("width")) if isinstance(pcie, dict) else None,
        pcie_max_width=_whole(section(static, "bus").get("max_pcie_width")),
        pages_unretirable=_pages(bad_pages, "un_res"),
    )


def _pages(record: dict[str, Any], kind: str) -> int | None:
    """How many bad pages of this kind: a list of pages, a sentence saying there are none, or N/A."""
    pages = record.get(kind)
    if isinstance(pages, list):
        return len(pages)
    if isinstance(pages, str) and "no bad pages" in pages.lower():
        return 0
    return None


def sample(runner: Runner, numbers: list[int], first: Any, window: float, samples: int) -> dict[int, float | None]:
    """Mean gfx_activity by gpu number over `window` seconds: `first` (a metric output) and
    samples - 1 more `metric --usage` runs; None where a reading is N/A."""
    taken: dict[int, list[float] | None] = {n: [] for n in numbers}
    for round_ in range(samples):
        if round_:
            time.sleep(window / max(1, samples - 1))
        output = first if round_ == 0 else runner(["metric", "--usage"])
        readings = by_gpu(output)
        for n in numbers:
            got = value(section(readings.get(n, {}), "usage").get("gfx_activity"))
            if taken[n] is None or not isinstance(got, (int, float)) or isinstance(got, bool):
                taken[n] = None
            else:
                taken[n].append(float(got))  # type: ignore[union-attr]
    return {n: sum(r) / len(r) if r else None for n, r in taken.items()}


def discover(window: float, samples: int | None = None, runner: Runner = run) -> list[Gpu]:
    """As amd.discover, from amd-smi's outputs; utilization sampled `samples` times (default
    UTILIZATION_SAMPLES) over `window` seconds."""
    samples = UTILIZATION_SAMPLES if samples is None else samples
    listing = runner(["list"])
    metric = runner(["metric"])
    numbers = [n for _, _, n, kind in layout(listing) if kind != "parent"]
    utilization = sample(runner, numbers, metric, window, samples)
    return parse(listing, runner(["static"]), metric, runner(["process"]), runner(["bad-pages"]), utilization)


class HealthReader:
    """Health readings by device id, each read one `metric`, `bad-pages` run (and `static` once)."""

    min_interval_s = HEALTH_INTERVAL_S
    """The least time between two readings the health watch leaves (launcher/gpus/health.py)."""

    def __init__(self, gpus: Sequence[Gpu], runner: Runner = run) -> None:
        self._gpus = list(gpus)
        self._runner = runner
        self._static = by_gpu(runner(["static"]))
        self._primary: dict[str, int] = {}
        """The gpu number each device's readings come from: a partition's, its GPU's first partition's."""
        for gpu_id, index, number, kind in layout(runner(["list"])):
            self._primary[gpu_id] = self._primary[str(index)] if kind == "partition" else number

    def read(self) -> dict[str, Health]:
        metrics = by_gpu(self._runner(["metric", "--ecc", "--pcie", "--throttle"]))
        pages = by_gpu(self._runner(["bad-pages"]))
        found = {}
        for gpu in self._gpus:
            number = self._primary.get(gpu.id)
            if number is None or number not in metrics:
                found[gpu.id] = Health(lost=True)  # no longer listed: fell off the bus
                continue
            found[gpu.id] = parse_health(metrics[number], self._static.get(number, {}), pages.get(number, {}))
        return found

    def close(self) -> None:
        pass


def peer_links(gpus: Sequence[Gpu], runner: Runner = run) -> dict[tuple[str, str], PeerLink]:
    """As amd.peer_links, from `amd-smi topology`: XGMI; PCIe where peer access is enabled (or not
    said); else none. Partitions, and pairs it does not show, are unknown."""
    pairs = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]
    if not pairs:
        return {}
    try:
        listing, topology = runner(["list"]), runner(["topology"])
    except (NoGpuDriver, AmdSmiFailure):
        return {(a.id, b.id): "unknown" for a, b in pairs}
    numbers = {gpu_id: number for gpu_id, _, number, kind in layout(listing) if kind == "gpu"}
    links: dict[tuple[int, int], PeerLink] = {}
    for record in records(topology):
        for link in record.get("links") or []:
            kind = str(value(link.get("link_type")) or "").upper()
            status = str(value(link.get("link_status")) or "ENABLED").upper()
            found: PeerLink = (
                "xgmi" if kind == "XGMI" else ("pcie" if status == "ENABLED" else "none") if kind == "PCIE" else "unknown"
            )
            links[(record.get("gpu"), link.get("gpu"))] = found  # type: ignore[index]
    return {
        (a.id, b.id): links.get((numbers.get(a.id), numbers.get(b.id)), "unknown")  # type: ignore[arg-type]
        for a, b in pairs
    }
