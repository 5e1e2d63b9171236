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
  get_error_code() is an amdsmi_status_t (STATUS below: AMDSMI_STATUS_NO_PERM = 10 ...).
- amdsmi_get_processor_handles(): one handle per GPU, or per partition of a GPU in a compute
  partition mode other than SPX (CPX on an MI300X: 8 per GPU, 64 on an 8-GPU box);
  amdsmi_get_gpu_kfd_info(h)["current_partition_id"] says which partition (0: the first).
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

import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

from launcher.gpus.devices import Gpu, GpuProcess, Health, NoGpuDriver, PeerLink
from launcher.gpus.owners import owner
from pretrain.run.refusal import Refusal

SCRIPTED_GPUS_VAR = "LAUNCHER_SCRIPTED_GPUS"
UTILIZATION_WINDOW = 1.0  # seconds over which utilization is sampled
UTILIZATION_SAMPLES = 5

STATUS = {
    "NOT_SUPPORTED": 2,
    "FAIL_LOAD_MODULE": 4,
    "DRM_ERROR": 6,
    "NO_PERM": 10,
    "IO": 12,
    "INIT_ERROR": 18,
    "NOT_FOUND": 31,
    "DRIVER_NOT_LOADED": 34,
    "AMDGPU_RESTART_ERR": 54,
}
"""amdsmi_status_t values (include/amd_smi/amdsmi.h) the launcher tells apart."""
NO_DRIVER = {STATUS["FAIL_LOAD_MODULE"], STATUS["DRIVER_NOT_LOADED"]}
"""amdsmi_init's failures that mean there is no amdgpu driver (as NVML's driver not loaded)."""
LOST = {STATUS["IO"], STATUS["NOT_FOUND"], STATUS["DRM_ERROR"], STATUS["AMDGPU_RESTART_ERR"]}
"""Failures that mean the GPU stopped answering (fell off the bus, needs a reset), as NVML's GPU
is lost: its device files fail with an I/O error or are gone."""
PARTITION_COUNTS = {"SPX": 1, "DPX": 2, "TPX": 3, "QPX": 4, "CPX": 8}
"""Compute partitions per GPU in each mode (an MI300X has 8 XCDs: CPX makes each its own GPU)."""
THROTTLE_REASONS = {
    "prochot": ("prochot_thrm", "hw_slowdown"),
    "ppt": ("ppt_pwr", "sw_power_cap"),
    "socket_thermal": ("socket_thrm", "hw_thermal"),
    "vr_thermal": ("vr_thrm", "hw_slowdown"),
    "hbm_thermal": ("hbm_thrm", "hw_thermal"),
}
"""AMD SMI's violations (the names amd-smi metric --throttle prints, without _violation_status):
the suffix of amdsmi_get_violation_status's active_* key, and the clock reason
(nvml.CLOCK_REASONS name, judged by launcher/gpus/health.py) it means. The package power limit
(PPT) is NVIDIA's software power cap: a busy GPU at its power limit, never held against it."""
PERMISSION_FIX = (
    "add this user to the render and video groups (sudo usermod -aG render,video $USER, then log in "
    "again) or give it read-write access to /dev/kfd and /dev/dri/renderD*, or use --device cpu"
)


class AmdSmiFailure(Refusal):
    """AMD SMI is installed but cannot start or list the GPUs (one line)."""


class AmdSmiPermission(AmdSmiFailure):
    """AMD SMI cannot open the GPUs: this user may not use /dev/kfd (one line naming the fix)."""


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


def _code(error: BaseException) -> int | None:
    return getattr(error, "err_code", None)


