"""benchmarks/features.py: AdamW vs Muon, dense vs MoE, as a table (a short run of each)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, launcher_env


@pytest.mark.slow
def test_the_features_benchmark_prints_one_row_per_combination_with_its_speed_and_loss():
    result = subprocess.run(
        [sys.executable, "benchmarks/features.py", "--steps", "4"],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row[0].lstrip("| ") for row in rows] == ["AdamW, dense", "Muon, dense", "AdamW, MoE 4x top-2", "Muon, MoE 4x top-2"]
    assert all(float(row[1].replace(",", "")) > 0 for row in rows)
    assert rows[0][2] == "1.00x"
