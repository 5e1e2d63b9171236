"""What the AMD GPUs of this machine are, how busy and how healthy they are, read through AMD SMI:
the `amdsmi` Python package ROCm ships (or, without it, the `amd-smi` command's JSON,
launcher/gpus/amd_smi_cli.py). The same API as launcher/gpus/nvml.py, filling the same records
(launcher/gpus/devices.py). No AMD hardware has run this yet: it is tested on scripted machines
(launcher/gpus/scripted_amdsmi.py, when LAUNCHER_SCRIPTED_GPUS names a file with "vendor": "amd")
and on recorded amd-smi output.

What it relies on, read from ROCm/amdsmi (py-interface/amdsmi_interface.py, amdsmi_exception.py,
include/amd_smi/amdsmi.h, amdsmi_cli/amdsmi_commands.py; snapshot 0ceca28, Oct 2024) and
rocm.docs.amd.com/projects/amdsmi:
- amdsmi_init(AmdSmiInitFlags.INIT_AMD_GPUS); failures raise AmdSmiLibraryException whose
  get_error_code() is an amdsmi_status_t (amd_common.STATUS: AMDSMI_STATUS_NO_PERM = 10 ...).
- amdsmi_get_processor_handles(): one handle per GPU, or per partition of a GPU in a compute
  partition mode other than SPX (CPX on an MI300X: 8 per GPU, 64 on an 8-GPU box);
  amdsmi_get_gpu_kfd_info(h)["current_partition_id"] says which partition (0: the first), and
  ["node_id"] its KFD node, whose order is ROCr's device order (Gpu.runtime_index). Every function but
  the few discovery cannot do without is looked up before it is called: one an older amdsmi lacks
  (kfd info, the partition modes, violation status came later) reads as unknown.
- amdsmi_get_gpu_asic_info(h) -> {"market_name", "asic_serial" ("0x%016X" of the unique id)...};
  amdsmi_get_gpu_board_info(h)["product_name"]; amdsmi_get_gpu_device_uuid(h) -> str;
  amdsmi_get_gpu_device_bdf(h) -> "0000:05:00.0".
- amdsmi_get_gpu_memory_total / _usage(h, AmdSmiMemoryType.VRAM) -> bytes.
- amdsmi_get_gpu_activity(h) -> {"gfx_activity": percent or "N/A", "umc_activity", "mm_activity"}.
- amdsmi_get_gpu_process_list(h) -> [{"pid", "mem", "memory_usage": {"vram_mem", ...}, ...}].
- amdsmi_get_gpu_total_ecc_count(h) -> {"correctable_count", "uncorrectable_count", "deferred_count"}.
- amdsmi_get_gpu_bad_page_info(h) -> [{"page_address", "page_size", "status"}], status an
  AmdSmiMemoryPageStatus: RESERVED (retired), PENDING (retired at the next reset), UNRESERVABLE.
- amdsmi_get_violation_status(h) -> {"active_prochot_thrm", "active_ppt_pwr", "active_socket_thrm",
  "active_vr_thrm", "active_hbm_thrm": bool or "N/A", ...} (ROCm 6.3 and later; absent before).
- amdsmi_get_pcie_info(h) -> {"pcie_static": {"max_pcie_width"}, "pcie_metric": {"pcie_width"}}.
- amdsmi_get_gpu_compute_partition(h) -> "SPX"|"DPX"|"TPX"|"QPX"|"CPX";
  amdsmi_get_gpu_memory_partition(h) -> "NPS1"|"NPS2"|"NPS4"|"NPS8".
- amdsmi_topo_get_link_type(a, b) -> {"hops", "type"}, type an AMDSMI_IOLINK_TYPE
  (PCIEXPRESS = 1, XGMI = 2); amdsmi_is_P2P_accessible(a, b) -> bool.

Partitions play MIG's part: a GPU in SPX mode is one device ("3"); a GPU in DPX, TPX, QPX or CPX
mode is listed whole, never chosen (mig_enabled), followed by its partitions "3.0", "3.1"...
(mig), each a device a worker can be given, chosen and claimed on its own as a MIG device is.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

from launcher.gpus import amd_smi_cli
from launcher.gpus.amd_common import (
    LOST,
    NO_DRIVER,
    PERMISSION_FIX,
    STATUS,
    AmdSmiFailure,
    AmdSmiPermission,
    partition_memory,
    runtime_indices,
)
from launcher.gpus.amd_readings import code, read_health, reading, say
from launcher.gpus.devices import Gpu, GpuProcess, Health, NoGpuDriver, PeerLink
from launcher.gpus.owners import owner

SCRIPTED_GPUS_VAR = "LAUNCHER_SCRIPTED_GPUS"
UTILIZATION_WINDOW = 1.0  # seconds over which utilization is sampled
UTILIZATION_SAMPLES = 5


def amdsmi_library() -> Any:
    """amdsmi, or the scripted AMD machine that LAUNCHER_SCRIPTED_GPUS names. NoGpuDriver when
    it is not installed (a scripted machine with "driver": false)."""
    script = os.environ.get(SCRIPTED_GPUS_VAR)
    if script:
        from launcher.gpus.scripted_amdsmi import ScriptedAmdSmi

        machine = ScriptedAmdSmi.from_file(script)
        if not machine.installed:
            raise NoGpuDriver("cannot import amdsmi (No module named 'amdsmi'; scripted)")
        return machine
    try:
        import amdsmi  # ROCm's, not PyPI's: /opt/rocm/share/amd_smi
    except ImportError as error:
        raise NoGpuDriver(f"cannot import amdsmi ({error})") from None
    return amdsmi


def available() -> bool:
    """AMD SMI is here (its Python package, or the amd-smi command), without starting it."""
    script = os.environ.get(SCRIPTED_GPUS_VAR)
    if script:
        try:
            amdsmi_library()
        except NoGpuDriver:
            return False
        return True
    import importlib.util

    return importlib.util.find_spec("amdsmi") is not None or shutil.which("amd-smi") is not None


def _start(amdsmi: Any) -> None:
    """amdsmi_init for the GPUs: NoGpuDriver without an amdgpu driver, AmdSmiPermission when this
    user may not open them, AmdSmiFailure for any other failure."""
    try:
        amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
    except amdsmi.AmdSmiException as error:
        status = code(error)
        if status in NO_DRIVER:
            raise NoGpuDriver(f"AMD SMI finds no amdgpu driver ({say(error)})") from None
        if status == STATUS["NO_PERM"]:
            raise AmdSmiPermission(f"AMD SMI cannot open the GPUs (permission denied); {PERMISSION_FIX}") from None
        raise AmdSmiFailure(f"AMD SMI cannot start ({say(error)}); check `amd-smi list`, or use --device cpu") from None


def discover(window: float | None = None, samples: int | None = None) -> list[Gpu]:
    """Every usable device in AMD SMI's order, a partition right after its GPU; utilization is
    sampled `samples` times over `window` seconds (default UTILIZATION_*). Without the amdsmi
    package, the amd-smi command's JSON (amd_smi_cli.discover, which samples fewer times by default:
    each sample is a process).

    Raises NoGpuDriver when AMD SMI is missing or finds no driver, AmdSmiPermission or
    AmdSmiFailure when it cannot start. A GPU it cannot read is listed with its error."""
    window = UTILIZATION_WINDOW if window is None else window
    try:
        amdsmi = amdsmi_library()
    except NoGpuDriver:
        if not os.environ.get(SCRIPTED_GPUS_VAR) and shutil.which("amd-smi"):
            return amd_smi_cli.discover(window, samples)
        raise
    samples = UTILIZATION_SAMPLES if samples is None else samples
    _start(amdsmi)
    try:
        layout = _layout(amdsmi)
        usable = [d for d in layout if d["handle"] is not None and d["kind"] != "parent"]
        sampled = _sample(amdsmi, [d["handle"] for d in usable], window, samples)
        utilization = dict(zip((d["id"] for d in usable), sampled, strict=True))
        return _share_memory(amdsmi, layout, [_describe(amdsmi, d, utilization.get(d["id"])) for d in layout])
    finally:
        amdsmi.amdsmi_shut_down()


def _layout(amdsmi: Any) -> list[dict[str, Any]]:
    """The devices AMD SMI's handles make, in its order: {"id", "index", "kind" ("gpu", "parent",
    "partition"), "handle" (None for a parent: it has no handle of its own), "parts" (a parent's
    partition handles), "primary" (the handle its GPU-wide readings come from: a partitioned
    GPU's first partition), "runtime" (ROCr's device number, amd_common.runtime_indices; None for a
    parent)}. A handle whose partition id is 0 (or cannot be read) starts a GPU; the handles after
    it with partition ids 1, 2... (or, where ids cannot be read, on the same PCI device) are its
    partitions."""
    try:
        handles = amdsmi.amdsmi_get_processor_handles()
    except amdsmi.AmdSmiException as error:
        raise AmdSmiFailure(f"AMD SMI cannot list the GPUs ({say(error)}); check `amd-smi list`, or use --device cpu") from None
    kfd = [reading(amdsmi, "amdsmi_get_gpu_kfd_info", h, lost_too=True) for h in handles]
    runtime = dict(zip(map(id, handles), runtime_indices([_kfd(info, "node_id") for info in kfd]), strict=True))
    groups: list[list[tuple[int, Any]]] = []
    for handle, info in zip(handles, kfd, strict=True):
        slot = _kfd(info, "current_partition_id")
        if slot or (slot is None and groups and _same_device(amdsmi, groups[-1][0][1], handle)):
            if groups:
                groups[-1].append((slot or len(groups[-1]), handle))
                continue
        groups.append([(0, handle)])
    layout: list[dict[str, Any]] = []
    for index, group in enumerate(groups):
        first = group[0][1]
        mode = reading(amdsmi, "amdsmi_get_gpu_compute_partition", first) if len(group) > 1 else None
        if len(group) == 1 and mode is None:
            layout.append(
                {
                    "id": str(index),
                    "index": index,
                    "kind": "gpu",
                    "handle": first,
                    "primary": first,
                    "runtime": runtime[id(first)],
                }
            )
            continue
        parts = [h for _, h in group]
        layout.append(
            {
                "id": str(index),
                "index": index,
                "kind": "parent",
                "handle": None,
                "parts": parts,
                "primary": first,
                "runtime": None,
            }
        )
        layout += [
            {
                "id": f"{index}.{slot}",
                "index": index,
                "kind": "partition",
                "handle": h,
                "primary": first,
                "runtime": runtime[id(h)],
            }
            for slot, h in group
        ]
    return layout


def _kfd(info: Any, key: str) -> int | None:
    """One of amdsmi_get_gpu_kfd_info's numbers ("node_id", "current_partition_id"); None where
    it could not be read."""
    value = info.get(key) if isinstance(info, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _same_device(amdsmi: Any, first: Any, handle: Any) -> bool:
    """Partitions of one GPU share its PCI bus and device; the function number tells them apart."""
    a, b = (reading(amdsmi, "amdsmi_get_gpu_device_bdf", h, lost_too=True) for h in (first, handle))
    return isinstance(a, str) and isinstance(b, str) and a.split(".")[0] == b.split(".")[0] and a != b


def _sample(amdsmi: Any, handles: list[Any], window: float, samples: int) -> list[float | None]:
    """Mean gfx_activity of each device over `window` seconds (one reading is a single instant, and
    a training job between two steps reads 0%); None where AMD SMI says N/A or cannot read it."""
    readings: list[list[float] | None] = [[] for _ in handles]
    for round_ in range(samples):
        if round_:
            time.sleep(window / max(1, samples - 1))
        for i, handle in enumerate(handles):
            taken = readings[i]
            if taken is None:
                continue
            try:
                value = amdsmi.amdsmi_get_gpu_activity(handle)["gfx_activity"]
            except amdsmi.AmdSmiException:
                value = None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                taken.append(float(value))
            else:
                readings[i] = None
    return [sum(r) / len(r) if r else None for r in readings]


def _describe(amdsmi: Any, device: dict[str, Any], utilization: float | None) -> Gpu:
    try:
        if device["kind"] == "parent":
            return _parent(amdsmi, device)
        return _read(amdsmi, device, utilization)
    except amdsmi.AmdSmiException as error:
        return Gpu.unreadable(
            device["id"],
            device["index"],
            say(error),
            lost=code(error) in LOST,
            mig=device["kind"] == "partition",
            vendor="amd",
            runtime_index=device["runtime"],
        )


def _read(amdsmi: Any, device: dict[str, Any], utilization: float | None) -> Gpu:
    handle, primary = device["handle"], device["primary"]
    partition = device["kind"] == "partition"
    return Gpu(
        id=device["id"],
        index=device["index"],
        uuid=_uuid(amdsmi, handle, whole=not partition),
        name=_name(amdsmi, handle),
        pci_bus_id=amdsmi.amdsmi_get_gpu_device_bdf(primary),
        memory_total=int(amdsmi.amdsmi_get_gpu_memory_total(handle, amdsmi.AmdSmiMemoryType.VRAM)),
        memory_used=int(amdsmi.amdsmi_get_gpu_memory_usage(handle, amdsmi.AmdSmiMemoryType.VRAM)),
        utilization=utilization,
        processes=_processes(amdsmi, handle),
        mig=partition,
        health=read_health(amdsmi, primary),
        vendor="amd",
        runtime_index=device["runtime"],
    )


def _parent(amdsmi: Any, device: dict[str, Any]) -> Gpu:
    """A partitioned GPU as a whole: what its partitions hold together (_share_memory sums their
    shares into its total); never given to a worker."""
    parts, primary = device["parts"], device["primary"]
    used = sum(int(amdsmi.amdsmi_get_gpu_memory_usage(h, amdsmi.AmdSmiMemoryType.VRAM)) for h in parts)
    mode = reading(amdsmi, "amdsmi_get_gpu_compute_partition", primary) or "?"
    nps = reading(amdsmi, "amdsmi_get_gpu_memory_partition", primary)
    return Gpu(
        id=device["id"],
        index=device["index"],
        uuid="",  # no handle of its own; its partitions have UUIDs
        name=f"{_name(amdsmi, primary)} ({mode}{'/' + nps if nps else ''})",
        pci_bus_id=amdsmi.amdsmi_get_gpu_device_bdf(primary),
        memory_total=0,
        memory_used=used,
        utilization=None,
        processes=(),
        mig_enabled=True,
        health=read_health(amdsmi, primary),
        vendor="amd",
    )


def _share_memory(amdsmi: Any, layout: list[dict[str, Any]], gpus: list[Gpu]) -> list[Gpu]:
    """Each partition's share of the memory pool it shares with its GPU's other partitions
    (amd_common.partition_memory), and each partitioned GPU's total the sum of its partitions'."""
    shared = list(gpus)
    for at, device in enumerate(layout):
        if device["kind"] != "parent":
            continue
        slots = [i for i, d in enumerate(layout) if d["kind"] == "partition" and d["index"] == device["index"]]
        nps = reading(amdsmi, "amdsmi_get_gpu_memory_partition", device["primary"], lost_too=True)
        shares = partition_memory([gpus[i].memory_total for i in slots], nps)
        for i, share in zip(slots, shares, strict=True):
            shared[i] = dataclasses.replace(gpus[i], memory_total=share)
        if gpus[at].error is None:
            shared[at] = dataclasses.replace(gpus[at], memory_total=sum(shares))
    return shared


def _name(amdsmi: Any, handle: Any) -> str:
    name = reading(amdsmi, "amdsmi_get_gpu_asic_info", handle, lost_too=True) or {}
    if name.get("market_name") not in (None, "", "N/A"):
        return str(name["market_name"])
    board = reading(amdsmi, "amdsmi_get_gpu_board_info", handle) or {}
    return str(board.get("product_name", "AMD GPU")) if board.get("product_name") not in (None, "", "N/A") else "AMD GPU"


def _uuid(amdsmi: Any, handle: Any, whole: bool) -> str:
    """A whole GPU: GPU-<its unique id, 16 hex digits>, the form ROCr's ROCR_VISIBLE_DEVICES takes
    (rocminfo's Uuid), made of asic_serial; else, and for a partition (which shares its GPU's
    unique id), AMD SMI's UUID."""
    serial = (reading(amdsmi, "amdsmi_get_gpu_asic_info", handle) or {}).get("asic_serial") if whole else None
    try:
        unique = int(str(serial), 16)
    except ValueError:
        unique = 0
    return f"GPU-{unique:016x}" if unique else str(amdsmi.amdsmi_get_gpu_device_uuid(handle))


