"""The workers of the GPU checks: each worker_* runs in a fresh Python process, started as
`python benchmarks/gpu_acceptance --worker NAME ARG...` (procs.worker), and prints its result
as one JSON line after RESULT_MARK (emit)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from itertools import pairwise
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_acceptance.procs import emit
from benchmarks.gpu_acceptance.workers_flash import FLASH_WORKERS
from benchmarks.gpu_acceptance.workers_profile import PROFILE_WORKERS
from benchmarks.gpu_acceptance.workers_runtime import RUNTIME_WORKERS

SYNC_WARNING = "synchronizing CUDA operation"
"""What torch.cuda.set_sync_debug_mode("warn") says at each synchronizing call."""
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls that block the host until the GPU catches up (cudaMemcpy: the blocking copy)."""
DEVICE, BACKEND = "cuda", "nccl"
"""Where the workers run (only a smoke test of the workers' own code changes them)."""
POISONED = "layers.1.feed_forward.w13.weight"
"""The weight of the debug model that the poison worker sets one NaN in (check_nan looks for it)."""
TINY = ("training.batch_size=2", "data.context_length=32")
"""The debug model's batch and context for the poisoned checkpoint and its resumed run."""


def worker_torch() -> None:
    import platform

    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            f"torch {torch.__version__} cannot use the GPU (CUDA {torch.version.cuda}); install a CUDA build of torch"
        )
    emit(
        {
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "python": platform.python_version(),
            "devices": torch.cuda.device_count(),
        }
    )


def worker_hold(index: str) -> None:
    """Hold 1 GiB on a GPU until stdin closes."""
    import torch

    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    held = torch.empty(2**30, dtype=torch.uint8, device=f"cuda:{int(index)}")
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.read()
    del held


def worker_nvml() -> None:
    from launcher.gpus import nvml

    emit(
        [
            {
                "index": g.index,
                "uuid": g.uuid,
                "mig": g.mig,
                "memory_total": g.memory_total,
                "processes": [(p.pid, p.memory) for p in g.processes],
            }
            for g in nvml.discover(window=0.2, samples=2)
        ]
    )


def worker_poison(run_dir: str) -> None:
    """A step_0 checkpoint of the debug model (TINY) whose POISONED weight holds one NaN."""
    import torch

    from pretrain.checkpoint import save_restore
    from pretrain import config as cfg
    from pretrain.data.fitting import fit_to_dataset
    from pretrain.data.prepare import prepare
    from pretrain.distributed.runtime import Runtime, setup_logging
    from pretrain.build import build

    config = cfg.resolve(preset="debug", sets=[*TINY, "system.device=cpu", "logging.tensorboard=false"])
    dataset = prepare(config.data, log=lambda _: None)
    config, _ = fit_to_dataset(config, dataset, world_size=1)
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")
    trainer = build(config, runtime, dataset, Path(run_dir), setup_logging("CPU 0", "WARNING"))
    with torch.no_grad():
        trainer.model.get_parameter(POISONED)[3, 5] = float("nan")
    emit({"checkpoint": str(save_restore.save(trainer, 0, trainer.run_dir))})


