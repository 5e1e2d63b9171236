"""Worker of the step-profile and compile-mode checks (checks_profile.py, checks_compile.py): the
`small` preset as a run has it (build() plans it as the launcher would), compiled, on one GPU;
its warm-up steps timed apart (they hold the compile), then timed steps, and with profile > 0
that many more under torch.profiler (benchmarks/step_profile.py). It prints its result with emit."""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gpu_acceptance.procs import emit

WARMUP = 3
"""Steps before the timed ones: the first compiles; reduce-overhead records its CUDA graphs on the next ones."""
DEVICE = "cuda"
"""Where the worker runs (only a smoke test of the worker's own code changes it)."""


def small_run_sets(data_sets: list[str], steps: int, compile_mode: str = "") -> list[str]:
    """The --set options of the worker's run: data_sets (context.Context.small_sets), compiled,
    bf16, nothing but training steps (no evaluation, checkpoint or tensorboard), and
    training.compile_mode when one is named."""
    return [
        *data_sets,
        "training.compile=true",
        "training.use_amp=true",
        "debug.trace_nonfinite=false",  # its hooks turn the compile off
        f"training.max_steps={steps}",
        "training.eval_interval=0",
        "training.checkpoint_interval=0",
        "logging.tensorboard=false",
        f"system.device={DEVICE}",
        *([f"training.compile_mode={compile_mode}"] if compile_mode else []),
    ]


def worker_small_run(steps: str, profile: str, data_sets: str, compile_mode: str = "") -> None:
    """WARMUP steps, then steps timed, then profile steps profiled; tokens/s, MFU, the warm-up's
    time beyond the timed steps' (the compile), and the split of the profiled steps."""
    import torch

    from benchmarks.step_profile import profile_steps
    from pretrain import config as cfg
    from pretrain.build import build
    from pretrain.data.fitting import fit_to_dataset
    from pretrain.data.prepare import prepare
    from pretrain.distributed.runtime import Runtime
    from pretrain.observe.metrics import flops_per_token, peak_bf16_flops
    from pretrain.train import train_step

    timed, profiled = int(steps), int(profile)
    sets = small_run_sets(json.loads(data_sets), WARMUP + timed + profiled, compile_mode)
    config = cfg.resolve(preset="small", sets=sets)
    dataset = prepare(config.data, log=lambda line: print(line, file=sys.stderr))
    config, _ = fit_to_dataset(config, dataset, world_size=1)
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    device = torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device(DEVICE)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else lambda: None
    runtime = Runtime(rank=0, world_size=1, device=device, label="GPU 0" if DEVICE == "cuda" else "CPU 0")
    with tempfile.TemporaryDirectory(prefix="gpu-check-small-") as run_dir:
        trainer = build(config, runtime, dataset, Path(run_dir), logging.getLogger("gpu_check"))
        times = []
        for step in range(WARMUP + timed):
            started = time.perf_counter()
            loss, _, _ = train_step(trainer, step)
            sync()
            times.append(time.perf_counter() - started)
        split = None
        if profiled:
            first = WARMUP + timed
            split = profile_steps(lambda step: train_step(trainer, step), range(first, first + profiled), device)
        t = trainer.config.training
        context = trainer.config.data.context_length
        step_s = statistics.median(times[WARMUP:])
        tokens = trainer.tokens_per_step
        gpu = torch.cuda.get_device_name(device) if DEVICE == "cuda" else ""
        peak = peak_bf16_flops(gpu) if gpu else None
        emit(
            {
                "compile_mode": t.compile_mode,
                "compiled": any(getattr(m, "_compiled_call_impl", None) is not None for m in trainer.model.modules()),
                "shape": f"batch {t.batch_size} x {context}, {t.grad_accum_nums} micro-batches",
                "checkpointing": cfg.activation_checkpointing(trainer.config),
                "first_step_s": times[0],
                "warmup_extra_s": sum(times[:WARMUP]) - WARMUP * step_s,
                "step_s": step_s,
                "tokens_per_s": tokens / step_s,
                "mfu": tokens / step_s * flops_per_token(trainer.config.model, context) / peak if peak else None,
                "loss": float(loss),
                "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if DEVICE == "cuda" else None,
                "profile": None if split is None else split.as_dict(),
                "torch": torch.__version__,
            }
        )


PROFILE_WORKERS: dict[str, Callable[..., Any]] = {"small-run": worker_small_run}
"""Registered in workers.WORKERS."""
