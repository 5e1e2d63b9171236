"""One rank of tests/pretrain/plan/test_float8.py's FSDP2 run: a tiny dense model with emulated float8 matmuls
(training.float8 "emulate") sharded over two gloo ranks, its weights all-gathered in float8, trains
a few steps with the scale precompute after each optimizer step, as pretrain/train.py does; and
exports. Writes to <out>/rank<r>.json the losses, what the weights are, and the export's path.

Run as: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/workers/float8_worker.py OUT
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from support.gloo_rank import fsdp_on_cpu, report_as_gloo_rank
from pretrain import config as cfg
from pretrain.checkpoint import model_state
from pretrain.checkpoint.dcp_files import DIRECTORY, read_dcp_metadata
from pretrain.distributed import float8
from pretrain.distributed.parallel import parallelize
from pretrain.distributed.runtime import Runtime
from pretrain.hf.export import export_model
from pretrain.model.loss import next_token_loss
from pretrain.model.transformer import Transformer

CONTEXT, SEED, STEPS = 16, 1234, 3


def tiny_float8() -> cfg.Config:
    model = cfg.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=257, max_seq_len=CONTEXT)
    config = fsdp_on_cpu(cfg.debug(), model, CONTEXT, SEED)
    return dataclasses.replace(config, training=dataclasses.replace(config.training, use_amp=True, float8="emulate"))


def measure(runtime: Runtime) -> dict:
    config = tiny_float8()
    with torch.device("meta"):
        model = Transformer(config.model, CONTEXT)
    sharded = parallelize(model, config, runtime, "fsdp")
    precompute = float8.scale_precompute(sharded, config, fsdp=True)
    assert precompute is not None
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(SEED + runtime.rank)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 257, (2, CONTEXT + 1), generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = next_token_loss(sharded, tokens[:, :-1], tokens[:, 1:], 0)
        loss.total.backward()
        optimizer.step()
        optimizer.zero_grad()
        precompute(sharded)
        losses.append(float(loss.cross_entropy))
    wqkv = sharded.layers[0].attention.wqkv
    state = sharded.state_dict()
    # The run's checkpoint as pretrain/checkpoint saves one under FSDP2 (DCP: each rank its
    # shards, the optimizer's state too), read back by the same ranks into a model without float8:
    # the checkpoint holds plain tensors, which the trainer's weights-only reader accepts.
    path = Path(sys.argv[1]) / "checkpoint"
    model_state.save_sharded(sharded, optimizer, path / DIRECTORY)
    dist.barrier()
    # What a process without torchao could not unpickle (torch's weights-only reader admits a
    # tensor subclass only once its module is imported): no file of it may name one.
    names_torchao = any(b"torchao" in file.read_bytes() for file in (path / DIRECTORY).iterdir())
    plain_config = dataclasses.replace(config, training=dataclasses.replace(config.training, float8=False))
    with torch.device("meta"):
        plain_model = Transformer(plain_config.model, CONTEXT)
    plain = parallelize(plain_model, plain_config, runtime, "fsdp")
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    model_state.load_sharded(plain, plain_optimizer, path, read_dcp_metadata(path))
    ours, theirs = sharded.state_dict(), plain.state_dict()
    plain_matches = ours.keys() == theirs.keys() and all(
        torch.equal(ours[name].full_tensor(), theirs[name].full_tensor()) for name in sorted(ours)
    )
    plain_optimizer_state = [type(v.to_local()).__name__ for s in plain_optimizer.state.values() for v in s.values() if v.dim()]
    written = export_model(sharded, config, Path(sys.argv[1]) / "export", None, writes=runtime.is_main, warn=lambda _: None)
    return {
        "losses": losses,
        "float8_linears": sorted(name for name, module in sharded.named_modules() if float8.is_float8(module)),
        "weight_wrapper": type(wqkv.weight.to_local()).__name__,
        "state_dtypes": sorted({str(value.dtype) for value in state.values()}),
        "state_keys": sorted(state),
        "scale_precomputed": wqkv.weight._local_tensor._precomputed_scale is not None,
        "plain_model_loads_checkpoint": plain_matches,
        "plain_optimizer_state": sorted(set(plain_optimizer_state)),
        "checkpoint_names_torchao": names_torchao,
        "export": str(written) if written else None,
    }


if __name__ == "__main__":
    report_as_gloo_rank(tiny_float8(), measure)
