"""The GPU checks: each check_* runs what it checks in processes of its own (the launcher, a
worker, pytest) and returns its rows of the table; CHECKS names them for --only, in table order."""

from __future__ import annotations

import json
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.gpu_acceptance.context import (
    OFFLINE_DATA,  # noqa: F401  (re-exported)
    SMALL_FALLBACK_VOCAB,  # noqa: F401  (re-exported)
    Context,
    Row,  # noqa: F401  (re-exported)
    sets_args,
)
from benchmarks.gpu_acceptance.checks_checkpoints import CHECKPOINT_CHECKS
from benchmarks.gpu_acceptance.checks_compile import COMPILE_CHECKS
from benchmarks.gpu_acceptance.checks_efficiency import EFFICIENCY_CHECKS
from benchmarks.gpu_acceptance.checks_features import FEATURE_CHECKS
from benchmarks.gpu_acceptance.checks_flash import FLASH_CHECKS
from benchmarks.gpu_acceptance.checks_float8 import FLOAT8_CHECKS
from benchmarks.gpu_acceptance.checks_moe import MOE_CHECKS
from benchmarks.gpu_acceptance.checks_gpus import check_gpus
from benchmarks.gpu_acceptance.checks_profile import PROFILE_CHECKS
from benchmarks.gpu_acceptance.checks_syncs import check_syncs, syncs_row  # noqa: F401  (syncs_row re-exported)
from benchmarks.gpu_acceptance.checks_runtime import RUNTIME_CHECKS, estimate_row, shape_estimate_row
from benchmarks.gpu_acceptance.procs import (
    LAST_LINES,
    GpuMemory,
    failed,
    falling,
    kill_group,
    launcher,
    losses_by_step,
    run,
    step_lines,
    watch,
    worker,
)
from benchmarks.gpu_acceptance.workers import POISONED, TINY


def check_nvml_test(ctx: Context) -> list[Row]:
    proc = run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/launcher/gpus/test_nvml.py",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-k",
            "real_nvml_describes_every_gpu",
        ],
        timeout=300,
    )
    passed = proc.ok and re.search(r"\b1 passed\b", proc.out) is not None
    summary = proc.out.strip().splitlines()[-1] if proc.out.strip() else proc.how()
    return [
        Row(
            "real-driver NVML test (tests/launcher/gpus/test_nvml.py)",
            summary,
            "1 passed",
            "yes" if passed else "no",
            failure="" if passed else proc.tail(),
        )
    ]


def debug_run_row(name: str, argv: list[str], ctx: Context, timeout: float) -> Row:
    """A debug run of one of the user's commands: exit 0, GPU<n>: prefixes, falling loss."""
    proc = run(argv, timeout)
    steps = step_lines(proc.out)
    prefixes = sorted({s["prefix"] for s in steps})
    unprefixed = [line for line in proc.out.splitlines() if "| [GPU " in line and not re.match(r"^GPU\d+:", line)]
    losses = losses_by_step(proc.out, prefixes[0] if prefixes else None)
    ok = proc.ok and bool(prefixes) and not unprefixed and falling(losses)
    first, last = (losses[min(losses)], losses[max(losses)]) if losses else (None, None)
    result = f"{proc.how()}; prefixes {', '.join(prefixes) or 'none'}; loss {first} -> {last} over {len(losses)} step lines" + (
        f"; {len(unprefixed)} unprefixed worker lines" if unprefixed else ""
    )
    return Row(
        f"`{name}`",
        result,
        "exit 0, GPU<n>: on every worker line, loss falls",
        "yes" if ok else "no",
        failure="" if ok else proc.tail(),
    )


def check_train_gpu(ctx: Context) -> list[Row]:
    gpu = str(ctx.gpus[0])
    return [
        debug_run_row(
            f"./train_gpu.sh {gpu} --debug",
            ["bash", "train_gpu.sh", gpu, "--debug", "--run-dir", ctx.run_dir("train_gpu")],
            ctx,
            240,
        )
    ]


def check_train_auto(ctx: Context) -> list[Row]:
    return [
        debug_run_row(
            "./train_auto_gpu.sh --debug",
            ["bash", "train_auto_gpu.sh", "--debug", "--run-dir", ctx.run_dir("train_auto")],
            ctx,
            240,
        )
    ]


def check_run_training(ctx: Context) -> list[Row]:
    row = debug_run_row(
        "bash run_training.sh --debug", ["bash", "run_training.sh", "--debug", "--run-dir", ctx.run_dir("run_training")], ctx, 240
    )
    row.check += f" ({len(ctx.gpus)} GPU(s))"
    return [row]


