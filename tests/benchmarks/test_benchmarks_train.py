"""The training benchmark's smoke run prints both of its tables, with real numbers in them, and
with --profile a third: where its steps' time goes."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from support.processes import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks.step_profile import KINDS  # noqa: E402

pytestmark = pytest.mark.slow  # real (if short) benchmark runs: about 7 s each

NUMBER = r"\d[\d,]*(\.\d+)?"


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in text, as rows keyed by the header's cells."""
    tables, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip("|").split("|")])
        elif block:
            header, _separator, *rows = block
            tables.append([dict(zip(header, row, strict=True)) for row in rows])
            block = []
    return tables


def number(cell: str) -> float:
    assert re.fullmatch(NUMBER, cell), f"not a number: {cell!r}"
    return float(cell.replace(",", ""))


def rounding(cell: str) -> float:
    """How far a printed number may be from the value it shows: half a unit of its last digit."""
    decimals = len(cell.split(".")[1]) if "." in cell else 0
    return 0.5 * 10.0**-decimals


def test_the_quick_benchmark_prints_a_throughput_table_and_a_cross_entropy_memory_table(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/train.py", "--quick", "--cache-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("Machine: CPU ")
    training, cross_entropy = markdown_tables(result.stdout)

    (row,) = training
    assert row["config"].startswith("debug") and row["compile"] == "off" and row["precision"] == "fp32"
    assert re.fullmatch(rf"{NUMBER} M \({NUMBER}\)", row["parameters"])
    batch, context = map(int, row["batch x context"].split(" x "))
    steps_per_s, tokens_per_s = number(row["steps/s"]), number(row["tokens/s"])
    assert steps_per_s > 0
    # tokens/s counts what a step trains: equal but for the rounding of each printed figure
    # (steps/s to 0.01, which is several percent of a slow machine's figure).
    slack = rounding(row["tokens/s"]) + rounding(row["steps/s"]) * batch * context
    assert abs(tokens_per_s - steps_per_s * batch * context) <= slack * (1 + 1e-9), row
    assert re.fullmatch(rf"(≤ )?{NUMBER} (MiB|GiB)", row["peak memory"])
    assert number(row["warm-up (s)"]) >= 0  # shown to 0.1 s: a fast machine warms up in less

    assert [r["chunk (tokens)"] for r in cross_entropy] == ["0 (whole batch)", "128"]
    for r in cross_entropy:
        assert re.fullmatch(rf"(≤ )?{NUMBER} (MiB|GiB)", r["peak memory"])
        assert re.fullmatch(rf"{NUMBER} (ms|s)", r["time per fwd+bwd"])
    # The same inputs in each row's process: chunking must not change the loss.
    losses = {r["loss"] for r in cross_entropy}
    assert len(losses) == 1 and number(losses.pop()) > 0


def test_with_profile_it_prints_where_the_steps_time_goes_and_writes_it_to_the_json(tmp_path):
    report = tmp_path / "train.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/train.py", "--quick", "--profile", "2", "--ce-chunks", "0", "--cache-dir", str(tmp_path)]
        + ["--json", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Where the time goes, debug, compile off: 2 step(s) under torch.profiler" in result.stdout
    _training, _cross_entropy, profile = markdown_tables(result.stdout)
    *kinds, total = profile
    assert [r["kind"] for r in kinds] == list(KINDS) and total["kind"] == "step"
    shares = [number(r["share"].rstrip("%")) for r in kinds]
    assert abs(sum(shares) - 100) <= sum(rounding(r["share"].rstrip("%")) for r in kinds)
    ms = [number(r["ms per step"]) for r in kinds]
    assert abs(sum(ms) - number(total["ms per step"])) <= sum(rounding(r["ms per step"]) for r in profile)
    assert number(kinds[KINDS.index("matmuls")]["ms per step"]) > 0  # a CPU step's matmuls are aten::mm
    saved = json.loads(report.read_text())
    (row,) = saved["training"]
    assert row["job"]["profile"] == 2 and row["result"]["profile"]["steps"] == 2
    assert sum(row["result"]["profile"]["shares"].values()) == pytest.approx(100)
