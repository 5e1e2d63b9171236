"""What both AMD SMI readers (launcher/gpus/amd.py through the amdsmi package, amd_smi_cli.py through
the amd-smi command) and the scripted AMD machine (scripted_amdsmi.py) share: AMD SMI's status codes,
its partition modes and violation names, the errors, and the rules that turn what AMD SMI lists into
ROCr's device numbers and a partition's share of memory. It imports none of them, so imports run one
way: amd.py -> amd_smi_cli.py -> amd_common.py, and scripted_amdsmi.py -> amd_common.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from pretrain.run.refusal import Refusal

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
MEMORY_POOLS = {"NPS1": 1, "NPS2": 2, "NPS4": 4, "NPS8": 8}
"""Memory pools (NUMA nodes) per GPU in each memory partition mode: NPS1 is one pool every compute
partition of the GPU allocates from; NPS4 four, each shared by the compute partitions beside it."""
THROTTLE_REASONS = {
    "prochot": ("prochot_thrm", "hw_slowdown"),
    "ppt": ("ppt_pwr", "sw_power_cap"),
    "socket_thermal": ("socket_thrm", "hw_thermal"),
    "vr_thermal": ("vr_thrm", "hw_slowdown"),
    "hbm_thermal": ("hbm_thrm", "hw_thermal"),
}
"""AMD SMI's violations (the names amd-smi metric --throttle prints, without _violation_status):
the suffix of amdsmi_get_violation_status's active_* key, and the clock reason
(devices.CLOCK_REASONS name, judged by launcher/gpus/health.py) it means. The package power limit
(PPT) is NVIDIA's software power cap: a busy GPU at its power limit, never held against it."""
PERMISSION_FIX = (
    "add this user to the render and video groups (sudo usermod -aG render,video $USER, then log in "
    "again) or give it read-write access to /dev/kfd and /dev/dri/renderD*, or use --device cpu"
)


class AmdSmiFailure(Refusal):
    """AMD SMI is installed but cannot start or list the GPUs (one line)."""


class AmdSmiPermission(AmdSmiFailure):
    """AMD SMI cannot open the GPUs: this user may not use /dev/kfd (one line naming the fix)."""


def runtime_indices(nodes: Sequence[int | None]) -> list[int | None]:
    """ROCr's device number of each device AMD SMI lists (whole GPUs and compute partitions, in AMD
    SMI's order), from its KFD node id (None: unreadable). ROCr numbers its GPU agents in KFD
    topology order, every compute partition a node of its own, so a device's number is how many
    devices have a lower node id: AMD SMI's own order may differ.

    A device whose node id cannot be read (a lost GPU, an amdsmi without amdsmi_get_gpu_kfd_info)
    still counts for ROCr. Its number is None, and the others' are still known where its place is:
    the gaps between the node ids read, GPU node ids being consecutive (they follow the CPU nodes)
    when as many gaps as unreadable devices; after them all, where it comes after every readable
    device in AMD SMI's order too and there is no gap. Anything else: every number is None."""
    known = sorted(n for n in nodes if n is not None)
    unknown = len(nodes) - len(known)
    if not known or len(set(known)) != len(known):
        return [None] * len(nodes)
    if unknown == 0:
        return [known.index(n) if n is not None else None for n in nodes]
    gaps = known[-1] - known[0] + 1 - len(known)
    if gaps == unknown:
        return [None if n is None else n - known[0] for n in nodes]
    last_known = max(i for i, n in enumerate(nodes) if n is not None)
    if gaps == 0 and all(n is not None for n in nodes[:last_known]):
        return [None if n is None else known.index(n) for n in nodes]
    return [None] * len(nodes)


def partition_memory(totals: Sequence[int], nps: str | None) -> list[int]:
    """Each compute partition's memory, from what AMD SMI reports for the partitions of one GPU (in
    slot order) and the GPU's memory partition mode. Partitions that share one memory pool (all of
    them in NPS1; in NPS4, the CPX partitions beside each quarter) are taken to each report the
    whole pool when they report the same amount, and get an equal share of it; partitions that
    report different amounts are taken at their word. Not verified on hardware: were AMD SMI to
    report each partition's share already, a partition would be given too little memory (a smaller
    plan, never an out-of-memory run)."""
    pools = MEMORY_POOLS.get(str(nps), 1)
    sharing = len(totals) // pools if len(totals) > pools and len(totals) % pools == 0 else 1
    shares = list(totals)
    for start in range(0, len(totals), sharing):
        group = totals[start : start + sharing]
        if sharing > 1 and len(set(group)) == 1:
            shares[start : start + sharing] = [group[0] // sharing] * sharing
    return shares
