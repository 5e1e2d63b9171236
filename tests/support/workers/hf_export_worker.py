"""One rank of tests/pretrain/hf/test_hf_export.py's FSDP export: a tiny mixture-of-experts model sharded over
two gloo ranks exports into <out>/fsdp (every rank gathers each weight in turn, rank 0 writes),
and rank 0 exports the same model built whole, in one process, into <out>/single. Writes to
<out>/rank<r>.json the paths written (none on rank 1).

Run as: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/workers/hf_export_worker.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from support.gloo_rank import fsdp_on_cpu, report_as_gloo_rank
from pretrain import config as cfg
from pretrain.hf.export import export_model
from pretrain.model.transformer import Transformer
from pretrain.distributed.parallel import parallelize
from pretrain.distributed.runtime import Runtime

CONTEXT, SEED = 16, 1234


def tiny_moe() -> cfg.Config:
    base = cfg.debug()
    model = cfg.ModelConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=257, max_seq_len=CONTEXT, moe=cfg.MoEConfig(4, 2)
    )
    return fsdp_on_cpu(base, model, CONTEXT, SEED)


def measure(runtime: Runtime) -> dict:
    config = tiny_moe()
    out = Path(sys.argv[1])
    with torch.device("meta"):
        model = Transformer(config.model, CONTEXT)
    sharded = parallelize(model, config, runtime, "fsdp")  # initialised from training.seed, one weight at a time
    written = export_model(sharded, config, out / "fsdp", None, writes=runtime.is_main, warn=lambda _: None)
    single = None
    if runtime.is_main:
        whole = Transformer(config.model, CONTEXT, seed=SEED)
        single = export_model(whole, config, out / "single", None, writes=True, warn=lambda _: None)
    return {"fsdp": str(written) if written else None, "single": str(single) if single else None}


if __name__ == "__main__":
    report_as_gloo_rank(tiny_moe(), measure)
