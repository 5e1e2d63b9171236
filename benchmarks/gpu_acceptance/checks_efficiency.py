"""GPU check `efficiency`: issue 27's hardware-independent counters measured on the GPU.

benchmarks/efficiency.py runs with --device cuda for the `small` preset dense, with a mixture of
experts, with Muon and with both (one rank, compiled, activation checkpointing as the memory plan
picks it for this GPU; one process per model, the four at once, so that their cold compiles overlap), and
its --json gives one acceptance row per model: graph breaks (dynamo's
counters while tracing), recompiles (a frame compiled again after the first train and the first
eval compile) and host syncs per step (the ops that make the host wait for the GPU, counted with a
dispatch mode over steps that log nothing). Its real runs use small's widths and depth at a short
batch (efficiency.py's RUN_GEOMETRY); the loss is chunked there iff small's own batch is.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.gpu_acceptance.context import Context, Row
from benchmarks.gpu_acceptance.procs import Proc, child_env, run, smi_query

PRESET = "small"
FEATURES = {
    "dense": "dense",
    "moe": "mixture of experts (4 experts, top-2)",
    "muon": "Muon",
    "moe+muon": "mixture of experts with Muon",
}
"""efficiency.py's features, each an acceptance row, and how the row names it."""
CHECKPOINTING = "auto"
"""What a run gets by default: the memory plan's choice for this GPU."""
MAX_HOST_SYNCS = 1
"""The step's one intended sync: the finite check (pretrain/numerics/debug.py agree_on_step)."""
TARGET = f"0 graph breaks; 0 recompiles after the first train and eval compiles; <= {MAX_HOST_SYNCS} host sync per step"
TIMEOUT_S = 420
"""One efficiency.py (a row: its FLOP count, then its run with a cold compile, about 4 minutes with
the others beside it), within a group's 8 minutes; the four run at the same time."""
JOB_TIMEOUT_S = 330
"""efficiency.py's --timeout for one job: the run, which holds the compile."""


def efficiency_argv(features: str, json_path: Path, plan_gpu_gib: float) -> list[str]:
    """The efficiency.py command for one acceptance row, its --json written to json_path."""
    return [
        sys.executable,
        "benchmarks/efficiency.py",
        "--device",
        "cuda",
        "--presets",
        PRESET,
        "--features",
        features,
        "--ranks",
        "1",
        "--checkpointing",
        CHECKPOINTING,
        "--compile",
        "all",
        "--plan-gpu-gib",
        f"{plan_gpu_gib:.3f}",
        "--timeout",
        str(JOB_TIMEOUT_S),
        "--no-markdown",
        "--json",
        str(json_path),
    ]


def efficiency_row(features: str, data: dict[str, Any] | None, about: str) -> Row:
    """The row of PRESET with features from efficiency.py's {"rows": [...]} (None: no file): met
    when it has no graph break, no recompile and at most MAX_HOST_SYNCS host syncs per step."""
    name = f"graph breaks, recompiles, host syncs: `{PRESET}`, {FEATURES[features]}, {about}"
    found = [r for r in (data or {}).get("rows", []) if (r.get("preset"), r.get("features")) == (PRESET, features)]
    if not found:
        return Row(name, "FAILED: no row in efficiency.py's --json", TARGET, "no")
    r = found[0]
    breaks, recompiles, syncs = r.get("graph_breaks"), r.get("recompiles"), r.get("host_syncs_per_step")
    if breaks is None or recompiles is None or syncs is None:
        return Row(name, "FAILED: not measured (efficiency.py's row has no counts)", TARGET, "no")
    flops = r.get("executed_over_model_flops")
    result = (
        f"{breaks} graph breaks, {recompiles} recompiles, {syncs:g} host syncs per step; "
        f"checkpointing {r.get('activation_checkpointing')}"
        + ("" if flops is None else f"; executed {flops:.3f} x the model FLOPs")
    )
    ok = breaks == 0 and recompiles == 0 and syncs <= MAX_HOST_SYNCS
    return Row(name, result, TARGET, "yes" if ok else "no")


def read_rows(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check_efficiency(ctx: Context) -> list[Row]:
    """The four models at once, one efficiency.py each (their compiles take a CPU core each, of many)."""
    index = ctx.gpus[0]
    plan_gpu_gib = int(smi_query("memory.total", index=index)[0][0]) / 1024
    env = child_env(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(index))
    paths = {features: ctx.tmp / f"efficiency-{features}.json" for features in FEATURES}
    with ThreadPoolExecutor(len(FEATURES)) as pool:
        procs = {
            features: pool.submit(run, efficiency_argv(features, path, plan_gpu_gib), TIMEOUT_S, env)
            for features, path in paths.items()
        }
    rows = []
    for features, path in paths.items():
        proc: Proc = procs[features].result()
        row = efficiency_row(features, read_rows(path), "1 GPU, compiled (benchmarks/efficiency.py, built-in corpus)")
        if row.met == "no":
            row.failure = proc.tail()
            if not proc.ok and row.result.startswith("FAILED"):
                row.result += f"; efficiency.py {proc.how()} after {proc.seconds:.0f} s"
        rows.append(row)
    return rows


EFFICIENCY_CHECKS = {"efficiency": check_efficiency}
"""Registered in checks.CHECKS after the syncs check."""
