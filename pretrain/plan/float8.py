"""Float8 training (training.float8), the parts that need no torch: whether a run asks for it,
which of the model's matmuls it converts, what it changes in the memory estimate, and the
refusals that can be made before any worker starts (torchao missing or too new for the installed
torch, float8 matmuls on a CPU or on a GPU below compute capability 8.9, as NVML reads it).
The launcher (launcher/prepare.py) and the plan import this; the conversion itself, and the checks
that read the GPU, are pretrain/distributed/float8.py.

Which Linears become torchao's Float8Linear: those inside the blocks whose in and out features
are both multiples of 16 (float8 tensor-core matmuls need them), less the MoE router (its
softmax decides where every token goes: kept in bf16, as torchtitan does). So the attention's
fused wqkv and wo and SwiGLU's fused w13 and w2 convert; the output head (the loss's logits),
the embedding (a lookup, no matmul) and a mixture of experts' expert weights (3-D parameters run
by grouped matmuls, not nn.Linear) stay bf16."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from collections.abc import Iterable

from pretrain.config import Config, ConfigError, ModelConfig

FLOAT8 = 1
"""Bytes of a float8 (e4m3 or e5m2) value."""
MULTIPLE = 16
"""What a float8 matmul's in and out features must be multiples of (torch._scaled_mm's rule)."""
MIN_CAPABILITY = (8, 9)
"""The oldest CUDA compute capability with float8 tensor cores: Ada (8.9: L4, L40S, RTX 4090) and
Hopper (9.0: H100, H200) and later."""
ROCM_FLOAT8_ARCHS = {"gfx942": "MI300X, MI325X", "gfx950": "MI350X, MI355X"}
"""AMD architectures with float8 matrix cores that torch._scaled_mm and torchao's float8 take (torchao
picks the fnuz float8 formats on gfx942 itself). On ROCm the arch, not the compute capability
torch reports (9.4 for gfx942, but 9.0 for the MI250X's gfx90a, which has no float8), decides.
Allowed from AMD's and torchao's documentation: no AMD GPU has run this code's float8 yet."""
INSTALL = 'pip install ".[float8]" (or pip install "torchao>=0.14.1,<0.19")'
"""How to install torchao, as pyproject.toml's float8 extra pins it."""
TORCHAO_NEEDS_TORCH = {(0, 18): (2, 11)}
"""torchao releases that need a newer torch than our oldest (torch 2.9). torchao 0.18 dropped torch
2.10 and older (its release notes; pytorch/ao#4401): on torch 2.9 `import torchao` itself fails
(0.18 imports torch.nn.functional.ScalingType, new in torch 2.10, from a module every import of
torchao loads), and 2.10 is no longer tested. pip cannot tell, since torchao's wheel declares no
torch requirement, so `pip install ".[float8]"` takes 0.18 on any torch."""


def requested(config: Config) -> bool:
    """Whether the run converts its matmuls to float8: training.float8 true or "emulate"."""
    return config.training.float8 is not False


def emulated(config: Config) -> bool:
    """training.float8 "emulate": torchao's float8 casts and scales, with the matmuls emulated in
    high precision (any device; for tests and numerics checks, no speed-up)."""
    return config.training.float8 == "emulate"


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def converts(fqn: str, in_features: int, out_features: int) -> bool:
    """Whether the Linear at fqn (its name in the Transformer) becomes a Float8Linear: inside a
    block (layers.N.), not a router, and both dims multiples of 16."""
    inside_block = fqn.startswith("layers.")
    return inside_block and not fqn.endswith("router") and in_features % MULTIPLE == 0 and out_features % MULTIPLE == 0


def converted_block_parameters(model: ModelConfig) -> int:
    """Parameters of one block that run as float8 matmuls (the Linears converts() takes): the
    attention's wqkv and wo, and SwiGLU's w13 and w2; a mixture of experts' experts and router
    none. A feed-forward block of another kind counts as keeping its matmuls in bf16, which
    under-counts the savings rather than over-counting them."""
    d, head_dim = model.dim, model.dim // model.n_heads
    q, kv = model.n_heads * head_dim, model.n_kv_heads * head_dim
    linears = [("layers.0.attention.wqkv", d, q + 2 * kv), ("layers.0.attention.wo", q, d)]
    if model.feed_forward == "swiglu":
        linears += [("layers.0.feed_forward.w13", d, 2 * model.ffn_dim), ("layers.0.feed_forward.w2", model.ffn_dim, d)]
    return sum(i * o for fqn, i, o in linears if converts(fqn, i, o))


def check_launch(config: Config, device_type: str, gpus: Iterable[tuple[str, tuple[int, int] | None]] = ()) -> None:
    """ConfigError (one line) for a float8 run that cannot run on device_type ("cuda" or "cpu"),
    as far as it can be told without torch: torchao is not installed or too new for the installed
    torch, float8 matmuls (true) are asked of a CPU, or of one of gpus ((name, compute capability)
    of each GPU the run uses, as NVML reads them; a capability None is unknown, left to the worker)
    below 8.9. The launcher calls it once before any worker starts; each worker again, with its own
    GPU (pretrain/distributed/float8.py check_device)."""
    if not requested(config):
        return
    if not torchao_installed():
        raise ConfigError(
            f"training.float8: needs torchao, which is not installed; {install_hint()}, or set training.float8=false"
        )
    if problem := torchao_version_problem():
        raise ConfigError(problem)
    if config.training.float8 is True and device_type != "cuda":
        raise ConfigError(
            f"training.float8: true needs a CUDA GPU with float8 tensor cores (compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+), and this run is on {device_type}; "
            'use training.float8="emulate" to check float8 numerics there, or false'
        )
    if config.training.float8 is True:
        for name, capability in gpus:
            if capability is not None and (problem := capability_problem(name, capability)):
                raise ConfigError(problem)


def uncompiled_line(config: Config, compiled: bool) -> str | None:
    """The warning for float8 matmuls (true) in a run whose blocks are not compiled (compiled:
    whether they are, training.compile and its prerequisites decided); None otherwise. Uncompiled,
    each float8 cast (the amax, the scale, the cast itself) runs as separate kernels, reading and
    writing the bf16 tensor each time, which usually costs more than the float8 matmul saves."""
    if config.training.float8 is not True or compiled:
        return None
    return (
        "training.float8 is true but training.compile is off: float8's casts and scales then run unfused, "
        "which is usually slower than bf16; turn compile on (training.compile=true), or set training.float8=false"
    )


def installed_version(name: str) -> str | None:
    """The installed version of the distribution name, from its metadata (no import); None where
    it has none (not installed, or a source tree on the path without metadata)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torchao_version_problem(torch_version: str | None = None) -> str | None:
    """Why the installed torchao cannot run with torch (torch_version, or the installed torch's
    from its metadata): one line naming a torchao that can; None when it can, or when either
    version is unknown (no metadata: nothing to judge, and the import will tell)."""
    torchao_version, torch_version = installed_version("torchao"), torch_version or installed_version("torch")
    if torchao_version is None or torch_version is None:
        return None
    torchao, torch_now = _major_minor(torchao_version), _major_minor(torch_version)
    for release, needs in TORCHAO_NEEDS_TORCH.items():
        if torchao >= release and torch_now < needs:
            return (
                f"training.float8: torchao {torchao_version} needs torch {needs[0]}.{needs[1]}+, and this is torch "
                f'{torch_version}; pip install "torchao>=0.14.1,<{release[0]}.{release[1]}" or a newer torch'
            )
    return None


def install_hint() -> str:
    """How to install a torchao that runs with the installed torch: the float8 extra, or on a
    torch that the newest torchao the extra allows has dropped, the newest release that has not."""
    torch_version = installed_version("torch")
    for release, needs in TORCHAO_NEEDS_TORCH.items():
        if torch_version is not None and _major_minor(torch_version) < needs:
            newest = f"{release[0]}.{release[1]}"
            return f'pip install "torchao>=0.14.1,<{newest}" (torchao {newest} needs torch {needs[0]}.{needs[1]}+)'
    return INSTALL


def _major_minor(text: str) -> tuple[int, int]:
    """(major, minor) of a version: "2.10.0+cu128" -> (2, 10), "0.18rc1" -> (0, 18)."""
    major, minor = (text.split("+")[0].split(".") + ["0"])[:2]
    return int(re.match(r"\d*", major).group() or 0), int(re.match(r"\d*", minor).group() or 0)  # type: ignore[union-attr]


def capability_problem(name: str, capability: tuple[int, int]) -> str | None:
    """Why the GPU named name, of that compute capability, cannot run float8 matmuls; None if it can."""
    if capability >= MIN_CAPABILITY:
        return None
    return (
        f"training.float8: true needs float8 tensor cores (compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+: "
        f"L4, L40S, H100, H200 or later), but {name} has {capability[0]}.{capability[1]}; set training.float8=false "
        '(or "emulate" to check float8 numerics without a speed-up)'
    )


def rocm_arch_problem(name: str, arch: str) -> str | None:
    """Why the AMD GPU named name, of architecture arch (gcnArchName, e.g. "gfx942:sramecc+:xnack-"),
    cannot run float8 matmuls; None if it can (ROCM_FLOAT8_ARCHS)."""
    base = arch.split(":")[0]
    if base in ROCM_FLOAT8_ARCHS:
        return None
    supported = "; ".join(f"{gfx}: {gpus}" for gfx, gpus in ROCM_FLOAT8_ARCHS.items())
    return (
        f"training.float8: true needs float8 matrix cores ({supported}), but {name or 'this AMD GPU'} is "
        f"{base or 'an unknown architecture'}; set training.float8=false "
        '(or "emulate" to check float8 numerics without a speed-up)'
    )
