"""GPU check `flash-attention`: compiled bf16 attention runs fused flash-attention kernels.

A compiled transformer block of `small` (head_dim 64) and of `production` (head_dim 128), forward
and backward under bf16 autocast (benchmarks/gpu_acceptance/workers_flash.py), profiled: the CUDA kernels
that ran must include a flash forward and a flash backward kernel, PyTorch's own
(pytorch_flash::flash_fwd_kernel, flash_bwd_...) or cuDNN's fused flash SDPA kernels
(cudnn_generated_fort_native_sdpa_sm90_flash_fprop_* / *_bprop_*: what torch 2.11 picked on an H200,
benchmarks/results/2026-11-25-h200.md), and not the math path, which inductor builds from a
softmax kernel and matmuls around the whole (B, heads, T, T) score matrix. The attention kernels
seen are listed either way: the memory-efficient (cutlass fmha) kernels, or cuDNN's helpers
(cudnn::fusion::fmha_reduce_head), show as other fused attention.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from benchmarks.gpu_acceptance.context import Context, Row
from benchmarks.gpu_acceptance.procs import CheckFailed, child_env, worker

PRESETS = ("small", "production")
TIMEOUT_S = 180
"""One block's cold compile and two passes: well under a minute on an H100."""
TARGET = (
    "flash forward and backward kernels (PyTorch's pytorch_flash::flash_* or cuDNN's *_sdpa_*_flash_fprop/bprop_*), "
    "no math path (softmax kernel)"
)
BACKWARD_WORDS = ("bwd", "backward", "bprop", "cutlassb", "dgrad")
"""Words in the name of an attention kernel of the backward pass (flash_bwd_*, fmha_cutlassB_*, cuDNN's *_bprop_*)."""


@dataclass(frozen=True)
class AttentionKernels:
    """The attention kernels among a pass's CUDA kernels, by kind, as short names."""

    flash_forward: tuple[str, ...]
    flash_backward: tuple[str, ...]
    other_fused: tuple[str, ...]
    """Fused attention that is not flash: memory-efficient (cutlass fmha), cuDNN's helpers."""
    math: tuple[str, ...]
    """Softmax kernels: the math path (a transformer block has no other softmax)."""

    @property
    def flash(self) -> bool:
        return bool(self.flash_forward and self.flash_backward and not self.math)

    def describe(self) -> str:
        parts = [
            f"{what}: {', '.join(names)}"
            for what, names in (
                ("flash forward", self.flash_forward),
                ("flash backward", self.flash_backward),
                ("other fused attention", self.other_fused),
                ("math path (softmax)", self.math),
            )
            if names
        ]
        return "; ".join(parts) or "no attention kernel recognised"


def short_name(kernel: str) -> str:
    """'void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<...>, ...>(Flash_fwd_params)'
    -> 'pytorch_flash::flash_fwd_kernel': the name without its return type, template and arguments."""
    name = re.sub(r"^void\s+", "", kernel.strip())
    return re.split(r"[<(]", name, maxsplit=1)[0].strip()


def attention_kind(kernel: str) -> str | None:
    """flash, other_fused, math, or None for a kernel that is not attention's. cuDNN's SDPA kernels
    are flash when they say so and run a pass (cudnn_generated_fort_native_sdpa_sm90_flash_fprop_...,
    ..._flash_bprop_...); its other attention kernels (fmha_reduce_head) are helpers: other_fused."""
    name = kernel.lower()
    if "cudnn" in name and any(word in name for word in ("sdpa", "fmha", "flash", "attention")):
        return "flash" if "flash" in name and ("fprop" in name or "bprop" in name) else "other_fused"
    if "flash" in name:
        return "flash"
    if "fmha" in name or "efficient_attention" in name or "mem_eff" in name:
        return "other_fused"
    if "softmax" in name:
        return "math"
    return None


def attention_kernels(kernels: Iterable[str]) -> AttentionKernels:
    """Sort the CUDA kernel names of a forward+backward pass by kind (attention_kind)."""
    found: dict[str, set[str]] = {"flash_forward": set(), "flash_backward": set(), "other_fused": set(), "math": set()}
    for kernel in kernels:
        kind = attention_kind(kernel)
        if kind == "flash":
            backward = any(word in kernel.lower() for word in BACKWARD_WORDS)
            kind = "flash_backward" if backward else "flash_forward"
        if kind is not None:
            found[kind].add(short_name(kernel))
    return AttentionKernels(**{kind: tuple(sorted(names)) for kind, names in found.items()})


def flash_row(r: dict) -> Row:
    """The row of one preset's block from the worker's result."""
    kernels = attention_kernels(r["kernels"])
    return Row(
        f"compiled bf16 attention kernels, `{r['preset']}` block (head_dim {r['head_dim']}, "
        f"{r['heads']}/{r['kv_heads']} heads, batch {r['batch']} x {r['context']}), forward+backward",
        f"{kernels.describe()} (first pass, with the compile: {r['compile_s']:.0f} s; torch {r['torch']})"[:600],
        TARGET,
        "yes" if kernels.flash else "no",
    )


def check_flash_attention(ctx: Context) -> list[Row]:
    env = child_env(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(ctx.gpus[0]))
    rows = []
    for preset in PRESETS:
        try:
            rows.append(flash_row(worker("flash-attention", TIMEOUT_S, preset, env=env)))
        except CheckFailed as error:
            name = f"compiled bf16 attention kernels, `{preset}` block"
            rows.append(Row(name, f"FAILED: {error}", TARGET, "no", failure=error.tail))
    return rows


FLASH_CHECKS = {"flash-attention": check_flash_attention}
"""Registered in checks.CHECKS after the runtime checks (beside fp32-attention)."""
