"""A Hugging Face checkpoint's weights in the built model (training.init_from), in the workers.

The model is built and initialised as for any fresh run (pretrain/distributed/parallel.py), then every
parameter is overwritten here, so nothing is left uninitialised whatever the checkpoint holds
(pretrain/hf/init_checkpoint.py has checked before any worker started that it holds every tensor, with
its shape). Each rank reads only what it holds: under FSDP2 a parameter's shard is a block of rows
(dim 0), read through safetensors' get_slice (those rows' bytes, from a memory map). Two tensors
need more than their rows:

- wq and wk: transformers' rows are ours permuted within each head (pretrain/hf/transformers_form.py), so the
  whole heads that cover a shard's rows are read, put in our order (unpermute_qk) and cut to it;
- a mixture of experts' batched w1, w2, w3 (num_experts, ...): a shard is a run of experts, each
  read whole from its own tensor (block_sparse_moe.experts.{j}.w1.weight) and transposed;
- the fused attention.wqkv and feed_forward.w13 (pretrain/model/fused_layout.py): their rows are
  q_proj's, k_proj's and v_proj's (gate_proj's and up_proj's) one after the other, and a shard
  may hold some rows of several of them: of each, only the rows inside the shard are read.

The optimizer, built on the parameters before this, holds no state yet, and the run starts at
step 0: only the weights come from the checkpoint.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pretrain.config import ModelConfig
from pretrain.data import first_line
from pretrain.hf.init_checkpoint import EMBEDDING, TIED, HfCheckpoint, InitFromError, model_type
from pretrain.hf.transformers_form import from_hf, fused_parts, hf_names
from pretrain.model import shards
from pretrain.distributed.parallel import unwrap

_ROTARY = ("attention.wq.weight", "attention.wk.weight")


class CheckpointReader:
    """Rows of a checkpoint's tensors, each read alone from its safetensors file (opened once)."""

    def __init__(self, checkpoint: HfCheckpoint) -> None:
        self.checkpoint = checkpoint
        self._files: dict[str, Any] = {}

    def rows(self, name: str, start: int, stop: int) -> Tensor:
        """Rows [start, stop) of the tensor name (of a 1-D tensor: its elements), in its stored dtype.
        InitFromError in one line where its file cannot be read (damaged or replaced since the
        launcher checked it: pretrain/hf/safetensors_header.py check_header)."""
        file = self.checkpoint.tensors[name].file
        try:
            if file not in self._files:
                self._files[file] = safe_open(self.checkpoint.directory / file, framework="pt", device="cpu")
            return self._files[file].get_slice(name)[start:stop]
        except (SafetensorError, OSError) as error:
            raise InitFromError(
                f"training.init_from: {self.checkpoint.source}: {file} cannot be read ({first_line(error)}); "
                "download or copy it again"
            ) from None

    def whole(self, name: str) -> Tensor:
        return self.rows(name, 0, self.checkpoint.tensors[name].shape[0])


@torch.no_grad()
def load_weights(model: nn.Module, checkpoint: HfCheckpoint, log: logging.Logger) -> None:
    """Overwrite every parameter of model (one process, DDP or FSDP2) with checkpoint's, each rank
    its own rows; say in one line where the weights came from."""
    transformer = unwrap(model)
    reader = CheckpointReader(checkpoint)
    for name, param in transformer.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.shape[0] == 0:  # a rank past the end of a short dim 0 holds nothing of it
            continue
        start = first_row(param)
        local.copy_(read_rows(reader, name, start, start + local.shape[0], transformer.cfg))
    tied = "; the output projection starts as a copy of the tied embedding" if checkpoint.tied else ""
    where = "" if str(checkpoint.directory) == checkpoint.source else f" in {checkpoint.directory}"
    log.info(
        f"Weights from {checkpoint.source} ({model_type(checkpoint)}{where}){tied}; "
        "the optimizer and the learning-rate schedule start at step 0"
    )


def first_row(param: Tensor) -> int:
    """The first row (dim 0) of param that this rank holds: 0 unless param is an FSDP2 shard, which
    splits dim 0 as torch.chunk does over one mesh dimension (HSDP: each node holds every row)."""
    try:
        return shards.first_row(param)
    except ValueError as error:
        raise ValueError(f"cannot load {error}") from None


def read_rows(reader: CheckpointReader, name: str, start: int, stop: int, model: ModelConfig) -> Tensor:
    """Rows [start, stop) of our parameter name, in our layout, read from the checkpoint."""
    if (parts := fused_parts(name, model)) is not None:  # the rows of each part inside [start, stop)
        pieces, first = [], 0
        for part, rows in parts:
            lo, hi = max(start, first), min(stop, first + rows)
            if lo < hi:
                pieces.append(read_rows(reader, part, lo - first, hi - first, model))
            first += rows
        return torch.cat(pieces)
    names = hf_names(name, model)
    if names == [TIED] and reader.checkpoint.tied:
        names = [EMBEDDING]
    if len(names) > 1:  # our experts [start, stop), each its own Hugging Face tensor
        # (ffn, dim) -> (dim, ffn) for w1 and w3, (dim, ffn) -> (ffn, dim) for w2, as from_hf does for all of them
        return torch.stack([reader.whole(hf_name).T for hf_name in names[start:stop]])  # (experts, ...)
    if name.split(".", 2)[-1] in _ROTARY:
        head_dim = model.dim // model.n_heads
        first, last = start // head_dim * head_dim, math.ceil(stop / head_dim) * head_dim  # whole heads
        heads = from_hf(name, [reader.rows(names[0], first, last)], model)  # (last - first, dim), our order
        return heads[start - first : stop - first]
    return from_hf(name, [reader.rows(names[0], start, stop)], model)
