"""Which GPUs a run gets, from the --gpus request and the free criteria (launcher/gpus/request.py):
each GPU judged, the launcher's own visibility variables (CUDA_VISIBLE_DEVICES; on AMD,
ROCR_VISIBLE_DEVICES, then HIP_VISIBLE_DEVICES or CUDA's), and the claims that keep two launches
off the same GPU.

A device's verdict is one of: free; busy (over --max-utilization, or under --min-free-memory)
or unhealthy (launcher/gpus/health.py: memory errors, a clock slowdown that means trouble, a
narrowed PCIe link): skipped by `all` and `auto:N`, a warning in an explicit list unless
--strict; or unusable (hidden by CUDA_VISIBLE_DEVICES, a GPU in MIG mode, claimed by another
launcher, one NVML or AMD SMI cannot read).

An AMD GPU in a compute partition mode (CPX, ...) is like a GPU in MIG mode: it is listed with its
partitions as devices index.slot (mig=True). Its partitions are kept apart from whole GPUs as MIG
devices are (a slice would pace a whole GPU), but a run may use several of them: each partition is a
GPU of its own to ROCr and RCCL, unlike MIG devices, which NCCL does not support.

"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from launcher.gpus import claims, health
from launcher.gpus.devices import Gpu
from launcher.gpus.request import GIB, Criteria, DeviceError, GpuRequest, Verdict

NO_GPU = "no NVIDIA or AMD GPU found"
NO_GPU_FOUND = f"{NO_GPU}; use --device cpu"
ONE_MIG_DEVICE = (
    "a run uses at most one MIG device: NCCL does not support MIG, and the MIG devices of "
    "one GPU share its PCI bus id, which NCCL refuses as a duplicate GPU"
)
NO_GPUS_VISIBLE = {"", "-1", "none", "nodevfiles", "void"}  # CUDA_VISIBLE_DEVICES values that hide every GPU
HIP_MASKS = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
"""HIP's mask on ROCm: the first of these set non-empty, and only that one (ROCm's clr reads
HIP_VISIBLE_DEVICES, else CUDA_VISIBLE_DEVICES; an empty one is no filter; torch's
_parse_visible_devices agrees). It applies to the devices ROCR_VISIBLE_DEVICES left."""

Limits = tuple[tuple[str, str], ...]
"""The limiting variables that are set, (name, value), in the order they apply."""


# --- what each GPU is ----------------------------------------------------------------


def judge(
    gpu: Gpu,
    criteria: Criteria,
    visible: set[str] | None,
    holder: Callable[[str], claims.Holder | None] = claims.holder_of,
    hidden_by: str = "CUDA_VISIBLE_DEVICES",
) -> Verdict:
    """hidden_by: the variables that limit the choice, as the reason for a GPU they hide says them."""
    if gpu.error is not None:
        return Verdict(gpu, "error", (f"{reader(gpu)} cannot read it: {gpu.error}",))
    if visible is not None and gpu.id not in visible:
        return Verdict(gpu, "hidden", (f"not in {hidden_by}",))
    if gpu.mig_enabled:
        return Verdict(
            gpu, "mig", ("partition mode: use its partitions" if gpu.vendor == "amd" else "MIG mode: use its MIG devices",)
        )
    held = holder(gpu.uuid)
    if held is not None:
        return Verdict(gpu, "claimed", (held.describe(),))
    assessment = health.assess(gpu.health)
    if not assessment.healthy:
        return Verdict(gpu, "unhealthy", assessment.reasons)
    reasons = []
    if gpu.utilization is not None and gpu.utilization > criteria.max_utilization:
        reasons.append(f"utilization {gpu.utilization:.0f}% > {criteria.max_utilization:g}%")
    if gpu.memory_free < criteria.needed(gpu):
        reasons.append(f"{gpu.memory_free / GIB:.1f} GiB free < {criteria.describe_memory()}")
    return Verdict(gpu, "busy" if reasons else "free", tuple(reasons))


def mig_device(gpu: Gpu) -> bool:
    """A MIG device (NVIDIA): one per process and per run, as NCCL does not support MIG. (An AMD
    partition is a GPU of its own to ROCr and RCCL.)"""
    return gpu.mig and gpu.vendor == "nvidia"


def reader(gpu: Gpu) -> str:
    """The library that read it, as an error names it."""
    return "AMD SMI" if gpu.vendor == "amd" else "NVML"


def visibility_limits(gpus: Sequence[Gpu], environ: Mapping[str, str]) -> Limits:
    """The launcher's own limiting variables that apply, for these GPUs' vendor, in the order its
    runtime applies them. NVIDIA: CUDA_VISIBLE_DEVICES. AMD: ROCR_VISIBLE_DEVICES where set (set
    but empty: no device), then HIP's mask (HIP_MASKS: HIP_VISIBLE_DEVICES, else CUDA_VISIBLE_DEVICES,
    never both)."""
    if not gpus or gpus[0].vendor != "amd":
        return (("CUDA_VISIBLE_DEVICES", environ["CUDA_VISIBLE_DEVICES"]),) if "CUDA_VISIBLE_DEVICES" in environ else ()
    limits: Limits = (("ROCR_VISIBLE_DEVICES", environ["ROCR_VISIBLE_DEVICES"]),) if "ROCR_VISIBLE_DEVICES" in environ else ()
    hip = next(((name, environ[name]) for name in HIP_MASKS if environ.get(name, "").strip()), None)
    return limits + ((hip,) if hip is not None else ())


def runtime_numbers(gpus: Sequence[Gpu]) -> dict[str, int]:
    """ROCr's device number of each AMD device a process can be given (whole GPUs and partitions, not
    a GPU in a partition mode itself), by id: Gpu.runtime_index, else its place among those devices
    in AMD SMI's order (taken to be ROCr's). The numbers the launcher's own ROCR_VISIBLE_DEVICES (or
    HIP's mask without it) count by, and a partition's worker is given."""
    devices = [gpu for gpu in gpus if gpu.vendor == "amd" and not gpu.mig_enabled]
    return {gpu.id: gpu.runtime_index if gpu.runtime_index is not None else at for at, gpu in enumerate(devices)}


def describe_limits(limits: Limits | str | None) -> str:
    """ "ROCR_VISIBLE_DEVICES=0,1 and HIP_VISIBLE_DEVICES=1", as an error names them."""
    return " and ".join(f"{name}={value}" for name, value in _as_limits(limits))


def limiting_names(limits: Limits | str | None) -> str:
    return "/".join(name for name, _ in _as_limits(limits)) or "CUDA_VISIBLE_DEVICES"


def _as_limits(limits: Limits | str | None) -> Limits:
    """A bare string is CUDA_VISIBLE_DEVICES' value."""
    if limits is None:
        return ()
    return (("CUDA_VISIBLE_DEVICES", limits),) if isinstance(limits, str) else limits


