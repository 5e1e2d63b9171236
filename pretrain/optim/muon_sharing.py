"""Muon's orthogonalization spread over the ranks: which rank orthogonalizes which hidden matrix,
and the collectives that bring each matrix's Nesterov momentum to its owner and its update back.

Orthogonalizing costs a few matmuls of a matrix with itself, so on W ranks that each do all of
it, W - 1 of every W are wasted. Here each matrix has one owner, chosen once by balancing
Newton-Schulz FLOPs (largest first, to the least-loaded rank); an owner stacks its matrices of
one shape into one (k, m, n) call. How the momentum reaches the owner depends on how the
parameters are held:
- alone (one process, or a mesh of one): every matrix is here; no collective.
- replicated (DDP: every rank holds every gradient, already averaged): each owner orthogonalizes
  its share and one all-gather of bf16 buffers gives every rank every update.
- row-sharded (FSDP2: each rank holds rows of every matrix, Shard(0)): one all-to-all sends each
  owner the bf16 rows of its matrices, and one all-to-all sends each rank its rows of the updates.
  Under HSDP the group is a node's ranks: every node orthogonalizes all the matrices among its
  own ranks, alike, from the same all-reduced gradients; nothing crosses nodes.
Collectives and orthogonalization run on the compute device (the GPU under CPU offload). What
travels (through a collective, or from the host to the GPU) is bf16, as Newton-Schulz computes;
the updates are applied in the parameters' dtype.

A fused parameter (attention.wqkv, feed_forward.w13: pretrain/model/fused_layout.py) stands for
several matrices stacked by rows: each part (Q, K, V; gate, up) is orthogonalized as the matrix of
its own that it is, with its own owner and key, and the parts' updates are joined back into the
parameter's rows. Under FSDP2 a rank's shard of it may hold rows of several parts, and of a part
only some rows: each part's rows travel to that part's owner.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

Orthogonalize = Callable[[torch.Tensor, int], torch.Tensor]
MatrixKey = tuple[tuple[int, ...], int]
"""(the whole matrix's shape, Newton-Schulz steps): matrices with the same key are stacked into one call."""
SEND_DTYPE = torch.bfloat16
STACK_ELEMENTS = 2**28
"""The most elements one orthogonalize call stacks (512 MiB in bf16; Newton-Schulz holds a few
times that): same-shape matrices beyond it take several calls, which bounds the step's memory."""


def newton_schulz_flops(shape: Sequence[int], steps: int) -> int:
    """The matmul FLOPs of Newton-Schulz on a (..., m, n) stack: per step and matrix, with
    a = min(m, n) and b = max(m, n), the Gram matrix (2a^2 b), its square (2a^3) and the
    product with the iterate (2a^2 b)."""
    *batch, rows, cols = shape
    a, b = min(rows, cols), max(rows, cols)
    return math.prod(batch) * steps * (4 * a * a * b + 2 * a**3)


def balanced_owners(costs: Sequence[int], world_size: int) -> list[int]:
    """The rank that orthogonalizes each matrix: largest cost first, each to the least-loaded
    rank (ties to the lower rank), so that every rank gets the same answer."""
    owners = [0] * len(costs)
    loads = [(0, rank) for rank in range(world_size)]  # a heap of (load, rank)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + costs[index], rank))
    return owners


def row_counts(rows: int, world_size: int) -> list[int]:
    """How many of a dimension's rows each rank holds under Shard(0): torch.chunk's split
    (ceil(rows / W) each, the last ranks fewer or none), as FSDP2 shards."""
    size = -(-rows // world_size)
    return [max(0, min(rows, (rank + 1) * size) - min(rows, rank * size)) for rank in range(world_size)]


def part_slices(parts: Sequence[int], first: int, held: int) -> list[slice]:
    """Of a matrix made of parts (their row counts, stacked in order), the rows of each part among
    the held rows [first, first + held) that a rank holds, as slices of those held rows (an empty
    slice where the rank holds none of the part)."""
    slices, start = [], 0
    for rows in parts:
        lo, hi = max(start, first), min(start + rows, first + held)
        slices.append(slice(lo - first, max(lo, hi) - first))
        start += rows
    return slices


def part_counts(parts: Sequence[int], world_size: int) -> list[list[int]]:
    """How many rows of each part each rank holds when the whole matrix (the parts stacked by
    rows) is sharded as FSDP2 shards it (row_counts): [part][rank]."""
    counts = row_counts(sum(parts), world_size)
    firsts = [sum(counts[:rank]) for rank in range(world_size)]
    held = [part_slices(parts, firsts[rank], counts[rank]) for rank in range(world_size)]
    return [[held[rank][j].stop - held[rank][j].start for rank in range(world_size)] for j in range(len(parts))]


@dataclass(frozen=True)
class Batch:
    """An owner's matrices of one key, stacked into one orthogonalize call."""

    shape: tuple[int, ...]
    steps: int
    members: list[int]  # positions in the step's list of matrices


def batches_by_owner(keys: Sequence[MatrixKey], owners: Sequence[int], world_size: int) -> list[list[Batch]]:
    """Each rank's batches, in the order every rank agrees on: keys by first appearance, members
    by position, at most STACK_ELEMENTS elements a stack (at least one matrix)."""
    grouped: list[dict[MatrixKey, list[int]]] = [{} for _ in range(world_size)]
    for position, (key, owner) in enumerate(zip(keys, owners, strict=True)):
        grouped[owner].setdefault(key, []).append(position)
    return [
        [
            Batch(shape, steps, positions[i : i + per_stack])
            for (shape, steps), positions in mine.items()
            for per_stack in [max(1, STACK_ELEMENTS // math.prod(shape))]
            for i in range(0, len(positions), per_stack)
        ]
        for mine in grouped
    ]


def members(batches: list[Batch]) -> list[int]:
    """The positions an owner's buffers hold, in their order."""
    return [m for batch in batches for m in batch.members]


class MatrixSharing:
    """This rank's part in orthogonalizing the hidden matrices (see the module docstring):
    how its matrices are held ("alone", "replicated" or "rows"), its process group, the compute
    device, and the owner of each matrix. params: every Muon parameter's key, in the optimizer's
    order; parts: for each, the row counts of the matrices it stacks by rows (None: one matrix,
    itself; a fused parameter: its parts)."""

    def __init__(
        self,
        params: list[MatrixKey],
        held: str,
        group: dist.ProcessGroup | None,
        device: torch.device,
        parts: list[list[int] | None] | None = None,
    ) -> None:
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self.held = "alone" if self.world_size == 1 else held
        self.rank = 0 if group is None else dist.get_rank(group)
        self.group, self.device = group, device
        given = parts if parts is not None else [None] * len(params)
        self.parts: list[list[int]] = [split or [shape[0]] for (shape, _), split in zip(params, given, strict=True)]
        """Each parameter's matrices, by their row counts in order ([rows]: one, the parameter)."""
        for (shape, _), rows in zip(params, self.parts, strict=True):
            if sum(rows) != shape[0]:
                raise ValueError(f"parts of {sum(rows)} rows in all cannot make a matrix of shape {shape}")
        self.keys: list[MatrixKey] = [
            ((rows, *shape[1:]), steps) for (shape, steps), split in zip(params, self.parts, strict=True) for rows in split
        ]
        """Every matrix orthogonalized (a fused parameter's parts each), in order."""
        self.first_key = [sum(len(split) for split in self.parts[:i]) for i in range(len(params))]
        """The position in keys of each parameter's first matrix."""
        self.counts: list[list[int]] = [
            counts for (shape, _), split in zip(params, self.parts, strict=True) for counts in part_counts(split, self.world_size)
        ]
        """How many rows of each matrix each rank holds under "rows": [matrix][rank]."""
        self.costs = [newton_schulz_flops(shape, steps) for shape, steps in self.keys]
        self.owners = balanced_owners(self.costs, self.world_size)

    def share_per_rank(self) -> list[float]:
        """The fraction of the Newton-Schulz FLOPs each rank does."""
        total, loads = sum(self.costs) or 1, [0] * self.world_size
        for cost, owner in zip(self.costs, self.owners, strict=True):
            loads[owner] += cost
        return [load / total for load in loads]

    def updates(self, nesterovs: list[torch.Tensor], present: list[int], orthogonalize: Orthogonalize) -> list[torch.Tensor]:
        """The orthogonalized update of each parameter, laid out as its nesterov (plain tensors: the
        whole matrix, or this rank's rows under "rows"), on its device, in the dtype it arrived in
        (bf16 from another rank; an fp32 copy of them all would cost 4 bytes a parameter). present:
        which of the parameters nesterovs are (every rank passes the same). A fused parameter's
        parts are orthogonalized apart and their updates joined by rows (one copy)."""
        if not nesterovs:
            return []
        matrices: list[torch.Tensor] = []
        positions: list[int] = []
        for nesterov, param in zip(nesterovs, present, strict=True):
            split = self.parts[param]
            if len(split) == 1:
                matrices.append(nesterov)
            else:
                first = self._first_held_row(param)
                matrices += [nesterov[rows] for rows in part_slices(split, first, nesterov.shape[0])]
            positions += range(self.first_key[param], self.first_key[param] + len(split))
        updates = iter(self._matrix_updates(matrices, positions, orthogonalize))
        joined = []
        for param in present:
            pieces = [next(updates) for _ in self.parts[param]]
            joined.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        return joined

    def _first_held_row(self, param: int) -> int:
        """The first row of parameter param that this rank holds (0 but under "rows")."""
        if self.held != "rows":
            return 0
        return sum(row_counts(sum(self.parts[param]), self.world_size)[: self.rank])

    def _matrix_updates(
        self, nesterovs: list[torch.Tensor], present: list[int], orthogonalize: Orthogonalize
    ) -> list[torch.Tensor]:
        """updates for matrices: present indexes keys (a fused parameter's parts each)."""
        keys = [self.keys[i] for i in present]
        owners = [self.owners[i] for i in present] if self.held != "alone" else [0] * len(present)
        plan = batches_by_owner(keys, owners, self.world_size)
        if self.held == "alone":
            return self._alone(nesterovs, plan[0], orthogonalize)
        if self.held == "replicated":
            return self._replicated(nesterovs, plan, orthogonalize)
        return self._row_sharded(nesterovs, keys, [self.counts[i] for i in present], plan, orthogonalize)

    def _stacked(self, nesterovs: list[torch.Tensor], batch: Batch) -> torch.Tensor:
        """A batch's whole matrices as one (k, *shape) tensor on the compute device: in their
        dtype where they are, in bf16 when they travel there (from the host under CPU offload)."""
        here = nesterovs[batch.members[0]]
        dtype = here.dtype if here.device == self.device else SEND_DTYPE
        stack = torch.empty((len(batch.members), *batch.shape), dtype=dtype, device=here.device)
        torch.stack([nesterovs[m] for m in batch.members], out=stack)
        return stack.to(self.device)

    def _alone(self, nesterovs: list[torch.Tensor], batches: list[Batch], orthogonalize: Orthogonalize) -> list[torch.Tensor]:
        like = nesterovs[0]
        out: list[torch.Tensor] = [like] * len(nesterovs)
        for batch in batches:
            result = orthogonalize(self._stacked(nesterovs, batch), batch.steps).to(like.device)
            for member, update in zip(batch.members, result.unbind(), strict=True):
                out[member] = update
        return out

    def _replicated(
        self, nesterovs: list[torch.Tensor], plan: list[list[Batch]], orthogonalize: Orthogonalize
    ) -> list[torch.Tensor]:
        """Every rank holds every whole matrix: each owner orthogonalizes its own, and one
        all-gather of equal-length bf16 buffers (each padded to the longest) shares them."""
        numels = [math.prod(nesterovs[m].shape) for m in range(len(nesterovs))]
        lengths = [sum(numels[m] for m in members(batches)) for batches in plan]
        longest = max(lengths)
        mine = torch.zeros(longest, dtype=SEND_DTYPE, device=self.device)
        results = [orthogonalize(self._stacked(nesterovs, batch), batch.steps) for batch in plan[self.rank]]
        if results:
            torch.cat([r.flatten() for r in results], out=mine[: lengths[self.rank]])
        gathered = torch.empty(self.world_size * longest, dtype=SEND_DTYPE, device=self.device)
        dist.all_gather_single(gathered, mine, group=self.group)  # (W * longest,)
        like = nesterovs[0]
        flat = gathered.to(like.device)
        out: list[torch.Tensor] = [like] * len(nesterovs)
        for rank, batches in enumerate(plan):
            offset = rank * longest
            for m in members(batches):
                out[m] = flat[offset : offset + numels[m]].view(nesterovs[m].shape)
                offset += numels[m]
        return out

    def _row_sharded(
        self,
        nesterovs: list[torch.Tensor],
        keys: list[MatrixKey],
        counts: list[list[int]],
        plan: list[list[Batch]],
        orthogonalize: Orthogonalize,
    ) -> list[torch.Tensor]:
        """Each rank holds rows of every matrix (Shard(0); counts[m][rank] of matrix m): one
        all-to-all sends each owner the bf16 rows of its matrices, the owner orthogonalizes the
        whole stacks, and one all-to-all sends each rank its rows of every update."""
        rows = RowLayout(counts, [math.prod(s[1:]) for s, _ in keys])
        for m, nesterov in enumerate(nesterovs):
            if nesterov.shape[0] != rows.counts[m][self.rank]:
                shape, held = keys[m][0], nesterov.shape[0]
                raise RuntimeError(
                    f"Muon expected {rows.counts[m][self.rank]} rows of a {shape} matrix on rank {self.rank}, not {held}"
                )
        wholes = self._rows_to_owners(nesterovs, rows, plan)
        results = []
        for batch in plan[self.rank]:  # each input dropped once orthogonalized
            results.append(orthogonalize(wholes.pop(0), batch.steps))
        return self._rows_to_holders(results, nesterovs, rows, plan)

    def _rows_to_owners(self, nesterovs: list[torch.Tensor], rows: RowLayout, plan: list[list[Batch]]) -> list[torch.Tensor]:
        """One all-to-all: to each owner d, this rank's rows of d's matrices; back, this rank's
        batches whole, each (k, *shape) on the compute device."""
        world, me = self.world_size, self.rank
        to_owner = [sum(rows.numel(m, me) for m in members(plan[d])) for d in range(world)]
        from_holder = [sum(rows.numel(m, s) for m in members(plan[me])) for s in range(world)]
        send = torch.empty(sum(to_owner), dtype=SEND_DTYPE, device=nesterovs[0].device)
        torch.cat([nesterovs[m].flatten() for d in range(world) for m in members(plan[d])], out=send)
        received = torch.empty(sum(from_holder), dtype=SEND_DTYPE, device=self.device)
        dist.all_to_all_single(received, send.to(self.device), from_holder, to_owner, group=self.group)
        # received: [holder s][my batches][members][s's rows of the member], copied into each
        # member's rows of its batch's stack. Members of one shape may be split differently over
        # the ranks (a fused parameter's part and a matrix of its own).
        wholes = [torch.empty((len(b.members), *b.shape), dtype=SEND_DTYPE, device=self.device) for b in plan[me]]
        offset = 0
        for s in range(world):
            for whole, batch in zip(wholes, plan[me], strict=True):
                for j, m in enumerate(batch.members):
                    size = rows.numel(m, s)
                    whole[j, rows.start(m, s) : rows.start(m, s + 1)] = received[offset : offset + size].view(
                        rows.counts[m][s], *batch.shape[1:]
                    )
                    offset += size
        return wholes

    def _rows_to_holders(
        self, results: list[torch.Tensor], nesterovs: list[torch.Tensor], rows: RowLayout, plan: list[list[Batch]]
    ) -> list[torch.Tensor]:
        """One all-to-all: to each rank d, its rows of this rank's results; back, this rank's rows
        of every update, on the nesterovs' device."""
        world, me = self.world_size, self.rank
        to_holder = [sum(rows.numel(m, d) for m in members(plan[me])) for d in range(world)]
        from_owner = [sum(rows.numel(m, me) for m in members(plan[s])) for s in range(world)]
        back = torch.empty(sum(to_holder), dtype=SEND_DTYPE, device=self.device)
        parts = [
            result[j, rows.start(m, d) : rows.start(m, d + 1)].flatten()
            for d in range(world)
            for result, b in zip(results, plan[me], strict=True)
            for j, m in enumerate(b.members)
        ]
        if parts:
            torch.cat(parts, out=back)
        received = torch.empty(sum(from_owner), dtype=SEND_DTYPE, device=self.device)
        dist.all_to_all_single(received, back, from_owner, to_holder, group=self.group)
        like = nesterovs[0]
        flat = received.to(like.device)
        out: list[torch.Tensor] = [like] * len(nesterovs)
        offset = 0
        for s in range(world):
            for m in members(plan[s]):
                out[m] = flat[offset : offset + rows.numel(m, me)].view(nesterovs[m].shape)
                offset += rows.numel(m, me)
        return out


@dataclass(frozen=True)
class RowLayout:
    """Which rows of each of the step's matrices each rank holds under Shard(0)."""

    counts: list[list[int]]  # counts[m][rank]: how many rows of matrix m rank holds
    row_size: list[int]  # elements in one row of matrix m

    def numel(self, m: int, rank: int) -> int:
        """How many elements of matrix m rank holds."""
        return self.counts[m][rank] * self.row_size[m]

    def __post_init__(self) -> None:
        # Each matrix's first row per rank, summed once: start() runs per (rank, matrix) every step.
        starts = [list(itertools.accumulate(counts, initial=0)) for counts in self.counts]
        object.__setattr__(self, "_starts", starts)

    def start(self, m: int, rank: int) -> int:
        """The first row of matrix m that rank holds (rank = W: one past the last row)."""
        return self._starts[m][rank]  # type: ignore[attr-defined]
