"""GPU checks of the trainer's runtime (device choice under torchrun, NCCL failures, the
allocator, attention memory) and of the memory estimate against what a run takes. Each runs in
processes of its own under a timeout; two-GPU checks are n.a. on one GPU."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

from benchmarks.gpu_acceptance.checks_nccl import check_nccl_transport
from benchmarks.gpu_acceptance.context import Context, Row
from benchmarks.gpu_acceptance.procs import (
    LAST_LINES,
    Proc,
    child_env,
    failed,
    kill_group,
    launcher,
    results,
    run,
    step_lines,
    watch,
    worker,
    worker_argv,
)
from benchmarks.gpu_acceptance.workers_runtime import FAILURE, RAISING

SUMMARY_RULE = "=" * 72
"""The line above the launcher's failure summary (launcher/supervise/summary.py RULE)."""
ESTIMATE = re.compile(r"estimated (?P<gib>[\d.]+) GiB of [\d.]+ GiB per GPU")
"""The launcher's line with pretrain.plan.gpu_memory's estimate for the run as the workers run it."""
MODEL_LINE = re.compile(r"\[(?P<label>(GPU|CPU) \d+)\] Model: .*?; device (?P<device>\S+); world size (?P<world>\d+)")
COLLECTIVE_TIMEOUT_S = 20
"""system.collective_timeout of the nccl-timeout check."""
ABORT_SLACK_S = 60
"""What the nccl-timeout check allows beyond the timeout: the watchdog's polling and its dumps."""
TEARDOWN_S = 10
"""The most the nccl-error check allows from the raise to the launcher's exit (--kill-grace 1)."""


def summary(out: str) -> str:
    """The launcher's failure summary: the text after its first rule line ("" without one)."""
    return out.split(SUMMARY_RULE, 1)[1] if SUMMARY_RULE in out else ""


def two_gpus(ctx: Context) -> str:
    return ",".join(map(str, ctx.gpus[:2]))


# --- the memory estimate against a run ---------------------------------------------------


def estimate_row(name: str, proc: Proc, used_gib: float | None) -> Row:
    """The launcher's estimate for a run against the run's peaks: torch's allocated peak (the
    step lines' Mem) and the GPU memory the driver saw it use (nvidia-smi, the reserved memory
    and the CUDA context). The estimate must not be low: the fit check trusts it."""
    target = "estimate >= GPU memory used (nvidia-smi) >= allocated peak"
    found = ESTIMATE.search(proc.out)
    allocated = max((s["mem"] for s in step_lines(proc.out) if s["mem"] is not None), default=None)
    if found is None or allocated is None or used_gib is None:
        missing = ", ".join(
            what
            for what, value in (
                ("the launcher's estimate line", found),
                ("Mem on the step lines", allocated),
                ("nvidia-smi samples", used_gib),
            )
            if value is None
        )
        return Row(name, f"FAILED: {proc.how()}; no {missing}", target, "no", failure=proc.tail())
    estimate = float(found["gib"])
    sampled = used_gib >= allocated * 0.95  # else the samples missed the peak (Mem is rounded to 0.1 GiB)
    ok = estimate >= used_gib and sampled
    return Row(
        name,
        f"estimate {estimate:.1f} GiB; used {used_gib:.1f} GiB (nvidia-smi); allocated peak "
        f"{allocated:.1f} GiB ({100 * used_gib / estimate:.0f}% of the estimate)"
        + ("" if sampled else "; nvidia-smi's samples missed the peak"),
        target,
        "yes" if ok else "no",
    )


def shape_estimate_row(r: dict) -> Row:
    """The production-shape worker's own peaks (torch, whole run) against pretrain.plan.gpu_memory.estimate."""
    ok = r["run_reserved_gib"] <= r["estimate_gib"]
    return Row(
        "memory estimate vs measured, 8B shape, 4 layers, 1 GPU",
        f"estimate {r['estimate_gib']:.1f} GiB ({r['estimate_parts']}); "
        f"peak reserved {r['run_reserved_gib']:.1f}, "
        f"allocated {r['run_allocated_gib']:.1f} GiB ({100 * r['run_reserved_gib'] / r['estimate_gib']:.0f}% "
        f"of the estimate)",
        "reserved peak <= estimate",
        "yes" if ok else "no",
    )


# --- torchrun ------------------------------------------------------------------------------


def check_torchrun(ctx: Context) -> list[Row]:
    """pretrain_main.py under torchrun on two GPUs: each rank must take GPU LOCAL_RANK."""
    name = "torchrun --standalone --nproc-per-node 2 pretrain_main.py --debug, system.device=cuda"
    target = "exit 0, the 2 ranks on different GPUs"
    if len(ctx.gpus) < 2:
        return [Row(name, "1 GPU", target, "n.a.")]
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "pretrain_main.py",
        "--debug",
        "--run-dir",
        ctx.run_dir("torchrun"),
        "--set",
        "system.device=cuda",
        "--set",
        "training.max_steps=10",
        "--set",
        "training.compile=false",
    ]
    proc = run(argv, 600, env=child_env(CUDA_VISIBLE_DEVICES=two_gpus(ctx), CUDA_DEVICE_ORDER="PCI_BUS_ID"))
    return [torchrun_row(name, target, proc)]