def visible_ids(gpus: list[Gpu], limits: Limits | str | None) -> set[str] | None:
    """The ids of the devices the launcher's own limiting variables allow (None: no limit);
    limits as visibility_limits gives them, or CUDA_VISIBLE_DEVICES' value alone.

    The first variable's entries are indices or UUIDs (GPU-..., MIG-...; a unique prefix is enough,
    as for CUDA; on AMD in any case, as ROCr upper-cases both). NVIDIA's indices are NVML's (the PCI
    order, as CUDA_DEVICE_ORDER=PCI_BUS_ID numbers them); AMD's are ROCr's device numbers
    (runtime_numbers: every partition a device), not AMD SMI's GPU ids. A later one (HIP's mask after
    ROCR_VISIBLE_DEVICES) counts its indices among the devices the one before left, as ROCm does. As for CUDA, -1 ends a list. A
    GPU in MIG mode (or an AMD GPU in a partition mode) named here allows its devices."""
    shown: list[Gpu] | None = None
    for variable, value in _as_limits(limits):
        shown = _allowed(gpus, shown, variable, value)
    return None if shown is None else {g.id for g in shown}


def _allowed(gpus: list[Gpu], before: list[Gpu] | None, variable: str, value: str) -> list[Gpu]:
    """The devices one variable leaves of those `before` left (None: every device), in its order."""
    allowed: list[Gpu] = []
    usable = [g for g in before if not g.mig_enabled] if before is not None else []
    for entry in (e.strip() for e in value.split(",")):
        if entry.lower() in NO_GPUS_VISIBLE or entry.startswith("-"):
            break
        context = f"{variable}={value} names"
        if before is None and entry.isdigit() and gpus and gpus[0].vendor == "amd":
            device = _rocr_device(gpus, int(entry), context)
        elif before is None:
            device = find(gpus, entry, context)
        elif entry.isdigit():
            if int(entry) >= len(usable):
                raise DeviceError(
                    f"{context} device {entry}, but only {len(usable)} are left to it by the variables before it; "
                    f"unset {variable}, or count from 0 among those"
                )
            device = usable[int(entry)]
        else:
            device = find(before, entry, context)
        allowed.append(device)
        allowed.extend(g for g in gpus if g.mig and device.mig_enabled and g.index == device.index)
    return allowed


def _rocr_device(gpus: list[Gpu], number: int, context: str) -> Gpu:
    """The AMD device ROCr numbers `number` (runtime_numbers)."""
    numbers = runtime_numbers(gpus)
    matches = [g for g in gpus if numbers.get(g.id) == number]
    if not matches:
        raise DeviceError(
            f"{context} device {number}, but ROCr numbers {len(numbers)} device(s) here (0-{len(numbers) - 1}, "
            f"partitions included); unset it, or name a device ROCr has"
        )
    return matches[0]


