"""Workers of the runtime checks (benchmarks/gpu_acceptance/checks_runtime.py): what runs inside a GPU
process to show how the trainer's runtime behaves there. Each prints its result with emit."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gpu_acceptance.procs import emit

RAISING = "rank 1 raises now"
"""What the nccl-error worker's failing rank prints just before it raises (the check times from it)."""
FAILURE = "rank 1 fails on purpose inside its all_reduce loop"
"""The message of the error it raises, which the launcher's summary must show."""
HOLDING = "holding the GPU until released"
"""What each nccl-transport worker prints once measured: the check reads NVML's processes then."""
ALL_REDUCE_MIB = 256
ALL_REDUCE_ROUNDS = 20
HOLD_S = 120
"""The longest an nccl-transport worker waits for the release file."""


def worker_attention(dtype: str = "float32") -> None:
    """Forward and backward of one attention layer of the production model (fp32 by default)
    at its full context, batch 1: the peak memory above the inputs and weights, and the size
    of the (B, heads, T, T) fp32 score matrix that SDPA's math kernel would build."""
    import torch

    from pretrain import config as cfg
    from pretrain.model.transformer import Attention, rotary_tables

    production = cfg.resolve(preset="production")
    model, context, batch = production.model, production.data.context_length, 1
    torch.cuda.set_device(0)
    device, kind = torch.device("cuda", 0), getattr(torch, dtype)
    layer = Attention(model).to(device, kind)
    cos, sin = (t.to(device) for t in rotary_tables(model.dim // model.n_heads, context, model.rope_theta))
    x = torch.randn(batch, context, model.dim, device=device, dtype=kind, requires_grad=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    kernels: list[str] = []
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            layer(x, cos, sin).sum().backward()
            torch.cuda.synchronize()
        kernels = sorted(
            {
                e.name
                for e in profiler.events()
                if any(word in e.name.lower() for word in ("fmha", "flash", "attention", "efficient", "cudnn", "softmax"))
            }
        )
        peak: float | None = (torch.cuda.max_memory_allocated() - before) / 2**30
    except torch.OutOfMemoryError:
        peak = None
    emit(
        {
            "dtype": dtype,
            "batch": batch,
            "heads": model.n_heads,
            "kv_heads": model.n_kv_heads,
            "context": context,
            "peak_gib": peak,
            "scores_gib": batch * model.n_heads * context * context * 4 / 2**30,
            "kernels": kernels[:4],
            "torch": torch.__version__,
        }
    )


def worker_alloc_conf() -> None:
    """Run as a launched GPU worker: the allocator settings it was given and whether torch's
    caching allocator made its segments expandable."""
    import torch

    torch.cuda.set_device(0)
    held = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    segments = torch.cuda.memory._snapshot().get("segments", [])
    flags = [s["is_expandable"] for s in segments if "is_expandable" in s]
    emit(
        {
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "device_order": os.environ.get("CUDA_DEVICE_ORDER"),
            "expandable": all(flags) if flags else None,
            "segments": len(segments),
            "torch": torch.__version__,
        }
    )
    del held


def worker_nccl_error(device: str = "cuda") -> None:
    """Run as two launched GPU workers: the trainer's runtime (pretrain.distributed.runtime.init_runtime,
    NCCL), all_reduce in a loop, and on rank 1 a RuntimeError after some rounds, handled as
    pretrain/train.py main handles one (unexpected_error, then shutdown without peers, then
    os._exit as pretrain_main.py). Rank 0 waits in its next all_reduce for a peer that is gone.
    device "cpu" (gloo) is the smoke test of this code on a machine without a GPU."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # as pretrain_main.py: the launcher may ask
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    import torch
    import torch.distributed as dist

    from pretrain import config as cfg
    from pretrain.distributed.runtime import init_runtime, shutdown
    from pretrain.train import unexpected_error

    config = cfg.resolve(preset="debug", sets=[f"system.device={device}", "training.cpu_offload=false"])
    runtime = init_runtime(config)
    code = 0
    try:
        x = torch.ones(2**20, device=runtime.device)
        rounds = 0
        while True:
            dist.all_reduce(x)
            if device == "cuda":
                torch.cuda.synchronize()  # the host waits here, as a training step's one sync does
            rounds += 1
            if runtime.rank == 1 and rounds == 20:
                print(RAISING, flush=True)
                raise RuntimeError(FAILURE)
    except Exception:
        code = unexpected_error()
    finally:
        shutdown(runtime, peers_alive=False)
    sys.stdout.flush()
    os._exit(code)


def _doubled_sum(t: Any) -> Any:
    return (t * 2).sum()


def worker_nccl_transport(release: str, device: str = "cuda") -> None:
    """Run as two launched GPU workers: the trainer's runtime (pretrain.distributed.runtime.init_runtime, so
    the device LAUNCHER_CUDA_DEVICE_INDEX names), one small torch.compile (which starts inductor's
    compile processes, as training does: they see the worker's GPUs too), a 256 MiB fp32
    all-reduce timed over 20 rounds after 5 unmeasured ones, and which other visible GPUs hold a
    primary context in this process (the driver's own answer, which creates none). Then it holds
    its GPU until the file release exists, so the check can read NVML's process lists while every
    worker and its compile processes are alive. device "cpu" (gloo) is the smoke test of this
    code on a machine without a GPU."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    import torch
    import torch.distributed as dist

    from pretrain import config as cfg
    from pretrain.distributed.runtime import init_runtime, shutdown

    runtime = init_runtime(cfg.resolve(preset="debug", sets=[f"system.device={device}", "training.cpu_offload=false"]))
    synchronize = torch.cuda.synchronize if runtime.device.type == "cuda" else (lambda: None)
    try:
        float(torch.compile(_doubled_sum)(torch.ones(1024, device=runtime.device)))
        compiled = "yes"
    except Exception as error:  # no compiler here: the rest still measures NCCL
        compiled = f"failed: {type(error).__name__}"
    x = torch.ones(ALL_REDUCE_MIB * 2**20 // 4, device=runtime.device)  # (elements,) fp32
    for _ in range(5):  # NCCL connects its channels in the first one
        dist.all_reduce(x)
    synchronize()
    started = time.perf_counter()
    for _ in range(ALL_REDUCE_ROUNDS):
        dist.all_reduce(x)
    synchronize()
    seconds = (time.perf_counter() - started) / ALL_REDUCE_ROUNDS
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    own = runtime.device.index
    visible = torch.cuda.device_count() if runtime.device.type == "cuda" else 0
    others = None if has_context is None else [i for i in range(visible) if i != own and has_context(i)]
    emit(
        {
            "rank": runtime.rank,
            "pid": os.getpid(),
            "device": str(runtime.device),
            "visible": visible,
            "bytes": x.numel() * x.element_size(),
            "seconds": seconds,
            "ranks": runtime.world_size,
            "other_contexts": others,
            "compiled": compiled,
        }
    )
    print(HOLDING, flush=True)
    deadline = time.monotonic() + HOLD_S
    while not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    shutdown(runtime, peers_alive=True)


RUNTIME_WORKERS: dict[str, Callable[..., None]] = {
    "attention": worker_attention,
    "alloc-conf": worker_alloc_conf,
    "nccl-error": worker_nccl_error,
    "nccl-transport": worker_nccl_transport,
}
