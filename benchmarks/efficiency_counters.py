"""The counters of benchmarks/efficiency.py: what a training step would cost on a GPU, counted on any device.

- HostSyncs: the ops that make the host wait for the device on CUDA (a scalar read, an output
  whose size depends on the data), counted with a dispatch mode, so a CPU run counts what a GPU
  would pay. Tensors that stay in host memory on a GPU too (torch AdamW's per-parameter `step`
  counters) are excluded by identity.
- Collectives: the bytes each kind of collective moves, from the same dispatch mode: every
  c10d op (DDP's C++ reducer and FSDP2's hooks included) and every functional collective
  (DTensor's); by link too (inter- or intra-node, by the op's process group:
  benchmarks/efficiency_links.py).
- CompileEvents: graph breaks (dynamo's counters) and recompiles (dynamo's compile-start
  callback: a frame compiled again in the same phase, train or eval).
- Orthogonalizations: the Newton-Schulz FLOPs of the matrices one rank orthogonalizes, by
  wrapping the Muon optimizer's `orthogonalize` attribute.
- FLOP_FORMULAS: FlopCounterMode's formulas for the ops torch has none for (a mixture of
  experts' grouped matmuls, aten._grouped_mm).
"""

from __future__ import annotations

import contextlib
import math
import re
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks import efficiency_links as links

aten = torch.ops.aten

ALWAYS_SYNC = {  # and aten._local_scalar_dense (.item(), float(t), bool(t)) of a tensor on the device
    aten.nonzero.default,
    aten.nonzero.out,
    aten.masked_select.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
    aten._unique.default,
    aten._unique2.default,
    aten.bincount.default,  # CUDA sizes the output from max().item()
    aten.equal.default,  # returns a Python bool
}
"""Ops that copy a value to the host on CUDA whatever their arguments: a scalar read, or an
output whose size depends on the data."""

CHECKS_CUDA_SKIPS = ("one_hot",)
"""Composite functions whose CPU path reads a value back (one_hot checks that its indices lie
in [0, num_classes) with min().item() and max().item()) but whose CUDA path does not when its
size is given: their inner reads are not counted (one_hot without num_classes counts one)."""

HOST_SIDE = ("data/",)
"""Project code that works in host memory on any device (pretrain/data/: the loader makes the
batches there, then the step copies them over): its reads are no synchronization."""

COLLECTIVE_KINDS = {
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast",
    "alltoall": "all_to_all",
    "all_to_all": "all_to_all",
    "send": "send_recv",
    "recv": "send_recv",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
}
"""Op name prefix (c10d and _c10d_functional) -> the kind of collective it is, longest first when matched."""


def collective_kind(op_name: str) -> str | None:
    """'c10d._allgather_base_.default' -> 'all_gather'; None for what moves no data (barrier,
    wait_tensor, monitored_barrier)."""
    name = op_name.split(".")[1].lstrip("_")
    for prefix in sorted(COLLECTIVE_KINDS, key=len, reverse=True):
        if name.startswith(prefix):
            return COLLECTIVE_KINDS[prefix]
    return None


def tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def payload_bytes(args: tuple, result: Any) -> int:
    """The collective's payload: the largest of its arguments and its result, each flattened:
    the gathered tensor of an all-gather, the tensor to reduce of a reduce-scatter, the buffer
    of an all-reduce or a broadcast (NCCL's "size" of the operation: what a ring moves about
    2 (W - 1) / W times of for an all-reduce and (W - 1) / W times of for the others)."""
    return max([tensor_bytes(arg) for arg in args] + [tensor_bytes(result)])


def user_site() -> str:
    """file:line of the innermost frame of project code (pretrain/) that led here."""
    for frame in reversed(traceback.extract_stack()):
        if "/pretrain/" in frame.filename:
            return f"{frame.filename.rsplit('/pretrain/', 1)[1]}:{frame.lineno}"
    return "?"


