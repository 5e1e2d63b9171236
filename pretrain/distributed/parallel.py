"""How the model is spread over the ranks: activation checkpointing, torch.compile, DDP, FSDP2
over every rank, or hybrid sharding (HSDP: FSDP2 within each node, replicated across nodes), with
CPU offload when training.cpu_offload is true, and where its weights are first made.

train.py builds a Transformer on the meta device (shapes, no storage) and hands it to
parallelize(), which shards it and only then allocates and initialises it, shard by shard
(materialize), so that no rank ever holds the whole model. Everything else train.py needs
to know about the wrapper (the module with the plain state_dict names, when gradients are
synchronised during accumulation, the global gradient norm) goes through the functions here,
so the training loop reads the same whichever mode runs. Which mode runs is decided once, by the
launcher (pretrain/plan/parallelism.py), and written into training.parallelism.
"""

from __future__ import annotations

import functools
import logging
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch._functorch.config
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from pretrain import config as cfg
from pretrain.plan.compile_prerequisites import compile_off_line, compile_requested, missing_compile_prerequisite
from pretrain.config import Config
from pretrain.model.moe import place_experts
from pretrain.model.transformer import Transformer, TransformerBlock
from pretrain.distributed import float8
from pretrain.distributed.runtime import Runtime, process_group_backend
from pretrain.plan import float8 as float8_plan


def compile_enabled(config: Config, device: torch.device) -> bool:
    """training.compile, or, when it is null, on CUDA only (a first compile on CPU is slow);
    never with debug.trace_nonfinite, and never without what torch.compile builds its kernels
    with (a compiler and the Python headers: then off, with one warning line)."""
    if not compile_requested(config, device.type):
        return False
    if missing := missing_compile_prerequisite(device.type):
        logging.getLogger("pretrain").warning(compile_off_line(missing))
        return False
    return True


def compile_mode(config: Config) -> str | None:
    """torch.compile's mode argument for training.compile_mode: None for "default" (torch's own
    default, whatever a version makes it), else the mode's name."""
    chosen = config.training.compile_mode
    return None if chosen == "default" else chosen


MODES = ("single", "ddp", *cfg.SHARDED_MODES)
"""A trainer's modes: one process, DDP, FSDP2 over every rank, HSDP (FSDP2 on a 2-D mesh)."""


def parallelize(model: Transformer, config: Config, runtime: Runtime, mode: str) -> nn.Module:
    """The model as trained: activation checkpointing and torch.compile per block when the
    config asks for them, then DDP, FSDP2 or HSDP (mode "ddp", "fsdp" or "hsdp") when there is
    more than one rank, or FSDP2 with CPU offload (training.cpu_offload, mode "fsdp"), even for one
    rank. One process otherwise gets the model itself, whatever the mode ("single" says so
    explicitly). HSDP needs several nodes (runtime.nodes; the plan runs FSDP on one).
    A model built on the meta device is materialised here, after sharding and before DDP
    (which broadcasts rank 0's weights). Parameter names and state_dict keys never change."""
    if mode not in MODES:
        raise ValueError(
            f"mode must be single, ddp or fsdp, or hsdp on several nodes (got {mode!r}); "
            "the launcher resolves training.parallelism"
        )
    if mode == "single" and runtime.distributed:
        raise ValueError(f"mode single is for one process, but there are {runtime.world_size} ranks")
    if mode == "hsdp" and runtime.nodes < 2:
        raise ValueError(
            f"mode hsdp replicates across nodes, but the {runtime.world_size} rank(s) are on one node "
            "(LOCAL_WORLD_SIZE); the plan runs fsdp there"
        )
    t = config.training
    offload = bool(t.cpu_offload)
    if offload and mode not in cfg.SHARDED_MODES:
        raise ValueError(f"training.cpu_offload needs mode fsdp or hsdp (got {mode!r})")
    sharded = mode in cfg.SHARDED_MODES and (runtime.distributed or offload)
    if float8_plan.requested(config):  # first: checkpointing, compile and FSDP2 then wrap the float8 Linears
        float8.convert(model, config, fsdp=sharded)
    for block in blocks(model):
        checkpoint_activations(block, cfg.activation_checkpointing(config))
    place_experts(model, runtime.device)  # before compile: the compiled blocks never ask CUDA for its capability
    if compile_enabled(config, runtime.device):
        how = compile_mode(config)
        # The norm's and the cross-entropy's autograd Functions (pretrain/model) keep AOT autograd's
        # cache from being used unless allowed: a warm launch would trace and partition every graph
        # again (1.6-2.7 s of its first step on 2 CPU cores). Both depend on their inputs only.
        torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
        for block in blocks(model):
            block.compile(mode=how)  # in place: no OptimizedModule wrapper, so no _orig_mod. in the names
        model.compile_loss_head = True  # the output projection and cross-entropy (pretrain/model/loss.py)
        model.compile_mode = how  # which that head's compile takes too
    if sharded:
        mesh = hybrid_mesh(runtime) if mode == "hsdp" else device_mesh(runtime)
        model = shard(model, mesh, t.use_amp, offload, reshard_after_forward=t.reshard_after_forward is not False)
    materialize(model, runtime.device, t.seed, offload)
    if runtime.distributed and mode == "ddp":
        return replicate(model, runtime.device)
    return model


