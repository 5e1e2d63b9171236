"""What benchmarks/checkpoints.py reads from a finished run and how it reports it: the per-save
records of metrics.jsonl, a run's goodput.json, the medians, the two Markdown tables and the JSON.

Nothing here starts a process: every function takes a run directory's files or what was read from
them, so tests/benchmarks/test_benchmarks_checkpoints.py checks it on written files."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Mode = Literal["sync", "async"]
STALL_TARGET = 0.10
"""The issue's bar: the asynchronous stall at most 10% of the synchronous one (small, 2 ranks)."""
TRAINED_LINE = re.compile(r"Training complete: (\d+) steps in ([\d.]+)s")
"""Rank 0's last line (pretrain/train.py fit): the steps this attempt trained and their seconds."""
RESUMED_LINE = re.compile(r"Resumed from \S+ at step (\d+)")
"""A worker's line when it resumes (pretrain/train.py); the launcher's summary quotes are skipped."""
PARTS = ("productive", "redone", "startup", "checkpoint_stall", "evaluation", "restart", "other")
"""goodput.json's parts_s, in the issue's order."""
STALL_HEADER = [
    "preset",
    "parallelism",
    "ranks",
    "mode",
    "saves",
    "first save's stall (s)",
    "stall per save (s)",
    "write per save (s)",
    "async / sync stall",
    "training (s)",
]
GOODPUT_HEADER = ["run", "exit", "resumed from", "wall (s)", "goodput", *(f"{part} (s)" for part in PARTS), "parts / wall"]


@dataclass(frozen=True)
class Save:
    """One completed save as rank 0 logged it in metrics.jsonl (MetricsLog.log_checkpoint)."""

    step: int
    tier: str
    is_async: bool
    stall_s: float
    """Seconds the training thread was blocked for this save (staging, waiting for the previous one)."""
    write_s: float
    """Seconds from the start of staging to the save's completion."""