class DispatchCounter(TorchDispatchMode):
    """Host synchronizations a CUDA device would make, and collective payloads, of the ops run
    inside. on_host(tensor) says whether a tensor would stay in host memory on a GPU (a read
    of it is no synchronization); ranks_per_node (None: one node) which collectives cross nodes."""

    def __init__(self, on_host: Callable[[torch.Tensor], bool], ranks_per_node: int | None = None) -> None:
        super().__init__()
        self.on_host = on_host
        self.ranks_per_node = ranks_per_node
        self.syncs: Counter[str] = Counter()
        """'op at file:line' -> count."""
        self.collective_bytes: Counter[str] = Counter()
        """kind -> payload bytes."""
        self.collective_calls: Counter[str] = Counter()
        self.link_bytes: Counter[str] = Counter()
        """'inter_node/all_reduce' (link/kind) -> payload bytes."""
        self.marks: dict[str, int] = {}
        """label -> the syncs counted when mark(label) was first called (where a sync sits in a step)."""
        self._quiet = 0

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())

    def note_sync(self, what: str) -> None:
        site = user_site()
        if not self._quiet and not site.startswith(HOST_SIDE):
            self.syncs[f"{what} at {site}"] += 1

    def mark(self, label: str) -> None:
        self.marks.setdefault(label, self.sync_count)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.syncs_on_cuda(func, args, kwargs):
            self.note_sync(func.__name__)
        result = func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional") and (kind := collective_kind(str(func))):
            payload = payload_bytes(args, result)
            self.collective_bytes[kind] += payload
            self.collective_calls[kind] += 1
            self.link_bytes[f"{links.op_link(func, args, kwargs, self.ranks_per_node)}/{kind}"] += payload
        return result

    def syncs_on_cuda(self, func: Any, args: tuple, kwargs: dict) -> bool:
        if func is aten._local_scalar_dense.default:
            return not self.on_host(args[0])
        if func in ALWAYS_SYNC:
            return True
        if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
            return kwargs.get("output_size", args[-1] if len(args) > 2 else None) is None
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
        return False


