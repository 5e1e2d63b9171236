"""One rank of tests/pretrain/distributed/test_parallel.py's two-rank runs (gloo, CPU): the same tiny model trained
for two optimizer steps under DDP, FSDP2, FSDP2 with full activation checkpointing, and with
selective checkpointing and blocks kept gathered from forward to backward, and under
bf16 autocast with DDP and FSDP2, from the same seed on the same data; the dtypes FSDP2
computes and keeps in under use_amp; which models count as sharded; DDP and FSDP2 built on the
meta device and materialised by parallelize; FSDP2 with CPU offload. Writes what each run saw to
<out>/rank<r>.json.

Run as: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/workers/parallel_worker.py OUT
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from pretrain import config as cfg
from pretrain.model.loss import next_token_loss
from pretrain.model.transformer import Transformer
from pretrain.distributed.parallel import clip_grad_norm, gradient_sync, has_fsdp, is_fsdp, parallelize, unwrap
from support.gloo_rank import report_as_gloo_rank
from pretrain.distributed.runtime import Runtime

CONTEXT, BATCH, ACCUM, STEPS = 16, 2, 2, 2


def tiny_config(**training: object) -> cfg.Config:
    base = cfg.debug()
    model = dataclasses.replace(base.model, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=61, max_seq_len=CONTEXT)
    return dataclasses.replace(
        base,
        model=model,
        data=dataclasses.replace(base.data, context_length=CONTEXT),
        training=dataclasses.replace(
            base.training, **({"use_amp": False, "compile": False, "grad_accum_nums": ACCUM} | training)
        ),
        system=dataclasses.replace(base.system, device="cpu"),
    )


def untraced(config: cfg.Config) -> cfg.Config:
    """config without the debug preset's NaN hooks, which would turn activation checkpointing off."""
    return dataclasses.replace(config, debug=dataclasses.replace(config.debug, trace_nonfinite=False))


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Different data on each rank (so that averaging matters), the same in every run."""
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, 61, (STEPS * ACCUM, BATCH, CONTEXT + 1), generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def grad_fingerprint(model: torch.nn.Module, absolute: bool = False) -> float | None:
    """Sum (absolute: of the absolute values) of the first block's wqkv gradient on this rank
    (None when it has none)."""
    grad = unwrap(model).layers[0].attention.wqkv.weight.grad
    if grad is None:
        return None
    grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return float(grad.abs().sum() if absolute else grad.sum())


def all_gather_floats(value: float | None) -> list[float | None]:
    """[rank 0's value, rank 1's value]; None travels as NaN."""
    mine = torch.tensor(float("nan") if value is None else value, dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [None if t.isnan() else float(t) for t in gathered]


def full_state(model: torch.nn.Module) -> dict[str, list[float]]:
    state = unwrap(model).state_dict()
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).flatten().tolist() for name, t in state.items()}


def train(config: cfg.Config, runtime, mode: str, meta: bool = False) -> dict:
    """Built whole from the config's seed, or (meta) on the meta device and materialised by parallelize."""
    if meta:
        with torch.device("meta"):
            model = Transformer(config.model, CONTEXT)
    else:
        model = Transformer(config.model, CONTEXT, seed=config.training.seed)
    model = parallelize(model, config, runtime, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = iter(batches(runtime.rank))
    record: dict = {
        "is_fsdp": is_fsdp(model),
        "has_fsdp": has_fsdp(model),
        "unwraps_to_transformer": isinstance(unwrap(model), Transformer),
        "keys": sorted(unwrap(model).state_dict()),
        "losses": [],
        "grad_norms": [],
        "inside_no_sync": [],
        "inside_no_sync_l1": [],
        "after_sync": [],
    }
    for _ in range(STEPS):
        loss_sum = torch.zeros(())
        for micro in range(ACCUM):
            x, y = next(data)
            last = micro == ACCUM - 1
            with gradient_sync(model, last):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.training.use_amp):
                    loss = next_token_loss(model, x, y).total / ACCUM
                # between forward and backward: which blocks FSDP2 resharded (their weights DTensor shards again)
                record.setdefault(
                    "resharded_after_forward", [isinstance(b.attention.wqkv.weight, DTensor) for b in unwrap(model).layers]
                )
                record.setdefault("embedding_resharded_after_forward", isinstance(unwrap(model).tok_embed.weight, DTensor))
                loss.backward()
            loss_sum += loss.detach()
            if not last:
                record["inside_no_sync"].append(all_gather_floats(grad_fingerprint(model)))
                record["inside_no_sync_l1"].append(all_gather_floats(grad_fingerprint(model, absolute=True)))
        record["after_sync"].append(all_gather_floats(grad_fingerprint(model)))
        dist.all_reduce(loss_sum)
        record["losses"].append(float(loss_sum) / runtime.world_size)
        norm = clip_grad_norm(model, 0.5)
        record["grad_norms"].append(all_gather_floats(float(norm)))
        record["norm_is_plain"] = type(norm) is torch.Tensor and norm.dim() == 0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    record["state"] = full_state(model)
    record["parameter_devices"] = sorted({str(p.device) for p in model.parameters()})
    record["gradient_norm_device"] = str(norm.device)
    return record