def check_nan(ctx: Context) -> list[Row]:
    """A checkpoint with one NaN weight (made on the CPU, as tests/pretrain/numerics/test_numerical_failure.py
    does), resumed on one GPU through the launcher."""
    run_dir = ctx.run_dir("nan")
    checkpoint = worker("poison", 120, run_dir)["checkpoint"]
    proc = launcher(
        "--debug",
        "--gpus",
        str(ctx.gpus[0]),
        "--max-steps",
        "3",
        "--run-dir",
        run_dir,
        "--resume",
        checkpoint,
        *sets_args(TINY),
        timeout=240,
    )
    banner = f"NaN GRADIENT DETECTED [GPU {ctx.gpus[0]}]"
    dump = Path(run_dir) / "debug" / "nan_debug_step_0.npz"
    problems = []
    if proc.returncode != 3:
        problems.append(f"{proc.how()}, not exit 3")
    if banner not in proc.out:
        problems.append("no report banner")
    elif POISONED not in proc.out.split(banner, 1)[1]:
        problems.append(f"the report does not name {POISONED}")
    try:
        import numpy as np

        with np.load(dump, allow_pickle=False) as saved:
            nans = int(np.isnan(saved[f"param/{POISONED}"]).sum())
        if nans != 1:
            problems.append(f"the dump holds {nans} NaN in {POISONED}, not 1")
    except (OSError, KeyError, ValueError) as error:
        problems.append(f"dump {dump.name}: {error}")
    result = "exit 3, report names the poisoned weight, dump loads (allow_pickle=False)" if not problems else "; ".join(problems)
    return [
        Row(
            "NaN run on 1 GPU (poisoned weight via checkpoint)",
            result,
            "exit 3, report, loadable dump",
            "no" if problems else "yes",
            failure=proc.tail() if problems else "",
        )
    ]


def check_small(ctx: Context) -> list[Row]:
    steps, interval = (60, 20) if ctx.quick else (300, 50)
    rows = []
    for compiled, timeout in ((True, 300), (False, 150)):  # 450 s together: a group's 8 minutes
        with GpuMemory(ctx.gpus[0]) as used:
            proc = launcher(
                "--preset",
                "small",
                "--gpus",
                str(ctx.gpus[0]),
                "--max-steps",
                str(steps),
                "--run-dir",
                ctx.run_dir(f"small-{compiled}"),
                *sets_args(
                    [
                        *ctx.small_sets,
                        f"training.compile={str(compiled).lower()}",
                        "training.eval_interval=0",
                        f"logging.log_interval={interval}",
                        "logging.tensorboard=false",
                    ]
                ),
                timeout=timeout,
            )
        how = "compiled" if compiled else "not compiled"
        name = f"`small` preset, bf16, {how}, {steps} steps ({ctx.data_note})"
        rows.append(estimate_row(f"memory estimate vs measured, `small`, {how}, 1 GPU", proc, used.peak_gib))
        lines = step_lines(proc.out)
        if not proc.ok or len(lines) < 3:
            rows.append(
                Row(
                    name,
                    f"FAILED: {proc.how()} after {proc.seconds:.0f} s, {len(lines)} step lines",
                    "MFU >= 45%" if compiled else "loss falls",
                    "no",
                    failure=proc.tail(),
                )
            )
            continue
        timed = lines[2:]  # the first windows hold the compile and the warm-up
        tps = statistics.median(s["tokens_per_s"] for s in timed)
        mfus = [s["mfu"] for s in timed if s["mfu"] is not None]
        mfu = statistics.median(mfus) if mfus else None
        mem = max((s["mem"] for s in lines if s["mem"] is not None), default=None)
        losses = {s["step"]: s["loss"] for s in lines}
        result = (
            f"{tps:,.0f} tokens/s, MFU {'n.a.' if mfu is None else f'{mfu:.1f}%'}, peak {mem} GiB, "
            f"loss {losses[min(losses)]:.3f} -> {losses[max(losses)]:.3f}"
        )
        good_loss = falling(losses)
        if compiled:
            met = "yes" if good_loss and mfu is not None and mfu >= 45 else "no"
            rows.append(Row(name, result, "MFU >= 45% (H100), loss falls", met))
        else:
            rows.append(Row(name, result, "loss falls", "yes" if good_loss else "no"))
    return rows


