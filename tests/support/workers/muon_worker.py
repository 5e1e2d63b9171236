"""One rank of tests/pretrain/optim/test_muon.py's multi-rank runs (gloo, CPU): Muon on a tiny model under DDP,
FSDP2 and FSDP2 with CPU offload, each step's weights compared with single-process Muon's given
the same gradients, and the Newton-Schulz FLOPs this rank orthogonalized, counted by wrapping the
optimizer's orthogonalize, beside the share its assignment gives. Writes <out>/rank<r>.json.

Run as: RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/workers/muon_worker.py OUT
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from pretrain import config as cfg
from pretrain.model.transformer import Transformer
from pretrain.optim.muon import Muon, build_muon
from pretrain.optim.muon_sharing import newton_schulz_flops
from pretrain.distributed.parallel import parallelize, unwrap
from support.gloo_rank import report_as_gloo_rank
from pretrain.distributed.runtime import Runtime

CONTEXT, STEPS, LR = 16, 2, 0.02


def tiny_config(cpu_offload: bool = False) -> cfg.Config:
    """Three layers of 7 matrices in four sizes: 21 to share, and rows that split unevenly over 3
    ranks. The fused wqkv's 48 rows (wq's 32, wk's 8, wv's 8) split so that a shard crosses from wq
    into wk and wv (rows 24-48 on 2 ranks, 32-48 on 3), and w13's 128 rows (w1's 64, w3's 64) cross
    from w1 into w3 on 3 ranks (rows 43-86)."""
    base = cfg.debug()
    model = dataclasses.replace(
        base.model, dim=32, n_layers=3, n_heads=4, n_kv_heads=1, ffn_dim=64, vocab_size=61, max_seq_len=CONTEXT
    )
    return dataclasses.replace(
        base,
        model=model,
        data=dataclasses.replace(base.data, context_length=CONTEXT),
        training=dataclasses.replace(base.training, optimizer="muon", use_amp=False, compile=False, cpu_offload=cpu_offload),
        system=dataclasses.replace(base.system, device="cpu"),
    )


def gradients(step: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The same whole gradients on every rank (as if already averaged), different at each step."""
    generator = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(p.shape, generator=generator) for name, p in unwrap(model).named_parameters()}


def set_gradients(model: torch.nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Copies of grads (Muon forms the Nesterov momentum in a gradient's storage)."""
    for name, p in unwrap(model).named_parameters():
        whole = grads[name].to(p.dtype, copy=True)
        p.grad = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else whole


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for name, p in unwrap(model).named_parameters()
    }


def count_flops(optimizer: Muon, counted: dict[str, int]) -> None:
    """Wrap the optimizer's orthogonalize: add each call's FLOPs and matrices to counted."""
    inner = optimizer.orthogonalize

    def counting(stack: torch.Tensor, steps: int) -> torch.Tensor:
        counted["flops"] += newton_schulz_flops(stack.shape, steps)
        counted["matrices"] += stack.shape[0]
        return inner(stack, steps)

    optimizer.orthogonalize = counting


def compare(config: cfg.Config, runtime: Runtime, mode: str) -> dict:
    """STEPS steps of Muon on the model as mode wraps it and on a plain copy in this process:
    the largest difference in the hidden matrices and in the rest after each step, the largest
    update, and what this rank orthogonalized in the first step."""
    with torch.device("meta"):
        meta = Transformer(config.model, CONTEXT)
    model = parallelize(meta, config, runtime, mode)
    reference = Transformer(config.model, CONTEXT, seed=config.training.seed)
    optimizer = build_muon(model, config.training, runtime.device)
    single = build_muon(reference, config.training, runtime.device)
    assert isinstance(optimizer, Muon) and isinstance(single, Muon)
    counted = {"flops": 0, "matrices": 0}
    count_flops(optimizer, counted)
    record: dict = {"hidden": [], "rest": [], "largest_update": [], "share": optimizer.sharing.share_per_rank()}
    record["total_flops"] = sum(optimizer.sharing.costs)
    for step in range(STEPS):
        before = weights(reference)
        grads = gradients(step, reference)
        for opt, m in ((optimizer, model), (single, reference)):
            set_gradients(m, grads)
            for group in opt.param_groups:
                group["lr"] = LR
            opt.step()
            opt.zero_grad(set_to_none=True)
        if step == 0:
            record["counted"] = dict(counted)
        ours, theirs = weights(model), weights(reference)
        hidden = {n for n, p in theirs.items() if n.startswith("layers.") and p.ndim >= 2}
        record["hidden"].append(max(float((ours[n] - theirs[n]).abs().max()) for n in hidden))
        record["rest"].append(max(float((ours[n] - theirs[n]).abs().max()) for n in theirs.keys() - hidden))
        record["largest_update"].append(max(float((theirs[n] - before[n]).abs().max()) for n in hidden))
    record["sharing"] = optimizer.sharing.held
    return record


def measure(runtime: Runtime) -> dict:
    config = tiny_config()
    return {
        "ddp": compare(config, runtime, "ddp"),
        "fsdp": compare(config, runtime, "fsdp"),
        "fsdp_offload": compare(tiny_config(cpu_offload=True), runtime, "fsdp"),
    }


if __name__ == "__main__":
    report_as_gloo_rank(tiny_config(), measure)
