"""One GPU memory figure: the launcher plans on NVML's total (or system.gpu_memory_gib) and writes
it into the workers' config; a worker checks the run against that figure, not torch's total_memory
(about 0.5 GiB less for the same GPU), so a run accepted at the memory line is never refused."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch

from support.processes import one_line_error
from support.memory_configs import scripted_gpu
from launcher.prepare import prepare_training
from launcher.gpus.placement import Placement
from launcher.supervise.printer import Printer
from pretrain import build
from pretrain import config as cfg
from pretrain.config import ConfigError
from pretrain.plan.gpu_memory import GIB, GPU_SHARE, estimate
from pretrain.plan.parallelism import planned_gpu_memory
from pretrain.distributed.runtime import Runtime

TORCH_SEES_LESS = GIB // 2
"""What torch's total_memory reports below NVML's total for the same GPU (the CUDA context's reservation)."""


def launcher_config(tmp_path, memory_bytes: int, *sets: str) -> cfg.Config:
    config = cfg.resolve(preset="debug", sets=[f"data.cache_dir={tmp_path / 'cache'}", *sets])
    return prepare_training(config, Placement("cuda", 1, gpus=(scripted_gpu(memory_bytes),)), Printer(io.StringIO(), None))


def worker_mode(config: cfg.Config, monkeypatch, torch_total: int) -> str:
    """What a worker on cuda:0 decides for config, torch reporting torch_total bytes."""
    properties = type("Properties", (), {"total_memory": torch_total})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    return build.parallel_mode(config, Runtime(0, 1, torch.device("cuda", 0), "GPU 0"))[1]


def test_a_run_the_launcher_accepts_at_the_memory_line_is_accepted_by_its_worker(tmp_path, monkeypatch):
    roomy = launcher_config(tmp_path, 80 * GIB)
    line = math.ceil(estimate(roomy, 1, roomy.training.parallelism).total / GPU_SHARE)  # the fewest bytes that fit
    accepted = launcher_config(tmp_path, line)
    assert accepted.system.gpu_memory_gib is not None and int(accepted.system.gpu_memory_gib * GIB) == line
    cfg.save(accepted, tmp_path / "config.json")  # the worker reads the config through JSON
    as_written = cfg.load(tmp_path / "config.json")
    assert worker_mode(as_written, monkeypatch, line - TORCH_SEES_LESS) == "single"
    # The control: planning on torch's own figure, the same worker would refuse the run.
    unplanned = dataclasses.replace(as_written, system=dataclasses.replace(as_written.system, gpu_memory_gib=None))
    with pytest.raises(ConfigError):
        worker_mode(unplanned, monkeypatch, line - TORCH_SEES_LESS)


def test_a_gpu_memory_setting_is_what_the_launcher_plans_and_the_workers_check(tmp_path):
    planned = launcher_config(tmp_path, 80 * GIB, "system.gpu_memory_gib=20")
    assert planned.system.gpu_memory_gib == 20


def test_a_gpu_memory_setting_above_the_gpus_own_is_refused_in_one_line():
    config = cfg.resolve(preset="debug", sets=["system.gpu_memory_gib=100"])
    with pytest.raises(ConfigError) as refused:
        planned_gpu_memory(config, 80 * GIB)
    assert one_line_error(refused) == (
        "system.gpu_memory_gib is 100 but the GPU has 80.0 GiB; set it to at most that, or to null to plan on the whole GPU"
    )
    assert planned_gpu_memory(config, None) is None  # CPU workers: no GPU to plan on
