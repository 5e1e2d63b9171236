"""Thread-count variables (pretrain/run/thread_env.py): refused in one line by the launcher and by
`python -m pretrain` before anything starts, instead of a libgomp warning and a slow run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.processes import ROOT, launcher_env
from support.runs import assert_one_line_error
from pretrain.run.thread_env import bad_thread_variable

FIX = "set it to a whole number from 1 to 65536 (export OMP_NUM_THREADS=4) or unset it (unset OMP_NUM_THREADS)"


@pytest.mark.parametrize("value", ["4", " 2", "2 ", "08", "4,2", "65536"])
def test_thread_counts_openmp_takes_are_accepted(value):
    assert bad_thread_variable({"OMP_NUM_THREADS": value}) is None


@pytest.mark.parametrize("value", ["abc", "", "0", "-1", "2.5", "4,", "65537", "99999999999999999999", "²"])
def test_values_that_are_not_a_number_of_threads_are_refused_naming_variable_value_and_fix(value):
    assert bad_thread_variable({"OMP_NUM_THREADS": value}) == f"OMP_NUM_THREADS={value!r} is not a number of threads; {FIX}"


@pytest.mark.parametrize("name", ["MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"])
def test_the_other_thread_variables_take_one_count_only(name):
    assert bad_thread_variable({name: "3"}) is None
    assert bad_thread_variable({name: "4,2"}) == (
        f"{name}='4,2' is not a number of threads; "
        f"set it to a whole number from 1 to 65536 (export {name}=4) or unset it (unset {name})"
    )


def test_the_launcher_refuses_omp_num_threads_abc_before_it_spawns_anything(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--device", "cpu", "--nproc", "2", "--run-dir", str(tmp_path / "r"), "--", "true"],
        cwd=ROOT,
        env=launcher_env(OMP_NUM_THREADS="abc"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_line_error(result, f"OMP_NUM_THREADS='abc' is not a number of threads; {FIX}", prefix="launcher: error: ")
    assert not (tmp_path / "r").exists()


def test_python_m_pretrain_alone_refuses_omp_num_threads_abc_before_torch_loads(tmp_path):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pretrain", "--debug", "--run-dir", str(tmp_path / "r")],
        cwd=ROOT,
        env=launcher_env(OMP_NUM_THREADS="abc"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    refusal = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert refusal == [f"pretrain: error: OMP_NUM_THREADS='abc' is not a number of threads; {FIX}"]
    assert "| torch\n" not in result.stderr  # refused before torch (and libgomp) loaded
    assert not (tmp_path / "r").exists()