def _start(amdsmi: Any) -> None:
    """amdsmi_init for the GPUs: NoGpuDriver without an amdgpu driver, AmdSmiPermission when this
    user may not open them, AmdSmiFailure for any other failure."""
    try:
        amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
    except amdsmi.AmdSmiException as error:
        code = _code(error)
        if code in NO_DRIVER:
            raise NoGpuDriver(f"AMD SMI finds no amdgpu driver ({_say(error)})") from None
        if code == STATUS["NO_PERM"]:
            raise AmdSmiPermission(f"AMD SMI cannot open the GPUs (permission denied); {PERMISSION_FIX}") from None
        raise AmdSmiFailure(f"AMD SMI cannot start ({_say(error)}); check `amd-smi list`, or use --device cpu") from None


def _say(error: BaseException) -> str:
    """An AMD SMI error in one line (AmdSmiLibraryException's str spans two)."""
    info = getattr(error, "get_error_info", None)
    return str(info()) if callable(info) else " ".join(str(error).split())


def discover(window: float | None = None, samples: int | None = None) -> list[Gpu]:
    """Every usable device in AMD SMI's order, a partition right after its GPU; utilization is
    sampled `samples` times over `window` seconds (default UTILIZATION_*). Without the amdsmi
    package, the amd-smi command's JSON (amd_smi_cli.discover).

    Raises NoGpuDriver when AMD SMI is missing or finds no driver, AmdSmiPermission or
    AmdSmiFailure when it cannot start. A GPU it cannot read is listed with its error."""
    window = UTILIZATION_WINDOW if window is None else window
    samples = UTILIZATION_SAMPLES if samples is None else samples
    try:
        amdsmi = amdsmi_library()
    except NoGpuDriver:
        if not os.environ.get(SCRIPTED_GPUS_VAR) and shutil.which("amd-smi"):
            from launcher.gpus import amd_smi_cli

            return amd_smi_cli.discover(window, samples)
        raise
    _start(amdsmi)
    try:
        layout = _layout(amdsmi)
        usable = [d for d in layout if d["handle"] is not None and d["kind"] != "parent"]
        sampled = _sample(amdsmi, [d["handle"] for d in usable], window, samples)
        utilization = dict(zip((d["id"] for d in usable), sampled, strict=True))
        return [_describe(amdsmi, d, utilization.get(d["id"])) for d in layout]
    finally:
        amdsmi.amdsmi_shut_down()


def _layout(amdsmi: Any) -> list[dict[str, Any]]:
    """The devices AMD SMI's handles make, in its order: {"id", "index", "kind" ("gpu", "parent",
    "partition"), "handle" (None for a parent: it has no handle of its own), "parts" (a parent's
    partition handles), "primary" (the handle its GPU-wide readings come from: a partitioned
    GPU's first partition)}. A handle whose partition id is 0 (or cannot be read) starts a GPU; the
    handles after it with partition ids 1, 2... are its partitions."""
    try:
        handles = amdsmi.amdsmi_get_processor_handles()
    except amdsmi.AmdSmiException as error:
        raise AmdSmiFailure(f"AMD SMI cannot list the GPUs ({_say(error)}); check `amd-smi list`, or use --device cpu") from None
    groups: list[list[tuple[int, Any]]] = []
    for handle in handles:
        slot = _partition_id(amdsmi, handle)
        if slot or (slot is None and groups and _same_device(amdsmi, groups[-1][0][1], handle)):
            if groups:
                groups[-1].append((slot or len(groups[-1]), handle))
                continue
        groups.append([(0, handle)])
    layout: list[dict[str, Any]] = []
    for index, group in enumerate(groups):
        mode = _reading(amdsmi, amdsmi.amdsmi_get_gpu_compute_partition, group[0][1]) if len(group) > 1 else None
        if len(group) == 1 and mode is None:
            layout.append({"id": str(index), "index": index, "kind": "gpu", "handle": group[0][1], "primary": group[0][1]})
            continue
        first = group[0][1]
        layout.append(
            {"id": str(index), "index": index, "kind": "parent", "handle": None, "parts": [h for _, h in group], "primary": first}
        )
        layout += [
            {"id": f"{index}.{slot}", "index": index, "kind": "partition", "handle": h, "primary": first} for slot, h in group
        ]
    return layout