def torchrun_row(name: str, target: str, proc: Proc) -> Row:
    """From each rank's Model line: the device it took (cuda:LOCAL_RANK expected)."""
    ranks = [m.group("label", "device", "world") for m in MODEL_LINE.finditer(proc.out)]
    devices = {device for _, device, _ in ranks}
    ok = (
        proc.ok
        and len(ranks) == 2
        and len(devices) == 2
        and all(d.startswith("cuda:") for d in devices)
        and all(world == "2" for *_, world in ranks)
    )
    shown = ", ".join(f"{device} ({label})" for label, device, _ in ranks) or "no Model lines"
    return Row(name, f"{proc.how()}; ranks on {shown}", target, "yes" if ok else "no", failure="" if ok else proc.tail())


# --- NCCL failures ---------------------------------------------------------------------------


def check_nccl_timeout(ctx: Context) -> list[Row]:
    """Two GPUs training the debug model on NCCL alone (no gloo beside it) with a short
    system.collective_timeout; rank 1 SIGSTOPped: rank 0's NCCL watchdog must abort it
    (SIGABRT, exit 134) after the timeout, and the launcher's summary must say why."""
    import psutil

    name = f"NCCL collective timeout ({COLLECTIVE_TIMEOUT_S} s), rank 1 SIGSTOPped, 2 GPUs"
    target = (
        f"exit 134 in {COLLECTIVE_TIMEOUT_S}-{COLLECTIVE_TIMEOUT_S + ABORT_SLACK_S} s, summary names system.collective_timeout"
    )
    if len(ctx.gpus) < 2:
        return [Row(name, "1 GPU", target, "n.a.")]
    argv = [
        sys.executable,
        "-m",
        "launcher",
        "--debug",
        "--gpus",
        two_gpus(ctx),
        "--max-steps",
        "100000",
        "--kill-grace",
        "1",
        "--run-dir",
        ctx.run_dir("nccl-timeout"),
        *[
            item
            for s in (
                f"system.collective_timeout={COLLECTIVE_TIMEOUT_S}",
                "training.cpu_offload=false",
                "training.parallelism=ddp",
                "training.compile=false",
                "logging.log_interval=1",
            )
            for item in ("--set", s)
        ],
    ]
    watched = watch(argv)
    proc, lines, training, reader = watched.proc, watched.lines, watched.seen, watched.reader
    stopped: list[psutil.Process] = []
    try:
        if not training.wait(timeout=600):
            return [Row(name, "the run ended or stalled before step 5", target, "no", failure="".join(lines[-LAST_LINES:]))]
        workers = sorted(
            (p for p in psutil.Process(proc.pid).children() if p.cmdline()[1:3] == ["-m", "pretrain"]),
            key=lambda p: int(p.environ()["RANK"]),
        )
        workers[1].suspend()  # SIGSTOP: alive, silent, never reaching the next collective
        stopped.append(workers[1])
        stopped_at = time.monotonic()
        try:
            code = proc.wait(timeout=COLLECTIVE_TIMEOUT_S + ABORT_SLACK_S + 60)
        except subprocess.TimeoutExpired:
            return [
                Row(
                    name,
                    f"the launcher was still running {COLLECTIVE_TIMEOUT_S + ABORT_SLACK_S + 60} s after the SIGSTOP",
                    target,
                    "no",
                    failure="".join(lines[-LAST_LINES:]),
                )
            ]
        seconds = time.monotonic() - stopped_at
    finally:
        for p in stopped:
            if p.is_running():
                p.kill()  # SIGKILL ends a stopped process too
        kill_group(proc)
        reader.join(timeout=10)
    out = "".join(lines)
    text = summary(out)
    hint = "system.collective_timeout" in text
    ok = code == 128 + signal.SIGABRT and COLLECTIVE_TIMEOUT_S <= seconds <= COLLECTIVE_TIMEOUT_S + ABORT_SLACK_S and hint
    return [
        Row(
            name,
            f"exit {code} {seconds:.1f} s after the SIGSTOP; summary "
            f"{'names' if hint else 'does not name'} system.collective_timeout"
            + ("" if "SIGABRT" in text else "; no SIGABRT in the summary"),
            target,
            "yes" if ok else "no",
            failure="" if ok else "".join(lines[-LAST_LINES:]),
        )
    ]


