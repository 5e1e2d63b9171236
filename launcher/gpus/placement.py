"""Where the workers run: CPU workers, or which GPUs (chosen, claimed, and explained).

Rules, in order:
1. `--device cpu` or `--gpus none`: CPU workers (--nproc of them, default 2). No NVML.
2. What is asked for: --gpus; else system.device_id (that one GPU); else --nproc N (the N
   freest GPUs, auto:N); else all (every free GPU).
3. The vendor (launcher/gpus/vendors.py): detected, or --gpu-vendor where the machine has both.
   No driver of either, no GPU, or a CUDA_VISIBLE_DEVICES (AMD: ROCR_VISIBLE_DEVICES, then HIP's or
   CUDA's) that hides them all: CPU workers (--nproc of them, default 2) when falling back is allowed (the
   debug preset, or a generic `-- COMMAND`), with device auto, and no more asked for than --gpus
   all or --nproc N (not a GPU id, auto:N or system.device_id); otherwise "no NVIDIA or AMD GPU
   found; use --device cpu". A driver that is there but broken is always an error (nvml.NvmlFailure).
4. Otherwise devices.select() chooses and claims; the claims last until release().
5. With two or more GPUs, which of them each worker sees (launcher/gpus/visibility.py): its own,
   or every run GPU of the node where some pair reaches the other over PCIe only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from launcher.gpus import selection as devices, vendors, visibility as gpu_visibility
from launcher.gpus.devices import Gpu, NoGpuDriver
from launcher.gpus.request import (
    DEFAULT_MAX_UTILIZATION,
    DEFAULT_MIN_FREE_MEMORY,
    Criteria,
    DeviceError,
    GpuRequest,
    parse_request,
)
from launcher.gpus.table import render
from launcher.supervise.printer import Printer

DEFAULT_CPU_WORKERS = 2


@dataclass(frozen=True)
class GpuOptions:
    """The launcher's device options, as given."""

    device: str = "auto"
    """auto, cpu or cuda (--device, else system.device)."""
    gpus: str | None = None
    nproc: int | None = None
    device_id: int | None = None
    min_free_memory: str = DEFAULT_MIN_FREE_MEMORY
    max_utilization: str = str(DEFAULT_MAX_UTILIZATION)
    strict: bool = False
    cpu_fallback: bool = False
    """Without GPUs, run CPU workers instead of stopping (the debug preset; generic commands)."""
    own_command: bool = False
    """The workers run the user's `-- COMMAND`: one GPU each, unless LAUNCHER_GPU_VISIBILITY asks."""
    gpu_vendor: str | None = None
    """--gpu-vendor: nvidia or amd, for a machine with both; None: the one detected."""


@dataclass
class Placement:
    """Where the workers run: device "cuda" or "cpu", and the device of each rank."""

    device: Literal["cpu", "cuda"]
    world_size: int
    gpus: tuple[Gpu, ...] = ()
    selection: devices.Selection | None = field(default=None, repr=False)
    shared_gpus: bool = False
    """Every worker sees all of gpus (in local-rank order) and uses cuda:LOCAL_RANK; else only its own, cuda:0."""
    runtime_ids: dict[str, str] = field(default_factory=dict)
    """What the visibility variable names a device by where Gpu.visible_id cannot say: an AMD
    partition (runtime_ids)."""

    def label(self, rank: int) -> str:
        return f"GPU{self.gpus[rank].id}" if self.device == "cuda" else f"CPU{rank}"

    def visible_devices(self, local_rank: int) -> str | None:
        """What this node's worker local_rank sees, as its visibility_variable() says it
        (None: a CPU worker)."""
        if self.device != "cuda":
            return None
        shown = self.gpus if self.shared_gpus else self.gpus[local_rank : local_rank + 1]
        return ",".join(self.runtime_ids.get(gpu.id, gpu.visible_id) for gpu in shown)

    def visibility_variable(self) -> str:
        """The variable visible_devices() is for: CUDA_VISIBLE_DEVICES (NVIDIA, CPU workers) or
        ROCR_VISIBLE_DEVICES (AMD)."""
        return self.gpus[0].visibility_variable if self.device == "cuda" and self.gpus else "CUDA_VISIBLE_DEVICES"

    def cuda_device_index(self, local_rank: int) -> int:
        """Which of the GPUs it sees is its own: the n of its cuda:n."""
        return local_rank if self.shared_gpus else 0

    def release(self) -> None:
        """Give back the GPU claims (the launcher's exit does too, however it exits)."""
        if self.selection is not None:
            self.selection.release()