def _partition_id(amdsmi: Any, handle: Any) -> int | None:
    info = _reading(amdsmi, amdsmi.amdsmi_get_gpu_kfd_info, handle, lost_too=True)
    slot = None if not isinstance(info, dict) else info.get("current_partition_id")
    return slot if isinstance(slot, int) else None


def _same_device(amdsmi: Any, first: Any, handle: Any) -> bool:
    """Partitions of one GPU share its PCI bus and device; the function number tells them apart."""
    a, b = (_reading(amdsmi, amdsmi.amdsmi_get_gpu_device_bdf, h, lost_too=True) for h in (first, handle))
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
        return Gpu(
            id=device["id"],
            index=device["index"],
            uuid="",
            name="?",
            pci_bus_id="?",
            memory_total=0,
            memory_used=0,
            utilization=None,
            processes=(),
            mig=device["kind"] == "partition",
            error=_say(error),
            health=Health(lost=_code(error) in LOST),
            vendor="amd",
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
    )


def _parent(amdsmi: Any, device: dict[str, Any]) -> Gpu:
    """A partitioned GPU as a whole: what its partitions hold together; never given to a worker."""
    parts, primary = device["parts"], device["primary"]
    memory = [
        (
            int(amdsmi.amdsmi_get_gpu_memory_total(h, amdsmi.AmdSmiMemoryType.VRAM)),
            int(amdsmi.amdsmi_get_gpu_memory_usage(h, amdsmi.AmdSmiMemoryType.VRAM)),
        )
        for h in parts
    ]
    mode = _reading(amdsmi, amdsmi.amdsmi_get_gpu_compute_partition, primary) or "?"
    nps = _reading(amdsmi, amdsmi.amdsmi_get_gpu_memory_partition, primary)
    return Gpu(
        id=device["id"],
        index=device["index"],
        uuid="",  # no handle of its own; its partitions have UUIDs
        name=f"{_name(amdsmi, primary)} ({mode}{'/' + nps if nps else ''})",
        pci_bus_id=amdsmi.amdsmi_get_gpu_device_bdf(primary),
        memory_total=sum(total for total, _ in memory),
        memory_used=sum(used for _, used in memory),
        utilization=None,
        processes=(),
        mig_enabled=True,
        health=read_health(amdsmi, primary),
        vendor="amd",
    )


def _name(amdsmi: Any, handle: Any) -> str:
    name = _reading(amdsmi, amdsmi.amdsmi_get_gpu_asic_info, handle, lost_too=True) or {}
    if name.get("market_name") not in (None, "", "N/A"):
        return str(name["market_name"])
    board = _reading(amdsmi, amdsmi.amdsmi_get_gpu_board_info, handle) or {}
    return str(board.get("product_name", "AMD GPU")) if board.get("product_name") not in (None, "", "N/A") else "AMD GPU"


def _uuid(amdsmi: Any, handle: Any, whole: bool) -> str:
    """A whole GPU: GPU-<its unique id, 16 hex digits>, the form ROCr's ROCR_VISIBLE_DEVICES takes
    (rocminfo's Uuid), made of asic_serial; else, and for a partition (which shares its GPU's
    unique id), AMD SMI's UUID."""
    serial = (_reading(amdsmi, amdsmi.amdsmi_get_gpu_asic_info, handle) or {}).get("asic_serial") if whole else None
    try:
        unique = int(str(serial), 16)
    except ValueError:
        unique = 0
    return f"GPU-{unique:016x}" if unique else str(amdsmi.amdsmi_get_gpu_device_uuid(handle))


def _processes(amdsmi: Any, handle: Any) -> tuple[GpuProcess, ...]:
    running = _reading(amdsmi, amdsmi.amdsmi_get_gpu_process_list, handle) or []
    found = []
    for process in running:
        if not isinstance(process, dict):  # a ROCm before 6.1 gave process handles: not read
            continue
        vram = (process.get("memory_usage") or {}).get("vram_mem", process.get("mem"))
        memory = int(vram) if isinstance(vram, int) else None
        found.append(GpuProcess(int(process["pid"]), memory, owner(int(process["pid"]))))
    return tuple(found)


