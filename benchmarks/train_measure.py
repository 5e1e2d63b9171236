"""The training benchmark's measurements (benchmarks/train.py), each in the fresh child process
`benchmarks/train.py --child JOB` runs: the workloads, peak memory, training throughput (and with
"profile" in the job, where a step's time goes: benchmarks/step_profile.py), and the chunked
cross-entropy's memory. Each prints its result as one JSON line after RESULT_MARK."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.step_profile import profile_steps

REPO = Path(__file__).resolve().parent.parent
RESULT_MARK = "BENCH_RESULT "
"""Prefix of the one stdout line that carries a child's JSON result (anything else it prints is ignored)."""


@dataclass(frozen=True)
class Workload:
    preset: str
    sets: tuple[str, ...]
    about: str
    batch_size: int


WORKLOADS = {
    "debug": Workload("debug", (), "debug preset", 8),
    "10m": Workload(
        "debug",
        (
            "model.dim=256",
            "model.n_layers=8",
            "model.n_heads=8",
            "model.n_kv_heads=4",
            "model.ffn_dim=1344",
            "data.context_length=256",
        ),
        "dim 256, 8 layers, 8/4 heads, ffn 1344",
        4,
    ),
    # The built-in byte corpus (no network): the ids stay below 257, and the model keeps the
    # preset's 50304 rows (GPT-2's vocabulary padded), so the step costs what the preset's does.
    "small": Workload("small", ("data.source=builtin", "data.tokenizer=byte"), "small preset, vocab 50304", 16),
    "1b": Workload(
        "small",
        (
            "data.source=builtin",
            "data.tokenizer=byte",
            "model.dim=2048",
            "model.n_layers=18",
            "model.n_heads=16",
            "model.n_kv_heads=8",
            "model.ffn_dim=5632",
            "model.vocab_size=32768",
            "model.rope_theta=500000",
            "model.max_seq_len=2048",
            "data.context_length=2048",
        ),
        "dim 2048, 18 layers, 16/8 heads, ffn 5632, vocab 32768",
        4,
    ),
}


# --- child side: one measurement in this fresh process ------------------------------------------


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class PeakMemory:
    """Peak memory of what runs between construction and read(), in bytes.

    CUDA: the allocator's peak minus what was allocated at the start. CPU: the peak resident set
    (ru_maxrss, a high-water mark of the whole process) minus the resident set at the start; when
    the peak never rose above an earlier one (import time), it is only an upper bound."""

    def __init__(self, device: Any) -> None:
        import resource

        import psutil
        import torch

        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self.start = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            self.start = psutil.Process().memory_info().rss
            self.maxrss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def read(self) -> tuple[int, bool]:
        """(peak bytes, exact); exact is False when the number is only an upper bound."""
        import resource

        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.start, True
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, maxrss - self.start), maxrss > self.maxrss_start


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_device(name: str) -> Any:
    import torch

    if name == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def is_compiled(model: Any) -> bool:
    """Whether build() compiled the model: torch.compile(model) or module.compile() on any part."""
    return hasattr(model, "_orig_mod") or any(  # _orig_mod: torch.compile's OptimizedModule wrapper
        getattr(module, "_compiled_call_impl", None) is not None for module in model.modules()
    )


def mfu(model_cfg: Any, seq_len: int, tokens_per_s: float, device_name: str) -> float | None:
    """Model FLOPs utilisation against the GPU's dense bf16 peak, when pretrain.observe.metrics exists."""
    try:
        from pretrain.observe import metrics
    except ImportError:
        return None
    peak = metrics.peak_bf16_flops(device_name)
    return tokens_per_s * metrics.flops_per_token(model_cfg, seq_len) / peak if peak else None


