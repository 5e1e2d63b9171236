"""A Llama-style decoder-only transformer.

tokens -> embedding -> n_layers x [x + attention(norm(x)), x + feed_forward(norm(x))] -> norm -> logits

Llama choices: RMSNorm before each block (pre-norm), rotary position embeddings on queries and
keys, grouped-query attention (fewer key/value heads than query heads), a SwiGLU feed-forward
block (model.ffn chooses another: pretrain/model/feed_forward.py), no biases, and an output projection
that is not tied to the embedding. Parameter names follow Meta's Llama layout
(`layers.0.attention.wo.weight`, ...) except where a block fuses matmuls that read the same input:
`attention.wqkv` holds wq's, wk's and wv's rows, `feed_forward.w13` w1's and w3's
(pretrain/model/fused_layout.py maps them both ways). The rotary embedding uses Meta's convention
(it rotates adjacent pairs of channels), so such checkpoints map onto this model by renaming
`tok_embeddings` to `tok_embed` and concatenating those weights (fused_layout.fuse_separate).
The model returns logits (or what an output head makes of its last hidden states) and the
blocks' auxiliary losses; the loss is pretrain/model/loss.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pretrain import registry
from pretrain.config import ModelConfig, RopeScalingConfig
from pretrain.model import shards


class RMSNorm(nn.Module):
    """x / rms(x) * weight: LayerNorm without the mean subtraction or bias (rms_norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / rms(x) * weight over the last dimension, in x's dtype; the statistics in float32."""
    return cast(Tensor, _RMSNorm.apply(x, weight, eps))


class _RMSNorm(torch.autograd.Function):
    """RMSNorm that keeps for the backward pass only its input, in its own dtype (bf16 in the
    residual stream under autocast), and the float32 1 / rms of each row, and recomputes the rest.
    Autograd through the float32 formula would keep a float32 copy of the input and of the
    normalised rows: 8 bytes a channel where this keeps 2. (torch.compile traces both passes and
    its partitioner chooses again; it keeps no float32 row either: benchmarks/efficiency.py.)"""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        # Squares of bf16 activations lose too much precision, so normalise in float32.
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight, rstd = ctx.saved_tensors  # type: ignore[attr-defined]
        normed = x.float() * rstd
        grad_normed = grad.float() * weight.float()
        # d/dx of x * rstd: rstd * (g - normed * mean(g * normed)), per row
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(dim=-1, keepdim=True))
        grad_weight = (grad.float() * normed).sum(dim=tuple(range(x.dim() - 1)))
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def rotary_tables(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScalingConfig | None = None
) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotation angle of every (position, channel pair): two (max_seq_len, head_dim // 2).
    scaling (Llama 3.1's, when it scales) slows the low frequencies down (llama3_frequencies)."""
    # Pair i turns by theta^(-2i / head_dim) radians per position: fast for the first pairs, slow for the last.
    # Angles are computed in float64 because position * frequency reaches thousands of radians.
    freqs = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (head_dim // 2,)
    if scaling is not None and scaling.scales:
        freqs = llama3_frequencies(freqs, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)  # (max_seq_len, head_dim // 2)
    return angles.cos().float(), angles.sin().float()


def llama3_frequencies(freqs: Tensor, scaling: RopeScalingConfig) -> Tensor:
    """Llama 3.1's scaled rotary frequencies (head_dim // 2,), as transformers'
    _compute_llama3_parameters computes them (in float64 here).

    A pair whose wavelength (positions per turn) exceeds the original context never turned a whole
    turn in training, so at longer contexts it would reach angles the model never saw: such slow
    pairs turn factor times slower (interpolation). Fast pairs, which turned many times and encode
    local order, keep their frequency; those between are blended linearly in context / wavelength.
    """
    wavelengths = 2 * math.pi / freqs  # (head_dim // 2,): positions per turn
    context = scaling.original_max_seq_len
    longest_kept = context / scaling.high_freq_factor  # shorter wavelengths are kept
    shortest_slowed = context / scaling.low_freq_factor  # longer wavelengths are divided by factor
    # 0 at the slowed bound, 1 at the kept one
    smooth = (context / wavelengths - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    slowed_or_blended = torch.where(wavelengths > shortest_slowed, freqs / scaling.factor, blended)
    return torch.where(wavelengths < longest_kept, freqs, slowed_or_blended)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each adjacent channel pair (2i, 2i + 1) of x (B, T, heads, head_dim) by its angle.

    Rotating q at position m and k at position n makes q . k depend only on m - n (and the content).
    """
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, T, heads, head_dim // 2, 2)
    x0, x1 = pairs.unbind(-1)  # each (B, T, heads, head_dim // 2)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, head_dim // 2): the same for every head
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (B, T, heads, head_dim // 2, 2)
    return rotated.flatten(-2).to(x.dtype)  # (B, T, heads, head_dim)


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings and grouped-query attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        # Queries, keys and values in one matmul: its rows are Llama's wq, wk and wv, in that
        # order (pretrain/model/fused_layout.py maps them). Three narrow matmuls (wk and wv are
        # only n_kv_heads x head_dim wide) would keep a GPU less busy and read x three times.
        self.qkv_rows = [cfg.n_heads * self.head_dim, cfg.n_kv_heads * self.head_dim, cfg.n_kv_heads * self.head_dim]
        self.wqkv = nn.Linear(cfg.dim, sum(self.qkv_rows), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def init_draws(self) -> list[tuple[Tensor, slice]]:
        """The weights' parts in the order Transformer.init_weights draws them: wq, wk, wv, wo,
        each whole, as before they were fused (so a seed gives the weights it always gave)."""
        q, kv, _ = self.qkv_rows
        wqkv = self.wqkv.weight
        return [(wqkv, slice(0, q)), (wqkv, slice(q, q + kv)), (wqkv, slice(q + kv, q + 2 * kv)), (self.wo.weight, slice(None))]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split(self.qkv_rows, dim=-1)  # views of one (B, T, (n_heads + 2 n_kv_heads) head_dim)
        q = q.view(B, T, self.n_heads, self.head_dim)  # (B, T, n_heads, head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Attention works per head, so heads go before time: (B, heads, T, head_dim).
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # Query head h reads key/value head h // (n_heads // n_kv_heads) (Llama's repeat_kv grouping).
        # enable_gqa does that without copies, but on CUDA only the flash kernel takes it, and flash
        # refuses fp32: fp32 q/k/v (use_amp=false) would fall back to the math kernel, which builds
        # the whole (B, n_heads, T, T) score matrix. So fp32 repeats K/V (n_heads / n_kv_heads
        # times their size, far below T x T) for the memory-efficient kernel; bf16 keeps enable_gqa.
        gqa = self.n_kv_heads != self.n_heads
        if gqa and q.dtype == torch.float32:
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, n_heads, T, head_dim)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, n_heads, T, head_dim)
            gqa = False
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (B, n_heads, T, head_dim)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, dim)
        return self.wo(y)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: the residual stream itself is never normalised. The feed-forward
    block is the one model.ffn names (pretrain/model/feed_forward.py; SwiGLU for Llama)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = registry.load(registry.FEED_FORWARDS[cfg.feed_forward].module)(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """(B, T, dim) -> (B, T, dim), and the feed-forward block's auxiliary losses (usually none)."""
        x = x + self.attention(self.attention_norm(x), cos, sin)
        out = self.feed_forward(self.ffn_norm(x))
        out, aux_losses = out if isinstance(out, tuple) else (out, {})
        return x + out, aux_losses


class ModelOutput(NamedTuple):
    out: Tensor
    """The logits (B, T, vocab_size), or what the forward's head made of the final hidden states
    (pretrain/model/loss.py's head: the loss, so the logits of the whole batch never exist together)."""
    aux_losses: dict[str, Tensor]
    """Every block's auxiliary losses, weighted, by name ("layers.3.<name>"); empty for dense blocks."""


OutputHead = Callable[[Tensor, RMSNorm, nn.Linear], Tensor]
"""(the last block's output (B, T, dim), the final norm, the output projection) -> what forward
returns as out. The head applies the norm itself, so a compiled head (pretrain/model/loss.py)
compiles the norm with the projection and the loss; an eager head calls the norm as a module (the
NaN tracer's hooks name it `norm`)."""


def project_logits(hidden: Tensor, norm: RMSNorm, output: nn.Linear) -> Tensor:
    return output(norm(hidden))  # (B, T, vocab_size)


class Transformer(nn.Module):
    """Built on the meta device (`with torch.device("meta")`), it has shapes but no storage and is
    not initialised: pretrain/distributed/parallel.py shards it, allocates the shards (to_empty) and then calls
    init_weights, so no process ever holds the whole model. Built anywhere else it is initialised
    at once, from seed (None: a seed drawn from torch's global generator, so torch.manual_seed
    decides). The same seed gives the same weights either way, on the same kind of device (a
    CUDA generator draws other numbers than the CPU's, and may differ between GPU models)."""

    # The rotary tables' buffers (register_buffer in __init__), declared so that their type is known.
    rope_cos: Tensor
    rope_sin: Tensor
    compile_loss_head: bool = False
    """Set by pretrain/distributed/parallel.py when it compiles the blocks: pretrain/model/loss.py's head (the
    final norm, the output projection and the cross-entropy) is then compiled too."""
    compile_mode: str | None = None
    """torch.compile's mode for what is compiled (training.compile_mode, set with compile_loss_head);
    None: torch's default."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int, seed: int | None = None) -> None:
        super().__init__()
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be at least 1 (got {max_seq_len})")
        if cfg.vocab_size is None:  # the config's resolve() sets it from the tokenizer
            raise ValueError("model.vocab_size is not set: resolve the config (pretrain.config.resolve) first")
        self.cfg, self.max_seq_len = cfg, max_seq_len
        self.tok_embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # The rotary tables are a function of the config, not learned state: keep them out of
        # checkpoints (persistent=False) so that a change of max_seq_len still loads them.
        head_dim = cfg.dim // cfg.n_heads
        shape = (max_seq_len, head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)  # (max_seq_len, head_dim // 2)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)
        if not self.output.weight.is_meta:
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, draw_device: torch.device | None = None) -> None:
        """Every parameter from one generator seeded with seed, in a fixed order, and the rotary
        tables recomputed (after to_empty they hold garbage).

        Each parameter is drawn whole, one at a time, on draw_device (default: where the
        parameters are); a fused one (wqkv, w13) part by part, each part whole and in the order it
        had before the fusion (the module's init_draws: wq, wk, wv, wo; w1, w2, w3), so a seed gives
        the weights it gave then. Each rank keeps its own part when the parameter is an FSDP shard
        (a DTensor). Drawing per shard would give other numbers than drawing the whole tensor, so a
        sharded model would start from other weights than a single-process one; drawing whole
        costs one full tensor at a time (the largest is the embedding: vocab x dim), never the model.
        """
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))  # from the global generator
        device = draw_device or _local(self.output.weight).device
        generator = torch.Generator(device=device).manual_seed(seed)
        std = self.cfg.init_std
        # wo and the feed-forward's output (SwiGLU's w2) write into the residual stream, which sums
        # 2 * n_layers such outputs (an attention and a feed-forward one per layer). Scaling them by
        # 1 / sqrt(2 * n_layers) keeps the stream's variance at init independent of depth (GPT-2's
        # residual scaling).
        # self.layers holds only TransformerBlocks (__init__ builds them; FSDP2 only subclasses them
        # in place), though to the type checker an nn.ModuleList holds plain Modules.
        blocks = [cast(TransformerBlock, layer) for layer in self.layers]
        residual = {id(m.weight) for block in blocks for m in (block.attention.wo, *block.feed_forward.residual_outputs())}
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        drawn: set[int] = set()  # weights a parent's init_draws drew already
        for module in self.modules():  # a fixed order: the generator's draws follow it
            if (init_draws := getattr(module, "init_draws", None)) is not None:  # fused weights: parts in their old order
                draws = init_draws()
                _draw_parts(draws, residual, std, residual_std, device, generator)
                drawn |= {id(param) for param, _rows in draws}
            if isinstance(module, nn.Linear | nn.Embedding) and id(module.weight) not in drawn:
                full = torch.empty(module.weight.shape, device=device)
                full.normal_(mean=0.0, std=residual_std if id(module.weight) in residual else std, generator=generator)
                _assign(module.weight, full)
            elif isinstance(module, RMSNorm):
                _local(module.weight).fill_(1.0)
            for name, kind in getattr(module, "normal_init", {}).items():  # weights that are not nn.Linear's (experts)
                param = getattr(module, name)
                full = torch.empty(param.shape, device=device)
                full.normal_(mean=0.0, std=residual_std if kind == "residual" else std, generator=generator)
                _assign(param, full)
        self.reset_rotary()

    @torch.no_grad()
    def reset_rotary(self, device: torch.device | None = None) -> None:
        """(Re)compute the rotary tables, on device (default: where they are)."""
        cos, sin = rotary_tables(self.cfg.dim // self.cfg.n_heads, self.max_seq_len, self.cfg.rope_theta, self.cfg.rope_scaling)
        device = device or self.rope_cos.device
        self.rope_cos = cos.to(device)  # a buffer stays a buffer when assigned a tensor
        self.rope_sin = sin.to(device)

    def forward(self, tokens: Tensor, head: OutputHead = project_logits) -> ModelOutput:
        """tokens (B, T) int64 -> the logits (B, T, vocab_size) (or head's result) and the blocks'
        auxiliary losses; position t sees only tokens 0..t. The loss is pretrain/model/loss.py's."""
        B, T = tokens.shape
        if T > self.max_seq_len:
            raise ValueError(
                f"input sequence length {T} exceeds the model's max_seq_len {self.max_seq_len}; "
                f"shorten the input or build the model with max_seq_len >= {T}"
            )
        cos, sin = self.rope_cos[:T].float(), self.rope_sin[:T].float()  # (T, head_dim // 2)
        x = self.tok_embed(tokens)  # (B, T, dim)
        # Under autocast the residual stream is in autocast's dtype (bf16): every block then reads,
        # writes and keeps for the backward pass 2 bytes a channel, not 4 (the norms keep their
        # statistics in float32). An fp32 run (no autocast) casts nothing.
        if (dtype := _autocast_dtype(x.device.type)) is not None:
            x = x.to(dtype)
        aux_losses: dict[str, Tensor] = {}
        for i, layer in enumerate(self.layers):
            x, block_losses = layer(x, cos, sin)  # (B, T, dim)
            aux_losses.update((f"layers.{i}.{name}", loss) for name, loss in block_losses.items())
        return ModelOutput(head(x, self.norm, self.output), aux_losses)

    def num_params(self) -> int:
        """Every parameter, the embedding and the (untied) output projection included."""
        return sum(p.numel() for p in self.parameters())


def _draw_parts(
    draws: list[tuple[Tensor, slice]],
    residual: set[int],
    std: float,
    residual_std: float,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    """Draw each (weight, rows) part whole, in the order given, as a tensor of its own (so it gets
    the numbers it got as a separate weight: a fused weight starts as the separate ones did), and
    copy it into those rows of its weight, or the rows of them this rank holds of an FSDP shard.
    Holds one part at a time: never a whole fused weight, nor one beside another."""
    drawn_rows: dict[int, int] = {}
    weights: dict[int, Tensor] = {}
    for weight, rows in draws:
        start, stop, _ = rows.indices(weight.shape[0])
        part = torch.empty((stop - start, *weight.shape[1:]), device=device)
        part.normal_(mean=0.0, std=residual_std if id(weight) in residual else std, generator=generator)
        _assign_rows(weight, start, part)
        drawn_rows[id(weight)] = drawn_rows.get(id(weight), 0) + part.shape[0]
        weights[id(weight)] = weight
    partly = [name for name, weight in weights.items() if drawn_rows[name] != weight.shape[0]]
    if partly:  # a module's init_draws left rows undrawn: garbage would be trained
        raise ValueError(f"init_draws left {len(partly)} weight(s) partly drawn")


def _assign_rows(param: Tensor, start: int, part: Tensor) -> None:
    """Copy part into param's rows start.., or into those of them this rank holds when param is an
    FSDP2 shard (pretrain/model/shards.py: FSDP's or HSDP's rows)."""
    if not isinstance(param, DTensor):
        param[start : start + part.shape[0]].copy_(part)
        return
    local = param.to_local()
    held = shards.first_row(param)  # ValueError, one line, for a placement FSDP2 does not make
    low, high = max(start, held), min(start + part.shape[0], held + local.shape[0])
    if low < high:
        local[low - held : high - held].copy_(part[low - start : high - start])


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """autocast's dtype on device_type when it is on there, else None (also for a device autocast
    has no mode for, such as meta)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # "unknown device type for autocast"
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def _local(param: Tensor) -> Tensor:
    """The tensor this process holds of param: its shard when param is an FSDP DTensor."""
    return param.to_local() if isinstance(param, DTensor) else param


def _assign(param: Tensor, full: Tensor) -> None:
    """Copy full into param, or this rank's rows of full when param is an FSDP2 shard."""
    if not isinstance(param, DTensor):
        param.copy_(full)
        return
    local = param.to_local()
    mine = shards.rows_of(full, param)  # ValueError, one line, for a placement FSDP2 does not make
    if mine.shape != local.shape:
        raise ValueError(f"cannot initialise a parameter of local shape {tuple(local.shape)} from rows {tuple(mine.shape)}")
    local.copy_(mine)
