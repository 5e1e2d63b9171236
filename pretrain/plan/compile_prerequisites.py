"""What torch.compile needs on the machine besides torch, found before the first forward needs it.

torch.compile builds kernels on first use: on CUDA, Triton builds each kernel's launcher with a C
compiler; on CPU, Inductor builds C++ kernels. Both compile C files that include Python.h, so a
host without the Python headers (a distribution's Python without its -dev package) fails at the
first step, with a compiler error deep in a traceback. Checked here instead, torch-free, so the
launcher can turn compile off once, with one line, before any worker starts (launcher/prepare.py),
and a worker run alone does the same (pretrain/distributed/parallel.py).

On ROCm the GPU is "cuda" too, and the check is the same: Triton's AMD backend (ROCm's torch ships
pytorch-triton-rocm) builds its kernel launcher with the same C compiler search and Python.h.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from pretrain import registry
from pretrain.config import Config


def compile_requested(config: Config, device_type: str) -> bool:
    """Whether the run asks for torch.compile on device_type: training.compile, or, when it is
    null, on CUDA only (a first compile on CPU is slow); never with debug.trace_nonfinite (compiled
    blocks hide their modules from its hooks)."""
    if config.debug.trace_nonfinite:
        return False
    chosen = config.training.compile
    return device_type == "cuda" if chosen is None else chosen


def missing_compile_prerequisite(device_type: str) -> str | None:
    """What torch.compile will look for on device_type ("cuda" or "cpu") and not find, said as
    what to install; None when everything is there."""
    return missing_compiler(device_type) or missing_python_headers()


def missing_compiler(device_type: str) -> str | None:
    """The compiler torch.compile will look for and not find, or None. Searched the way the
    compilers do, so a missing one is found before the first forward raises."""
    if device_type == "cuda":
        # Triton builds its kernel launcher with $CC, else gcc, else clang (triton/runtime/build.py).
        if os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang"):
            return None
        return "a C compiler (gcc or clang on PATH, or CC)"
    # Inductor's CPU kernels are C++, built with $CXX, else g++ (torch._inductor.config.cpp.cxx).
    if shutil.which(os.environ.get("CXX") or "g++"):
        return None
    return "a C++ compiler (g++ on PATH, or CXX)"


def python_include_dir() -> Path:
    """Where the compilers look for Python.h: the interpreter's include directory, as Inductor's
    and Triton's builds ask sysconfig for it."""
    return Path(sysconfig.get_paths()["include"])


def missing_python_headers(include_dir: Path | None = None) -> str | None:
    """The Python headers, said as the package that installs them, when Python.h is not in
    include_dir (default: this interpreter's); None when it is there."""
    include_dir = include_dir or python_include_dir()
    if (include_dir / "Python.h").is_file():
        return None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (
        f"the Python headers (no Python.h in {include_dir}: e.g. apt-get install python{version}-dev, "
        f"or dnf install python{version}-devel)"
    )


def compile_off_line(missing: str) -> str:
    """The one warning line for a compile turned off for want of missing."""
    return (
        f"training.compile is off: torch.compile needs {missing} on first use, and none was found; "
        "install it, or set training.compile=false to silence this"
    )


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""training.compile_mode's choices that replay compiled regions as CUDA graphs."""


GpuFacts = tuple[str, str, tuple[int, int] | None]
"""A GPU as the launcher read it: (name, vendor, compute capability or None)."""


def dropless_cuda_graph_problem(config: Config, device_type: str, gpus: Sequence[GpuFacts]) -> str | None:
    """Why this run cannot capture its compiled blocks as CUDA graphs: dropless experts whose
    grouped matmul syncs with the host on one of gpus ((name, vendor, compute capability)), which
    a graph capture cannot hold; None when nothing stands in the way. Unknown capabilities pass."""
    moe, t = config.model.moe, config.training
    if moe.num_experts == 0 or moe.capacity_factor is not None or not t.use_amp or t.compile_mode not in CUDA_GRAPH_MODES:
        return None
    if not compile_requested(config, device_type) or not registry.grouped_widths_aligned(
        config.model.dim, config.model.ffn_dim, 2
    ):
        return None  # uncompiled, or the every-token buffer (no grouped matmul, no sync)
    for name, vendor, capability in gpus:
        syncs = vendor == "amd" or (capability is not None and capability[0] not in registry.GROUPED_MM_SYNC_FREE_CUDA_MAJORS)
        if syncs:
            where = "ROCm" if vendor == "amd" else f"compute capability {capability[0]}.{capability[1]}"  # type: ignore[index]
            return (
                f"training.compile_mode {t.compile_mode} captures CUDA graphs, which cannot hold the host sync of "
                f"dropless experts' grouped matmul on {name} ({where}); use training.compile_mode=default or "
                "max-autotune-no-cudagraphs, or model.moe.capacity_factor=1.25 (capacity routing, no sync)"
            )
    return None
