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