def materialize(model: Transformer, device: torch.device, seed: int, offload: bool) -> None:
    """Allocate a model built on the meta device (under FSDP: each rank's shards only) and
    initialise it from seed (Transformer.init_weights: one whole parameter at a time, so the
    weights are those of a model built whole with that seed). Under CPU offload the parameters
    live in host memory and the rotary tables, which the forward pass reads directly, on the
    device. A model that already has storage is left as it is."""
    if not any(_is_meta(p) for p in model.parameters()):
        return
    model.to_empty(device=torch.device("cpu") if offload else device)
    model.reset_rotary(device)
    model.init_weights(seed, draw_device=device)


def _is_meta(param: Tensor) -> bool:
    return (param.to_local() if isinstance(param, DTensor) else param).is_meta


def hybrid_mesh(runtime: Runtime) -> DeviceMesh:
    """HSDP's mesh: (nodes, ranks_per_node), named ("replicate", "shard"). Ranks are node-major, so
    each row is one node's ranks, over which each parameter is sharded (its all-gathers and
    reduce-scatters stay within the node), and each column holds the same shard on every node,
    over which gradients are all-reduced (the only traffic between nodes)."""
    return init_device_mesh(runtime.device.type, (runtime.nodes, runtime.ranks_per_node), mesh_dim_names=("replicate", "shard"))


def device_mesh(runtime: Runtime) -> DeviceMesh:
    """FSDP's mesh: every rank in one dimension. FSDP2 needs a process group even for one process (CPU
    offload), so a lone process joins one of its own (torch.distributed's in-memory store);
    pretrain/distributed/runtime.py's shutdown leaves it."""
    if not dist.is_initialized():
        if runtime.distributed:
            raise RuntimeError("FSDP over several ranks needs the process group that init_runtime joins")
        backend = process_group_backend(runtime.device, host_tensors=True)  # the offloaded shards'
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=runtime.device if runtime.device.type == "cuda" else None,
        )
    return init_device_mesh(runtime.device.type, (runtime.world_size,))


def blocks(model: Transformer) -> list[TransformerBlock]:
    return [module for module in model.layers if isinstance(module, TransformerBlock)]