def check_production_shape(ctx: Context) -> list[Row]:
    """The 8B shape (dim 4096, 128256 vocabulary, context 8192, activation checkpointing) with
    fewer layers on one GPU; two depths give the time one more layer adds."""
    depths = (2, 4)
    steps = "2" if ctx.quick else "4"
    timeouts = {2: 240, 4: 210}  # the first compiles cold; 450 s together
    results = {n: worker("shape", timeouts[n], str(n), steps, json.dumps(ctx.data_sets)) for n in depths}
    per_layer = (results[4]["step_s"] - results[2]["step_s"]) / 2
    r = results[4]
    projected = r["step_s"] + 28 * per_layer
    layer_mfu = r["layer_flops_per_step"] / per_layer / r["peak_flops"] if r["peak_flops"] and per_layer > 0 else None
    result = (
        f"4 layers ({r['params'] / 1e9:.2f} B params, {r.get('mode', '?')}): {r['step_s']:.3f} s/step "
        f"({r['tokens']} tokens), "
        f"{r['tokens_per_s']:,.0f} tokens/s, MFU {fmt_pct(r['mfu'])}, peak {r['peak_gib']:.1f} GiB; "
        f"2 layers {results[2]['step_s']:.3f} s/step; one layer {per_layer:.3f} s/step "
        f"(MFU of a layer {fmt_pct(layer_mfu)}); "
        f"32 layers projected {projected:.2f} s/step"
    )
    return [Row(shape_name(results), result, "measured", "n.a."), shape_estimate_row(r)]


def shape_name(results: dict[int, dict]) -> str:
    """The production-shape row's name, with the activation checkpointing the runs had once planned
    (the workers read it from their built trainers: "auto" is what the plan chose for this GPU)."""
    ran = sorted({str(r.get("checkpointing", "?")) for r in results.values()})
    return f"8B shape, 1 GPU, 2 and 4 layers, bf16, compiled, activation checkpointing {' / '.join(ran)} (as planned)"


def fmt_pct(value: float | None) -> str:
    return "n.a." if value is None else f"{100 * value:.1f}%"


def check_bf16(ctx: Context) -> list[Row]:
    """The debug model for 20 steps, bf16 autocast and fp32 (TF32 matmuls), same seed and data."""
    runs = {}
    for amp in (True, False):
        proc = launcher(
            "--debug",
            "--gpus",
            str(ctx.gpus[0]),
            "--max-steps",
            "20",
            "--run-dir",
            ctx.run_dir(f"amp-{amp}"),
            *sets_args([f"training.use_amp={str(amp).lower()}", "training.compile=false"]),
            timeout=150,
        )
        losses = losses_by_step(proc.out, f"GPU{ctx.gpus[0]}")
        if not proc.ok or len(losses) != 20:
            raise failed(f"use_amp={amp}", proc)
        runs[amp] = losses
    relative = [abs(runs[True][s] - runs[False][s]) / abs(runs[False][s]) for s in runs[False]]
    worst = max(relative)
    ok = 0 < worst <= 0.05
    return [
        Row(
            "bf16 vs fp32 loss, debug model, 20 steps",
            f"max relative difference {worst:.2e} (final {runs[True][19]:.4f} vs {runs[False][19]:.4f})",
            "close (<= 5e-2), not identical (> 0)",
            "yes" if ok else "no",
        )
    ]


def check_offload(ctx: Context) -> list[Row]:
    """The small preset on one GPU for 10 steps with and without FSDP2's CPU offload (same seed
    and data): offloaded, the weights, gradients and AdamW state (16 bytes a parameter) live in
    host memory, so the peak GPU memory is lower, and the losses are those of the plain run."""
    runs = {}
    for offload in (False, True):
        proc = launcher(
            "--preset",
            "small",
            "--gpus",
            str(ctx.gpus[0]),
            "--max-steps",
            "10",
            "--run-dir",
            ctx.run_dir(f"offload-{offload}"),
            *sets_args(
                [
                    *ctx.small_sets,
                    f"training.cpu_offload={str(offload).lower()}",
                    "training.compile=false",
                    "logging.log_interval=1",
                    "training.eval_interval=0",
                    "logging.tensorboard=false",
                ]
            ),
            timeout=210 if offload else 150,  # the offloaded run steps AdamW on the host
        )
        steps = [s for s in step_lines(proc.out) if s["prefix"] == f"GPU{ctx.gpus[0]}"]
        if not proc.ok or len(steps) != 10 or (offload and "with CPU offload over 1 GPU" not in proc.out):
            raise failed(f"cpu_offload={str(offload).lower()}", proc)
        runs[offload] = steps
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(runs[True], runs[False], strict=True))
    plain, offloaded = (max(s["mem"] or 0.0 for s in runs[o]) for o in (False, True))
    ok = worst <= 1e-2 and offloaded <= plain - 1.0
    return [
        Row(
            "CPU offload, `small`, 1 GPU, 10 steps: peak GPU memory and losses against no offload",
            f"peak {plain:.1f} -> {offloaded:.1f} GiB; max relative loss difference {worst:.1e}",
            "peak >= 1 GiB lower (16 B x 153M parameters leave the GPU); losses within 1e-2",
            "yes" if ok else "no",
        )
    ]