def measure_training(job: dict[str, Any]) -> dict[str, Any]:
    import logging

    import torch

    from pretrain import config as cfg
    from pretrain.data.fitting import fit_to_dataset
    from pretrain.data.prepare import prepare
    from pretrain.distributed.runtime import Runtime
    from pretrain.build import build
    from pretrain.train import train_step

    device = bench_device(job["device"])
    workload = WORKLOADS[job["config"]]
    warmup, steps = job["warmup"], job["steps"]
    profiled = job.get("profile", 0)  # steps traced after the timed ones (--profile), 0: none
    sets = [
        *workload.sets,
        f"data.cache_dir={json.dumps(job['cache_dir'])}",
        f"training.batch_size={workload.batch_size}",
        "training.grad_accum_nums=1",
        f"training.max_steps={warmup + steps + profiled}",
        "training.eval_batches=1",
        f"training.compile={json.dumps(job['compile'])}",
        f"training.use_amp={json.dumps(job['amp'])}",
        *([f"training.compile_mode={json.dumps(job['compile_mode'])}"] if job.get("compile_mode") else []),
        f"training.loss_chunk_tokens={job['loss_chunk_tokens']}",
        f"system.device={device.type}",
        "logging.tensorboard=false",
        "debug.trace_nonfinite=false",
    ]  # the debug preset's hooks: debug_checks.py
    config = cfg.resolve(preset=workload.preset, sets=sets)
    dataset = prepare(config.data, log=progress)
    config, _ = fit_to_dataset(config, dataset, world_size=1)
    log = logging.getLogger("benchmarks.train")
    log.addHandler(logging.StreamHandler(sys.stderr))
    log.setLevel(logging.WARNING)
    runtime = Runtime(rank=0, world_size=1, device=device, label="GPU 0" if device.type == "cuda" else "CPU 0")
    with tempfile.TemporaryDirectory(prefix="train-bench-run-") as run_dir:
        memory = PeakMemory(device)
        trainer = build(config, runtime, dataset, Path(run_dir), log)
        started = time.perf_counter()
        for step in range(warmup):
            train_step(trainer, step)
        synchronize(device)
        timed_from = time.perf_counter()
        for step in range(warmup, warmup + steps):
            loss, _, _ = train_step(trainer, step)
        synchronize(device)
        elapsed = time.perf_counter() - timed_from
        peak, exact = memory.read()
        split = None
        if profiled:  # after the timed steps and the peak: the profiler's own cost touches neither
            first = warmup + steps
            split = profile_steps(lambda step: train_step(trainer, step), range(first, first + profiled), device)
        t, context = config.training, config.data.context_length
        tokens_per_s = steps * t.batch_size * context * t.grad_accum_nums / elapsed
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        return {
            "params": sum(p.numel() for p in trainer.model.parameters()),
            "compiled": is_compiled(trainer.model),
            "batch_size": t.batch_size,
            "context": context,
            "steps_per_s": steps / elapsed,
            "tokens_per_s": tokens_per_s,
            "warmup_s": timed_from - started,
            "peak_bytes": peak,
            "peak_exact": exact,
            "loss": float(loss),
            "mfu": mfu(config.model, context, tokens_per_s, gpu) if gpu else None,
            "gpu": gpu,
            "cuda": torch.version.cuda,
            "threads": torch.get_num_threads(),
            "profile": None if split is None else split.as_dict(),
        }


def measure_cross_entropy(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch import nn

    from pretrain.model.loss import chunked_cross_entropy

    device = bench_device(job["device"])
    torch.manual_seed(0)  # the same inputs in every variant's process, so their losses must agree
    hidden = torch.randn(job["tokens"], job["dim"], device=device, requires_grad=True)
    output = nn.Linear(job["dim"], job["vocab"], bias=False, device=device)
    targets = torch.randint(0, job["vocab"], (job["tokens"],), device=device)
    # Two rows through the same code path (checkpointed when chunked) pay its one-time setup
    # (lazy imports, kernel selection) before anything is measured; the --ce-warmup passes do the rest.
    chunked_cross_entropy(hidden[:2], output, targets[:2], 1 if job["chunk"] else 0).backward()
    memory = PeakMemory(device)
    times = []
    for _ in range(job["warmup"] + job["repeats"]):
        hidden.grad = output.weight.grad = None  # each pass allocates its gradients afresh
        synchronize(device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=job["amp"]):
            loss = chunked_cross_entropy(hidden, output, targets, job["chunk"])
        loss.backward()
        synchronize(device)
        times.append(time.perf_counter() - started)
    peak, exact = memory.read()
    timed = sorted(times[job["warmup"] :])
    return {"seconds": timed[len(timed) // 2], "peak_bytes": peak, "peak_exact": exact, "loss": float(loss)}


def run_child(job_json: str) -> None:
    job = json.loads(job_json)
    result = measure_training(job) if job["task"] == "training" else measure_cross_entropy(job)
    print(RESULT_MARK + json.dumps(result), flush=True)
