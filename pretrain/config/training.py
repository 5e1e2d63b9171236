"""The config's training section: TrainingConfig (the batch and its accumulation, the optimizer,
the schedule, precision, compile, what is recomputed, checkpoints), its fields' docstrings and
its own checks. Split from schema.py, which assembles the sections into Config.
Nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pretrain import registry
from pretrain.config.checks import (
    MAX_COUNT,
    MAX_SIZE,
    MAX_STEPS,
    check as _check,
    check_at_most as _check_at_most,
    describe,
    not_one_of,
)


CheckpointingMode = Literal["none", "selective", "full"]
"""What a block recomputes in the backward pass, least first (training.activation_checkpointing once planned)."""
CHECKPOINTING_MODES: tuple[CheckpointingMode, ...] = ("none", "selective", "full")
SHARDED_MODES = ("fsdp", "hsdp")
"""The modes (training.parallelism, a trainer's mode) in which FSDP2 shards the parameters: over
every rank, or over the ranks of a node and replicated across nodes."""
CHECKPOINTING_CHOICES = (*CHECKPOINTING_MODES, "auto")
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_MODES: tuple[CompileMode, ...] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""torch.compile's modes (torch._inductor.list_mode_options(), less "lite", a debugging mode that
falls back to eager kernels): training.compile_mode's choices."""


@dataclass(frozen=True)
class TrainingConfig:
    batch_size: int = 1
    """Sequences per forward pass on each rank (the micro-batch)."""
    grad_accum_nums: int | Literal["auto"] = 8
    """Micro-batches accumulated into one optimizer step. "auto": the largest micro-batch that fits the GPU, and as many of them as keep training.global_batch_size (which "auto" needs: the global batch it keeps; the per-rank share, global_batch_size / ranks, must be whole). The plan (launcher/prepare.py, or a run alone) tries every divisor of the per-rank share as training.batch_size, largest first, with the least recomputation that fits, against the memory estimate (pretrain/plan/gpu_memory.py); on CPU workers, which have no GPU memory to fill, the micro-batch is the largest divisor of the share at most training.batch_size. The run's config.json and its log hold the numbers chosen."""
    num_workers: int = 0
    """DataLoader worker processes per rank; 0 loads batches in the training process."""
    optimizer: str = "adamw"
    """The optimizer, by its name in pretrain/registry.py (OPTIMIZERS): "adamw" (decoupled weight decay on matrices only), or "muon" (Muon for the matrices inside the blocks, AdamW for embeddings, norms and the output layer)."""
    lr_schedule: str = "cosine"
    """The learning-rate schedule, by its name in pretrain/registry.py (LR_SCHEDULES): "cosine" (linear warmup, then cosine decay to min_lr_ratio)."""
    learning_rate: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    min_lr_ratio: float = 0.1
    """Learning rate at the last step, as a fraction of the peak (cosine decay)."""
    warmup_steps: int = 2000
    """Optimizer steps of linear warmup from zero to the peak learning rate."""
    max_steps: int = 10000
    """Optimizer steps to train for (when epochs is 0)."""
    epochs: int = 0
    """Passes over the train split; sets the run length instead of max_steps when above 0 (setting both is an error)."""
    by_epoch: bool = False
    """Count the run in epochs: the step line shows how many are done, and a checkpoint is saved at the end of each. The launcher sets it for a run whose length is training.epochs (the workers then get that length as max_steps)."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to weight matrices only."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    muon_learning_rate: float = 0.02
    """Muon's peak learning rate for the matrices inside the blocks (training.optimizer=muon); the schedule scales it as it scales learning_rate, which the AdamW groups use."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov) before the update is orthogonalized."""
    muon_orthogonalize: str = "newton_schulz"
    """How Muon orthogonalizes an update, by its name in pretrain/registry.py (ORTHOGONALIZERS): "newton_schulz" (a few bfloat16 iterations) or "svd" (exact, slow)."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per Muon update."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    use_amp: bool = True
    """Run the forward pass in bfloat16 autocast (weights and optimizer stay fp32)."""
    seed: int = 1337
    """Seed for initialisation and data order; identical on every rank. Below 2^63."""
    eval_interval: int = 0
    """Compute validation loss every N steps (a fresh run from step 0, before training) and after the last step; 0 only after the last step. The loss logged at step N is that of the weights checkpoint step_N holds."""
    eval_batches: int = 4
    """Global batches in one validation pass: the first eval_batches x the global batch (batch_size x grad_accum_nums x ranks) windows of the val split (all of it when it holds fewer), shared out over the ranks, so validation covers the same windows whatever the number of GPUs; each rank runs eval_batches x grad_accum_nums micro-batches."""
    global_batch_size: int = 0
    """Sequences per optimizer step over all ranks; when above 0, grad_accum_nums is derived from it (it must be a multiple of batch_size x ranks), so the step stays the same whatever the number of GPUs."""
    parallelism: Literal["auto", "ddp", "fsdp", "hsdp"] = "auto"
    """How ranks share the model: "ddp" (a full copy on each GPU), "fsdp" (FSDP2, parameters sharded per block over every rank), "hsdp" (hybrid: FSDP2 sharded over the ranks of a node and replicated across nodes, so only one gradient all-reduce per step crosses the network; on one node it is FSDP, with a warning; refused in one line where the model does not fit sharded within one node), or "auto" (DDP when the estimated memory fits one GPU; else, on several nodes, HSDP when the model fits sharded within one node, with whatever recomputation that takes; else FSDP). The launcher's "parallelism:" line says which and why."""
    cpu_offload: bool | None = None
    """FSDP2 with CPU offload: sharded weights, gradients and AdamW state in host memory, the GPU holding only what is in flight (slower: every step copies them over PCIe); null uses it only when the model does not fit the GPUs but fits with it, within the host's memory (the launcher says so). Offload shards over every rank: with training.parallelism=hsdp on several nodes it is refused, and "auto" offloads as FSDP."""
    activation_checkpointing: Literal["none", "selective", "full", "auto"] | bool = "auto"
    """What each block recomputes in the backward pass instead of keeping: "none"; "selective" (keeps the matmul and attention outputs, recomputes the element-wise ops: norms, rotary, silu, products; no matmul FLOPs added); "full" (keeps only the block's input and runs its forward again: ~20-25% more FLOPs); "auto": the least that fits the GPU, chosen by the launcher's plan (on CPU workers none unless the host memory needs more). true and false mean full and none."""
    float8: bool | Literal["emulate"] = False
    """Run the blocks' matmuls in float8 through torchao's float8 linears (tensorwise dynamic scaling; pip install ".[float8]"): true on a CUDA GPU of compute capability 8.9 or later (L4, L40S, H100, H200), where it speeds up large matmuls (8B-class models; torchtitan reports 1.2-1.3x on H100s); "emulate": the same float8 casts and scales with the matmuls emulated in high precision, on any device (tests and numerics checks, no speed-up); false: bf16 matmuls. Needs training.use_amp. The output head, the embedding, a mixture of experts' router and experts, and any Linear whose dims are not multiples of 16 stay bf16; weights, gradients, optimizer state and checkpoints stay high precision, and MFU is still counted against the bf16 peak (docs/training.md, "Float8 training")."""
    compile: bool | None = None
    """torch.compile the model; null compiles on CUDA and not on CPU (where the first compile is slow)."""
    compile_mode: CompileMode = "default"
    """torch.compile's mode for the blocks and the loss head, when training.compile is on: "default" (torch's); "max-autotune-no-cudagraphs" (times several Triton configurations of each matmul and fused kernel and keeps the fastest); "max-autotune" (the same, and replays each compiled region as a CUDA graph); "reduce-overhead" (CUDA graphs only, for launch-bound small models). Autotuning lengthens the first step's compile: on CPU, debug preset, 72 s against 69 s (CPU has little to tune); on a GPU it times every matmul's candidate kernels, minutes more, not measured yet (docs/training.md, "Compile modes"). CUDA graphs keep each graph's inputs and outputs in memory of their own, which the memory plan does not count."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the output projection and cross-entropy, each chunk's fp32 logits recomputed in the backward pass (one more output-projection matmul) so that those of the whole micro-batch never exist at once; 0 computes them in one piece; null: one piece when the whole micro-batch's logits fit the GPU, else 2048 (the launcher's plan decides)."""
    reshard_after_forward: bool | None = None
    """FSDP and HSDP: free each block's gathered bf16 weights after its forward and all-gather them again for its backward (true), or keep them gathered until then (false: one all-gather fewer per micro-batch, every block's weights unsharded at the start of the backward pass); null: false when those weights fit the GPU (the launcher's plan decides)."""
    checkpoint_interval: int = 1000
    """Save a checkpoint every N steps (and always after the last step); 0 only after the last step."""
    keep_checkpoints: int = 3
    """How many step_<N> checkpoints to keep; older ones are deleted once a newer one is complete."""
    async_checkpoint: bool | Literal["auto"] = "auto"
    """Write checkpoints in the background: the step blocks only while the state is copied to host memory (pinned on a GPU), then training goes on while a thread writes it (DCP's asynchronous save under FSDP); at most one save is in flight (a second waits for the first), and a checkpoint is complete (renamed into place, pruned after) only once every rank's files are written. "auto": on where the host has memory for the staged copy (the state's bytes on this host), else off, said in one line; true: the same, refused in one line where the host has no room; false: every save blocks the step for the whole write (docs/training.md, "Checkpoints")."""
    local_checkpoint_interval: int = 0
    """Also save a checkpoint every N steps on the node (training.local_checkpoint_dir), of which only the newest is kept: a restart or --resume auto takes the newest complete checkpoint of either tier (a local one only when every node has the same step), so a restart redoes at most N steps instead of checkpoint_interval; must be below checkpoint_interval when both are set (a step due in both is saved durable). The local tier is removed when the run ends; a durable checkpoint is never pruned for a local one. 0: no local tier. On several nodes with the sharded format (FSDP or HSDP) the local tier is off (docs/failures.md, "Local checkpoints")."""
    local_checkpoint_dir: str = ""
    """Where the local checkpoints go (training.local_checkpoint_interval), each node's its own: into <dir>/<run id>-<hash of the run directory's path>/ (node<k>/ inside that on several nodes), removed when the run ends. "": /dev/shm/pretrain-<user>/<run id>-<hash>/ when /dev/shm has room for two checkpoints (weights and optimizer state), else no local tier, said in one warning line. A directory named here that is not writable, too small, or is, holds or is inside the run directory or the runs root is refused before any worker starts. Also --local-checkpoint-dir."""
    resume: str = ""
    """Continue from a checkpoint: "auto" (the latest one of the run directory, or of the run under runs/ whose latest checkpoint is newest), a checkpoint or run directory path, or "" to start fresh. Also --resume."""
    init_from: str = ""
    """Start a fresh run from a Hugging Face Llama or Mixtral checkpoint: a local directory (config.json and safetensors) or a Hub model id (owner/name, or owner/name@revision), read through the Hugging Face cache (offline: what the cache holds). Every tensor's name and shape, and the fields that change what the model computes (heads, rotary base, norm epsilon, experts), are checked against model before any worker starts; the optimizer and the learning-rate schedule start afresh at step 0. A checkpoint to resume from (training.resume) wins over it. "" starts from random weights. Also --init-from."""

    AT_MOST: ClassVar[dict[str, int]] = {
        "batch_size": MAX_SIZE,
        "grad_accum_nums": MAX_SIZE,
        "num_workers": 1024,
        "warmup_steps": MAX_STEPS,
        "max_steps": MAX_STEPS,
        "epochs": 10**6,
        "muon_ns_steps": 100,
        "eval_interval": MAX_STEPS,
        "eval_batches": MAX_SIZE,
        "global_batch_size": 1 << 32,
        "loss_chunk_tokens": MAX_COUNT,
        "checkpoint_interval": MAX_STEPS,
        "keep_checkpoints": MAX_STEPS,
        "local_checkpoint_interval": MAX_STEPS,
    }

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_steps", "eval_batches", "keep_checkpoints", "muon_ns_steps"):
            _check(getattr(self, name) >= 1, f"training.{name}", f"must be at least 1 (got {getattr(self, name)})")
        accum = self.grad_accum_nums
        _check(
            accum == "auto" or (isinstance(accum, int) and accum >= 1),
            "training.grad_accum_nums",
            f'must be at least 1 or "auto" (got {accum!r})',
        )
        _check(self.compile_mode in COMPILE_MODES, "training.compile_mode", not_one_of(self.compile_mode, COMPILE_MODES))
        for name in (
            "epochs",
            "num_workers",
            "warmup_steps",
            "weight_decay",
            "max_grad_norm",
            "eval_interval",
            "global_batch_size",
            "checkpoint_interval",
            "local_checkpoint_interval",
        ):
            _check(getattr(self, name) >= 0, f"training.{name}", f"must not be negative (got {getattr(self, name)})")
        _check_at_most(self, "training")
        if self.loss_chunk_tokens is not None:
            _check(
                self.loss_chunk_tokens >= 0,
                "training.loss_chunk_tokens",
                f"must not be negative (got {self.loss_chunk_tokens}); 0 computes the loss in one piece, null lets the plan decide",
            )
        if isinstance(self.activation_checkpointing, bool):  # the older true/false: full or none
            object.__setattr__(self, "activation_checkpointing", "full" if self.activation_checkpointing else "none")
        _check(
            self.activation_checkpointing in CHECKPOINTING_CHOICES,
            "training.activation_checkpointing",
            not_one_of(self.activation_checkpointing, CHECKPOINTING_CHOICES) + " (true and false mean full and none)",
        )
        _check(
            self.async_checkpoint is True or self.async_checkpoint is False or self.async_checkpoint == "auto",
            "training.async_checkpoint",
            f'{describe(self.async_checkpoint)} is not one of true, false, "auto"',
        )
        _check(
            self.float8 is True or self.float8 is False or self.float8 == "emulate",
            "training.float8",
            f'{describe(self.float8)} is not one of true, false, "emulate"',
        )
        _check(
            self.float8 is False or self.use_amp,
            "training.float8",
            f"{describe(self.float8)} needs training.use_amp=true (float8 matmuls take bf16 autocast's inputs); set both, "
            'or training.float8=false (true also needs a CUDA GPU of compute capability 8.9+; "emulate" runs anywhere)',
        )
        local, durable = self.local_checkpoint_interval, self.checkpoint_interval
        _check(
            not (local and durable) or local < durable,
            "training.local_checkpoint_interval",
            f"must be below training.checkpoint_interval (got {local}, checkpoint_interval {durable}): the local tier is "
            f"the frequent one; lower it, or set it to 0 for durable checkpoints alone",
        )
        _check(
            self.local_checkpoint_dir == self.local_checkpoint_dir.strip(),
            "training.local_checkpoint_dir",
            f"{self.local_checkpoint_dir!r} has leading or trailing spaces; give a directory",
        )
        _check(0 <= self.seed < 2**63, "training.seed", f"must be in [0, 2**63) (got {self.seed})")
        _check(self.learning_rate > 0, "training.learning_rate", f"must be positive (got {self.learning_rate})")
        _check(0 <= self.min_lr_ratio <= 1, "training.min_lr_ratio", f"must be between 0 and 1 (got {self.min_lr_ratio})")
        for name in ("beta1", "beta2"):
            _check(0 <= getattr(self, name) < 1, f"training.{name}", f"must be in [0, 1) (got {getattr(self, name)})")
        _check(
            self.optimizer in registry.OPTIMIZERS,
            "training.optimizer",
            not_one_of(self.optimizer, registry.OPTIMIZERS),
        )
        _check(self.muon_learning_rate > 0, "training.muon_learning_rate", f"must be positive (got {self.muon_learning_rate})")
        _check(0 <= self.muon_momentum < 1, "training.muon_momentum", f"must be in [0, 1) (got {self.muon_momentum})")
        _check(
            self.muon_orthogonalize in registry.ORTHOGONALIZERS,
            "training.muon_orthogonalize",
            not_one_of(self.muon_orthogonalize, registry.ORTHOGONALIZERS),
        )
        _check(
            self.lr_schedule in registry.LR_SCHEDULES,
            "training.lr_schedule",
            not_one_of(self.lr_schedule, registry.LR_SCHEDULES),
        )
        _check(
            self.init_from == self.init_from.strip(),
            "training.init_from",
            f"{self.init_from!r} has leading or trailing spaces; give a directory or a Hub id (owner/name)",
        )