def _processes(amdsmi: Any, handle: Any) -> tuple[GpuProcess, ...]:
    running = reading(amdsmi, "amdsmi_get_gpu_process_list", handle) or []
    found = []
    for process in running:
        if not isinstance(process, dict):  # a ROCm before 6.1 gave process handles: not read
            continue
        vram = (process.get("memory_usage") or {}).get("vram_mem", process.get("mem"))
        memory = int(vram) if isinstance(vram, int) else None
        found.append(GpuProcess(int(process["pid"]), memory, owner(int(process["pid"]))))
    return tuple(found)


class HealthReader:
    """The health of a run's devices, read again and again with AMD SMI started once (the run-time
    watch, launcher/gpus/health.py, reads every few seconds). Only the health readings. A partition
    reads its GPU's. Without the amdsmi package: amd_smi_cli.HealthReader."""

    def __init__(self, gpus: Sequence[Gpu]) -> None:
        """Start AMD SMI: NoGpuDriver, AmdSmiPermission or AmdSmiFailure where it cannot."""
        self._gpus = list(gpus)
        self._cli: Any = None
        self.min_interval_s = 0.0
        """The least time between two readings the health watch should leave (launcher/gpus/health.py):
        each reading through the amd-smi command is two processes (amd_smi_cli.HEALTH_INTERVAL_S)."""
        try:
            self._amdsmi = amdsmi_library()
        except NoGpuDriver:
            if os.environ.get(SCRIPTED_GPUS_VAR) or not shutil.which("amd-smi"):
                raise
            self._cli = amd_smi_cli.HealthReader(gpus)
            self.min_interval_s = self._cli.min_interval_s
            return
        _start(self._amdsmi)
        layout = _layout(self._amdsmi)
        self._handles = {d["id"]: d["primary"] for d in layout}

    def read(self) -> dict[str, Health]:
        """Each device's readings by id; Health(lost=True) for a GPU that stopped answering (or is
        no longer listed). Any other AMD SMI error goes up."""
        if self._cli is not None:
            return dict(self._cli.read())
        return {gpu.id: self._read(gpu) for gpu in self._gpus}

    def _read(self, gpu: Gpu) -> Health:
        handle = self._handles.get(gpu.id)
        if handle is None:
            return Health(lost=True)
        try:
            return read_health(self._amdsmi, handle)
        except self._amdsmi.AmdSmiException as error:
            if code(error) in LOST:
                return Health(lost=True)
            raise

    def close(self) -> None:
        if self._cli is None:
            self._amdsmi.amdsmi_shut_down()