def worker_shape(layers: str, steps: str, data_sets: str) -> None:
    """Step time of the production preset with this many layers on one GPU, bf16, compiled."""
    import logging

    import torch

    from pretrain import config as cfg
    from pretrain.data.fitting import fit_to_dataset
    from pretrain.data.prepare import prepare
    from pretrain.observe.metrics import flops_per_token, peak_bf16_flops
    from pretrain.distributed.runtime import Runtime
    from pretrain.build import build
    from pretrain.train import train_step

    warmup, timed = 2, int(steps)
    # The 8B vocabulary stays (byte ids are valid rows of it): only the layers are fewer.
    sets = [
        *[s for s in json.loads(data_sets) if s != "model.vocab_size=null"],
        f"model.n_layers={layers}",
        "training.batch_size=1",
        "training.grad_accum_nums=2",
        f"training.max_steps={warmup + timed}",
        "training.warmup_steps=1",
        "training.eval_batches=1",
        "logging.tensorboard=false",
        f"system.device={DEVICE}",
    ]
    config = cfg.resolve(preset="production", sets=sets)
    dataset = prepare(config.data, log=lambda line: print(line, file=sys.stderr))
    config, _ = fit_to_dataset(config, dataset, world_size=1)
    torch.cuda.set_device(0)
    device = torch.device(DEVICE, 0)
    runtime = Runtime(rank=0, world_size=1, device=device, label="GPU 0")
    log = logging.getLogger("gpu_check")
    with tempfile.TemporaryDirectory(prefix="gpu-check-shape-") as run_dir:
        trainer = build(config, runtime, dataset, Path(run_dir), log)
        for step in range(warmup):
            train_step(trainer, step)
        torch.cuda.synchronize()
        warmup_peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()  # build and compile
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        for step in range(warmup, warmup + timed):
            train_step(trainer, step)
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - started) / timed
    context = config.data.context_length
    tokens = trainer.tokens_per_step  # the plan's micro-batches (grad_accum_nums made concrete)
    peak = peak_bf16_flops(torch.cuda.get_device_name(device))
    per_token = flops_per_token(config.model, context)
    one_layer = dataclasses.replace(config.model, n_layers=1)
    two_layers = dataclasses.replace(config.model, n_layers=2)
    layer_flops = flops_per_token(two_layers, context) - flops_per_token(one_layer, context)
    emit(
        {
            "params": sum(p.numel() for p in trainer.model.parameters()),
            "mode": trainer.mode,
            "checkpointing": cfg.activation_checkpointing(trainer.config),  # as planned and built, not as asked
            "step_s": step_s,
            "tokens": tokens,
            "tokens_per_s": tokens / step_s,
            "mfu": tokens / step_s * per_token / peak if peak else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_flops": peak,
            "layer_flops_per_step": layer_flops * tokens,
            **memory_against_estimate(trainer, warmup_peaks),
        }
    )


def memory_against_estimate(trainer: Any, warmup_peaks: tuple[int, int]) -> dict[str, Any]:
    """pretrain.plan.gpu_memory's estimate for this run's config and mode, and the peaks of the whole
    run (warm-up steps included) in GiB: what the caching allocator handed out and reserved."""
    import torch

    from pretrain.plan import gpu_memory as memory

    offload = bool(trainer.config.training.cpu_offload)
    mode = trainer.mode if trainer.mode in ("fsdp", "hsdp") else "ddp"  # "single" is the one-rank case of ddp's formula
    runtime = trainer.runtime
    estimate = memory.estimate(trainer.config, runtime.world_size, mode, offload, shard_ranks=runtime.ranks_per_node)
    return {
        "estimate_gib": estimate.total / 2**30,
        "estimate_parts": estimate.parts(),
        "run_allocated_gib": max(warmup_peaks[0], torch.cuda.max_memory_allocated()) / 2**30,
        "run_reserved_gib": max(warmup_peaks[1], torch.cuda.max_memory_reserved()) / 2**30,
    }


