"""Benchmark: training throughput, and the memory of the output projection + cross-entropy.

Run from the repository root:

    python benchmarks/train.py [--device cpu|cuda] [--configs NAME,...] [--steps N] [--warmup N]
                               [--compile both|on|off] [--compile-mode MODE] [--profile [N]]
                               [--ce-dim D] [--ce-chunks 0,2048,...] [--json FILE] [--quick]

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
3. With --profile [N]: N more steps (3 by default) of each training row under torch.profiler,
   their time binned by kind (matmuls, attention, cross-entropy, optimizer, communication, other
   compiled kernels, other, idle): benchmarks/step_profile.py. On CUDA the GPU's kernels, on CPU
   the CPU ops' own time.
Progress goes to stderr; the Markdown tables go to stdout (--json FILE: every result as JSON too).
Exit status 1 when a measurement failed. The child side is benchmarks/train_measure.py, the
tables benchmarks/train_report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if Path(sys.path[0]).resolve() == REPO / "benchmarks":  # run as a script: the repository, not benchmarks/
    sys.path[0] = str(REPO)  # (whose launcher.py would shadow the launcher package)

# Re-exported: benchmarks/debug_checks.py, efficiency_report.py and restarts.py use them from here.
from benchmarks.train_measure import (  # noqa: E402, F401
    RESULT_MARK,
    WORKLOADS,
    PeakMemory,
    Workload,
    bench_device,
    is_compiled,
    measure_cross_entropy,
    measure_training,
    mfu,
    progress,
    run_child,
    synchronize,
)
from pretrain.config.training import COMPILE_MODES  # noqa: E402  (no torch: the parent stays light)
from benchmarks.train_report import (  # noqa: E402, F401
    Outcome,
    cpu_model,
    json_report,
    load_average,
    machine_line,
    machine_line_for,
    print_report,
    print_table,
    row_name,
)

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
PROFILE_STEPS = 3
"""Steps --profile traces when it names no number."""
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


# --- parent side: run the children, print the tables ---------------------------------------------


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
            "profile": args.profile,
            **({"compile_mode": args.compile_mode} if args.compile_mode and compiled else {}),
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
        detail = row_name(job) if job["task"] == "training" else f"chunk {job['chunk']}"
        progress(f"[{i}/{len(jobs)}] {what}: {detail} ...")
        outcomes.append(run_job(job))
    return outcomes


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
    parser.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        help="training.compile_mode of the compiled rows (default: the config's)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=PROFILE_STEPS,
        default=0,
        metavar="N",
        help=f"after the timed steps, trace N more (default {PROFILE_STEPS}) and print where their time goes",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every result (profiles included) here as JSON")
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
    if args.profile < 0:
        parser.error("--profile N: N must be at least 1 (0: no profile)")
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
    elapsed = time.monotonic() - started
    print_report(args, training, ce, elapsed)
    if args.json is not None:
        args.json.write_text(json.dumps(json_report(args, training, ce, elapsed), indent=1) + "\n")
    return 1 if any(o.error for o in training + ce) else 0


if __name__ == "__main__":
    sys.exit(main())