def find(gpus: list[Gpu], name: str, context: str) -> Gpu:
    """The device an id or UUID (or a unique UUID prefix) names; an AMD UUID in any case."""
    if gpus and gpus[0].vendor == "amd" and name.upper().startswith("GPU-"):
        matches = [g for g in gpus if g.uuid.upper().startswith(name.upper())]
    elif name.startswith(("GPU-", "MIG-")):
        matches = [g for g in gpus if g.uuid.startswith(name)]
    else:
        matches = [g for g in gpus if g.id == name]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(g.id for g in gpus if not g.mig_enabled) or "none"
    if matches:
        raise DeviceError(f"{context} {name}, which matches {len(matches)} GPUs; give more of the UUID")
    raise DeviceError(f"{context} GPU {name}, which does not exist; GPUs here: {known} (`python -m launcher gpus` shows them)")


# --- choosing and claiming -----------------------------------------------------------


@dataclass
class Selection:
    chosen: list[Gpu] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    held: list[claims.Claim] = field(default_factory=list)

    def release(self) -> None:
        for claim in self.held:
            claim.release()
        self.held.clear()


def freest_first(verdict: Verdict) -> tuple:
    """auto:N order: lowest utilization (unknown after every known value), then most free memory."""
    gpu = verdict.gpu
    return (gpu.utilization is None, gpu.utilization or 0.0, -gpu.memory_free, gpu.index, gpu.id)


def select(
    gpus: list[Gpu],
    request: GpuRequest,
    criteria: Criteria,
    *,
    strict: bool = False,
    limits: Limits | str | None = None,
    claim: Callable[[str], claims.Claim | claims.Holder] = claims.try_claim,
    holder: Callable[[str], claims.Holder | None] = claims.holder_of,
) -> Selection:
    """Choose and claim the GPUs `request` asks for; limits: the launcher's own limiting
    variables (visibility_limits), or CUDA_VISIBLE_DEVICES' value. The claims are held on
    return; on error none is."""
    visible = visible_ids(gpus, limits)
    hidden_by = limiting_names(limits)
    selection = Selection(verdicts=[judge(g, criteria, visible, holder, hidden_by) for g in gpus])
    try:
        if request.kind == "list":
            _claim_listed(selection, gpus, request, strict, claim, hidden_by)
        else:
            _claim_free(selection, request, criteria, claim)
    except BaseException:
        selection.release()
        raise
    order = {g.id: at for at, g in enumerate(gpus)}
    selection.chosen.sort(key=lambda g: order[g.id])  # ranks in NVML order
    chosen_ids = {g.id for g in selection.chosen}
    selection.verdicts = [replace(v, state="chosen") if v.gpu.id in chosen_ids else v for v in selection.verdicts]
    return selection


def _claim_free(
    selection: Selection, request: GpuRequest, criteria: Criteria, claim: Callable[[str], claims.Claim | claims.Holder]
) -> None:
    """all: every free GPU, in NVML order; auto:N: the N freest. A GPU another launcher
    claims between the look and the claim is skipped like any claimed GPU."""
    _keep_mig_devices_apart(selection)
    only_mig = any(mig_device(v.gpu) and v.state in ("free", "busy") for v in selection.verdicts)
    if only_mig and request.kind == "auto" and request.count > 1:
        raise DeviceError(
            f"--gpus {request} needs {request.count} GPUs, but only MIG devices are usable here "
            f"and {ONE_MIG_DEVICE}; use --gpus auto:1, or whole GPUs",
            verdicts=selection.verdicts,
        )
    free = [v for v in selection.verdicts if v.state == "free"]
    if request.kind == "auto":
        free.sort(key=freest_first)
    wanted = 1 if only_mig else request.count if request.kind == "auto" else len(free)
    for verdict in free:
        if len(selection.chosen) == wanted:
            break
        _claim_one(selection, verdict, claim)
    if only_mig and selection.chosen:  # say why `all` left the other MIG devices out
        selection.verdicts = [
            Verdict(v.gpu, "mig", ("MIG device: one per run (NCCL does not support MIG)",))
            if v.state in ("free", "busy") and v.gpu not in selection.chosen
            else v
            for v in selection.verdicts
        ]
    if not selection.chosen or (request.kind == "auto" and len(selection.chosen) < wanted):
        usable = [v for v in selection.verdicts if v.state not in ("hidden", "mig", "error")]
        have = (
            f"{len(selection.chosen)} of {len(usable)} GPU(s) are free"
            if selection.chosen
            else f"none of the {len(usable)} GPU(s) is free"
        )
        need = "" if request.kind == "all" else f"--gpus {request} needs {request.count}, but "
        raise DeviceError(
            f"{need}{have} (free: utilization <= {criteria.max_utilization:g}% and at least "
            f"{criteria.describe_memory()} memory free, unclaimed, healthy); wait, loosen --max-utilization "
            f"or --min-free-memory, or name GPUs with --gpus",
            verdicts=selection.verdicts,
        )


