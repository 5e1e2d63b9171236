"""pretrain/plan/compile_prerequisites.py: torch.compile's compiler and Python headers, found missing
before the first forward needs them, and compile turned off with one line."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from support.processes import ROOT, launcher_env
from pretrain.plan import compile_prerequisites
from pretrain.plan.compile_prerequisites import missing_python_headers
from pretrain.config import Config, DebugConfig, TrainingConfig
from pretrain import config as cfg
from pretrain.build import parallel_mode
from pretrain.distributed.parallel import compile_enabled
from pretrain.distributed.runtime import Runtime


def asking_for_compile() -> Config:
    return Config(training=TrainingConfig(compile=True), debug=DebugConfig(trace_nonfinite=False))


@pytest.fixture
def pretrain_warnings():
    """The pretrain logger's records, as 'LEVEL message'."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(f"{record.levelname} {record.getMessage()}")
    logger = logging.getLogger("pretrain")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_python_headers_are_found_in_an_include_directory_that_has_python_h(tmp_path):
    (tmp_path / "Python.h").write_text("/* the real one is longer */\n")
    assert missing_python_headers(tmp_path) is None


def test_missing_python_headers_name_the_directory_and_the_package_to_install(tmp_path):
    missing = missing_python_headers(tmp_path)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert missing is not None and str(tmp_path) in missing
    assert f"apt-get install python{version}-dev" in missing and f"python{version}-devel" in missing


def test_this_interpreters_headers_are_where_the_check_looks():
    # CI and the development machine have them (gcc builds packages here): the check must agree.
    assert missing_python_headers() is None


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_compile_without_python_headers_is_turned_off_with_one_warning_line(monkeypatch, tmp_path, pretrain_warnings, device):
    monkeypatch.setattr(compile_prerequisites, "python_include_dir", lambda: tmp_path)
    monkeypatch.setattr("shutil.which", lambda name, *args, **kwargs: f"/usr/bin/{name}")  # every compiler is there
    assert not compile_enabled(asking_for_compile(), torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
    assert len(pretrain_warnings) == 1
    assert pretrain_warnings[0].startswith("WARNING training.compile is off: torch.compile needs the Python headers")


def test_the_launcher_turns_compile_off_once_for_every_worker_when_the_compiler_is_missing(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--debug", "--device", "cpu", "--nproc", "2", "--max-steps", "1"]
        + ["--run-dir", str(tmp_path / "r"), "--set", f"data.cache_dir={tmp_path / 'cache'}"]
        + ["--set", "training.compile=true", "--set", "debug.trace_nonfinite=false", "--set", "data.context_length=32"],
        cwd=ROOT,
        env=launcher_env(CXX=str(tmp_path / "no-such-g++")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    off = [line for line in lines if "training.compile is off" in line]
    assert len(off) == 1 and off[0].startswith("launcher: warning: training.compile is off: "), off
    assert "a C++ compiler (g++ on PATH, or CXX)" in off[0]
    config = (tmp_path / "r" / "config.json").read_text()
    assert '"compile": false' in config


def test_a_run_alone_plans_without_compile_when_torch_compile_cannot_build_kernels(monkeypatch, tmp_path, pretrain_warnings):
    """Decided before the memory plan (which gives a compiled run less memory than an eager one),
    as the launcher decides it before its own plan."""
    monkeypatch.setattr(compile_prerequisites, "python_include_dir", lambda: tmp_path)
    monkeypatch.setattr("shutil.which", lambda name, *args, **kwargs: f"/usr/bin/{name}")
    config = cfg.resolve(preset="debug", sets=["training.compile=true", "debug.trace_nonfinite=false", "model.vocab_size=256"])
    planned, mode = parallel_mode(config, Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0"))
    assert planned.training.compile is False and mode == "single"
    assert [line.split(":")[0] for line in pretrain_warnings] == ["WARNING training.compile is off"]


# --- CUDA graphs and dropless experts' grouped matmul ------------------------------------------

MOE_GRAPHS = ["model.moe.num_experts=4", "model.moe.top_k=2", "training.use_amp=true", "training.compile=true"]
MOE_GRAPHS += ["debug.trace_nonfinite=false"]  # the debug preset traces non-finite values, which turns compile off


def dropless(*sets: str):
    from pretrain import config as cfg

    return cfg.resolve(preset="debug", sets=[*MOE_GRAPHS, *sets])


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graphs_are_refused_where_dropless_experts_grouped_matmul_syncs_naming_the_gpu_and_the_ways_out(mode):
    config = dropless(f"training.compile_mode={mode}")
    problem = compile_prerequisites.dropless_cuda_graph_problem(
        config, "cuda", [("NVIDIA H100 80GB HBM3", "nvidia", (9, 0)), ("NVIDIA A100-SXM4-80GB", "nvidia", (8, 0))]
    )
    assert problem is not None and "\n" not in problem
    assert "NVIDIA A100-SXM4-80GB (compute capability 8.0)" in problem and mode in problem
    assert "max-autotune-no-cudagraphs" in problem and "capacity_factor" in problem
    amd = compile_prerequisites.dropless_cuda_graph_problem(config, "cuda", [("AMD Instinct MI300X", "amd", None)])
    assert amd is not None and "(ROCm)" in amd


@pytest.mark.parametrize(
    "sets, gpus",
    [
        (["training.compile_mode=reduce-overhead"], [("NVIDIA H200", "nvidia", (9, 0)), ("B200", "nvidia", (10, 0))]),
        (["training.compile_mode=reduce-overhead"], [("MIG", "nvidia", None)]),  # unknown: left to the run
        (["training.compile_mode=max-autotune-no-cudagraphs"], [("A100", "nvidia", (8, 0))]),
        (["training.compile_mode=reduce-overhead", "model.moe.capacity_factor=1.25"], [("A100", "nvidia", (8, 0))]),
        (["training.compile_mode=reduce-overhead", "model.ffn_dim=100"], [("A100", "nvidia", (8, 0))]),  # the buffer
        (["training.compile_mode=reduce-overhead", "training.compile=false"], [("A100", "nvidia", (8, 0))]),
    ],
    ids=["sync-free-gpus", "unknown-capability", "no-graphs", "capacity-routing", "unaligned-widths", "uncompiled"],
)
def test_cuda_graphs_with_experts_that_never_sync_are_left_alone(sets, gpus):
    assert compile_prerequisites.dropless_cuda_graph_problem(dropless(*sets), "cuda", gpus) is None


def test_the_launcher_refuses_cuda_graphs_over_syncing_grouped_matmuls_before_the_data(tmp_path):
    import io

    from launcher.errors import UsageError
    from launcher.gpus.devices import Gpu
    from launcher.gpus.placement import Placement
    from launcher.prepare import prepare_training
    from launcher.supervise.printer import Printer

    config = dropless("training.compile_mode=reduce-overhead", f"data.cache_dir={tmp_path / 'cache'}")
    a100 = Gpu("0", 0, "GPU-0", "NVIDIA A100-SXM4-80GB", "0", 80 << 30, 0, 0.0, (), compute_capability=(8, 0))
    with pytest.raises(UsageError, match="cannot hold the host sync"):
        prepare_training(config, Placement("cuda", 1, gpus=(a100,)), Printer(io.StringIO(), None))
    assert not (tmp_path / "cache").exists()