def peer_links(gpus: Sequence[Gpu]) -> dict[tuple[str, str], PeerLink]:
    """How each pair of these devices reaches the other, keyed by their ids in the order given.
    XGMI (Infinity Fabric) when AMD SMI's link type says so; PCIe when the link is PCIe and peer
    access is possible (amdsmi_is_P2P_accessible); else none. A partition, or a pair AMD SMI cannot
    judge, is unknown; so is every pair when AMD SMI cannot start."""
    pairs = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]
    if not pairs:
        return {}
    try:
        amdsmi = amdsmi_library()
    except NoGpuDriver:
        if not os.environ.get(SCRIPTED_GPUS_VAR) and shutil.which("amd-smi"):
            return amd_smi_cli.peer_links(gpus)
        return {(a.id, b.id): "unknown" for a, b in pairs}
    try:
        _start(amdsmi)
    except (NoGpuDriver, AmdSmiFailure):
        return {(a.id, b.id): "unknown" for a, b in pairs}
    try:
        handles = {d["id"]: d["handle"] for d in _layout(amdsmi) if d["kind"] == "gpu"}
        return {(a.id, b.id): _link(amdsmi, handles.get(a.id), handles.get(b.id)) for a, b in pairs}
    finally:
        amdsmi.amdsmi_shut_down()


def _link(amdsmi: Any, a: Any, b: Any) -> PeerLink:
    if a is None or b is None:
        return "unknown"
    try:
        kind = int(amdsmi.amdsmi_topo_get_link_type(a, b)["type"])
        if kind == int(amdsmi.AmdSmiIoLinkType.XGMI):
            return "xgmi"
        if kind == int(amdsmi.AmdSmiIoLinkType.PCIEXPRESS):
            return "pcie" if amdsmi.amdsmi_is_P2P_accessible(a, b) else "none"
    except amdsmi.AmdSmiException:  # not supported: a driver too old to say
        return "unknown"
    return "unknown"