def checkpoint_activations(block: TransformerBlock, mode: cfg.CheckpointingMode) -> None:
    """Keep less of the block for the backward pass and recompute the rest there: "full" keeps
    only the block's inputs and runs its forward again; "selective" also keeps what the matmuls
    and attention return (selective_saved_ops) and recomputes only the element-wise ops between
    them (norms, rotary, silu, products), torchtitan's selective op mode. "none" leaves it be.

    The block's forward is replaced on the instance, not wrapped in another module, so the
    module tree, and with it every parameter name, stays as it was. The recomputation calls
    the class's forward directly: under FSDP2 it runs while the block's parameters are
    gathered for its backward, as the hooks of a call would not run twice. torch.compile
    (block.compile(), after this) traces the checkpoint with its policy into the block's graph."""
    if mode == "none":
        return
    plain_forward = type(block).forward
    context_fn = functools.partial(create_selective_checkpoint_contexts, selective_saved_ops()) if mode == "selective" else None

    def forward(self: TransformerBlock, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        if not torch.is_grad_enabled():  # evaluation: nothing is kept anyway
            return plain_forward(self, x, cos, sin)
        if context_fn is None:
            return checkpoint(plain_forward, self, x, cos, sin, use_reentrant=False)
        return checkpoint(plain_forward, self, x, cos, sin, use_reentrant=False, context_fn=context_fn)

    # Replacing a method on an instance is what mypy's method-assign flags; here it is the point.
    block.forward = types.MethodType(forward, block)  # type: ignore[method-assign]


def selective_saved_ops() -> list[torch._ops.OpOverload]:
    """The ops whose outputs selective checkpointing keeps: the matmuls (every nn.Linear runs as
    one of them; a float8 Linear, training.float8 true, as _scaled_mm, which would otherwise run
    again in the backward pass) and each scaled-dot-product-attention kernel (its output and
    logsumexp), the work worth keeping; every other op's output is recomputed in the backward pass.
    Also the full reductions to a maximum: a float8 cast's absolute maximum, from which its scale
    comes (one number per tensor), kept as torchtitan keeps it rather than read the tensor again."""
    aten = torch.ops.aten
    ops = [
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_mm.default,
        aten.max.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    ]
    if hasattr(aten, "_grouped_mm"):  # experts' matmuls, where a mixture of experts uses it
        ops.append(aten._grouped_mm.default)
    return ops


def replicate(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    """DDP: a full copy per rank, gradients all-reduced in buckets during the backward pass.
    The gradients are views into those buckets (gradient_as_bucket_view), so they are not
    held twice."""
    # The only buffers are the rotary tables: constants, identical on every rank, so
    # broadcasting them before every forward would be wasted traffic. torch 2.13 warns
    # that broadcast_buffers is deprecated, but its replacement still syncs at init.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False,
            gradient_as_bucket_view=True,
        )


def shard(
    model: Transformer, mesh: DeviceMesh, use_amp: bool, offload: bool = False, reshard_after_forward: bool = True
) -> Transformer:
    """FSDP2: parameters sharded over the ranks and gathered only while their group runs (on a 2-D
    mesh, HSDP: sharded over its "shard" dimension, replicated over "replicate"). The groups: the
    embedding, each block, and the root (the final norm and the output projection, gathered
    through the whole step, as it is needed again as soon as the backward pass starts).

    reshard_after_forward (training.reshard_after_forward, which the launcher's plan decides):
    each block's gathered weights are freed after its forward and all-gathered again for its
    backward; false keeps them until the backward, one all-gather fewer per micro-batch for
    every block's weights, and the embedding's, held at the start of the backward pass
    (pretrain/plan/gpu_memory.py). The last block is never resharded: its backward comes right after the
    head's, as torchtitan does.

    Under use_amp the blocks and the root are gathered as bf16 and their gradients reduced in
    fp32; every sharded master weight stays fp32. The modes must compute the same thing, and
    in every mode the model casts the embedding's output to autocast's dtype itself, so the
    residual stream (x + block(x)) is bf16 under autocast (Transformer.forward). So here the
    embedding is gathered in fp32, as DDP holds it (its lookup then cast gives the same bf16 rows),
    and no group casts its floating-point inputs (cast_forward_inputs=False): autocast runs each
    matmul in bf16, as it does under DDP.
    The one difference left: the norms' weights are gathered as bf16 with their group, where
    autocast leaves them fp32, so once trained the losses differ in the fifth digit or so.

    With offload, each group's sharded parameters, gradients and so the optimizer's state live
    in host memory; each group is copied to the device for its all-gather and its gradients back
    after the reduce-scatter (pinned memory on CUDA, for asynchronous copies)."""
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if use_amp else None,
        reduce_dtype=torch.float32 if use_amp else None,
        cast_forward_inputs=False,
    )
    # Without offload, OffloadPolicy(): fully_shard's own default, which offloads nothing.
    offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    # No mp_policy: fp32, as DDP holds it (the model casts its output). Kept gathered with the blocks when they
    # are: its backward is the step's last, and gathering 4 bytes a parameter twice per micro-batch
    # is the largest all-gather of all (the vocabulary x dim table).
    fully_shard(model.tok_embed, mesh=mesh, offload_policy=offload_policy, reshard_after_forward=reshard_after_forward)
    layers = blocks(model)
    for i, block in enumerate(layers):
        reshard = reshard_after_forward and i < len(layers) - 1
        fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload_policy)
    return model


