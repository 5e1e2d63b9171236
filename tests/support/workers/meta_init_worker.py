"""One rank of tests/pretrain/distributed/test_meta_init.py: a Llama-3-8B-shaped model cut to two layers and a small
vocabulary, built on the meta device and materialised under FSDP2 by pretrain/distributed/parallel.py, on
two gloo ranks. Writes to <out>/rank<r>.json this rank's resident memory before building, its peak
once the model is initialised, the model's whole fp32 size, the loss of its first batch under FSDP
and its rotary table. Rank 0 then also builds the same model whole (eagerly) from the same seed,
once for both ranks, and adds the loss of each rank's first batch and that model's rotary table.

Run as: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/workers/meta_init_worker.py OUT
"""

from __future__ import annotations

import dataclasses
import gc
import resource

import psutil
import torch

from pretrain import config as cfg
from pretrain.model.loss import next_token_loss
from pretrain.model.transformer import Transformer
from pretrain.distributed.parallel import parallelize
from support.gloo_rank import fsdp_on_cpu, report_as_gloo_rank
from pretrain.distributed.runtime import Runtime

CONTEXT, VOCAB, SEED = 16, 512, 1234


def production_shaped() -> cfg.Config:
    base = cfg.production()
    model = dataclasses.replace(base.model, n_layers=2, vocab_size=VOCAB)  # dim 4096, 32/8 heads, ffn 14336
    return fsdp_on_cpu(base, model, CONTEXT, SEED)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (1, CONTEXT + 1), generator=torch.Generator().manual_seed(rank))
    return tokens[:, :-1], tokens[:, 1:]


def measure(runtime: Runtime) -> dict:
    config = production_shaped()
    x, y = batch(runtime.rank)
    gc.collect()
    before = psutil.Process().memory_info().rss
    with torch.device("meta"):
        model = Transformer(config.model, CONTEXT)
    full_bytes = 4 * model.num_params()
    model = parallelize(model, config, runtime, "fsdp")
    initialised_peak = peak_rss()  # before the forward pass gathers any block
    with torch.no_grad():
        sharded_loss = float(next_token_loss(model, x, y).total)
    seen = {
        "rss_before": before,
        "initialised_peak": initialised_peak,
        "full_bytes": full_bytes,
        "sharded_loss": sharded_loss,
        "rope_cos": model.rope_cos.tolist(),  # compared with the eager model's: not to_empty's garbage
    }
    del model
    gc.collect()
    if runtime.rank == 0:  # the whole model is the same for every rank: built once, not on each (5 s of CPU)
        seen["eager"] = eager_reference(config, runtime.world_size)
    return seen


def eager_reference(config: cfg.Config, world_size: int) -> dict:
    """The whole model, as one process builds it, from the same seed: the loss of every rank's
    first batch, and its rotary tables (a function of the config alone)."""
    eager = Transformer(config.model, CONTEXT, seed=SEED)
    with torch.no_grad():
        losses = [float(next_token_loss(eager, *batch(rank)).total) for rank in range(world_size)]
    return {"losses": losses, "rope_cos": eager.rope_cos.tolist()}


if __name__ == "__main__":
    report_as_gloo_rank(production_shaped(), measure)
