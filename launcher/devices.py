"""GPU discovery through NVML (the nvidia-ml-py package, imported as pynvml).

This is the one seam through which the launcher sees GPUs: tests replace `nvml_gpu_indices`.
Selection policies, utilization and claims come with the GPU-selection work (issue 5)."""

from __future__ import annotations


def nvml_gpu_indices() -> list[int]:
    """Indices of the NVIDIA GPUs NVML sees; [] when there is no driver or no package."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return []
    try:
        return list(range(pynvml.nvmlDeviceGetCount()))
    finally:
        pynvml.nvmlShutdown()


class DeviceError(ValueError):
    """The requested devices cannot be had; the message is one line."""


def restrict_to_visible(available: list[int], cuda_visible_devices: str | None) -> list[int]:
    """An existing CUDA_VISIBLE_DEVICES (Slurm, a container, a user sharing the machine)
    limits the choice to the GPUs it lists, in its order. Only indices for now: GPU UUIDs
    are refused rather than ignored, since ignoring them could land on someone else's GPU."""
    if cuda_visible_devices is None:
        return available
    listed = [entry.strip() for entry in cuda_visible_devices.split(",") if entry.strip()]
    if not all(entry.isdigit() for entry in listed):
        raise DeviceError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} names GPUs by UUID, which the "
                          f"launcher cannot map yet; list GPU indices instead")
    return [int(entry) for entry in listed if int(entry) in available]


def choose_gpus(available: list[int], nproc: int | None, device_id: int | None) -> list[int]:
    """Which physical GPUs to run on: [device_id] when pinned, else the first nproc
    (default: all) of those available."""
    if not available:
        raise DeviceError("no NVIDIA GPU found; use --device cpu")
    if device_id is not None:
        if device_id not in available:
            raise DeviceError(f"GPU {device_id} does not exist; GPUs here: {', '.join(map(str, available))}")
        if nproc not in (None, 1):
            raise DeviceError(f"system.device_id pins one GPU but --nproc is {nproc}; drop one of them")
        return [device_id]
    count = len(available) if nproc is None else nproc
    if count > len(available):
        raise DeviceError(f"--nproc {count} asks for more GPUs than there are ({len(available)})")
    return available[:count]
