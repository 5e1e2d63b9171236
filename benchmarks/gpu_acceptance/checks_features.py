"""GPU check of issue 19's benchmark: the `small` preset's training speed with AdamW against Muon
and dense against a mixture of experts (benchmarks/features.py), and the time of Muon's
Newton-Schulz orthogonalization in bf16 at 768x768 and 4096x4096 (benchmarks/newton_schulz.py).
Each script runs in a process of its own under a timeout; the rows are read from the Markdown
tables they print, and one that fails becomes a `no` row without stopping the other."""

from __future__ import annotations

import math
import sys

from benchmarks.gpu_acceptance.context import Context, Row, sets_args
from benchmarks.gpu_acceptance.procs import child_env, run

NS_SIZES = "768x768,4096x4096"
NS_STEPS = 5
"""Muon's default (training.muon_ns_steps)."""
FEATURES_TIMEOUT_S, NS_TIMEOUT_S = 390, 60
"""Four launches, two of them cold compiles (about 6 minutes on an H100), and one short script: 450 s together."""


def table_rows(out: str, first_header: str) -> list[list[str]]:
    """The cells of the body rows of the Markdown table whose header row starts with first_header."""
    rows: list[list[str]] = []
    inside = False
    for line in out.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            inside = False
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] == first_header:
            inside, rows = True, []
        elif inside and not set(cells[0]) <= {"-", " "}:
            rows.append(cells)
    return rows


def tokens_per_step(sets: list[str]) -> int:
    """Tokens in one optimizer step of the small preset with these overrides, on one GPU."""
    from pretrain import config as cfg

    config = cfg.resolve(preset="small", sets=sets)
    t = config.training
    if t.global_batch_size:
        return t.global_batch_size * config.data.context_length
    assert isinstance(t.grad_accum_nums, int)  # "auto" needs training.global_batch_size, taken above
    sequences = t.batch_size * t.grad_accum_nums
    return sequences * config.data.context_length


def feature_rows(out: str, about: str, step_tokens: int) -> list[Row]:
    """benchmarks/features.py's four rows (run | tokens/s | vs AdamW dense | last loss) as rows of the table."""
    rows = []
    for name, tps, relative, loss in (cells[:4] for cells in table_rows(out, "run")):
        speed, last = float(tps.replace(",", "")), float(loss)
        ok = speed > 0 and math.isfinite(last)
        rows.append(
            Row(
                f"`small` {name}, {about}",
                f"{speed:,.0f} tokens/s ({speed / step_tokens:.2f} steps/s of {step_tokens:,} tokens), "
                f"{relative} AdamW dense's, last loss {last:.4f}",
                "measured; loss finite",
                "yes" if ok else "no",
            )
        )
    return rows


def newton_schulz_rows(out: str, about: str) -> list[Row]:
    """benchmarks/newton_schulz.py's rows (size | dtype | device | median ms | min ms | TFLOP/s) as rows of the table."""
    return [
        Row(
            f"Muon Newton-Schulz, {NS_STEPS} iterations, {size}, {dtype}, {about}",
            f"{float(median):.3f} ms median (min {float(fastest):.3f} ms), {rate} TFLOP/s",
            "measured",
            "n.a.",
        )
        for size, dtype, _, median, fastest, rate in (cells[:6] for cells in table_rows(out, "size"))
    ]


def check_features(ctx: Context) -> list[Row]:
    gpu = str(ctx.gpus[0])
    steps = 6 if ctx.quick else 20
    sets = [*ctx.small_sets, "training.compile=true", "training.eval_interval=0", "logging.tensorboard=false"]
    argv = [sys.executable, "benchmarks/features.py", "--preset", "small", "--device", "cuda", "--gpus", gpu]
    proc = run([*argv, "--steps", str(steps), *sets_args(sets)], timeout=FEATURES_TIMEOUT_S)
    name = f"`small` AdamW/Muon x dense/MoE (benchmarks/features.py), 1 GPU, {steps} steps"
    rows = feature_rows(proc.out, f"1 GPU, bf16, compiled, {steps} steps ({ctx.data_note})", tokens_per_step(sets))
    if not proc.ok or len(rows) != 4:
        rows = [
            Row(
                name,
                f"FAILED: {proc.how()} after {proc.seconds:.0f} s, {len(rows)} of 4 rows",
                "4 rows",
                "no",
                failure=proc.tail(),
            )
        ]
    repeats = "10" if ctx.quick else "50"
    ns = [sys.executable, "benchmarks/newton_schulz.py", "--device", "cuda", "--sizes", NS_SIZES, "--repeats", repeats]
    ns_proc = run(
        [*ns, "--steps", str(NS_STEPS)],
        timeout=NS_TIMEOUT_S,
        env=child_env(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=gpu),
    )
    ns_rows = newton_schulz_rows(ns_proc.out, f"1 GPU, median of {repeats}")
    if not ns_proc.ok or len(ns_rows) != len(NS_SIZES.split(",")):
        ns_rows = [
            Row(
                f"Muon Newton-Schulz {NS_SIZES} (benchmarks/newton_schulz.py), 1 GPU",
                f"FAILED: {ns_proc.how()} after {ns_proc.seconds:.0f} s, {len(ns_rows)} rows",
                "one row per size",
                "no",
                failure=ns_proc.tail(),
            )
        ]
    return rows + ns_rows


FEATURE_CHECKS = {"features": check_features}
"""Registered in checks.CHECKS after the others."""
