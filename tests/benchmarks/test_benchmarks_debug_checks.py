"""The debug-checks benchmark's smoke run prints one row per setting, with real numbers in them."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from support.processes import ROOT
from test_benchmarks_train import NUMBER, markdown_tables, number

pytestmark = pytest.mark.slow  # a real (if short) benchmark run of every debug setting


def test_the_quick_benchmark_prints_the_step_time_of_each_debug_setting_against_off(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/debug_checks.py", "--quick", "--cache-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("Machine: CPU ") and "; torch " in result.stdout.splitlines()[0]
    (table,) = markdown_tables(result.stdout)

    assert [row["setting"] for row in table] == ["off", "checks", "trace"]
    for row in table:
        assert row["config"].startswith("debug")
        ms, steps_per_s = number(row["ms/step (median)"]), number(row["steps/s"])
        assert ms > 0 and steps_per_s > 0
        assert abs(steps_per_s - 1000 / ms) <= 0.006 + 60 / ms**2  # the same median, shown rounded
        assert re.fullmatch(r"[+-]\d+\.\d%", row["overhead vs off"])
        assert re.fullmatch(rf"{NUMBER}–{NUMBER}", row["spread (ms/step)"])
    off = table[0]
    assert off["overhead vs off"] in ("+0.0%", "0.0%", "-0.0%")  # the baseline against itself
    # The three settings train the same steps from the same seed: the checks must not change the result.
    (loss_header,) = [key for key in off if key.startswith("loss after step")]
    assert len({row[loss_header] for row in table}) == 1 and number(off[loss_header]) > 0