@contextlib.contextmanager
def counting_syncs(counter: DispatchCounter) -> Iterator[DispatchCounter]:
    """counter active, with the read the dispatcher does not see counted too (Tensor.tolist() of a
    tensor that would be on the device: torch copies it to the host without dispatching on a
    CPU), and the CPU-only checks of CHECKS_CUDA_SKIPS left out. (Tensor.numpy() refuses a CUDA
    tensor: whatever calls it works in host memory.)"""
    functional = torch.nn.functional
    originals = {"tolist": torch.Tensor.tolist}
    one_hot = functional.one_hot

    def reading(name: str) -> Callable[..., Any]:
        original = originals[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not counter.on_host(self):
                counter.note_sync(f"Tensor.{name}")
            with counter.quiet():
                return original(self, *args, **kwargs)

        return read

    def one_hot_as_on_cuda(tensor: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
        if num_classes < 0:
            counter.note_sync("one_hot without num_classes")
        with counter.quiet():
            return one_hot(tensor, num_classes)

    try:
        for name in originals:
            setattr(torch.Tensor, name, reading(name))
        functional.one_hot = one_hot_as_on_cuda
        with counter:
            yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        functional.one_hot = one_hot


def host_tensors(optimizer: torch.optim.Optimizer) -> set[int]:
    """The ids of the optimizer's state tensors that live in host memory on any device: torch
    AdamW's (and this project's Muon's) per-parameter `step` counters when not capturable."""
    found = set()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.ndim == 0:
                found.add(id(value))
    return found


# --- torch.compile ------------------------------------------------------------------------------


class CompileEvents:
    """Graph breaks and recompiles while active. phase ("train" or "eval") is set by the caller:
    a frame's first compile in each phase is expected (eval runs without gradients, a guard of
    its own); every further compile of the same frame in the same phase is a recompile."""

    def __init__(self) -> None:
        self.phase = "train"
        self.compiles: Counter[tuple[str, str]] = Counter()
        """(frame id, phase) -> compiles."""
        self.graph_break_reasons: Counter[str] = Counter()
        self.graphs = 0
        """Graphs dynamo captured: a block it gave up on (a break inside a checkpointed region) has none."""
        self._breaks_before: Counter[str] = Counter()
        self._graphs_before = 0

    def _started(self, args: Any) -> None:
        from torch._dynamo.callback import CallbackTrigger

        if args.callback_trigger != CallbackTrigger.DYNAMO:
            return
        parts = re.findall(r"\d+", str(args.compile_id))
        frame = parts[-2] if len(parts) >= 2 else str(args.compile_id)
        self.compiles[(frame, self.phase)] += 1

    def __enter__(self) -> CompileEvents:
        from torch._dynamo import callback_handler
        from torch._dynamo.utils import counters

        self._breaks_before = Counter(counters["graph_break"])
        self._graphs_before = counters["stats"]["unique_graphs"]
        callback_handler.register_start_callback(self._started)
        return self

    def __exit__(self, *exc: object) -> None:
        from torch._dynamo import callback_handler
        from torch._dynamo.utils import counters

        callback_handler.remove_start_callback(self._started)
        self.graphs = counters["stats"]["unique_graphs"] - self._graphs_before
        for reason, count in counters["graph_break"].items():
            if count > self._breaks_before[reason]:
                self.graph_break_reasons[short_reason(reason)] += count - self._breaks_before[reason]

    @property
    def graph_breaks(self) -> int:
        return sum(self.graph_break_reasons.values())

    @property
    def recompiles(self) -> int:
        return sum(count - 1 for count in self.compiles.values())


def short_reason(reason: str) -> str:
    """Dynamo's graph break reason in one line: its kind and, where it gives one, the developer context."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    context = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Developer debug context:")), "")
    return f"{lines[0]} ({context[:120]})" if context else lines[0] if lines else "?"


# --- FLOPs ---------------------------------------------------------------------------------------


def grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of aten._grouped_mm(a, b, offs): 2 x (rows) x (contraction) x (columns) over every group.
    2D a (M, K) x 3D b (G, K, N), rows ragged by offs (the experts' forward and input gradient):
    each of the M rows meets one group's (K, N), 2 M K N. 3D a (G, M, K) x 2D b (K, N), columns
    ragged: 2 M K N. 2D a (M, K) x 2D b (K, N), the contraction ragged (the weight gradient, a
    (G, M, N) output): each group contracts its share of K, 2 M K N over the whole K. 3D x 3D is
    bmm: 2 G M K N. The rows, columns or contraction past offs[-1] are counted as if used (the
    values of offs are not known to a shape formula; a mixture of experts' offsets end at M)."""
    if len(a_shape) == 3 and len(b_shape) == 3:
        groups, m, k = a_shape
        return 2 * groups * m * k * b_shape[-1]
    return 2 * a_shape[-2] * a_shape[-1] * b_shape[-1]


FLOP_FORMULAS: dict[Any, Callable[..., int]] = {aten._grouped_mm: grouped_mm_flops} if hasattr(aten, "_grouped_mm") else {}
"""FlopCounterMode(custom_mapping=FLOP_FORMULAS): the formulas torch's counter lacks."""


# --- Muon ---------------------------------------------------------------------------------------


def newton_schulz_flops(shape: Iterable[int], steps: int) -> float:
    """Matmul FLOPs of Newton-Schulz on a (..., m, n) batch: per iteration and matrix, with
    s = min(m, n) and l = max(m, n), the Gram matrix (2 s^2 l), its square (2 s^3) and the
    product with x (2 s^2 l): what FlopCounterMode counts of pretrain/optim/muon.py's newton_schulz."""
    *batch, m, n = shape
    small, large = min(m, n), max(m, n)
    return math.prod(batch) * steps * (4.0 * small * small * large + 2.0 * small**3)


class Orthogonalizations:
    """Wraps optimizer.orthogonalize (called with one (m, n) matrix or a (k, m, n) stack of
    same-shape ones, and the Newton-Schulz steps) and adds up the FLOPs of what it was given."""

    def __init__(self, optimizer: Any) -> None:
        self.flops = 0.0
        self.matrices = 0
        self.optimizer = optimizer
        self.original = optimizer.orthogonalize

        def counted(tensor: torch.Tensor, steps: int, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.flops += newton_schulz_flops(tensor.shape, steps)
            self.matrices += math.prod(tensor.shape[:-2])
            return self.original(tensor, steps, *args, **kwargs)

        optimizer.orthogonalize = counted

    def remove(self) -> None:
        self.optimizer.orthogonalize = self.original


def hidden_matrix_flops(named_parameters: Iterable[tuple[str, torch.Tensor]], steps: int, model_config: Any = None) -> float:
    """Newton-Schulz FLOPs of every hidden matrix (pretrain/optim/muon.py's is_hidden_matrix: a matrix
    inside a block), at its whole (unsharded) shape: what one rank does alone. A fused projection
    (pretrain/model/fused_layout.py, given the model's config) counts as the separate matrices
    Muon orthogonalizes."""
    from pretrain.model.fused_layout import row_splits
    from pretrain.optim.muon import is_hidden_matrix

    total = 0.0
    for name, p in named_parameters:
        if not is_hidden_matrix(name, p):
            continue
        parts = row_splits(name, model_config) if model_config is not None else None
        shapes = [(rows, *p.shape[1:]) for rows in parts] if parts else [p.shape]
        total += sum(newton_schulz_flops(shape, steps) for shape in shapes)
    return total


def per_rank_summary(values: list[dict[str, Any]], key: str) -> Any:
    """The largest of the ranks' values (None when no rank has one)."""
    present = [v[key] for v in values if v.get(key) is not None]
    return max(present) if present else None


def merge_counts(dicts: Iterable[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for d in dicts:
        for key, value in d.items():
            total[key] += value
    return dict(total)
