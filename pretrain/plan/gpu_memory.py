"""How much GPU memory a run needs per GPU, from its config alone, before anything is built.

The estimate, the choice between DDP, FSDP and HSDP and the check that refuses a config that cannot
fit, with one line that says what would help. The launcher's plan (pretrain/plan/parallelism.py, which
also counts host memory and decides CPU offload, activation checkpointing, loss chunks and FSDP's
resharding) uses them before any worker starts: no torch here. The estimate is a model of the
peak, not a measurement: parameters, gradients and AdamW state are exact counts; activations
follow the per-layer formulas of pretrain/plan/activations.py for each activation checkpointing
mode, eager or compiled (what autograd keeps, or what torch.compile's partitioner keeps: it
recomputes element-wise ops instead; checked against autograd, the checkpoints and a compiled
block's saved outputs, tests/pretrain/plan/test_memory.py); the backward's temporaries are one block's
activation gradients; the loss counts three fp32 copies of one chunk's logits eager, or one in
the compute dtype compiled (of the whole micro-batch's in one piece; both measured on an H200:
small's estimate within 1.3x of its allocated peak, tests/pretrain/plan/test_memory_plan.py); a
fixed allowance covers the CUDA context, NCCL and the caching allocator's fragmentation; and
every decision plans on GPU_SHARE (90%) of the GPU, for what the model still leaves out. A
config the plan has not made concrete yet counts as its first choice: "auto" checkpointing as
none, a null loss chunk as one piece, a null reshard_after_forward as true.

What each mode keeps on every GPU (P parameters, W ranks, a = 2 bytes under bf16 autocast, else 4,
s bytes of optimizer state per parameter: AdamW's two fp32 moments, 8; pretrain/registry.py):

    DDP   weights 4P (+ 2P: autocast's bf16 copies of the matrices, kept for the backward)
          gradients 4P (DDP's buckets hold them: gradient_as_bucket_view), optimizer state sP
    FSDP  weights 4P/W + a x (head + 2 blocks): the unsharded copies in flight (the root group,
          the final norm and output projection, stays gathered through the step; one block
          runs while the next is prefetched; every block, when training.reshard_after_forward
          is false, keeps them from its forward to its backward); gradients 4P/W + a x head (the root's, unsharded
          until the end of the backward pass) + (a + 4) x block (one block's unsharded
          gradients and the fp32 buffer they are reduce-scattered from); optimizer state sP/W

FSDP with CPU offload (training.cpu_offload) keeps the sharded weights, gradients and AdamW
state in host memory (counted in pretrain/plan/host_memory.py) and on the GPU only what is in flight:
the unsharded groups and gradients above, the activations and the logits.

Float8 training (training.float8, pretrain/plan/float8.py names the Linears it converts): under
FSDP2 those weights are all-gathered already cast to float8, 1 byte a parameter instead of 2, so
the gathered blocks above shrink by the converted share; under DDP (or one process) a float8 Linear
casts its fp32 weight to float8 where autocast made a bf16 copy, 1 byte a parameter instead of 2.
Its autograd function keeps the bf16 input and the weight as a plain Linear does and casts them
again in the backward pass, so the activations do not change; each cast's scale is one number.

FSDP reduce-scatters on every micro-batch of gradient accumulation (pretrain/distributed/parallel.py,
gradient_sync), so no rank ever holds the full gradient and grad_accum_nums changes nothing
here. The embedding is gathered in fp32 around its own forward and backward, where the
activations are few, so it is not part of the peak; when training.reshard_after_forward is false
it stays gathered from its forward to its backward with the blocks (4 bytes a parameter more).

HSDP (training.parallelism "hsdp": FSDP2 on a 2-D mesh, sharded over the ranks of a node and
replicated across nodes) keeps on every GPU what FSDP over one node's ranks keeps (W = ranks per
node, shard_ranks): the cross-node all-reduce runs in place on the reduce-scattered shards.

One process is never wrapped (pretrain/distributed/parallel.py) unless it offloads, so world_size 1 is
estimated as the plain model whatever the mode, and as FSDP over one rank with offload.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from pretrain import config as cfg
from pretrain import registry
from pretrain.config import Config, ConfigError, ModelConfig
from pretrain.plan import float8
from pretrain.plan.activations import (  # re-exported: the estimate's parts, by their old names here
    BF16,
    COMPILED_LOGIT_COPIES,
    FP32,
    LOGIT_COPIES,
    activation_bytes,
    compiled,
    logits_bytes,
    loss_chunked,
    require_vocab,
    temporary_bytes,
)

__all__ = [
    "BF16",
    "COMPILED_LOGIT_COPIES",
    "FP32",
    "LOGIT_COPIES",
    "activation_bytes",
    "compiled",
    "logits_bytes",
    "loss_chunked",
    "require_vocab",
    "temporary_bytes",
]

GIB = 1 << 30
OVERHEAD_BYTES = 2 * GIB
"""The CUDA context (~0.5 GiB), NCCL's buffers and the caching allocator's fragmentation."""
GPU_SHARE = 0.9
"""A run plans on this share of each GPU: the estimate is a model, and what it leaves out
(fragmentation beyond the allowance, kernels' workspaces, a longer NCCL buffer) must still fit.
"auto" picks DDP when DDP's estimate fits it, and a run whose estimate does not is refused."""
MODES = ("ddp", "fsdp", "hsdp")
LOSS_CHUNK_TOKENS = 2048
"""The chunk a loss is split into when its logits do not fit in one piece (the launcher's plan,
for training.loss_chunk_tokens null, and the refusal's suggestion)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU at the peak of a training step (the start of the backward pass)."""

    mode: str
    world_size: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    """What autograd keeps for one micro-batch's backward pass, over every block."""
    logits: int
    """The fp32 logits of one loss chunk, their log-probabilities and gradient (LOGIT_COPIES)."""
    overhead: int
    temporaries: int = 0
    """The backward pass's short-lived buffers: the gradients of one block's activations, as large
    as what the block saved."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.temporaries + self.logits + self.overhead

    def describe(self) -> str:
        """~61.3 GiB per GPU: weights 30.0, gradients 30.0, optimizer 60.0, ... GiB"""
        return f"~{gib(self.total)} GiB per GPU: {self.parts()}"

    def parts(self) -> str:
        """The parts that are not zero (host memory under CPU offload has no activations)."""
        names = ("weights", "gradients", "optimizer", "activations", "temporaries", "logits", "overhead")
        return ", ".join(f"{name} {gib(getattr(self, name))}" for name in names if getattr(self, name)) + " GiB"


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.1f}"


# --- parameters -------------------------------------------------------------------------


def block_parameter_count(model: ModelConfig) -> int:
    """One TransformerBlock: two RMSNorm weights, wq/wk/wv/wo, and the feed-forward block
    (its own count, from pretrain/registry.py: SwiGLU's w1/w2/w3 are 3 x dim x ffn_dim)."""
    d, head_dim = model.dim, model.dim // model.n_heads
    attention = d * model.n_heads * head_dim * 2 + d * model.n_kv_heads * head_dim * 2  # wq, wo; wk, wv
    return 2 * d + attention + registry.FEED_FORWARDS[model.feed_forward].parameters(model)


def embedding_parameter_count(model: ModelConfig) -> int:
    """The token embedding: a lookup table, no matmul (FLOPs per token leave it out)."""
    return require_vocab(model) * model.dim


def head_parameter_count(model: ModelConfig) -> int:
    """The final norm and the (untied) output projection: FSDP's root group."""
    return require_vocab(model) * model.dim + model.dim


def parameter_count(model: ModelConfig) -> int:
    """Every parameter of Transformer(model); equals Transformer.num_params(). The one count:
    pretrain/observe/metrics.py counts FLOPs from it."""
    return embedding_parameter_count(model) + model.n_layers * block_parameter_count(model) + head_parameter_count(model)


def _matrix_parameter_count(model: ModelConfig) -> int:
    """The parameters autocast copies to bf16 (the Linear weights; not the embedding or norms)."""
    norms = 2 * model.dim
    return model.n_layers * (block_parameter_count(model) - norms) + require_vocab(model) * model.dim


# --- the estimate -----------------------------------------------------------------------


def estimate(config: Config, world_size: int, mode: str, offload: bool = False, shard_ranks: int | None = None) -> MemoryEstimate:
    """Peak bytes per GPU of training config on world_size GPUs with mode "ddp", "fsdp" or "hsdp"
    (offload: FSDP with CPU offload, the shards in host memory: see host_memory.host_estimate).
    shard_ranks: the ranks of one node, over which HSDP shards (needed for "hsdp", which is
    FSDP's estimate over them; ignored by the other modes)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} (got {mode!r})")
    if offload and mode != "fsdp":
        raise ValueError("CPU offload is a mode of FSDP")
    if mode == "hsdp" and shard_ranks is None:
        raise ValueError("mode hsdp needs shard_ranks: the ranks of one node, over which it shards")
    shards = min(shard_ranks or world_size, world_size) if mode == "hsdp" else world_size
    model, amp = config.model, config.training.use_amp
    params = parameter_count(model)
    unsharded = BF16 if amp else FP32  # the dtype FSDP gathers into (MixedPrecisionPolicy under amp)
    # training.float8: the blocks' float8 matmuls' weights are gathered (FSDP2) or cast (DDP) to 1 byte
    converted = float8.converted_block_parameters(model) if float8.requested(config) else 0
    if offload:
        head, block = head_parameter_count(model), block_parameter_count(model)
        # The fp32 shards of the groups being gathered are copied in from the host first.
        weights = unsharded * head + gathered_block_bytes(config, unsharded) * 2 + ceil_div(FP32, world_size) * (head + 2 * block)
        gradients = unsharded * head + (unsharded + FP32) * block
        optimizer = 0
    elif mode in cfg.SHARDED_MODES and world_size > 1:  # HSDP with one rank a node: wrapped, sharded over 1
        head, block = head_parameter_count(model), block_parameter_count(model)
        weights = (
            ceil_div(FP32 * params, shards) + unsharded * head + gathered_blocks(config) * gathered_block_bytes(config, unsharded)
        )
        if config.training.reshard_after_forward is False:  # the embedding kept gathered too, in fp32
            weights += FP32 * embedding_parameter_count(model)
        gradients = ceil_div(FP32 * params, shards) + unsharded * head + (unsharded + FP32) * block
        optimizer = ceil_div(optimizer_state_bytes(config.training) * params, shards)
    else:
        # Under autocast each matrix is cast to a bf16 copy that the backward keeps; a float8
        # Linear casts its fp32 weight to float8 instead (its backward keeps the fp32 weight
        # itself and casts again), counted as kept, as the compiled partitioner may keep it.
        casts = BF16 * (_matrix_parameter_count(model) - model.n_layers * converted) + float8.FLOAT8 * model.n_layers * converted
        weights = FP32 * params + (casts if amp else 0)
        gradients = FP32 * params
        optimizer = optimizer_state_bytes(config.training) * params
    return MemoryEstimate(
        mode=mode,
        world_size=world_size,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=activation_bytes(config),
        logits=logits_bytes(config),
        overhead=OVERHEAD_BYTES,
        temporaries=temporary_bytes(config),
    )


def gathered_block_bytes(config: Config, unsharded: int) -> int:
    """One block's weights as FSDP2 gathers them: in the unsharded dtype, or, for the Linears
    training.float8 converts, already cast to float8 (1 byte; torchao's float8 all-gather, whose
    scales, one number a weight, are left out)."""
    block = block_parameter_count(config.model)
    converted = float8.converted_block_parameters(config.model) if float8.requested(config) else 0
    return unsharded * (block - converted) + float8.FLOAT8 * converted


def gathered_blocks(config: Config) -> int:
    """Blocks whose weights FSDP holds unsharded at the start of the backward pass: the one that
    runs and the one prefetched, or, when blocks are not resharded after their forward
    (training.reshard_after_forward false), all of them."""
    return 2 if config.training.reshard_after_forward is not False else max(2, config.model.n_layers)


def optimizer_state_bytes(training: cfg.TrainingConfig) -> int:
    """Bytes of state per parameter of training.optimizer (pretrain/registry.py; AdamW: 8)."""
    return registry.OPTIMIZERS[training.optimizer].state_bytes_per_param


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up: one rank's share of a sharded tensor."""
    return -(-a // b)


# --- choosing and checking --------------------------------------------------------------


def choose_parallelism(
    config: Config, world_size: int, gpu_memory_bytes: int | None, local_ranks: int | None = None
) -> Literal["ddp", "fsdp", "hsdp"]:
    """training.parallelism when it names a mode ("hsdp" on one node: "fsdp", nothing to replicate
    across); for "auto", DDP when there is one rank, no memory limit (CPU: None), or when DDP's
    estimate fits GPU_SHARE of the GPU (DDP communicates less); else, on several nodes
    (local_ranks, the ranks of a node, fewer than world_size), HSDP when it fits sharded within a
    node (only its gradient all-reduce crosses nodes); FSDP otherwise."""
    chosen = config.training.parallelism
    nodes = several_nodes(world_size, local_ranks)
    if chosen == "hsdp":
        return "hsdp" if nodes else "fsdp"
    if chosen != "auto":
        return chosen
    if world_size == 1 or gpu_memory_bytes is None:
        return "ddp"
    if fits_gpu(estimate(config, world_size, "ddp").total, gpu_memory_bytes):
        return "ddp"
    if nodes and fits_gpu(estimate(config, world_size, "hsdp", shard_ranks=local_ranks).total, gpu_memory_bytes):
        return "hsdp"
    return "fsdp"


def several_nodes(world_size: int, local_ranks: int | None) -> bool:
    """Whether world_size ranks, local_ranks on each node (None: all on one), span several nodes."""
    return local_ranks is not None and world_size > local_ranks


def node_gpus(ranks: int) -> str:
    """How HSDP's shard group is said: "the 8 GPUs of a node"."""
    return "the one GPU of a node" if ranks == 1 else f"the {ranks} GPUs of a node"


def fits_gpu(needed_bytes: int, gpu_memory_bytes: int) -> bool:
    """Whether an estimate fits GPU_SHARE of the GPU, the margin every decision keeps."""
    return needed_bytes <= GPU_SHARE * gpu_memory_bytes


def check_fits(
    config: Config,
    world_size: int,
    gpu_memory_bytes: int,
    mode: str,
    offload: bool = False,
    note: str = "",
    shard_ranks: int | None = None,
) -> None:
    """ConfigError (one line: the estimate, the GPU's memory, what would help) when the
    estimate exceeds gpu_memory_bytes. note goes after the GPU's memory (why offload does not help).
    shard_ranks: the ranks of a node, which HSDP shards over (mode "hsdp")."""
    needed = estimate(config, world_size, mode, offload, shard_ranks)
    if fits_gpu(needed.total, gpu_memory_bytes):
        return
    suggestions = _suggestions(config, world_size, mode, needed.total, gpu_memory_bytes, shard_ranks)
    hint = "try " + join_or(suggestions) if suggestions else "use a smaller model or a shorter data.context_length"
    if mode == "hsdp" and world_size > 1:
        where = f"with HSDP (sharded over {node_gpus(min(shard_ranks or world_size, world_size))})"
    else:
        where = "with FSDP" if mode == "fsdp" and world_size > 1 else "with DDP" if world_size > 1 else "on one GPU"
    if offload:
        where += " and CPU offload"
    raise ConfigError(
        f"preset {config.preset} needs ~{gib(needed.total)} GiB per GPU {where} ({needed.parts()}) "
        f"but the GPU has {gib(gpu_memory_bytes)} GiB (a run plans on {GPU_SHARE:.0%} of it){note}; {hint}"
    )


def _suggestions(
    config: Config, world_size: int, mode: str, total: int, gpu_memory_bytes: int, shard_ranks: int | None = None
) -> list[str]:
    """The changes not already made that lower the estimate, each as the user would make it."""
    t = config.training
    found = []

    def helps(changed: Config, ranks: int = world_size, as_mode: str = mode) -> bool:
        return estimate(changed, ranks, as_mode, shard_ranks=shard_ranks).total < total

    if mode == "ddp" and world_size > 1 and helps(config, as_mode="fsdp"):
        found.append("--set training.parallelism=fsdp")
    elif mode == "hsdp" and helps(config, as_mode="fsdp"):  # sharded over every node's GPUs, not one node's
        found.append(f"--set training.parallelism=fsdp (sharded over all {world_size} GPUs)")
    untraced = dataclasses.replace(config, debug=dataclasses.replace(config.debug, trace_nonfinite=False))
    if t.activation_checkpointing == "auto":
        untraced = with_training(untraced, activation_checkpointing="full")  # what "auto" may choose without the hooks
    if t.activation_checkpointing != "none" and cfg.activation_checkpointing(config) == "none" and helps(untraced):
        found.append("--set debug.trace_nonfinite=false (its hooks turn activation checkpointing off)")
    elif less_kept := _more_checkpointing(config, world_size, mode, total, gpu_memory_bytes, shard_ranks):
        found.append(f"--set training.activation_checkpointing={less_kept}")
    if not loss_chunked(config) and helps(with_training(config, loss_chunk_tokens=LOSS_CHUNK_TOKENS)):
        found.append(f"--set training.loss_chunk_tokens={LOSS_CHUNK_TOKENS}")
    kept_gathered = mode in cfg.SHARDED_MODES and world_size > 1 and t.reshard_after_forward is False
    if kept_gathered and helps(with_training(config, reshard_after_forward=True)):
        found.append("--set training.reshard_after_forward=true")
    if t.batch_size > 1:
        found.append(
            "a smaller training.batch_size"
            if t.global_batch_size
            else "a smaller training.batch_size with a larger training.grad_accum_nums"
        )
    if mode == "fsdp" or world_size == 1:
        if helps(config, ranks=max(2, 2 * world_size), as_mode="fsdp"):
            # "auto" picks FSDP by itself once there are GPUs to shard over
            gpus = _gpus_that_fit(config, world_size, gpu_memory_bytes)
            more = f"{gpus} or more GPUs" if gpus else "more GPUs"
            found.append(
                f"{more} (FSDP shards the model over them)"
                if mode == "fsdp" or t.parallelism == "auto"
                else f"{more} with --set training.parallelism=fsdp"
            )
    return found


def _more_checkpointing(
    config: Config, world_size: int, mode: str, total: int, gpu_memory_bytes: int, shard_ranks: int | None = None
) -> str | None:
    """The least activation checkpointing beyond config's that makes it fit the GPU, else the most
    if that lowers the estimate at all; None when the debug hooks turn it off or nothing helps."""
    if config.debug.trace_nonfinite:
        return None
    current = cfg.CHECKPOINTING_MODES.index(cfg.activation_checkpointing(config))
    more = [with_training(config, activation_checkpointing=name) for name in cfg.CHECKPOINTING_MODES[current + 1 :]]
    estimates = [estimate(changed, world_size, mode, shard_ranks=shard_ranks).total for changed in more]
    for changed, needed in zip(more, estimates, strict=True):
        if fits_gpu(needed, gpu_memory_bytes):
            return cfg.activation_checkpointing(changed)
    return cfg.activation_checkpointing(more[-1]) if more and estimates[-1] < total else None


def _gpus_that_fit(config: Config, world_size: int, gpu_memory_bytes: int, most: int = 1024) -> int | None:
    """The fewest GPUs (more than world_size, at most `most`) over which FSDP fits, if any."""
    for gpus in range(world_size + 1, most + 1):
        if fits_gpu(estimate(config, gpus, "fsdp").total, gpu_memory_bytes):
            return gpus
    return None


# --- the one GPU memory figure -----------------------------------------------------------


def planned_gpu_memory(config: Config, measured_bytes: int | None) -> int | None:
    """The GPU memory, in bytes, a run plans on: system.gpu_memory_gib when set, else
    measured_bytes (the launcher's NVML total; None on CPU workers). The launcher writes the
    figure into the workers' config (with_gpu_memory), and a worker plans on that figure, not on
    torch's total_memory, which reports ~0.5 GiB less for the same GPU: a run the launcher accepts
    at the line is never refused by its workers. ConfigError when the setting exceeds what was
    measured."""
    given = config.system.gpu_memory_gib
    if given is None or measured_bytes is None:
        return measured_bytes
    planned = int(given * GIB)
    if planned > measured_bytes:
        raise ConfigError(
            f"system.gpu_memory_gib is {given:g} but the GPU has {gib(measured_bytes)} GiB; "
            "set it to at most that, or to null to plan on the whole GPU"
        )
    return planned


def with_gpu_memory(config: Config, gpu_memory_bytes: int) -> Config:
    """config with system.gpu_memory_gib set to gpu_memory_bytes (exact: a byte count over 2^30 is
    a float that multiplies back to the same count)."""
    return dataclasses.replace(config, system=dataclasses.replace(config.system, gpu_memory_gib=gpu_memory_bytes / GIB))


def with_training(config: Config, **changes: Any) -> Config:
    """config with training's fields changed. (Any: a TypedDict of TrainingConfig's fields would
    repeat them; dataclasses.replace checks the names when it runs.)"""
    return dataclasses.replace(config, training=dataclasses.replace(config.training, **changes))


def join_or(items: list[str]) -> str:
    """a; a or b; a, b, or c"""
    if len(items) <= 2:
        return " or ".join(items)
    return ", ".join(items[:-1]) + ", or " + items[-1]
