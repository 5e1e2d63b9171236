"""benchmarks/efficiency.py's report: the table of its rows, where each row's syncs and graph
breaks are, and the machine and tree it ran on, as Markdown."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

from benchmarks.train import cpu_model, load_average, machine_line_for

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Row:
    preset: str
    features: str
    ranks: int
    """Per node."""
    activation_checkpointing: str
    nodes: int = 1
    parallelism: str = ""
    """training.parallelism as set for the row ("hsdp", "fsdp"); "": the preset's (the plan decides)."""

    @property
    def name(self) -> str:
        if self.nodes == 1:
            return f"{self.preset} {self.features} x{self.ranks} ckpt={self.activation_checkpointing}"
        where = f"{self.nodes}x{self.ranks} {self.parallelism or 'auto'}"
        return f"{self.preset} {self.features} {where} ckpt={self.activation_checkpointing}"


@dataclass
class Outcome:
    row: Row
    values: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def bytes_cell(per_kind: dict[str, float] | None) -> str:
    if per_kind is None:
        return ""
    if not per_kind:
        return "0"
    total = sum(per_kind.values())
    parts = ", ".join(f"{kind} {value:,.0f}" for kind, value in sorted(per_kind.items()) if value >= 0.5)
    return f"{total:,.0f} ({parts})" if parts else f"{total:,.2f}"


def number(value: Any, digits: int = 3) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def bytes_number(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}"


def table(outcomes: list[Outcome]) -> list[str]:
    header = [
        "preset",
        "features",
        "nodes",
        "ranks / node",
        "parallelism",
        "checkpointing",
        "executed / model FLOPs",
        "... / planned (with recompute)",
        "graph breaks",
        "recompiles",
        "host syncs / step",
        "collective bytes / token (by kind)",
        "minimum bytes / token",
        "inter-node bytes / token (by kind)",
        "inter-node minimum",
        "intra-node bytes / token",
        "orthogonalize share / rank",
        "saved bytes / token",
        "of them fp32",
        "matmuls / block",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for o in outcomes:
        r, v = o.row, o.values
        cells = [r.preset, r.features, str(r.nodes), str(r.ranks), v.get("parallelism") or r.parallelism]
        cells.append(r.activation_checkpointing)
        if o.note:
            cells += [o.note] + [""] * (len(header) - len(cells) - 1)
        else:
            cells += [
                number(v["executed_over_model_flops"]),
                number(v.get("executed_over_planned_flops")),
                number(v["graph_breaks"]) or "not compiled",
                number(v["recompiles"]),
                number(v["host_syncs_per_step"]),
                bytes_cell(v["collective_bytes_per_token"]),
                bytes_cell(v["collective_minimum_bytes_per_token"]),
                bytes_cell(v.get("inter_node_bytes_by_kind")),
                bytes_number(v.get("inter_node_minimum_bytes_per_token")),
                bytes_number(v.get("intra_node_bytes_per_token")),
                number(v["orthogonalize_share_per_rank"], 2),
                bytes_number(v.get("activation_bytes_per_token")),
                bytes_number(v.get("activation_fp32_bytes_per_token")),
                number(v.get("matmuls_per_block")),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def detail_lines(outcomes: list[Outcome]) -> list[str]:
    """Where the syncs and graph breaks are, and what the plan chose, row by row."""
    lines = []
    for o in outcomes:
        if o.note:
            continue
        d = o.details
        parts = [f"plan {json.dumps(d['plan'])}, mode {d['mode']}"]
        if d["sync_sites"]:
            parts.append("syncs in a step (rank 0, step 2): " + "; ".join(f"{k} x{v}" for k, v in d["sync_sites"].items()))
            parts.append(sync_position(d.get("syncs_before_optimizer_step"), sum(d["sync_sites"].values())))
        if d.get("uncompiled_forward_ops") is not None:
            ops = d["uncompiled_forward_ops"]
            parts.append("uncompiled in the forward: " + ("; ".join(f"{k} x{v}" for k, v in ops.items()) if ops else "nothing"))
        elif d.get("activations_measured") == "eager":
            parts.append("the forward runs uncompiled (the row is not compiled)")
        if d.get("activations_measured"):
            parts.append(saved_line(d["activations_measured"], d.get("activation_bytes_by_dtype") or {}))
        if d["eval_syncs"]:
            parts.append(
                f"eval pass: {d['eval_syncs']} syncs (" + "; ".join(f"{k} x{v}" for k, v in d["eval_sync_sites"].items()) + ")"
            )
        if d["graphs"] is not None:
            parts.append(f"{d['graphs']} graph(s) captured")
        if d["graph_break_reasons"]:
            parts.append("graph breaks: " + "; ".join(f"{k} x{v}" for k, v in d["graph_break_reasons"].items()))
        lines.append(f"- {o.row.name}: " + "; ".join(parts))
    return lines


def sync_position(before: int | None, total: int) -> str:
    """Where the step's syncs sit against its optimizer step."""
    if before is None:
        return "optimizer.step not called in the counted step"
    if before == total:
        return f"all {total} before optimizer.step: the device's queue drains before the update is issued"
    return f"{before} of {total} before optimizer.step, {total - before} after it was issued"


def saved_line(measured: str, by_kind: dict[str, dict[str, float] | None]) -> str:
    """What the forward keeps for backward, per token by dtype, eager and compiled (the row's columns: `measured`)."""
    parts = []
    for kind in ("eager", "compiled"):
        if per_dtype := by_kind.get(kind):
            parts.append(f"{kind} " + ", ".join(f"{dtype} {value:,.0f}" for dtype, value in per_dtype.items() if value >= 0.5))
    return f"saved for backward per token (columns: {measured}): " + "; ".join(parts)


def machine_line(device: str) -> str:
    if device == "cuda":
        import torch

        return machine_line_for(f"GPU {torch.cuda.get_device_name(0)}")
    return machine_line_for(f"CPU {cpu_model()}, {os.cpu_count()} cores, load average {load_average()} at the end")


def commit() -> str:
    result = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def report(outcomes: list[Outcome], args: argparse.Namespace, elapsed: float) -> str:
    command = "python benchmarks/efficiency.py " + " ".join(args.argv)
    return "\n".join(
        [
            f"# Efficiency: FLOPs, graph breaks, host syncs, collective bytes, saved activations ({args.label or 'this tree'})",
            "",
            machine_line(args.device),
            f"Tree: {commit()}. Command: `{command.strip()}`. Planned for a GPU of {args.plan_gpu_gib:.1f} GiB. "
            f"Compile backend: {args.compile_backend}. Total {elapsed:.0f} s.",
            "",
            *table(outcomes),
            "",
            "Per row:",
            "",
            *detail_lines(outcomes),
            "",
        ]
    )


def machine_slug(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0).lower().replace("nvidia ", "").replace(" ", "-")
    return f"cpu-{os.cpu_count()}core"
