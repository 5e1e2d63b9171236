"""GPU check `syncs`: host synchronizations in the steps of a compiled `small` run that log
nothing (the syncs worker, workers.worker_syncs), one process and a 1-rank NCCL group."""

from __future__ import annotations

import json

from benchmarks.gpu_acceptance.context import Context, Row
from benchmarks.gpu_acceptance.procs import worker

SYNC_MODES = (
    ("single", "1 process", 240),  # the first compiles cold
    ("group", "1-rank NCCL group", 105),
    ("group-nocheck", "1-rank NCCL group, debug.check_finite=false", 105),
)
"""The syncs check's runs: the worker's mode, how the row names it, its timeout (450 s together)."""


def check_syncs(ctx: Context) -> list[Row]:
    """Host synchronizations in the steps of fit() that log nothing, on `small` as a run has it
    (its batch and context, the loss head as the memory plan decides it, compiled), counted two
    ways (see workers.worker_syncs): one process, a 1-rank NCCL group (the collective path),
    and that group without the finite check (the stop agreement's own all-reduce)."""
    steps = "4" if ctx.quick else "6"
    rows = []
    for mode, about, timeout in SYNC_MODES:
        r = worker("syncs", timeout, mode, steps, json.dumps(ctx.small_sets))
        rows.append(syncs_row(r, about))
    return rows


def syncs_row(r: dict, about: str) -> Row:
    """One run of the syncs worker as a row: at most one synchronization in any counted step."""
    profiled = (
        f"profiler: {r['profiler_syncs']:.2f} sync calls, {r['pageable_h2d']:.2f} pageable H2D copies per step"
        if r.get("profiler_syncs") is not None
        else f"profiler: n.a. ({r.get('profiler_error', '?')})"
    )
    ok = r["max_syncs"] <= 1 and r["compiled"]  # a pageable copy to the GPU stages the data and returns: no sync
    return Row(
        f"host synchronizations per non-logging step, {about}, `small` ({r.get('shape', '?')}), "
        f"{'compiled' if r['compiled'] else 'NOT compiled'}",
        f"max {r['max_syncs']}, mean {r['mean_syncs']:.2f} over {r['steps']} steps (sync debug mode); "
        f"{profiled}" + (f"; where: {r['where']}" if r.get("where") else ""),
        "<= 1, compiled",
        "yes" if ok else "no",
    )
