"""The GPU caching allocator's setting: which variables torch reads it from, and the default a
worker gets (standard library only: the launcher sets it for its workers, and the entry point
before torch loads).

torch reads its allocator setting from one of PYTORCH_ALLOC_CONF (its name since 2.9, for every
accelerator), PYTORCH_CUDA_ALLOC_CONF and PYTORCH_HIP_ALLOC_CONF (the ROCm name), and which one wins
when several are set differs between torch versions. So the default
is written only when none of them is set, which is right whatever the order: written beside a
user's PYTORCH_HIP_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF might win and silently drop the user's
setting on a ROCm machine. It is written as PYTORCH_CUDA_ALLOC_CONF, which both vendors' builds of
every torch this code runs on read."""

from __future__ import annotations

from collections.abc import MutableMapping

ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
"""Where torch reads the allocator setting (which wins when several are set depends on the version)."""
DEFAULT_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT_SETTING = "expandable_segments:True"
"""Segments that grow in place instead of new blocks of fixed sizes: far less fragmentation when
allocation sizes vary (FSDP's gathered groups, the chunked loss), so a run near the memory limit
fits where it otherwise fails with memory reserved but unusable. ROCm's torch supports them on
Instinct GPUs; where a platform does not, torch warns once and allocates as before."""


def set_default_allocator(env: MutableMapping[str, str]) -> None:
    """Give env the default allocator setting unless it names one under any of torch's variables."""
    if not any(name in env for name in ALLOCATOR_VARIABLES):
        env[DEFAULT_VARIABLE] = DEFAULT_SETTING
