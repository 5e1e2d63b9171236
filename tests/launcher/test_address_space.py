"""Too little address space (`ulimit -v`) for the launcher or the setup: one line naming the limit
and the fix, exit 2, no traceback, wherever in the start-up it runs out (launcher/address_space.py)."""

from __future__ import annotations

import errno
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import ROOT, launcher_env
from support.runs import run_in_process
from launcher import address_space
from launcher import cli
from launcher.processes.worker import StartError

KIB = 1024


def under_limit(kib: int):
    """A preexec_fn: the child's address space limited as `ulimit -v kib` does."""
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (kib * KIB, kib * KIB))


def refusal_line(kib: int) -> str:
    return (
        f"launcher: error: not enough address space to start: ulimit -v is {kib} KiB (RLIMIT_AS, {kib * KIB >> 20} MiB); "
        "raise it (ulimit -v unlimited)\n"
    )


@pytest.mark.parametrize("kib", [30000, 100000])
def test_the_launcher_under_a_small_ulimit_v_says_so_in_one_line_and_exits_2(kib, tmp_path):
    # 30000 KiB runs out while importing, 100000 where numpy (OpenBLAS) would load for the dataset.
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--debug", "--device", "cpu", "--run-dir", str(tmp_path / "r")]
        + ["--set", f"data.cache_dir={tmp_path / 'cache'}"],
        cwd=ROOT,
        env=launcher_env(),
        preexec_fn=under_limit(kib),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == refusal_line(kib)
    assert not (tmp_path / "r").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("kib", "nproc"), [(700000, 2), (1000000, 2), (700000, 1)])
def test_a_ulimit_v_too_small_for_a_training_worker_is_refused_in_one_line_before_any_starts(kib, nproc, tmp_path):
    # Measured here: the launcher starts under these limits, and each worker used to fail with a
    # traceback of 64 lines (MemoryError while importing torch._dynamo, or torch's allocator).
    launch = [sys.executable, "-m", "launcher", "--debug", "--device", "cpu", "--nproc", str(nproc), "--max-steps", "1"]
    launch += ["--run-dir", str(tmp_path / "r"), "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    result = subprocess.run(
        ["bash", "-c", f'ulimit -v {kib} && exec "$@"', "bash", *launch],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    needs = "alone needs more than 736 MiB" if nproc == 1 else "beside other ranks needs more than 980 MiB"
    assert result.stderr == (
        f"launcher: error: not enough address space for the training workers: ulimit -v is {kib} KiB "
        f"(RLIMIT_AS, {kib * KIB >> 20} MiB), which every worker inherits, and one {needs}; raise it (ulimit -v unlimited)\n"
    )
    assert "CPU0:" not in result.stdout  # no worker started
    assert not (tmp_path / "r").exists() and not (tmp_path / "cache").exists()


def test_a_ulimit_v_a_training_worker_can_train_in_is_not_refused(monkeypatch):
    monkeypatch.setattr(address_space, "address_space_limit", lambda: 800000 * KIB)  # measured: one worker trains
    assert address_space.too_small_for_workers(1) is None
    monkeypatch.setattr(address_space, "address_space_limit", lambda: 1050000 * KIB)  # and two
    assert address_space.too_small_for_workers(2) is None
    monkeypatch.setattr(address_space, "address_space_limit", lambda: None)
    assert address_space.too_small_for_workers(8) is None


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("can't start new thread"),
        MemoryError(),
        StartError("python", OSError(errno.ENOMEM, "Cannot allocate memory"), "CPU0"),
        OSError(errno.ENOMEM, "Cannot allocate memory"),
        ImportError("libtorch_cpu.so: failed to map segment from shared object"),
    ],
)
def test_running_out_later_in_the_launchers_own_code_is_the_same_one_line(error, monkeypatch, capsys):
    monkeypatch.setattr(address_space, "address_space_limit", lambda: 700000 * KIB)

    def run(argv):
        raise error

    monkeypatch.setattr(cli, "run", run)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # else main ends this process with os._exit
    result = run_in_process(lambda argv: cli.main(argv), [], capsys)
    assert (result.returncode, result.stderr) == (2, refusal_line(700000))


def test_other_runtime_errors_are_not_taken_for_a_lack_of_memory(monkeypatch):
    monkeypatch.setattr(address_space, "address_space_limit", lambda: 700000 * KIB)
    assert not address_space.is_out_of_memory(RuntimeError("dictionary changed size during iteration"))
    assert not address_space.is_out_of_memory(OSError(errno.EACCES, "Permission denied"))
    monkeypatch.setattr(address_space, "address_space_limit", lambda: None)
    assert not address_space.is_out_of_memory(SystemError("returned NULL without setting an exception"))


def test_numpy_is_not_loaded_where_its_address_space_is_not_left_and_openblas_gets_one_thread(monkeypatch):
    monkeypatch.delitem(sys.modules, "numpy", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setattr(address_space, "address_space_limit", lambda: 200 << 20)
    monkeypatch.setattr(address_space, "address_space_in_use", lambda: 150 << 20)
    with pytest.raises(MemoryError), address_space.loading_numpy():
        pass
    monkeypatch.setattr(address_space, "address_space_in_use", lambda: 50 << 20)
    with address_space.loading_numpy():
        assert address_space.os.environ["OPENBLAS_NUM_THREADS"] == "1"
    assert "OPENBLAS_NUM_THREADS" not in address_space.os.environ  # the workers get the environment as it was


def test_setup_under_a_ulimit_v_too_small_for_python_says_so_in_one_line_and_installs_nothing(tmp_path):
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copy(ROOT / "requirements.txt", tmp_path / "requirements.txt")
    script = f'ulimit -v 8000; source "{tmp_path}/scripts/setup.sh" && setup_python "{tmp_path}" "{tmp_path}/requirements.txt"'
    result = subprocess.run(
        ["bash", "-c", script],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr == (
        "setup: error: not enough address space to start Python: ulimit -v is 8000 KiB; raise it (ulimit -v unlimited)\n"
    )
    assert not Path(tmp_path / ".venv").exists()
