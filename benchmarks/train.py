"""Benchmark: training throughput, and the memory of the output projection + cross-entropy.

Run from the repository root:

    python benchmarks/train.py [--device cpu|cuda] [--configs NAME,...] [--steps N] [--warmup N]
                               [--compile both|on|off] [--ce-dim D] [--ce-chunks 0,2048,...] [--quick]

Measured, each in a fresh Python process, so that its memory, its compiled kernels and a
failure (an out-of-memory error) are its own:
1. training: `pretrain.build.build` then `train_step` on the built-in corpus (byte tokenizer;
   a config whose vocabulary is larger only sizes the model bigger, every id stays valid), one
   rank, one micro-batch per step. The --warmup steps are timed apart (they include compiling)
   and left out of steps/s and tokens/s; CUDA is synchronized before each clock read. Peak
   memory: CUDA max_memory_allocated; CPU the growth of the peak resident set (ru_maxrss) over
   the resident set just before build(). MFU on CUDA when pretrain/observe/metrics.py exists.
   CUDA: bf16 autocast, each config compiled and not (training.compile); CPU: fp32, not compiled.
2. `chunked_cross_entropy(hidden, output, targets, chunk)` forward + backward, N tokens against
   Llama-3's 128256-token vocabulary, for several chunk sizes (0: the whole batch at once). Peak
   memory above the inputs and weights: CUDA max_memory_allocated minus memory_allocated before;
   CPU the growth of ru_maxrss over the resident set before (a fresh process per chunk size makes
   this the variant's own peak). Both include the gradients of hidden and of the weight.
   CUDA runs it under bf16 autocast as training does; CPU in fp32 and, for RAM and time, at a
   smaller dim (the logits, which dominate, do not depend on dim).
Progress goes to stderr; the Markdown tables go to stdout. Exit status 1 when a measurement failed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {
        "configs": "debug,10m",
        "warmup": 2,
        "steps": 5,
        "compile": "off",
        "ce_tokens": 8192,
        "ce_dim": 128,
        "ce_vocab": 128256,
        "ce_chunks": "0,2048,1024",
        "ce_warmup": 0,
        "ce_repeats": 1,
    },
    "cuda": {
        "configs": "small,1b",
        "warmup": 3,
        "steps": 10,
        "compile": "both",
        "ce_tokens": 8192,
        "ce_dim": 4096,
        "ce_vocab": 128256,
        "ce_chunks": "0,4096,2048,1024",
        "ce_warmup": 2,
        "ce_repeats": 10,
    },
}
"""Every option left unset takes its device's value here (or --quick's)."""
QUICK: dict[str, Any] = {
    "configs": "debug",
    "warmup": 1,
    "steps": 2,
    "compile": "off",
    "ce_tokens": 512,
    "ce_dim": 64,
    "ce_vocab": 8192,
    "ce_chunks": "0,128",
    "ce_warmup": 0,
    "ce_repeats": 1,
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
    sets = [
        *workload.sets,
        f"data.cache_dir={json.dumps(job['cache_dir'])}",
        f"training.batch_size={workload.batch_size}",
        "training.grad_accum_nums=1",
        f"training.max_steps={warmup + steps}",
        "training.eval_batches=1",
        f"training.compile={json.dumps(job['compile'])}",
        f"training.use_amp={json.dumps(job['amp'])}",
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


# --- parent side: run the children, print the tables ---------------------------------------------


@dataclass
class Outcome:
    job: dict[str, Any]
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def run_job(job: dict[str, Any], script: Path = Path(__file__)) -> Outcome:
    """Run `script --child JOB` in a fresh Python process and read its result line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    process = subprocess.run(
        [sys.executable, str(script.resolve()), "--child", json.dumps(job)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    results = [line[len(RESULT_MARK) :] for line in process.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if process.returncode != 0 or not results:
        lines = process.stderr.strip().splitlines() or [f"exit status {process.returncode}"]
        progress(f"  failed ({process.returncode}); its last output:\n" + "\n".join(lines[-15:]))
        return Outcome(job, error=lines[-1][:160])
    return Outcome(job, result=json.loads(results[-1]))


def compile_settings(choice: str) -> list[bool]:
    return {"both": [False, True], "on": [True], "off": [False]}[choice]


def training_jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [
        {
            "task": "training",
            "device": args.device,
            "config": name,
            "compile": compiled,
            "amp": args.device == "cuda",
            "warmup": args.warmup,
            "steps": args.steps,
            "loss_chunk_tokens": args.loss_chunk_tokens,
            "cache_dir": str(args.cache_dir),
        }
        for name in args.configs
        for compiled in compile_settings(args.compile)
    ]


def cross_entropy_jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [
        {
            "task": "cross_entropy",
            "device": args.device,
            "tokens": args.ce_tokens,
            "dim": args.ce_dim,
            "vocab": args.ce_vocab,
            "chunk": chunk,
            "amp": args.device == "cuda",
            "warmup": args.ce_warmup,
            "repeats": args.ce_repeats,
        }
        for chunk in args.ce_chunks
    ]


def run_all(jobs: list[dict[str, Any]], what: str) -> list[Outcome]:
    outcomes = []
    for i, job in enumerate(jobs, 1):
        detail = (
            f"{job['config']}, compile {'on' if job['compile'] else 'off'}"
            if job["task"] == "training"
            else f"chunk {job['chunk']}"
        )
        progress(f"[{i}/{len(jobs)}] {what}: {detail} ...")
        outcomes.append(run_job(job))
    return outcomes


def size(num_bytes: int, exact: bool = True) -> str:
    text = f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MiB"
    return text if exact else f"≤ {text}"


def params(count: int) -> str:
    return f"{count / 1e9:.3f} B ({count:,})" if count >= 1e9 else f"{count / 1e6:.2f} M ({count:,})"


def training_row(outcome: Outcome) -> list[str]:
    job, r = outcome.job, outcome.result
    workload = WORKLOADS[job["config"]]
    name = f"{job['config']} ({workload.about})"
    precision = "bf16 autocast" if job["amp"] else "fp32"
    wanted = "on" if job["compile"] else "off"
    if outcome.error:
        return [name, "", "", precision, wanted, f"failed: {outcome.error}", "", "", "", ""]
    compiled = "on" if r["compiled"] else "off"
    if compiled != wanted:  # build() did not honour training.compile: say so rather than mislabel the row
        compiled = f"{compiled} (asked {wanted})"
    return [
        name,
        params(r["params"]),
        f"{r['batch_size']} x {r['context']}",
        precision,
        compiled,
        f"{r['steps_per_s']:.2f}",
        f"{r['tokens_per_s']:,.0f}",
        "" if r["mfu"] is None else f"{r['mfu'] * 100:.1f}%",
        size(r["peak_bytes"], r["peak_exact"]),
        f"{r['warmup_s']:.1f}",
    ]


def cross_entropy_row(outcome: Outcome, whole: Outcome | None) -> list[str]:
    job, r = outcome.job, outcome.result
    name = "0 (whole batch)" if job["chunk"] == 0 else str(job["chunk"])
    if outcome.error:
        return [name, f"failed: {outcome.error}", "", "", ""]
    base = whole.result.get("peak_bytes") if whole is not None else None
    ratio = f"{r['peak_bytes'] / base:.2f}" if base else ""
    seconds = r["seconds"]
    timing = f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"
    return [name, size(r["peak_bytes"], r["peak_exact"]), ratio, timing, f"{r['loss']:.4f}"]


def machine_line(device: str, outcomes: list[Outcome]) -> str:
    first = next((o.result for o in outcomes if o.result), {})
    if device == "cuda":
        where = f"GPU {first.get('gpu', '?')} (CUDA {first.get('cuda', '?')})"
    else:
        threads = f", torch threads {first['threads']}" if "threads" in first else ""
        # Timings on a shared CPU depend on what else runs: say how busy it was.
        where = f"CPU {cpu_model()}, {os.cpu_count()} cores{threads}, load average {load_average()} at the end"
    return machine_line_for(where)


def machine_line_for(where: str) -> str:
    """The results' Machine: line, where the device (GPU or CPU) is said by where."""
    return (
        f"Machine: {where}; {platform.platform()}; Python {platform.python_version()}; "
        f"torch {importlib.metadata.version('torch')}; {datetime.date.today().isoformat()}"
    )


def load_average() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def print_table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def print_report(args: argparse.Namespace, training: list[Outcome], ce: list[Outcome], elapsed: float) -> None:
    print(machine_line(args.device, training))
    memory = "max_memory_allocated" if args.device == "cuda" else "peak RSS growth over the RSS before build()"
    print(
        f"\nTraining: built-in corpus, byte tokenizer, 1 rank, 1 micro-batch per step, loss_chunk_tokens "
        f"{args.loss_chunk_tokens}; {args.steps} timed step(s) after {args.warmup} warm-up step(s) (warm-up time "
        f"shown apart, compiling included); peak memory: {memory}.\n"
    )
    print_table(
        [
            "config",
            "parameters",
            "batch x context",
            "precision",
            "compile",
            "steps/s",
            "tokens/s",
            "MFU",
            "peak memory",
            "warm-up (s)",
        ],
        [training_row(o) for o in training],
    )
    whole = next((o for o in ce if o.job["chunk"] == 0 and not o.error), None)
    logits = args.ce_tokens * args.ce_vocab * 4
    memory = (
        "max_memory_allocated minus memory_allocated before, bf16 autocast"
        if args.device == "cuda"
        else "peak RSS growth (ru_maxrss) over the RSS before, fresh process per row, fp32"
    )
    print(
        f"\nOutput projection + cross-entropy, forward + backward: N={args.ce_tokens} tokens, dim {args.ce_dim}, "
        f"vocab {args.ce_vocab} (fp32 logits of all N: {size(logits)}); peak memory above inputs and weights "
        f"({memory}; weight and input gradients included); time: median of {args.ce_repeats} after "
        f"{args.ce_warmup} warm-up. Same inputs in every row, so the losses agree.\n"
    )
    print_table(
        ["chunk (tokens)", "peak memory", "vs whole", "time per fwd+bwd", "loss"], [cross_entropy_row(o, whole) for o in ce]
    )
    print(f"\nTotal {elapsed:.0f} s.")


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def config_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown config {', '.join(unknown) or text!r}; choose from {', '.join(WORKLOADS)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cpu, cuda = DEFAULTS["cpu"], DEFAULTS["cuda"]

    def default(name: str) -> str:
        return f"default: cpu {cpu[name]}, cuda {cuda[name]}"

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(DEFAULTS), default="cpu", help="where to measure (default cpu)")
    parser.add_argument(
        "--configs", type=config_list, help=f"comma-separated, from {', '.join(WORKLOADS)} ({default('configs')})"
    )
    parser.add_argument("--steps", type=int, help=f"timed training steps ({default('steps')})")
    parser.add_argument("--warmup", type=int, help=f"untimed warm-up steps before them ({default('warmup')})")
    parser.add_argument("--compile", choices=["both", "on", "off"], help=f"training.compile ({default('compile')})")
    parser.add_argument("--loss-chunk-tokens", type=int, default=2048, help="training.loss_chunk_tokens (default 2048)")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=REPO / "cache" / "datasets",
        help="data.cache_dir for the prepared corpus (default: the project cache)",
    )
    parser.add_argument("--ce-tokens", type=int, help=f"cross-entropy rows N ({default('ce_tokens')})")
    parser.add_argument("--ce-dim", type=int, help=f"cross-entropy hidden size ({default('ce_dim')})")
    parser.add_argument("--ce-vocab", type=int, help=f"cross-entropy vocabulary ({default('ce_vocab')})")
    parser.add_argument("--ce-chunks", type=int_list, help=f"chunk sizes, 0 = whole batch ({default('ce_chunks')})")
    parser.add_argument("--ce-warmup", type=int, help=f"untimed cross-entropy passes first ({default('ce_warmup')})")
    parser.add_argument("--ce-repeats", type=int, help=f"timed cross-entropy passes ({default('ce_repeats')})")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items())
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is None:
        fill_defaults(parser, args)
    return args


def fill_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options left unset take the --quick value, else their device's."""
    preset = {**DEFAULTS[args.device], **(QUICK if args.quick else {})}
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, {"configs": config_list, "ce_chunks": int_list}.get(name, lambda v: v)(value))
    if args.steps < 1 or args.warmup < 0 or args.ce_repeats < 1 or args.ce_warmup < 0:
        parser.error("--steps and --ce-repeats must be at least 1; --warmup and --ce-warmup not negative")
    if args.ce_tokens < 1 or args.ce_dim < 1 or args.ce_vocab < 2 or args.loss_chunk_tokens < 0:
        parser.error("--ce-tokens and --ce-dim must be at least 1, --ce-vocab at least 2, --loss-chunk-tokens not negative")
    if args.device == "cuda" and not cuda_available():
        parser.error("--device cuda: no CUDA GPU is visible here; use --device cpu")
    args.cache_dir = args.cache_dir.resolve()


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        run_child(args.child)
        return 0
    started = time.monotonic()
    training = run_all(training_jobs(args), "training")
    ce = run_all(cross_entropy_jobs(args), "cross-entropy")
    print_report(args, training, ce, time.monotonic() - started)
    return 1 if any(o.error for o in training + ce) else 0


if __name__ == "__main__":
    sys.exit(main())
