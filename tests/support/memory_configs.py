"""What the memory tests share (test_memory.py, test_memory_plan.py, test_host_memory.py, test_gpu_memory_figure.py):
an 80 GiB GPU, a scripted one of any size, and configs changed field by field."""

from __future__ import annotations

import dataclasses

from launcher.gpus import nvml
from pretrain import config as cfg
from pretrain.plan.gpu_memory import GIB

GPU_80 = 80 * GIB


def scripted_gpu(memory_bytes: int) -> nvml.Gpu:
    """GPU 0 of a scripted machine, with memory_bytes of memory, none of it in use."""
    return nvml.Gpu(
        id="0",
        index=0,
        uuid="GPU-0",
        name="scripted",
        pci_bus_id="0",
        memory_total=memory_bytes,
        memory_used=0,
        utilization=0.0,
        processes=(),
    )


def with_training(config: cfg.Config, **changes: object) -> cfg.Config:
    return dataclasses.replace(config, training=dataclasses.replace(config.training, **changes))


def with_model(config: cfg.Config, **changes: object) -> cfg.Config:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **changes))


def small() -> cfg.Config:
    return with_model(cfg.small(), vocab_size=32768)  # what the trained BPE tokenizer gives it