def saves_in(lines: Iterable[str]) -> list[Save]:
    """The per-save records among metrics.jsonl's lines, in order. A record is
    {"checkpoint": {"step", "tier", "async", "stall_s", "write_s", ...}}; a line that does not
    parse (a killed writer's half line) or is another kind is skipped."""
    saves = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        fields = record.get("checkpoint") if isinstance(record, dict) else None
        if not isinstance(fields, dict):
            continue
        try:
            saves.append(
                Save(
                    int(fields["step"]),
                    str(fields.get("tier", "durable")),
                    bool(fields["async"]),
                    float(fields["stall_s"]),
                    float(fields["write_s"]),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue
    return saves


def read_saves(run_dir: Path) -> list[Save]:
    path = run_dir / "metrics.jsonl"
    return saves_in(path.read_text().splitlines()) if path.exists() else []


@dataclass(frozen=True)
class StallResult:
    """One stall run's outcome: a row of the first table."""

    preset: str
    parallelism: str
    ranks: int
    mode: Mode
    exit_code: int | None
    """None: killed at the timeout."""
    saves: list[Save] = field(default_factory=list)
    """The periodic saves: the end-of-run save (every run waits for it, async or not) left out.
    The first is set apart (it may pay once-per-run costs: the staging buffers, where not made
    ahead); the medians take the rest."""
    trained_s: float | None = None
    """The training loop's seconds (rank 0's "Training complete" line): steps, saves and evaluations."""
    warning: str = ""
    """Why the row is doubtful: the run failed, no save was recorded, or a save's mode is not the row's."""

    @property
    def steady(self) -> list[Save]:
        """The saves the medians take: all but the first, unless it is the only one."""
        return self.saves[1:] or self.saves

    @property
    def first_stall_s(self) -> float | None:
        return self.saves[0].stall_s if self.saves else None

    @property
    def stall_s(self) -> float | None:
        return statistics.median(s.stall_s for s in self.steady) if self.saves else None

    @property
    def write_s(self) -> float | None:
        return statistics.median(s.write_s for s in self.steady) if self.saves else None

    def row(self) -> dict[str, Any]:
        """The --json row: the issue's keys, then the saves behind the medians."""
        return {
            "preset": self.preset,
            "parallelism": self.parallelism,
            "ranks": self.ranks,
            "mode": self.mode,
            "stall_s": self.stall_s,
            "write_s": self.write_s,
            "first_stall_s": self.first_stall_s,
            "saves": [{"step": s.step, "stall_s": s.stall_s, "write_s": s.write_s, "async": s.is_async} for s in self.saves],
            "trained_s": self.trained_s,
            "exit_code": self.exit_code,
            **({"warning": self.warning} if self.warning else {}),
        }


def periodic(saves: Sequence[Save], max_steps: int, mode: Mode) -> tuple[list[Save], str]:
    """The saves the medians take (the durable ones before the last step: the end of the run waits
    for its save in either mode) and a warning when a save ran in the other mode than asked."""
    kept = [s for s in saves if s.step < max_steps and s.tier == "durable"]
    wrong = [s.step for s in kept if s.is_async != (mode == "async")]
    warning = f"save(s) at step {', '.join(map(str, wrong))} ran {'sync' if mode == 'async' else 'async'}" if wrong else ""
    return kept, warning


def trained_seconds(output: str) -> float | None:
    """The training loop's seconds from rank 0's (else any rank's) "Training complete" line."""
    found = [(line, match) for line in output.splitlines() if (match := TRAINED_LINE.search(line))]
    rank0 = [match for line, match in found if "[CPU 0]" in line or "[GPU 0]" in line]
    chosen = rank0 or [match for _, match in found]
    return float(chosen[-1][2]) if chosen else None


def resumed_steps(output: str) -> list[int]:
    """The step each restart resumed at, once per attempt (one worker's lines: the first rank seen)."""
    steps: list[int] = []
    prefix = None
    for line in output.splitlines():
        if line.startswith("launcher:") or not (match := RESUMED_LINE.search(line)):
            continue
        worker = line.split("|", 1)[0]
        prefix = prefix or worker
        if worker == prefix:
            steps.append(int(match[1]))
    return steps


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "—" if value is None else f"{value:{spec}}"


def ratio_of(result: StallResult, results: Sequence[StallResult]) -> float | None:
    """An async row's median stall over its sync twin's (same preset, parallelism, ranks)."""
    if result.mode != "async" or result.stall_s is None:
        return None
    for other in results:
        if (other.preset, other.parallelism, other.ranks, other.mode) == (
            result.preset,
            result.parallelism,
            result.ranks,
            "sync",
        ):
            return result.stall_s / other.stall_s if other.stall_s else None
    return None


def stall_cells(result: StallResult, results: Sequence[StallResult]) -> list[str]:
    saves = result.steady
    spread = lambda values: f" ({min(values):.3f}–{max(values):.3f})" if len(values) > 1 else ""  # noqa: E731
    ratio = ratio_of(result, results)
    exit_note = "" if result.exit_code == 0 else f"; exit {'timeout' if result.exit_code is None else result.exit_code}"
    return [
        result.preset,
        result.parallelism,
        str(result.ranks),
        result.mode + (f" ({result.warning})" if result.warning else ""),
        f"{len(result.saves)}{exit_note}",
        fmt(result.first_stall_s),
        fmt(result.stall_s) + spread([s.stall_s for s in saves]),
        fmt(result.write_s) + spread([s.write_s for s in saves]),
        "—" if ratio is None else f"{ratio:.1%}" + ("" if ratio <= STALL_TARGET else " (above 10%)"),
        fmt(result.trained_s, ".1f"),
    ]


@dataclass(frozen=True)
class GoodputResult:
    """One faulted debug run's outcome: a row of the second table."""

    label: str
    local_tier: bool
    exit_code: int | None
    goodput: dict[str, Any] | None
    """goodput.json as the run left it (None: none written)."""
    resumed_from: list[int] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {
            "run": self.label,
            "local_tier": self.local_tier,
            "exit_code": self.exit_code,
            "resumed_from": self.resumed_from,
            **({} if self.goodput is None else {key: self.goodput.get(key) for key in ("wall_s", "goodput", "parts_s")}),
        }


def read_goodput(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "goodput.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def goodput_cells(result: GoodputResult) -> list[str]:
    data = result.goodput or {}
    parts = data.get("parts_s") or {}
    wall = data.get("wall_s")
    total = sum(v for v in parts.values() if isinstance(v, int | float))
    return [
        result.label,
        "timeout" if result.exit_code is None else str(result.exit_code),
        ", ".join(f"step_{s}" if s else "step 0" for s in result.resumed_from) or "—",
        fmt(wall, ".1f"),
        "—" if data.get("goodput") is None else f"{data['goodput']:.1%}",
        *(fmt(parts.get(part), ".1f") for part in PARTS),
        f"{total / wall:.3f}" if wall else "—",
    ]


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(row) + " |" for row in rows)]


def verdict(results: Sequence[StallResult]) -> str:
    """The Done-when line: each small 2-rank async row's stall against its sync one's."""
    lines = []
    for result in results:
        if result.preset == "small" and result.ranks == 2 and (ratio := ratio_of(result, results)) is not None:
            met = "met" if ratio <= STALL_TARGET else "NOT met"
            lines.append(f"{result.parallelism}: {ratio:.1%} ({met})")
    return "Async stall / sync stall, `small` on 2 ranks (target at most 10%): " + ("; ".join(lines) or "not measured") + "."


def json_report(stalls: Sequence[StallResult], goodputs: Sequence[GoodputResult], meta: dict[str, Any]) -> dict[str, Any]:
    return {"rows": [r.row() for r in stalls], "goodput": [g.row() for g in goodputs], **meta}