def read_health(amdsmi: Any, handle: Any) -> Health:
    """The health readings of the GPU `handle` names. A reading AMD SMI cannot give is None; an
    error that means the GPU stopped answering goes up (discovery lists it with its error)."""
    ecc = _reading(amdsmi, amdsmi.amdsmi_get_gpu_total_ecc_count, handle)
    pages = _reading(amdsmi, amdsmi.amdsmi_get_gpu_bad_page_info, handle)
    statuses = None if not isinstance(pages, list) else [int(page["status"]) for page in pages]
    pcie = _reading(amdsmi, amdsmi.amdsmi_get_pcie_info, handle) or {}
    uncorrectable = None if ecc is None else ecc.get("uncorrectable_count")
    return Health(
        ecc_uncorrected=uncorrectable if isinstance(uncorrectable, int) else None,
        retired_pages_pending=None if statuses is None else int(amdsmi.AmdSmiMemoryPageStatus.PENDING) in statuses,
        clock_reasons=_clock_reasons(amdsmi, handle),
        pcie_width=_number((pcie.get("pcie_metric") or {}).get("pcie_width")),
        pcie_max_width=_number((pcie.get("pcie_static") or {}).get("max_pcie_width")),
        pages_unretirable=None if statuses is None else statuses.count(int(amdsmi.AmdSmiMemoryPageStatus.UNRESERVABLE)),
    )


def _number(value: Any) -> int | None:
    """AMD SMI's reading, or None for its "N/A" (and the maximum values it means N/A by)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 0xFFFF else None


def _clock_reasons(amdsmi: Any, handle: Any) -> frozenset[str] | None:
    """The clock reasons the violations active now mean; None where AMD SMI cannot say (before ROCm
    6.3 it has no amdsmi_get_violation_status; some boards answer N/A)."""
    read = getattr(amdsmi, "amdsmi_get_violation_status", None)
    status = None if read is None else _reading(amdsmi, read, handle)
    if not isinstance(status, dict):
        return None
    flags = {name: status.get(f"active_{key}") for name, (key, _) in THROTTLE_REASONS.items()}
    if not any(isinstance(flag, bool) for flag in flags.values()):
        return None
    return frozenset(THROTTLE_REASONS[name][1] for name, flag in flags.items() if flag is True)


def _reading(amdsmi: Any, read: Any, *args: Any, lost_too: bool = False) -> Any:
    """read(*args), or None where AMD SMI cannot tell (not supported, no permission); an error that
    means the GPU stopped answering goes up, unless lost_too (then None as well)."""
    try:
        return read(*args)
    except amdsmi.AmdSmiException as error:
        if _code(error) in LOST and not lost_too:
            raise
        return None


class HealthReader:
    """The health of a run's devices, read again and again with AMD SMI started once (the run-time
    watch, launcher/gpus/health.py, reads every few seconds). Only the health readings. A partition
    reads its GPU's. Without the amdsmi package: amd_smi_cli.HealthReader."""

    def __init__(self, gpus: Sequence[Gpu]) -> None:
        """Start AMD SMI: NoGpuDriver, AmdSmiPermission or AmdSmiFailure where it cannot."""
        self._gpus = list(gpus)
        self._cli: Any = None
        try:
            self._amdsmi = amdsmi_library()
        except NoGpuDriver:
            if os.environ.get(SCRIPTED_GPUS_VAR) or not shutil.which("amd-smi"):
                raise
            from launcher.gpus import amd_smi_cli

            self._cli = amd_smi_cli.HealthReader(gpus)
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
            if _code(error) in LOST:
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
            from launcher.gpus import amd_smi_cli

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
