"""tests/support/cpu_cost.py: `--cpu-cost=N` lists the tests that cost the most CPU, the processes
they started included, in order; without the option nothing is measured or printed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SPENDING_TESTS = textwrap.dedent(
    """\
    import subprocess, sys, time

    BUSY = "import time\\nend = time.process_time() + {seconds}\\nwhile time.process_time() < end: pass"

    def test_a_test_whose_process_spends_half_a_second():
        subprocess.run([sys.executable, "-c", BUSY.format(seconds=0.5)], check=True)

    def test_a_test_that_spends_a_quarter_second_itself():
        end = time.process_time() + 0.25
        while time.process_time() < end:
            pass

    def test_an_idle_test():
        pass
    """
)


def run_pytest(tmp_path: Path, *options: str) -> list[str]:
    (tmp_path / "test_spending.py").write_text(SPENDING_TESTS)
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    env.pop("PYTEST_ADDOPTS", None)  # this run's own options (PYTEST_ADDOPTS=--cpu-cost=30 bash .ci/run) are not the inner run's
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "support.cpu_cost", *options, "test_spending.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


def test_the_report_ranks_tests_by_their_cpu_with_what_their_processes_spent(tmp_path):
    lines = run_pytest(tmp_path, "--cpu-cost=2")
    header = next(i for i, line in enumerate(lines) if "CPU: 3 tests" in line)
    assert "the 2 that cost the most" in lines[header]
    assert lines[header + 1].split()[:3] == ["total", "started", "test"]
    first, second = lines[header + 2].split(), lines[header + 3].split()
    assert first[-1].endswith("::test_a_test_whose_process_spends_half_a_second")
    assert float(first[0]) >= 0.5 and float(first[1]) >= 0.5  # its child's half second counts
    assert second[-1].endswith("::test_a_test_that_spends_a_quarter_second_itself")
    assert 0.25 <= float(second[0]) < float(first[0]) and float(second[1]) < 0.1  # its own, not in a child
    assert not any("test_an_idle_test" in line for line in lines[header:])  # only the 2 asked for


def test_without_the_option_nothing_is_reported(tmp_path):
    assert not any("CPU:" in line for line in run_pytest(tmp_path))