def amp_dtypes(runtime) -> dict[str, str | list[str]]:
    """Under use_amp, the dtype of a block's weight as its forward sees it, of the sharded
    weight the optimizer updates and its gradient, and of the residual stream: what each
    block's first norm and the final norm receive."""
    config = tiny_config(use_amp=True)
    model = parallelize(Transformer(config.model, CONTEXT), config, runtime, "fsdp")
    wqkv = unwrap(model).layers[0].attention.wqkv
    seen = {}

    def record(module: torch.nn.Module, args: tuple) -> None:
        seen.setdefault("forward", str(module.weight.dtype))

    wqkv.register_forward_pre_hook(record)
    residual = []
    for norm in [block.attention_norm for block in unwrap(model).layers] + [unwrap(model).norm]:
        norm.register_forward_pre_hook(lambda module, args: residual.append(str(args[0].dtype)))
    x, y = batches(runtime.rank)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = next_token_loss(model, x, y).total
    loss.backward()
    return seen | {"master": str(wqkv.weight.dtype), "gradient": str(wqkv.weight.grad.dtype), "residual": residual}


def sharded_blocks_only(runtime) -> dict[str, bool]:
    """A model whose blocks alone are sharded: the root is no FSDPModule, a submodule is."""
    config = tiny_config()
    model = Transformer(config.model, CONTEXT)
    fully_shard(model.layers[0], mesh=init_device_mesh("cpu", (runtime.world_size,)))
    return {"is_fsdp": is_fsdp(model), "has_fsdp": has_fsdp(model)}


def measure(runtime: Runtime) -> dict:
    config = tiny_config()
    return {
        "ddp": train(config, runtime, "ddp"),
        "fsdp": train(config, runtime, "fsdp"),
        "fsdp_checkpointed": train(untraced(tiny_config(activation_checkpointing="full")), runtime, "fsdp"),
        "fsdp_selective_kept_gathered": train(
            untraced(tiny_config(activation_checkpointing="selective", reshard_after_forward=False)), runtime, "fsdp"
        ),
        "ddp_amp": train(tiny_config(use_amp=True), runtime, "ddp"),
        "fsdp_amp": train(tiny_config(use_amp=True), runtime, "fsdp"),
        "amp_dtypes": amp_dtypes(runtime),
        "sharded_blocks_only": sharded_blocks_only(runtime),
        "fsdp_meta": train(config, runtime, "fsdp", meta=True),
        "ddp_meta": train(config, runtime, "ddp", meta=True),
        "fsdp_offload": train(tiny_config(cpu_offload=True), runtime, "fsdp", meta=True),
    }


if __name__ == "__main__":
    report_as_gloo_rank(tiny_config(), measure)
