"""Which rows of a parameter this rank holds when FSDP2 shards it, for the code that reads or writes
a shard directly (Muon's exchange, init_from, a checkpoint of the separate layout): FSDP over every
rank places it Shard(0) on a 1-D mesh; HSDP (Replicate(), Shard(0)) on its 2-D mesh, each node
holding every row, split over its ranks. Either way the rows split as torch.chunk splits them."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard


def row_mesh_dim(tensor: DTensor) -> int | None:
    """The mesh dimension over which tensor's rows (dim 0) are split, every other dimension
    replicating it (FSDP2's placements); None for any other placement."""
    placements = tuple(tensor.placements)
    split = [i for i, placement in enumerate(placements) if placement == Shard(0)]
    if len(split) != 1 or not all(isinstance(p, Replicate) for i, p in enumerate(placements) if i != split[0]):
        return None
    return split[0]


def row_split(tensor: DTensor) -> tuple[int, int]:
    """(this rank's place among the ranks that split tensor's rows, how many they are). ValueError,
    one line, for a placement FSDP2 does not make."""
    dim = row_mesh_dim(tensor)
    if dim is None:
        raise ValueError(
            f"a tensor placed as {tuple(tensor.placements)} on a {tensor.device_mesh.ndim}-D mesh; "
            "FSDP2 shards dim 0 over one mesh dimension and replicates over the others"
        )
    return tensor.device_mesh.get_local_rank(dim), tensor.device_mesh.size(dim)


def first_row(tensor: torch.Tensor) -> int:
    """The first row (dim 0) of tensor this rank holds: 0 unless it is an FSDP2 shard (torch.chunk's
    split: ceil(rows / ranks) each, the last ranks fewer or none)."""
    if not isinstance(tensor, DTensor):
        return 0
    place, ranks = row_split(tensor)
    rows = tensor.shape[0]
    return min(place * -(-rows // ranks), rows)


def rows_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's rows of full (a view) as like holds them: all of full for a plain tensor."""
    if not isinstance(like, DTensor):
        return full
    place, ranks = row_split(like)
    chunks = full.chunk(ranks, dim=0)
    return chunks[place] if place < len(chunks) else full.narrow(0, 0, 0)
