"""pretrain/plan/host_memory.py: what one process keeps in host memory, and the host memory a run
plans on. How the launcher's plan uses them (CPU workers, CPU offload, the local tier):
test_memory_plan.py and test_checkpoint_memory.py."""

from __future__ import annotations

import pytest

from support.memory_configs import small, with_training
from pretrain.config import ConfigError
from pretrain.plan.gpu_memory import GIB, OVERHEAD_BYTES, estimate
from pretrain.plan.host_memory import HOST_MEMORY_ENV, HOST_OVERHEAD_BYTES, host_estimate, host_memory_bytes


def test_the_host_memory_of_cpu_workers_is_the_gpu_estimate_without_the_cuda_allowance():
    eager = with_training(small(), compile=False)
    gpu, host = estimate(eager, 2, "ddp"), host_estimate(eager, 2, "ddp", on_gpus=False)
    assert host.total == gpu.total - OVERHEAD_BYTES + HOST_OVERHEAD_BYTES
    assert (host.weights, host.activations) == (gpu.weights, gpu.activations)


def test_cpu_workers_are_estimated_as_not_compiled_unless_compile_is_asked_for():
    # training.compile null compiles on GPUs only: a GPU's estimate counts it, a CPU worker's not
    host = host_estimate(small(), 2, "ddp", on_gpus=False)
    assert host.activations == estimate(with_training(small(), compile=False), 2, "ddp").activations
    assert host.activations > estimate(small(), 2, "ddp").activations
    compiled = with_training(small(), compile=True)
    assert host_estimate(compiled, 2, "ddp", on_gpus=False).activations == estimate(compiled, 2, "ddp").activations


def test_host_memory_comes_from_the_environment_when_set_and_bad_values_are_one_line(monkeypatch):
    monkeypatch.setenv(HOST_MEMORY_ENV, "12.5")
    assert host_memory_bytes() == int(12.5 * GIB)
    for bad in ("lots", "-1", "nan", "inf"):
        monkeypatch.setenv(HOST_MEMORY_ENV, bad)
        with pytest.raises(ConfigError, match=f"{HOST_MEMORY_ENV}=.* is not a positive number of GiB"):
            host_memory_bytes()
    monkeypatch.delenv(HOST_MEMORY_ENV)
    assert 0 < host_memory_bytes()