def is_hybrid(model: nn.Module) -> bool:
    """Whether model is sharded by HSDP: FSDP2 on a 2-D mesh (replicated across its first dimension)."""
    first = next((p for p in model.parameters() if isinstance(p, DTensor)), None) if is_fsdp(model) else None
    return first is not None and first.device_mesh.ndim == 2


def is_fsdp(model: nn.Module) -> bool:
    """Whether model itself is FSDP2-sharded (parallelize shards the root whenever it shards)."""
    return isinstance(model, FSDPModule)


def has_fsdp(model: nn.Module) -> bool:
    """Whether model or any of its submodules is FSDP2-sharded: then its state_dict holds
    DTensor shards, and saving or loading it is a collective over every rank."""
    return any(isinstance(module, FSDPModule) for module in model.modules())


def unwrap(model: nn.Module) -> Transformer:
    """The Transformer, whose state_dict has the plain parameter names (under FSDP2 its values
    are DTensors: each rank's shard)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if not isinstance(inner, Transformer):
        raise TypeError(f"expected a Transformer, DDP or FSDP2 model, got {type(model).__name__}")
    return inner


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Inside, a DDP backward pass all-reduces gradients only when enabled: the micro-batches of
    gradient accumulation before the last add to each rank's local gradients instead, which DDP
    holds anyway (its full gradients are the buckets).

    FSDP2 reduce-scatters on every micro-batch whatever enabled says, as torchtitan does: without
    the sync, FSDP2 keeps every parameter's full, unsharded gradient (fp32 under use_amp: 4 bytes
    a parameter, ~30 GiB for Llama-3 8B) until the last micro-batch, while with it only the
    shards accumulate and the estimate (pretrain/plan/gpu_memory.py) stays true. The extra reduce-scatters
    overlap with the backward's compute, and stay within a node under HSDP. There, the all-reduce
    of the shards across nodes (the traffic between them) runs only when enabled: before the last
    micro-batch each rank adds its node's reduce-scattered shards up, and the last all-reduces the
    sum once (set_requires_all_reduce), as DDP's no_sync does for the whole gradient. The flag is
    back on when the block ends, so an unfinished accumulation never leaves it off.
    One process has no sync to skip."""
    if enabled or not isinstance(model, DistributedDataParallel | FSDPModule):
        yield
        return
    if isinstance(model, FSDPModule):
        if not is_hybrid(model):  # FSDP over every rank: nothing is all-reduced
            yield
            return
        model.set_requires_all_reduce(False)
        try:
            yield
        finally:
            model.set_requires_all_reduce(True)
        return
    with model.no_sync():
        yield


def clip_grad_norm(model: nn.Module, max_norm: float) -> Tensor:
    """Clip the gradients to a global norm of max_norm (0 or inf: leave them) and return their
    global norm before clipping: a plain 0-d tensor on the device, the same on every rank."""
    total = grad_norm(model)
    clip_gradients(model, max_norm, total)
    return total


def grad_norm(model: nn.Module) -> Tensor:
    """The global norm of every gradient: a plain 0-d tensor on the device, the same on every
    rank. Under FSDP2 each rank holds a shard of every gradient, so the norm of the shards is
    reduced over the ranks (full_tensor: under HSDP over a node's ranks, each node holding the same
    shards)."""
    device = compute_device(model)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:  # nothing was trained (every gradient None): the norm is 0
        return torch.zeros((), device=device)
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        # Under CPU offload the shards' norm is in host memory: reduce it on the device (NCCL
        # reduces no host tensor), as FSDP's own collectives do.
        total = DTensor.from_local(total.to_local().to(device), total.device_mesh, total.placements).full_tensor()
    return total.to(device)


def compute_device(model: nn.Module) -> torch.device:
    """Where the forward pass runs: the rotary tables' device (under CPU offload the
    parameters are in host memory, the tables never are)."""
    return unwrap(model).rope_cos.device


def clip_gradients(model: nn.Module, max_norm: float, total: Tensor) -> None:
    """Scale the gradients so their global norm, total, becomes max_norm, if it is above it
    (0 or inf: leave them). Apart from clip_grad_norm so that a non-finite norm can be caught
    first: scaling by it would turn every gradient into NaN and hide which ones were bad."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    if parameters and 0 < max_norm < float("inf"):
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
