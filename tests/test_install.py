"""Installability: the runs and cache roots, PYTHONPATH for our workers and the user's, the line
naming the run directory, and an installed copy's console commands run from another directory."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from support.processes import ROOT, launcher_env
from support.runs import run_launcher
from launcher import cli, launch
from launcher.compile_cache import kernel_cache_dir
from launcher.gpus.placement import Placement
from launcher.processes.worker import with_package_root, without_package_root
from pretrain import config as cfg
from pretrain.run.files import CACHE_DIR_VAR, PACKAGE_ROOT, RUNS_DIR_VAR, cache_path, cache_root, create_run_dir, runs_root
from pretrain.run.shared_cache import user_name

CONSOLE_COMMANDS = [
    "pretrain-launch",
    "pretrain-prepare",
    "pretrain-generate",
    "pretrain-export",
    "pretrain-plot",
    "pretrain-evaluate",
]
# A generic worker's report: its PYTHONPATH, and whether this project's packages are importable.
WHAT_THE_USER_SEES = (
    "import importlib.util, os; print('pythonpath', os.environ.get('PYTHONPATH'));"
    "print('importable', importlib.util.find_spec('launcher') is not None)"
)


@pytest.fixture
def no_roots(monkeypatch, tmp_path):
    """A current directory of the test's own and neither root variable set (restored after the
    test even where the launcher's options set them: setenv records what to restore, delenv of a
    variable that is not set records nothing). TORCHINDUCTOR_CACHE_DIR too: a user's value wins
    over the cache root's, and torch sets it in this process once an earlier test compiles."""
    for variable in (RUNS_DIR_VAR, CACHE_DIR_VAR, "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def last_line(out: str) -> str:
    return out.rstrip("\n").splitlines()[-1]


# --- the roots --------------------------------------------------------------------------


def test_runs_and_cache_default_to_the_current_directory(no_roots):
    assert runs_root() == no_roots / "runs"
    assert cache_root() == no_roots / "cache"
    assert create_run_dir(None).parent == no_roots / "runs"


def test_the_environment_moves_the_roots_and_a_relative_value_is_from_the_current_directory(no_roots, monkeypatch):
    monkeypatch.setenv(RUNS_DIR_VAR, "elsewhere/runs")
    monkeypatch.setenv(CACHE_DIR_VAR, str(no_roots / "scratch"))
    assert runs_root() == no_roots / "elsewhere" / "runs"
    assert cache_root() == no_roots / "scratch"


def test_the_default_data_cache_dir_is_under_the_cache_root_and_an_absolute_one_is_kept(no_roots, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_VAR, str(no_roots / "scratch"))
    assert cache_path("cache/datasets") == no_roots / "scratch" / "datasets"
    assert cache_path("mine") == no_roots / "scratch" / "mine"
    assert cache_path(no_roots / "abs") == no_roots / "abs"


def test_launcher_options_set_the_roots_its_training_workers_get_absolute(no_roots, monkeypatch):
    cli.set_roots("r", "c")  # as --runs-dir r --cache-dir c
    assert os.environ[RUNS_DIR_VAR] == str(no_roots / "r") and os.environ[CACHE_DIR_VAR] == str(no_roots / "c")
    monkeypatch.chdir("/")  # the workers agree with the launcher wherever they run
    config = cfg.Config()
    kernels = kernel_cache_dir(
        dataclasses.replace(config, training=dataclasses.replace(config.training, compile=True)), "cpu", print
    )
    (worker,) = launch.make_workers(Placement("cpu", 1), ["true"], training=True, compile_cache=kernels)
    assert worker.env[RUNS_DIR_VAR] == str(no_roots / "r")
    assert worker.env[CACHE_DIR_VAR] == str(no_roots / "c")
    assert worker.env["TORCHINDUCTOR_CACHE_DIR"] == str(no_roots / "c" / f"inductor-{user_name(os.geteuid())}")


def test_an_empty_root_option_is_a_one_line_usage_error(no_roots):
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--runs-dir", "", "--", "true"],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr == "launcher: error: --runs-dir must not be empty; leave it out for the default\n"


# --- PYTHONPATH -------------------------------------------------------------------------


def test_the_users_command_gets_their_pythonpath_without_this_project(tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "mine"), str(PACKAGE_ROOT), str(tmp_path / "theirs")])}
    assert without_package_root(env, PACKAGE_ROOT) == {
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "mine"), str(tmp_path / "theirs")])
    }
    assert without_package_root({"PYTHONPATH": str(PACKAGE_ROOT) + "/"}, PACKAGE_ROOT) == {}


def test_our_training_workers_find_a_clone_on_pythonpath_once(tmp_path):
    clone = tmp_path / "clone"
    assert with_package_root({}, clone) == {"PYTHONPATH": str(clone)}
    assert with_package_root({"PYTHONPATH": "/x"}, clone) == {"PYTHONPATH": f"{clone}{os.pathsep}/x"}
    assert with_package_root({"PYTHONPATH": f"/x{os.pathsep}{clone}"}, clone) == {"PYTHONPATH": f"/x{os.pathsep}{clone}"}


def test_generic_workers_from_a_clone_do_not_see_its_packages(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "--device",
            "cpu",
            "--nproc",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
            "--",
            sys.executable,
            "-c",
            WHAT_THE_USER_SEES,
        ],
        cwd=tmp_path,
        env=launcher_env() | {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path / 'mine'}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"CPU0:pythonpath {tmp_path / 'mine'}" in result.stdout.splitlines()
    assert "CPU0:importable False" in result.stdout.splitlines()


# --- the last line ----------------------------------------------------------------------