def _keep_mig_devices_apart(selection: Selection) -> None:
    """all and auto:N never put MIG devices (or AMD partitions) and whole GPUs in one run (a 10 GB
    slice would pace an 80 GB GPU); they are theirs only on a machine with no whole GPU to use."""
    whole = [v for v in selection.verdicts if not v.gpu.mig and v.state not in ("hidden", "mig", "error")]
    if whole:
        selection.verdicts = [
            Verdict(v.gpu, "mig", (f"{_slice(v.gpu)}: not mixed with whole GPUs; name it in --gpus",))
            if v.gpu.mig and v.state in ("free", "busy")
            else v
            for v in selection.verdicts
        ]


def _claim_listed(
    selection: Selection,
    gpus: list[Gpu],
    request: GpuRequest,
    strict: bool,
    claim: Callable[[str], claims.Claim | claims.Holder],
    hidden_by: str = "CUDA_VISIBLE_DEVICES",
) -> None:
    by_id = {v.gpu.id: v for v in selection.verdicts}
    listed = [by_id[find(gpus, name, "--gpus names").id] for name in request.ids]
    if len({v.gpu.id for v in listed}) < len(listed):
        raise DeviceError(f"--gpus {request} names one GPU twice (by id and by UUID); one worker runs per GPU")
    slices = [v.gpu.id for v in listed if mig_device(v.gpu)]
    if len(slices) > 1:
        raise DeviceError(
            f"--gpus {request} names {len(slices)} MIG devices ({', '.join(slices)}), but "
            f"{ONE_MIG_DEVICE}; name one of them, or use whole GPUs"
        )
    for verdict in listed:
        gpu = verdict.gpu
        if verdict.state == "hidden":
            raise DeviceError(
                f"GPU {gpu.id} is not in {hidden_by}; choose among "
                f"{', '.join(v.gpu.id for v in selection.verdicts if v.state not in ('hidden', 'mig'))}"
            )
        if verdict.state == "error":
            check = "`amd-smi list`" if gpu.vendor == "amd" else "`nvidia-smi`"
            raise DeviceError(f"GPU {gpu.id}: {verdict.reasons[0]}; check {check}, or choose another GPU")
        if verdict.state == "mig":
            migs = ", ".join(g.id for g in gpus if g.mig and g.index == gpu.index) or "none configured"
            if gpu.vendor == "amd":
                raise DeviceError(
                    f"GPU {gpu.id} is in a compute partition mode, so it is used as its partitions; "
                    f"choose them ({migs}) or their UUIDs"
                )
            raise DeviceError(
                f"GPU {gpu.id} is in MIG mode, so CUDA cannot use it whole; choose its MIG devices ({migs}) or their UUIDs"
            )
        if verdict.state == "busy":
            problem = f"GPU {gpu.id} is busy ({'; '.join(verdict.reasons)})"
            if strict:
                raise DeviceError(f"{problem}; --strict refuses busy GPUs", verdicts=selection.verdicts)
            selection.warnings.append(f"{problem}; using it anyway as --gpus names it (--strict refuses)")
        if verdict.state == "unhealthy":
            problem = f"GPU {gpu.id} is unhealthy ({'; '.join(verdict.reasons)})"
            if strict:
                raise DeviceError(f"{problem}; --strict refuses unhealthy GPUs; choose another GPU")
            selection.warnings.append(f"{problem}; using it anyway as --gpus names it (--strict refuses)")
    for verdict in listed:
        if not _claim_one(selection, verdict, claim):
            raise DeviceError(
                f"GPU {verdict.gpu.id} is {selection_reason(selection, verdict.gpu)}; "
                f"choose another GPU or wait for that run to end"
            )


def _claim_one(selection: Selection, verdict: Verdict, claim: Callable[[str], claims.Claim | claims.Holder]) -> bool:
    """Claim verdict's GPU; on losing the race, record who holds it."""
    result = claim(verdict.gpu.uuid)
    if isinstance(result, claims.Claim):
        selection.held.append(result)
        selection.chosen.append(verdict.gpu)
        return True
    at = selection.verdicts.index(verdict)
    selection.verdicts[at] = Verdict(verdict.gpu, "claimed", (result.describe(),))
    return False


def _slice(gpu: Gpu) -> str:
    return "partition" if gpu.vendor == "amd" else "MIG device"


def selection_reason(selection: Selection, gpu: Gpu) -> str:
    return next(v.describe() for v in selection.verdicts if v.gpu.id == gpu.id)
