"""benchmarks/harness.py, what the launcher benchmarks (launcher.py, multinode.py) share: finding
and killing a run's processes by their marker, counting survivors, the ratio column; and both
benchmarks still start as the docs run them."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from support.processes import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import harness  # noqa: E402


def test_the_ratio_is_ours_over_theirs_by_median_and_a_bound_where_every_torchrun_run_timed_out():
    assert harness.ratio([1.0, 2.0, 9.0], [4.0, 4.0]) == "0.5"
    assert harness.ratio([], [4.0]) == "—" and harness.ratio([1.0], [0.0]) == "—"
    assert harness.ratio([1.0], []) == "—"  # no timeout: nothing to bound by
    assert harness.ratio([1.0, 3.0], [], timeout=40.0) == "< 0.05"


def test_killing_a_run_ends_every_process_with_its_marker_prefix_and_no_other():
    run = uuid.uuid4().hex
    markers = [f"{run}.0", f"{run}.1", uuid.uuid4().hex]
    procs = [subprocess.Popen(["sleep", "30"], env={**os.environ, harness.MARKER_VAR: m}) for m in markers]
    try:
        assert sorted(harness.marked_pids(lambda m: m.startswith(run))) == sorted(p.pid for p in procs[:2])
        harness.kill_marked(run)
        assert [p.wait(timeout=10) for p in procs[:2]] == [-9, -9]
        assert harness.count_survivors(markers[:2]) == 0
        assert procs[2].poll() is None and harness.count_survivors({markers[2]}) == 1
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("script", ["launcher.py", "multinode.py"])
def test_each_launcher_benchmark_run_as_a_script_answers_help(script):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "--repeat" in result.stdout and "--quick" in result.stdout


def test_a_benchmark_unwinds_on_sigterm_also_when_the_signal_lands_in_a_finalizer():
    code = (
        "import signal, sys, time\n"
        "from benchmarks.harness import unwind_on_signals\n"
        "unwind_on_signals()\n"
        "class Finalized:\n"
        "    def __del__(self):\n"
        "        signal.raise_signal(signal.SIGTERM)  # Python drops what the handler raises here\n"
        "try:\n"
        "    Finalized()\n"
        "    time.sleep(30)\n"
        "finally:\n"
        "    print('cleaned up', flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (143, "cleaned up\n"), result.stderr
