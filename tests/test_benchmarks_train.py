"""The training benchmark's smoke run prints both of its tables, with real numbers in them."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # a real (if short) benchmark run: about 7 s

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