@pytest.mark.parametrize("code", [0, 3])
def test_a_generic_run_ends_with_a_line_naming_its_run_directory(tmp_path, code):
    result = run_launcher(
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        "--",
        sys.executable,
        "-c",
        f"raise SystemExit({code})",
    )
    assert result.returncode == code, result.stderr
    assert last_line(result.stdout) == f"launcher: run directory: {tmp_path / 'run'}"


# --- from a clone, in another directory ---------------------------------------------------


@pytest.mark.slow
def test_run_training_sh_from_another_directory_keeps_runs_in_the_clone_unless_told(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (RUNS_DIR_VAR, CACHE_DIR_VAR, "PYTHONPATH")}
    argv = ["bash", str(ROOT / "run_training.sh"), "--device", "cpu", "--nproc", "1", "--", "true"]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    run_dir = Path(last_line(result.stdout).removeprefix("launcher: run directory: "))
    try:
        assert run_dir.parent == ROOT / "runs"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    told = subprocess.run(
        argv, cwd=tmp_path, env=env | {RUNS_DIR_VAR: str(tmp_path / "mine")}, capture_output=True, text=True, timeout=120
    )
    assert told.returncode == 0, told.stderr
    assert Path(last_line(told.stdout).removeprefix("launcher: run directory: ")).parent == tmp_path / "mine"


# --- installed --------------------------------------------------------------------------


def copy_of_the_project(destination: Path) -> Path:
    """What pip needs to build the package, outside the clone (an in-tree build writes there)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("launcher", "pretrain"):
        shutil.copytree(ROOT / name, destination / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "requirements.txt", "requirements-dev.txt"):
        shutil.copy(ROOT / name, destination / name)
    return destination


def new_environment(where: Path) -> Path:
    """A fresh virtual environment that borrows this one's packages (torch, pip, setuptools: there
    is no network) through a .pth file, and so holds this project only once it is installed."""
    venv.EnvBuilder(with_pip=False).create(where)
    site = where / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    borrowed = [p for p in sys.path if p.endswith("site-packages") and Path(p).resolve() != ROOT]
    (site / "borrowed.pth").write_text("\n".join(borrowed) + "\n")
    return where / "bin"


def pip_install(bin_dir: Path, *args: str) -> None:
    result = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin directory of an environment where `pip install .` installed this project."""
    base = tmp_path_factory.mktemp("installed")
    bin_dir = new_environment(base / "venv")
    pip_install(bin_dir, str(copy_of_the_project(base / "src")))
    return bin_dir


def run_installed(bin_dir: Path, command: str, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", RUNS_DIR_VAR, CACHE_DIR_VAR)}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"  # as an activated environment has it
    return subprocess.run([str(bin_dir / command), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_pip_install_gives_every_console_command_and_the_worker_module(installed, tmp_path):
    assert sorted(p.name for p in installed.glob("pretrain-*")) == sorted(CONSOLE_COMMANDS)
    for command in CONSOLE_COMMANDS:
        helped = run_installed(installed, command, "--help", cwd=tmp_path)
        assert helped.returncode == 0 and helped.stdout.startswith(f"usage: {command} "), (command, helped.stdout[:200])
    worker = run_installed(installed, "python", "-m", "pretrain", "--help", cwd=tmp_path)
    assert worker.returncode == 0 and worker.stdout.startswith("usage: python -m pretrain"), worker.stderr
    assert run_installed(installed, "pretrain-launch", "--help", cwd=tmp_path).stdout.startswith("usage: pretrain-launch")


@pytest.mark.slow
def test_the_installed_launcher_trains_the_debug_preset_from_another_directory(installed, tmp_path):
    result = run_installed(installed, "pretrain-launch", "--debug", "--max-steps", "2", "--nproc", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    *_, where, goodput = result.stdout.splitlines()  # a training run's last line is its goodput (docs/failures.md#goodput)
    assert where == f"launcher: run directory: {run_dir}" and goodput.startswith("launcher: goodput ")
    assert (run_dir / "checkpoints" / "step_2").is_dir() and (run_dir / "logs" / "cpu1.log").is_file()
    assert any((tmp_path / "cache" / "datasets").iterdir())
    assert "Training complete: 2 steps" in (run_dir / "logs" / "cpu0.log").read_text()


@pytest.mark.slow
def test_the_installed_launcher_runs_a_generic_command_without_this_projects_packages(installed, tmp_path):
    python = installed / "python"  # the installed environment's own: the project is importable there
    result = run_installed(
        installed,
        "pretrain-launch",
        "--device",
        "cpu",
        "--nproc",
        "1",
        "--",
        str(python),
        "-c",
        WHAT_THE_USER_SEES,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "CPU0:pythonpath None" in lines and "CPU0:importable True" in lines  # installed: site-packages, not us
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert lines[-1] == f"launcher: run directory: {run_dir}"


@pytest.mark.slow
def test_the_installed_preparation_command_caches_in_the_current_directory(installed, tmp_path):
    result = run_installed(installed, "pretrain-prepare", "--debug", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"{tmp_path / 'cache' / 'datasets'}/builtin-" in result.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_the_installed_launchers_guardian_runs_from_another_directory(installed, tmp_path):
    # The guardian reads `done` and exits 0; one that could not import launcher.processes.guardian exits 1.
    probe = (
        "import os; from launcher.processes.guardian import Guardian; g = Guardian('t', dict(os.environ)); g.dismiss();"
        "print('guardian exit', g._process.returncode)"
    )
    result = run_installed(installed, "python", "-c", probe, cwd=tmp_path, timeout=60)
    assert result.stdout == "guardian exit 0\n", result.stderr