def worker_syncs(mode: str, steps: str, data_sets: str) -> None:
    """Count the host synchronizations of each step of fit() that logs nothing, on the `small`
    preset as a run has it: its batch, context and micro-batches, compiled, and the loss head in
    one piece or in chunks as the memory plan decides for this GPU (build plans as the launcher
    would), so what is counted is what a real run pays. data_sets: the JSON list of --set options
    for the data (context.Context.small_sets).

    Two counts, over the same steps (after warm-up steps that compile and create the NCCL
    communicator): torch.cuda.set_sync_debug_mode("warn") warns at every synchronizing call
    torch makes (stream/device/event synchronize, blocking copies, .item(), .tolist()); the
    warnings between two step starts are that step's. The profiler's CUDA runtime trace counts
    the cuda*Synchronize calls, and copies from pageable host memory, which block the host
    without torch knowing. "group": a 1-rank NCCL process group, with the runtime marked
    distributed so that every collective of a multi-GPU step runs."""
    import logging

    import torch
    import torch.distributed as dist

    import pretrain.train as train
    from pretrain import config as cfg
    from pretrain.build import Trainer, build
    from pretrain.data.fitting import fit_to_dataset
    from pretrain.data.prepare import prepare
    from pretrain.distributed.runtime import Runtime

    warmup, counted = 3, int(steps)
    total = warmup + counted + 1  # and a last step, which logs
    sets = [
        *json.loads(data_sets),
        "debug.trace_nonfinite=false",  # its hooks synchronize on purpose
        "training.use_amp=true",
        "training.compile=true",
        f"training.max_steps={total}",
        "logging.log_interval=1000000",
        "logging.level=INFO",
        "logging.tensorboard=false",
        "training.eval_interval=0",
        "training.checkpoint_interval=0",
        f"system.device={DEVICE}",
        f"debug.check_finite={'false' if mode == 'group-nocheck' else 'true'}",
    ]
    config = cfg.resolve(preset="small", sets=sets)
    dataset = prepare(config.data, log=lambda _: None)
    config, _ = fit_to_dataset(config, dataset, world_size=1)
    torch.cuda.set_device(0)
    device = torch.device(DEVICE, 0)

    @dataclass(frozen=True)
    class Distributed(Runtime):
        @property
        def distributed(self) -> bool:
            return True

    log = logging.getLogger("gpu_check")
    with tempfile.TemporaryDirectory(prefix="gpu-check-syncs-") as run_dir:
        trainer = build(config, Runtime(0, 1, device, "GPU 0"), dataset, Path(run_dir), log)
        if mode != "single":
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group(BACKEND, rank=0, world_size=1, device_id=device if DEVICE == "cuda" else None)
            trainer.runtime = Distributed(0, 1, device, "GPU 0")
        marks: list[int] = []
        caught: list[warnings.WarningMessage] = []
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
        unmarked_step = train.train_step

        def marked_step(trainer: Trainer, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
            if step == warmup:
                torch.cuda.synchronize()
                profiler.start()
                torch.cuda.set_sync_debug_mode("warn")
            if warmup <= step:
                marks.append(len(caught))
            if step == total - 1:  # the logging step: not counted
                torch.cuda.set_sync_debug_mode(0)
                profiler.stop()
            return unmarked_step(trainer, step)

        train.train_step = marked_step
        with warnings.catch_warnings(record=True) as caught_here:
            warnings.simplefilter("always")
            caught = caught_here
            train.fit(trainer)
        compiled = any(getattr(m, "_compiled_call_impl", None) is not None for m in trainer.model.modules())
        shape = run_shape(trainer.config)
    if mode != "single":
        dist.destroy_process_group()
    per_step = [sum(SYNC_WARNING in str(w.message) for w in caught[a:b]) for a, b in pairwise(marks)]
    where = sorted(
        {f"{Path(w.filename).name}:{w.lineno}" for a, b in pairwise(marks) for w in caught[a:b] if SYNC_WARNING in str(w.message)}
    )
    result: dict[str, Any] = {
        "steps": len(per_step),
        "max_syncs": max(per_step),
        "mean_syncs": sum(per_step) / len(per_step),
        "compiled": compiled,
        "shape": shape,
        "where": ", ".join(where),
    }
    try:
        names = [e.name for e in profiler.events()]
        result["profiler_syncs"] = sum(n in SYNC_CALLS for n in names) / len(per_step)
        result["pageable_h2d"] = sum("HtoD" in n and "Pageable" in n for n in names) / len(per_step)
    except Exception as error:  # the cross-check is optional; the sync debug count stands alone
        result["profiler_error"] = f"{type(error).__name__}: {error}"[:120]
    emit(result)


def run_shape(config: Any) -> str:
    """A run's step as the syncs row names it: micro-batch, micro-batches, how the loss is computed."""
    from pretrain import config as cfg

    t, context = config.training, config.data.context_length
    chunk = cfg.loss_chunk_tokens(config)
    loss = f"loss in chunks of {chunk} tokens" if 0 < chunk < t.batch_size * context else "loss in one piece"
    return f"batch {t.batch_size} x {context}, {t.grad_accum_nums} micro-batches, {loss}"


WORKERS: dict[str, Callable[..., None]] = {
    "torch": worker_torch,
    "hold": worker_hold,
    "nvml": worker_nvml,
    "poison": worker_poison,
    "shape": worker_shape,
    "syncs": worker_syncs,
    **RUNTIME_WORKERS,
    **FLASH_WORKERS,
    **PROFILE_WORKERS,
}
