"""Worker of the flash-attention check (benchmarks/gpu_acceptance/checks_flash.py): one compiled transformer
block of a preset, forward and backward under bf16 autocast as training runs it, with the names of
the CUDA kernels that ran. It prints its result with emit."""

from __future__ import annotations

import time
from collections.abc import Callable

from benchmarks.gpu_acceptance.procs import emit

NAME_CHARS = 200
"""Kernel names are cut here (template arguments make some thousands of characters long)."""


def worker_flash_attention(preset: str) -> None:
    """A pretrain.model.transformer.TransformerBlock of preset's model (fp32 weights, compiled in place as
    pretrain/distributed/parallel.py compiles each block), at the preset's micro-batch and context; one
    forward+backward compiles it, the next runs under torch.profiler."""
    import torch

    from pretrain import config as cfg
    from pretrain.model.transformer import TransformerBlock, rotary_tables

    config = cfg.resolve(preset=preset)
    model, context, batch = config.model, config.data.context_length, config.training.batch_size
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    block = TransformerBlock(model).to(device)
    block.compile()
    head_dim = model.dim // model.n_heads
    cos, sin = (t.to(device) for t in rotary_tables(head_dim, context, model.rope_theta))  # (T, head_dim // 2)
    x = torch.randn(batch, context, model.dim, device=device, requires_grad=True)  # (B, T, dim), the fp32 residual stream

    def forward_backward() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as pretrain/train.py's autocast
            out, _ = block(x, cos, sin)  # (B, T, dim)
        out.float().sum().backward()

    started = time.perf_counter()
    forward_backward()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - started
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        forward_backward()
        torch.cuda.synchronize()
    kernels = sorted({e.name[:NAME_CHARS] for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    emit(
        {
            "preset": preset,
            "batch": batch,
            "context": context,
            "heads": model.n_heads,
            "kv_heads": model.n_kv_heads,
            "head_dim": head_dim,
            "compile_s": compile_s,
            "kernels": kernels,
            "torch": torch.__version__,
        }
    )


FLASH_WORKERS: dict[str, Callable[..., None]] = {"flash-attention": worker_flash_attention}
"""Registered in workers.WORKERS."""