def gpu_request(options: GpuOptions) -> GpuRequest:
    if options.nproc is not None and options.nproc < 1:
        raise DeviceError(f"--nproc must be at least 1 (got {options.nproc})")
    if options.gpus is not None:
        request = parse_request(options.gpus)
        if options.device == "cpu" and request.kind != "none":
            raise DeviceError(f"--device cpu conflicts with --gpus {options.gpus}; drop one of them")
        if options.nproc is not None and request.kind != "none":
            raise DeviceError(
                f"--nproc sets the number of CPU workers; with --gpus {options.gpus} the GPUs "
                f"decide it (auto:N for N GPUs); drop --nproc"
            )
        if (
            options.device_id is not None
            and request.kind != "none"
            and request != GpuRequest("list", ids=(str(options.device_id),))
        ):
            raise DeviceError(f"system.device_id pins GPU {options.device_id} but --gpus is {options.gpus}; drop one of them")
        return request
    if options.device == "cpu":
        return GpuRequest("none")
    if options.device_id is not None:
        if options.nproc not in (None, 1):
            raise DeviceError(f"system.device_id pins one GPU but --nproc is {options.nproc}; drop one of them")
        return GpuRequest("list", ids=(str(options.device_id),))
    if options.nproc is not None:
        return GpuRequest("auto", count=options.nproc)
    return GpuRequest("all")


def place(options: GpuOptions, printer: Printer) -> Placement:
    """Decide CPU or GPU and which GPUs; the chosen GPUs are claimed on return."""
    request = gpu_request(options)
    cpu_workers = options.nproc or DEFAULT_CPU_WORKERS
    if request.kind == "none":
        return Placement("cpu", cpu_workers)
    criteria = Criteria.parse(options.min_free_memory, options.max_utilization)
    wanted = gpu_visibility.setting(os.environ)
    try:
        gpus = vendors.discover_requested(options.gpu_vendor)
    except NoGpuDriver:
        gpus = []
    limits = devices.visibility_limits(gpus, os.environ)
    usable = devices.visible_ids(gpus, limits) if gpus else set()
    if not gpus or usable == set():
        # --nproc N asks for N workers: on GPUs where there are some (auto:N), else on CPUs.
        asked_for_any = request.kind == "all" or (options.gpus is None and options.nproc is not None)
        falls_back = options.cpu_fallback and options.device == "auto" and asked_for_any and options.device_id is None
        if falls_back:
            printer.launcher_line(
                f"{devices.NO_GPU}; running {cpu_workers} CPU worker "
                f"process{'es' * (cpu_workers != 1)} (gloo); --nproc N changes the count"
            )
            return Placement("cpu", cpu_workers)
        if gpus:
            raise DeviceError(f"{devices.describe_limits(limits)} hides every GPU; unset it or use --device cpu")
        raise DeviceError(devices.NO_GPU_FOUND)
    selection = devices.select(gpus, request, criteria, strict=options.strict, limits=limits)
    _explain(selection, request, printer)
    try:
        links = vendors.of(selection.chosen).peer_links(selection.chosen)
        visibility = gpu_visibility.choose(selection.chosen, links, options.own_command, wanted)
    except BaseException:
        selection.release()
        raise
    if visibility.line:
        printer.launcher_line(visibility.line)
    return Placement(
        "cuda",
        len(selection.chosen),
        tuple(selection.chosen),
        selection,
        shared_gpus=visibility.shared,
        runtime_ids=runtime_ids(gpus),
    )


def runtime_ids(gpus: list[Gpu]) -> dict[str, str]:
    """ROCr's device number of each AMD partition, by id (devices.runtime_numbers: Gpu.runtime_index,
    else its place among the devices a process can be given). A partition needs it: it shares its
    GPU's unique id, so no ROCr UUID names it alone. (A whole GPU goes by its UUID, GPU-<unique id>:
    Gpu.visible_id.)"""
    numbers = devices.runtime_numbers(gpus)
    return {gpu.id: str(numbers[gpu.id]) for gpu in gpus if gpu.id in numbers and gpu.visible_id == gpu.id}


def _explain(selection: devices.Selection, request: GpuRequest, printer: Printer) -> None:
    """Say which GPUs were chosen and why, before anything else happens."""
    ids = ", ".join(g.id for g in selection.chosen)
    plural = "s" if len(selection.chosen) > 1 else ""
    for warning in selection.warnings:
        printer.launcher_line(f"warning: {warning}")
    if request.kind == "auto":
        printer.launcher_line(f"Using GPU{plural} {ids} (lowest utilization)")
        printer.launcher_line(render(selection.verdicts))
    elif request.kind == "all":
        skipped = [
            v for v in selection.verdicts if v.state in ("busy", "unhealthy", "claimed", "error", "mig") and not v.gpu.mig_enabled
        ]
        printer.launcher_line(f"using GPU{plural} {ids}" + (f"; skipped {len(skipped)}:" if skipped else ""))
        for verdict in skipped:
            printer.launcher_line(f"  GPU {verdict.gpu.id}: {verdict.describe()}")