def check_nccl(ctx: Context) -> list[Row]:
    if len(ctx.gpus) < 2:
        return [
            Row("NCCL fail-fast: a rank killed during training", "1 GPU", "every process gone <= 2 s, exit 137", "n.a."),
            Row("DDP vs FSDP loss at step 1 (2 GPUs)", "1 GPU", "relative difference <= 1e-3", "n.a."),
        ]
    return [fail_fast(ctx), ddp_vs_fsdp(ctx)]


def fail_fast(ctx: Context) -> Row:
    """Two GPUs training the debug model; rank 1 SIGKILLed from outside, as the OOM killer
    would, while rank 0 is in (or about to enter) a collective with it."""
    import psutil

    gpus = ",".join(map(str, ctx.gpus[:2]))
    argv = [
        sys.executable,
        "-m",
        "launcher",
        "--debug",
        "--gpus",
        gpus,
        "--max-steps",
        "100000",
        "--kill-grace",
        "1",
        "--run-dir",
        ctx.run_dir("fail-fast"),
        "--set",
        "logging.log_interval=1",
        "--set",
        "training.compile=false",
    ]
    watched = watch(argv)
    proc, lines, training, reader = watched.proc, watched.lines, watched.seen, watched.reader
    name = "NCCL fail-fast: rank 1 SIGKILLed during training, 2 GPUs"
    target = "every process gone <= 2 s, exit 137"
    try:
        if not training.wait(timeout=180):
            return Row(name, "the run ended or stalled before step 5", target, "no", failure="".join(lines[-LAST_LINES:]))
        workers = sorted(
            (p for p in psutil.Process(proc.pid).children() if p.cmdline()[1:3] == ["-m", "pretrain"]),
            key=lambda p: int(p.environ()["RANK"]),
        )
        workers[1].kill()
        killed_at = time.monotonic()
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            return Row(
                name, "the launcher was still running 60 s after the kill", target, "no", failure="".join(lines[-LAST_LINES:])
            )
        exited = time.monotonic() - killed_at
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers):
            if time.monotonic() - killed_at > 30:
                break
            time.sleep(0.05)  # polling the process table: there is nothing to wait on
        gone = time.monotonic() - killed_at
    finally:
        kill_group(proc)
        reader.join(timeout=10)
    ok = code == 128 + signal.SIGKILL and gone <= 2
    return Row(
        name,
        f"exit {code}; launcher exited {exited:.2f} s, every worker gone {gone:.2f} s after the kill",
        target,
        "yes" if ok else "no",
        failure="" if ok else "".join(lines[-LAST_LINES:]),
    )


def ddp_vs_fsdp(ctx: Context) -> Row:
    gpus = ",".join(map(str, ctx.gpus[:2]))
    losses = {}
    for mode in ("ddp", "fsdp"):
        proc = launcher(
            "--debug",
            "--gpus",
            gpus,
            "--max-steps",
            "2",
            "--run-dir",
            ctx.run_dir(f"mode-{mode}"),
            *sets_args([f"training.parallelism={mode}", "training.compile=false"]),
            timeout=90,
        )
        found = losses_by_step(proc.out, f"GPU{ctx.gpus[0]}")
        if not proc.ok or 1 not in found:
            raise failed(mode, proc)
        losses[mode] = found[1]
    diff = abs(losses["ddp"] - losses["fsdp"]) / abs(losses["ddp"])
    return Row(
        "DDP vs FSDP loss at step 1, 2 GPUs, debug model",
        f"{losses['ddp']:.5f} vs {losses['fsdp']:.5f} (relative {diff:.1e})",
        "relative difference <= 1e-3",
        "yes" if diff <= 1e-3 else "no",
    )


CHECKS: dict[str, Callable[[Context], list[Row]]] = {
    "gpus": check_gpus,
    "nvml-test": check_nvml_test,
    "train-gpu": check_train_gpu,
    "train-auto": check_train_auto,
    "run-training": check_run_training,
    "nan": check_nan,
    "small": check_small,
    **PROFILE_CHECKS,
    "production-shape": check_production_shape,
    **COMPILE_CHECKS,
    "bf16": check_bf16,
    "offload": check_offload,
    "nccl": check_nccl,
    "syncs": check_syncs,
    **EFFICIENCY_CHECKS,
    **RUNTIME_CHECKS,
    **FLASH_CHECKS,
    **FEATURE_CHECKS,
    **FLOAT8_CHECKS,
    **MOE_CHECKS,
    **CHECKPOINT_CHECKS,
}
"""Every command a check runs has its own timeout, and a check's timeouts add up to at most
groups.CHECK_LIMIT_S, so no check hangs and a group fits its device call."""
