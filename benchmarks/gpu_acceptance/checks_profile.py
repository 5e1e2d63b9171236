"""GPU check `step-profile`: where the time of a compiled `small` step goes.

The small-run worker (workers_profile.py) builds `small` as a run has it (compiled, bf16, the
plan's micro-batches and loss head), runs its warm-up and 10 timed steps, then 3 more under
torch.profiler, and bins their GPU time by kind (benchmarks/step_profile.py: matmuls, attention,
cross-entropy, optimizer, communication, other compiled kernels, other, idle). The table gets a
row for the whole step and one per kind with its longest kernels: measurements, no target (issue
38: the split says what is left between the MFU measured and 45%)."""

from __future__ import annotations

import json
from typing import Any

from benchmarks.gpu_acceptance.context import Context, Row
from benchmarks.gpu_acceptance.procs import CheckFailed, child_env, worker
from benchmarks.step_profile import KINDS, Split

PROFILED_STEPS = 3
TIMEOUT_S = 150
"""A launch, `small`'s compile (warm from the `small` check's run before it in the group), 16 steps."""
NAME = "where the time goes, `small`, compiled"


def fmt_mfu(value: float | None) -> str:
    return "n.a." if value is None else f"{100 * value:.1f}%"


def profile_rows(r: dict[str, Any]) -> list[Row]:
    """The worker's result as rows: the step (its time, shares, throughput), then one per kind."""
    split = Split.from_dict(r["profile"])
    shares = split.shares
    total = sum(shares.values())
    summary = ", ".join(f"{kind} {shares[kind]:.1f}%" for kind in KINDS)
    rows = [
        Row(
            f"{NAME} ({r['shape']}, checkpointing {r['checkpointing']}), {split.steps} steps under torch.profiler",
            f"{split.step_ms:.1f} ms per step: {summary}; {split.overlap_ms:.1f} ms overlapped; "
            f"unprofiled {r['tokens_per_s']:,.0f} tokens/s, MFU {fmt_mfu(r['mfu'])} (torch {r['torch']})",
            "measured; kinds and idle add up to the step (100%)",
            "yes" if abs(total - 100) < 0.05 and split.device == "cuda" else "no",
        )
    ]
    for kind in KINDS:
        longest = "; ".join(f"{name} {ms:.2f} ms" for name, ms in split.top.get(kind, []))
        rows.append(
            Row(
                f"{NAME}: {kind}",
                f"{split.ms[kind]:.2f} ms per step ({shares[kind]:.1f}%)" + (f"; longest: {longest}" if longest else ""),
                "measured",
                "n.a.",
            )
        )
    return rows


def check_step_profile(ctx: Context) -> list[Row]:
    env = child_env(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(ctx.gpus[0]))
    try:
        r = worker("small-run", TIMEOUT_S, "10", str(PROFILED_STEPS), json.dumps(ctx.small_sets), env=env)
    except CheckFailed as error:
        return [Row(NAME, f"FAILED: {error}", "measured", "no", failure=error.tail)]
    return profile_rows(r)


PROFILE_CHECKS = {"step-profile": check_step_profile}
"""Registered in checks.CHECKS after `small`."""
