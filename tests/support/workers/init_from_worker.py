"""One rank of tests/pretrain/hf/test_init_from.py: Hugging Face checkpoints (<out>/dense and <out>/moe, written
by the test) loaded under FSDP2 on two gloo ranks by pretrain/hf/init_from.py. Writes to
<out>/rank<r>.json every read this rank made of the checkpoint (tensor, first row, end row) and,
per parameter, whether the whole tensor its shards make equals what one process loads.

Run as: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/workers/init_from_worker.py OUT
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from support.gloo_rank import report_as_gloo_rank
from pretrain import config as cfg
from pretrain.hf import init_from
from pretrain.hf.init_checkpoint import read_checkpoint
from pretrain.model.transformer import Transformer
from pretrain.distributed.parallel import parallelize
from pretrain.distributed.runtime import Runtime

SEQ = 16
DENSE = cfg.ModelConfig(
    dim=40, n_layers=1, n_heads=5, n_kv_heads=1, ffn_dim=24, vocab_size=64, rope_theta=10000.0, max_seq_len=SEQ
)
"""head_dim 8: the fused wqkv's 56 rows (wq's 40, wk's 8, wv's 8) split 28 and 28 between the ranks,
through the middle of wq's head 3, and rank 1's shard crosses the wq/wk and wk/wv boundaries."""
MOE = dataclasses.replace(DENSE, dim=32, n_heads=4, n_kv_heads=2, moe=cfg.MoEConfig(num_experts=4, top_k=2))


def config_for(model: cfg.ModelConfig) -> cfg.Config:
    base = cfg.debug()
    training = dataclasses.replace(
        base.training, parallelism="fsdp", use_amp=False, compile=False, activation_checkpointing="none"
    )
    return dataclasses.replace(base, model=model, training=training, system=dataclasses.replace(base.system, device="cpu"))


def loaded(model_cfg: cfg.ModelConfig, directory: Path, runtime: Runtime | None, reads: list) -> dict[str, torch.Tensor]:
    """Every parameter, whole, after loading directory into model_cfg's model: sharded over the
    ranks (runtime given, reads recorded) or built whole in this process."""
    checkpoint = read_checkpoint(str(directory), directory)
    model: torch.nn.Module
    if runtime is None:
        model = Transformer(model_cfg, SEQ, seed=0)
    else:
        with torch.device("meta"):
            meta = Transformer(model_cfg, SEQ)
        model = parallelize(meta, config_for(model_cfg), runtime, "fsdp")
    plain_rows = init_from.CheckpointReader.rows

    def recorded(self, name: str, start: int, stop: int) -> torch.Tensor:
        reads.append([name, start, stop])
        return plain_rows(self, name, start, stop)

    init_from.CheckpointReader.rows = recorded  # type: ignore[method-assign]
    try:
        init_from.load_weights(model, checkpoint, logging.getLogger("init_from_worker"))
    finally:
        init_from.CheckpointReader.rows = plain_rows  # type: ignore[method-assign]
    return {name: p.full_tensor() if isinstance(p, DTensor) else p.detach() for name, p in model.named_parameters()}


def measure(runtime: Runtime) -> dict:
    out = Path(sys.argv[1])
    report = {}
    for kind, model_cfg in (("dense", DENSE), ("moe", MOE)):
        reads: list = []
        sharded = loaded(model_cfg, out / kind, runtime, reads)
        whole = loaded(model_cfg, out / kind, None, [])
        report[kind] = {"reads": reads, "equal": {name: bool(torch.equal(sharded[name], whole[name])) for name in whole}}
    return report


if __name__ == "__main__":
    report_as_gloo_rank(config_for(DENSE), measure)
