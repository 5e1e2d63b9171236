"""Float8 training (training.float8) through torchao's float8 linears: the GPU check, the
conversion of the model's Linears, and the per-step scale precompute under FSDP2.

parallelize (pretrain/distributed/parallel.py) converts the model first of all, on the meta
device: before activation checkpointing, torch.compile and FSDP2 each wrap what the blocks hold,
so each wraps the Float8Linears. Which Linears convert, and why, is pretrain/plan/float8.py
(torch-free, for the launcher and the memory plan); torchao is imported only here, and only once a
run asks for float8 (its import prints warnings about its C++ extensions on a CPU machine).

Float8Linear is an nn.Linear subclass that keeps nn.Linear's `weight` parameter in its dtype
(fp32 master weights), so parameter names, state_dict keys and dtypes, checkpoints and the
Hugging Face export are those of a bf16 run: a float8 run resumes without float8 and back.
Recipe: tensorwise dynamic scaling (torchao's default: one scale per tensor, computed from its
absolute maximum each time it is cast), e4m3 forward and e5m2 gradients, fp32 accumulation.

Under FSDP2 the weights are all-gathered already cast to float8 (enable_fsdp_float8_all_gather:
half the bytes of a bf16 all-gather), and their scales are computed for the whole model in one
fused op right after each optimizer step (scale_precompute), instead of one small all-reduce per
weight at the next all-gather.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pretrain.config import Config, ConfigError
from pretrain.plan import float8 as plan

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig


def check_device(config: Config, device: torch.device) -> None:
    """ConfigError (one line) when training.float8 cannot run on device: torchao missing or too
    new for this torch, true on a CPU, or a GPU below compute capability 8.9 (on ROCm: an AMD GPU
    other than gfx942 or gfx950, pretrain/plan/float8.py ROCM_FLOAT8_ARCHS). Called by each
    worker before anything is built (pretrain/train.py main), as a backstop: the launcher has
    made these checks once already (pretrain/plan/float8.py check_launch, with NVML's capability),
    so here they catch a run without the launcher, a GPU NVML could not read, or an AMD GPU (which
    has no CUDA compute capability for the launcher to judge)."""
    if not plan.requested(config):
        return
    plan.check_launch(config, device.type)
    if problem := plan.torchao_version_problem(torch.__version__):  # this torch, metadata or not
        raise ConfigError(problem)
    if config.training.float8 is True:
        name = torch.cuda.get_device_name(device)
        if torch.version.hip:  # ROCm's reported capability is not CUDA's scale: the architecture decides
            problem = plan.rocm_arch_problem(name, torch.cuda.get_device_properties(device).gcnArchName)
        else:
            problem = plan.capability_problem(name, torch.cuda.get_device_capability(device))
        if problem:
            raise ConfigError(problem)


def _torchao_float8() -> Any:
    """torchao.float8, imported quietly: on import torchao warns that its C++ extensions did not
    load (they do not on a CPU, or with a torch other than the one it was built against) and
    torch warns about an enum torchao registers, on every worker; float8 training uses neither."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    return torchao.float8


def linear_config(config: Config, fsdp: bool) -> Float8LinearConfig:
    """torchao's Float8LinearConfig for the run: tensorwise dynamic scaling, emulated matmuls for
    training.float8 "emulate", float8 all-gathers under FSDP2."""
    Float8LinearConfig = _torchao_float8().Float8LinearConfig

    return Float8LinearConfig(emulate=plan.emulated(config), enable_fsdp_float8_all_gather=fsdp)


def convert(model: nn.Module, config: Config, fsdp: bool) -> list[str]:
    """Swap model's Linears that plan.converts() takes for torchao's Float8Linear, in place (the
    names of the modules and their parameters stay), and return the names of those converted.
    fsdp: the model is about to be sharded by FSDP2 (the weights then all-gather in float8)."""
    convert_to_float8_training = _torchao_float8().convert_to_float8_training
    converted: list[str] = []

    def take(module: nn.Module, fqn: str) -> bool:
        if isinstance(module, nn.Linear) and plan.converts(fqn, module.in_features, module.out_features):
            converted.append(fqn)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=take, config=linear_config(config, fsdp))
    return converted


def is_float8(module: nn.Module) -> bool:
    """Whether module is one of torchao's Float8Linear."""
    return type(module).__name__ == "Float8Linear" and isinstance(module, nn.Linear)


def scale_precompute(model: nn.Module, config: Config, fsdp: bool) -> Callable[[nn.Module], None] | None:
    """What runs right after each optimizer step: under FSDP2 with float8 all-gathers, torchao's
    precompute_float8_dynamic_scale_for_fsdp (every float8 weight's scale for the next all-gather,
    from one fused amax over all of them); None otherwise (nothing to precompute).

    None under training.cpu_offload too: there the shards live in host memory, and FSDP2 copies
    each one to the GPU before its all-gather; torchao's weight wrapper does not carry a
    precomputed scale through that copy (its _to_copy makes a new wrapper without one), so the
    all-gather computes the scale again anyway, and the precompute would only cost host time (an
    amax over every float8 weight on the CPU, each step)."""
    if not (plan.requested(config) and fsdp) or config.training.cpu_offload:
        return None
    return _torchao_float8().precompute_float8_dynamic_scale_for_fsdp


def describe(converted: list[str], config: Config) -> str:
    """The build's line about float8: how many matmuls run in float8, and how MFU is counted."""
    how = "emulated float8 (no speed-up)" if plan.emulated(config) else "float8"
    return (
        f"{how} matmuls in {len(converted)} Linears (tensorwise scaling); the output head, embedding, "
        "routers, experts and layers not multiples of 16 stay bf16; MFU is counted against the bf16 peak"
    )


def plain_tensors(state: Any) -> Any:
    """state (a nested dict of a model's or optimizer's state, as DCP saves and loads it) with
    every tensor that FSDP2's float8 all-gather wraps (torchao's WeightWithDynamicFloat8CastTensor:
    a float8 Linear's weight under FSDP2, and the optimizer states made like it) replaced by the
    plain high-precision tensor inside, sharing its storage: a checkpoint then holds plain
    tensors, which a run without float8 (or without torchao) reads, and which loading back in place
    writes into the weights themselves. Anything else is returned as it is."""
    if isinstance(state, dict):
        return {key: plain_tensors(value) for key, value in state.items()}
    if isinstance(state, DTensor) and _is_cast_wrapper(state._local_tensor):
        local: Any = state._local_tensor  # torchao's wrapper: its plain tensor is _tensor
        inner = local._tensor
        return DTensor.from_local(
            inner, state.device_mesh, state.placements, run_check=False, shape=state.shape, stride=state.stride()
        )
    if _is_cast_wrapper(state):
        return state._tensor
    return state


def _is_cast_wrapper(tensor: Any) -> bool:
    """Whether tensor is torchao's FSDP2 float8 weight wrapper (told by name: torchao may be absent)."""
    return type(tensor).__name__ == "WeightWithDynamicFloat8CastTensor" and isinstance(
        getattr(tensor, "_tensor", None), torch.Tensor
    )
