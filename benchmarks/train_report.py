"""The training benchmark's report (benchmarks/train.py): each child's outcome, the Markdown tables
(throughput, cross-entropy memory, and with --profile where each step's time goes), the machine
line, and the --json file."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.step_profile import Split, describe, format_table
from benchmarks.train_measure import WORKLOADS


@dataclass
class Outcome:
    job: dict[str, Any]
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""


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
    if job.get("compile_mode") and r["compiled"]:
        compiled += f", {job['compile_mode']}"
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
    print_profiles(training)
    print(f"\nTotal {elapsed:.0f} s.")


def row_name(job: dict[str, Any]) -> str:
    """A training row as the profile tables name it: its config and whether it was compiled."""
    return f"{job['config']}, compile {'on' if job['compile'] else 'off'}" + (
        f" ({job['compile_mode']})" if job.get("compile_mode") else ""
    )


def print_profiles(training: list[Outcome]) -> None:
    """With --profile: one table per training row of where its steps' time went."""
    for outcome in training:
        if outcome.result.get("profile"):
            split = Split.from_dict(outcome.result["profile"])
            print(f"\nWhere the time goes, {row_name(outcome.job)}: {describe(split)}.\n")
            print(format_table(split))


def json_report(args: argparse.Namespace, training: list[Outcome], ce: list[Outcome], elapsed: float) -> dict[str, Any]:
    """What --json writes: the machine line, and every job with its result (a training row's
    profile included) or its error."""
    return {
        "machine": machine_line(args.device, training),
        "seconds": elapsed,
        "training": [{"job": o.job, "result": o.result, "error": o.error} for o in training],
        "cross_entropy": [{"job": o.job, "result": o.result, "error": o.error} for o in ce],
    }