def check_nccl_error(ctx: Context) -> list[Row]:
    """Two launched GPU workers in an NCCL all_reduce loop; rank 1 raises (workers_runtime):
    its traceback must reach the launcher's summary and everything end within TEARDOWN_S."""
    name = "NCCL: rank 1 raises in an all_reduce loop, 2 GPUs under the launcher"
    target = f"rank 1's traceback printed, the launcher done <= {TEARDOWN_S} s after the raise"
    if len(ctx.gpus) < 2:
        return [Row(name, "1 GPU", target, "n.a.")]
    proc = launcher(
        "--gpus",
        two_gpus(ctx),
        "--kill-grace",
        "1",
        "--run-dir",
        ctx.run_dir("nccl-error"),
        "--",
        *worker_argv("nccl-error"),
        timeout=300,
        first_match=re.compile(re.escape(RAISING)),
    )
    return [error_row(name, target, proc)]


def error_row(name: str, target: str, proc: Proc) -> Row:
    """Rank 1's traceback among its own lines (the prefix of its RAISING line), and how soon the
    launcher was done after the raise. Which rank the summary names first is a race: the peer
    may notice the lost connection (gloo, or NCCL's asynchronous error check) before the
    launcher sees rank 1 exit."""
    raised = next((line for line in proc.out.splitlines() if RAISING in line), None)
    if proc.returncode is None or proc.first_match_s is None or raised is None:
        raise failed("launcher -- worker nccl-error", proc)
    prefix = raised.split(RAISING, 1)[0]
    own = [line[len(prefix) :] for line in proc.out.splitlines() if line.startswith(prefix)]
    shown = "Traceback (most recent call last):" in own and f"RuntimeError: {FAILURE}" in own
    first = re.search(r"FAILED: (\S+ \(rank \d+\)) failed first", summary(proc.out))
    seconds = proc.seconds - proc.first_match_s
    ok = shown and seconds <= TEARDOWN_S and proc.returncode != 0
    return Row(
        name,
        f"{proc.how()} {seconds:.1f} s after the raise; rank 1's traceback "
        f"{'printed' if shown else 'NOT printed'}; summary: {first[1] if first else '?'} failed first",
        target,
        "yes" if ok else "no",
        failure="" if ok else proc.tail(),
    )


# --- one GPU -------------------------------------------------------------------------------------


def check_alloc_conf(ctx: Context) -> list[Row]:
    """A launched GPU worker (the launcher's worker environment, PYTORCH_CUDA_ALLOC_CONF unset
    by the user) reads its allocator settings and device order, and asks torch's allocator."""
    env = child_env()
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_DEVICE_ORDER"):
        env.pop(key, None)
    proc = launcher(
        "--gpus", str(ctx.gpus[0]), "--run-dir", ctx.run_dir("alloc-conf"), "--", *worker_argv("alloc-conf"), timeout=300, env=env
    )
    found = results(proc.out)
    if not proc.ok or not found:
        raise failed("launcher -- worker alloc-conf", proc)
    r = found[-1]
    ok = r["alloc_conf"] == "expandable_segments:True" and r["device_order"] == "PCI_BUS_ID" and r["expandable"] is not False
    expandable = {True: "expandable", False: "NOT expandable", None: "not reported by this torch"}[r["expandable"]]
    return [
        Row(
            "allocator settings in a launched GPU worker",
            f"PYTORCH_CUDA_ALLOC_CONF={r['alloc_conf']}, CUDA_DEVICE_ORDER={r['device_order']}; "
            f"{r['segments']} segment(s) {expandable} (torch {r['torch']})",
            "expandable_segments:True, segments expandable, PCI_BUS_ID",
            "yes" if ok else "no",
        )
    ]


def check_fp32_attention(ctx: Context) -> list[Row]:
    """One attention layer of the 8B model at its full context in fp32: SDPA must not fall back
    to the math kernel, whose (B, heads, T, T) fp32 score matrix alone takes scores_gib."""
    r = worker("attention", 300, "float32")
    shape = f"batch {r['batch']}, {r['heads']}/{r['kv_heads']} heads, context {r['context']}"
    target = f"peak < {r['scores_gib']:.1f} GiB (one fp32 score matrix)"
    name = f"fp32 attention forward+backward, 8B layer ({shape})"
    if r["peak_gib"] is None:
        return [Row(name, "CUDA out of memory", target, "no")]
    kernels = ", ".join(r["kernels"]) or "none recognised"
    ok = r["peak_gib"] < r["scores_gib"]
    return [
        Row(
            name,
            f"peak {r['peak_gib']:.2f} GiB above inputs and weights; kernels: {kernels}"[:400],
            target,
            "yes" if ok else "no",
        )
    ]


RUNTIME_CHECKS = {
    "torchrun": check_torchrun,
    "nccl-timeout": check_nccl_timeout,
    "nccl-error": check_nccl_error,
    "nccl-transport": check_nccl_transport,
    "alloc-conf": check_alloc_conf,
    "fp32-attention": check_fp32_attention,
}
"""Registered in checks.CHECKS after the checks there."""
