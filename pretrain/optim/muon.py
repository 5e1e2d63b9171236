"""Muon (training.optimizer=muon): momentum, then an orthogonalized update, for the hidden matrices;
AdamW for the rest (embeddings, norms, the output layer), in one torch.optim.Optimizer so that
checkpoints, clipping and the schedule treat it as any other.

A hidden matrix's update is its Nesterov momentum with its singular values pushed towards 1
(U S V^T -> U V^T), by default with a few Newton-Schulz iterations in bfloat16 (Keller Jordan's
quintic), on CUDA compiled once for every shape (compiled_newton_schulz). The orthogonalization
is chosen by name (training.muon_orthogonalize, registry ORTHOGONALIZERS), so alternatives can be
studied without touching the optimizer. The training loop sets every group's "lr" from the
schedule; a Muon group scales it by its "lr_scale" (muon_learning_rate / learning_rate), so both
follow one schedule.

Each hidden matrix is orthogonalized on one rank, same-shape matrices stacked into one call
(pretrain/optim/muon_sharing.py: which rank, and the collectives): under DDP every rank holds the
averaged gradients and the updates are all-gathered; under FSDP2 a parameter is a DTensor sharded
by rows, its momentum stays sharded, and its rows travel to the owner and back by all-to-all.
Under HSDP the rows are sharded over a node's ranks and every node holds them all, with the same
gradients: each node shares the work among its own ranks and computes every update itself, so
nothing crosses nodes.
A fused parameter (attention.wqkv: Q, K and V's rows; feed_forward.w13: gate and up's;
pretrain/model/fused_layout.py) is orthogonalized as the separate matrices it stacks, each
update scaled by its own part's shape, so a step moves the weights as it did before the fusion.
The AdamW half is torch's own functional AdamW (fused, or foreach where no fused kernel exists),
with torch.optim.AdamW's state layout, so checkpoints read the same.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.fx.experimental._config as fx_config
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim.adamw import adamw

from pretrain import registry
from pretrain.plan.compile_prerequisites import missing_compile_prerequisite
from pretrain.config import ModelConfig, TrainingConfig
from pretrain.model import shards
from pretrain.model import fused_layout
from pretrain.optim.muon_sharing import MatrixSharing, Orthogonalize, part_slices, row_counts
from pretrain.optim.optimizers import fusable

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # a quintic that maximises the slope at 0
Iterate = Callable[[torch.Tensor, int], torch.Tensor]
"""Newton-Schulz's iterations on a wide bf16 stack (k, m, n), m <= n: newton_schulz_iterations or its compiled copy."""


class MuonError(ValueError):
    """A parameter group Muon cannot update: one line naming it."""


def newton_schulz(grad: torch.Tensor, steps: int, iterate: Iterate | None = None) -> torch.Tensor:
    """grad (..., m, n) -> approximately U V^T of its SVD, in bfloat16: singular values land
    in about [0.7, 1.2], which trains as well as exactly 1 and costs a few matmuls. The
    iterations (iterate: newton_schulz_iterations, or its compiled copy) see one wide stack
    (k, m, n) with m <= n, contiguous, in bf16: a tall matrix is transposed (to iterate on the
    smaller Gram matrix) and the leading dimensions flattened here, outside, so that nothing they
    compute depends on the shape and one compiled graph serves every shape (compiled_newton_schulz)."""
    tall = grad.size(-2) > grad.size(-1)
    wide = grad.mT if tall else grad
    # One copy at most: the cast and the transposed layout made contiguous together (a bf16 tensor
    # comes back from .to as it is, strides and all: .contiguous() then copies a transposed one).
    stack = wide.to(torch.bfloat16, memory_format=torch.contiguous_format).contiguous().view(-1, *wide.shape[-2:])
    x = (iterate or newton_schulz_iterations)(stack, steps).view(wide.shape)
    return x.mT if tall else x


def newton_schulz_iterations(x: torch.Tensor, steps: int) -> torch.Tensor:
    """Keller Jordan's quintic, steps times, on a wide bf16 stack x (k, m, n), m <= n: what
    compiled_newton_schulz compiles. bmm and baddbmm, not @: matmul's decomposition guards
    on a size of 1, which would compile a second graph for a (k, 1, n) stack."""
    a, b, c = NS_COEFFICIENTS
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)  # (k, m, m)
        polynomial = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b gram + c gram^2
        x = torch.baddbmm(x, polynomial, x, beta=a)  # a x + (b gram + c gram^2) x
    return x


def compiled_newton_schulz() -> Orthogonalize:
    """newton_schulz with its iterations compiled once for every shape a run passes (the stacks
    of each matrix shape, a fused parameter's parts, MoE's expert stacks; any stack size, 1
    included): every dimension of the wide stack is marked dynamic before the first call, and
    traced size-obliviously (torch's backed_size_oblivious, where this torch has it), so no size
    is specialized: neither a stack of one matrix, nor equal sizes (a square matrix) tied to
    each other. The orientation and the bf16 cast stay eager (newton_schulz): dynamo would guard
    on them. Past torch's recompile limit (8) dynamo would run the iterations eagerly, silently."""
    compiled = torch.compile(newton_schulz_iterations)

    def iterate(stack: torch.Tensor, steps: int) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(stack, [0, 1, 2])
        with size_oblivious():
            return compiled(stack, steps)

    return lambda grad, steps: newton_schulz(grad, steps, iterate)


def size_oblivious() -> contextlib.AbstractContextManager[Any]:
    """Tracing that assumes no size is 0 or 1 unless the code asks (torch.fx's backed_size_oblivious;
    a no-op on a torch without it: there a stack of one matrix compiles a graph of its own)."""
    if hasattr(fx_config, "backed_size_oblivious"):
        return fx_config.patch(backed_size_oblivious=True)  # type: ignore[attr-defined]
    return contextlib.nullcontext()


def svd_orthogonalize(grad: torch.Tensor, steps: int) -> torch.Tensor:
    """grad -> exactly U V^T (in fp32; steps is unused): the reference Newton-Schulz approximates."""
    u, _, vh = torch.linalg.svd(grad.float(), full_matrices=False)
    return u @ vh


COMPILED_ON: tuple[str, ...] = ("cuda",)
"""The device types orthogonalizer compiles on (under training.compile). Not the CPU: a first
compile there costs more than it saves; benchmarks/efficiency_worker.py adds "cpu", so that its
recompile counter sees Newton-Schulz's compiles without a GPU."""


def orthogonalizer(name: str, device: torch.device, compile: bool | None) -> Orthogonalize:
    """training.muon_orthogonalize's function; on a device type in COMPILED_ON (CUDA) compiled (the
    element-wise work around its matmuls fused), unless compile (training.compile) is false or
    torch.compile's compiler is missing: Newton-Schulz once for every shape (compiled_newton_schulz),
    another function (svd, one a study registers) by torch.compile as it is. Elsewhere eager."""
    function = registry.load(registry.ORTHOGONALIZERS[name])
    if device.type in COMPILED_ON and compile is not False and missing_compile_prerequisite(device.type) is None:
        return compiled_newton_schulz() if function is newton_schulz else torch.compile(function)
    return function


class Muon(torch.optim.Optimizer):
    """Groups with use_muon=True get Muon (lr * lr_scale, momentum, weight_decay, ns_steps);
    the others AdamW (lr, betas, eps, weight_decay). Hidden matrices only in Muon groups:
    MuonError otherwise. replicated_over: the process group whose ranks hold the same whole
    parameters (DDP), which then share the orthogonalizing; DTensor parameters (FSDP2) share it
    over the mesh dimension that splits their rows (HSDP's "shard": a node's ranks). device: where
    orthogonalizing runs (default: the parameters' device; the GPU under CPU offload).
    row_splits: for a parameter (by id) that stacks several matrices by rows (a fused
    attention.wqkv or feed_forward.w13), their row counts, in order: each is orthogonalized and
    scaled as a matrix of its own. self.orthogonalize is what is called, with (k, ..., m, n) stacks."""

    def __init__(
        self,
        groups: list[dict],
        orthogonalize: Orthogonalize,
        names: dict[int, str] | None = None,
        *,
        replicated_over: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        row_splits: dict[int, list[int]] | None = None,
    ) -> None:
        defaults: dict[str, Any] = {"lr": 0.0, "lr_scale": 1.0, "weight_decay": 0.0, "momentum": 0.95, "ns_steps": 5}
        defaults |= {"betas": (0.9, 0.95), "eps": 1e-8, "use_muon": False}
        super().__init__(groups, defaults)
        self.orthogonalize = orthogonalize
        matrices = [p for group in self.param_groups if group["use_muon"] for p in group["params"]]
        for p in matrices:
            if p.ndim < 2:
                name = (names or {}).get(id(p), "a parameter")
                shape = tuple(p.shape)
                raise MuonError(f"Muon updates matrices only, but {name} has shape {shape}; leave it to the AdamW groups")
        self.row_splits = {id(p): list(rows) for p in matrices if (rows := (row_splits or {}).get(id(p))) is not None}
        for p in matrices:
            if id(p) in self.row_splits and sum(self.row_splits[id(p)]) != p.shape[0]:
                name, rows = (names or {}).get(id(p), "a parameter"), self.row_splits[id(p)]
                raise MuonError(f"{name} has {p.shape[0]} rows, but its parts' rows {rows} add up to {sum(rows)}")
        for group in self.param_groups:
            # The fused kernel where there is one (CUDA, CPU: also for parameters offloaded to the host),
            # torch's foreach kernels elsewhere; "fused" also tells load_state_dict to keep "step" beside them.
            group["fused"] = not group["use_muon"] and all(fusable(p) for p in group["params"])
        self.sharing = matrix_sharing(self.param_groups, replicated_over, device, self.row_splits)

    @property
    def takes_found_inf(self) -> bool:
        """Whether step() can be told to change nothing by a device tensor (self.found_inf, set as
        torch's GradScaler sets it; pretrain/optim/optimizers.py step_unless): when every AdamW group
        runs torch's fused kernel, which takes it (the Muon groups mask their own update)."""
        return all(group["fused"] for group in self.param_groups if not group["use_muon"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        # 1.0 for a step to skip, as GradScaler tells torch's optimizers; None: no such check.
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)
        self._muon([g for g in self.param_groups if g["use_muon"]], found_inf)
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw(group, [p for p in group["params"] if p.grad is not None], found_inf)
        return loss

    def _muon(self, groups: list[dict], found_inf: torch.Tensor | None = None) -> None:
        """Momentum, then every Muon group's updates from one exchange (sharing.updates), applied per
        group. found_inf 1.0: every momentum buffer, weight and gradient is left as it was."""
        entries = [(g, position, p) for g, position, p in muon_entries(groups) if p.grad is not None]
        skip = None if found_inf is None else found_inf > 0  # a 0-d bool on the device, never read here
        for group in groups:
            params = [p for g, _, p in entries if g is group]
            grads = [local(gradient(p)) for p in params]
            buffers = [local(self._momentum_buffer(p)) for p in params]
            if params and skip is not None:
                masked_momentum(buffers, grads, group["momentum"], skip)
            elif params:
                torch._foreach_lerp_(buffers, grads, 1 - group["momentum"])
                torch._foreach_lerp_(grads, buffers, group["momentum"])  # Nesterov, in the spent gradient's storage
        nesterovs = [local(gradient(p)) for _, _, p in entries]
        orthogonalize = self.orthogonalize if skip is None else finite_input(self.orthogonalize, skip)
        updates = self.sharing.updates(nesterovs, [position for _, position, _ in entries], orthogonalize)
        for group in groups:
            lr = group["lr"] * group["lr_scale"]
            mine = [(p, update) for (g, _, p), update in zip(entries, updates, strict=True) if g is group]
            if skip is not None:
                masked_apply(mine, lr, group["weight_decay"], skip, self.row_splits)
                continue
            torch._foreach_mul_([local(p) for p, _ in mine], 1 - lr * group["weight_decay"])
            for scale, pairs in by_scale(mine, self.row_splits).items():  # one add per aspect ratio, computed in fp32
                torch._foreach_add_([local(p) for p, _ in pairs], [u for _, u in pairs], alpha=-lr * scale)

    def _momentum_buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(gradient(p))  # a DTensor shard under FSDP2, as p
        return state["momentum_buffer"]

    def _adamw(self, group: dict, params: list[torch.Tensor], found_inf: torch.Tensor | None = None) -> None:
        """torch's AdamW (fused or foreach) on this group's tensors: no loop over them here.
        found_inf (fused only): 1.0 leaves weights, moments and step counts as they were."""
        if not params:
            return
        if found_inf is not None and not group["fused"]:
            raise ValueError("Muon's foreach AdamW takes no found_inf; step it only after the flags are read")
        for p in params:
            state = self.state[p]
            if not state:  # torch.optim.AdamW's layout: "step" a float32 scalar, beside p when fused
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if group["fused"] else None)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            [local(p) for p in params],
            [local(gradient(p)) for p in params],
            [local(s["exp_avg"]) for s in states],
            [local(s["exp_avg_sq"]) for s in states],
            [],
            [s["step"] for s in states],
            foreach=not group["fused"],
            fused=group["fused"],
            grad_scale=None,
            found_inf=found_inf,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


MASK_CHUNK_BYTES = 64 * 2**20
"""masked_momentum's temporaries at most (a larger matrix alone): a chunk's matrices go through
foreach kernels together, and nothing the size of every matrix is held at once."""


def masked_momentum(buffers: list[torch.Tensor], grads: list[torch.Tensor], momentum: float, skip: torch.Tensor) -> None:
    """The momentum and Nesterov steps of _muon unless skip (a 0-d bool on the device): then every
    buffer and gradient keeps its value, so a report or dump of the step reads the backward's
    gradients. A skipped step's input is the buffer itself (torch.where: a NaN gradient scaled by 0
    is still NaN), so lerp leaves the buffer exactly as it was. Per chunk of matrices: one where per
    matrix into a temporary, two foreach lerps, one where per matrix back into the gradient; a step
    that is not skipped computes what the unmasked one does, bit for bit."""
    for chunk in _chunks(list(zip(buffers, grads, strict=True)), MASK_CHUNK_BYTES):
        inputs = [torch.where(skip, buffer, grad) for buffer, grad in chunk]
        torch._foreach_lerp_([buffer for buffer, _ in chunk], inputs, 1 - momentum)
        torch._foreach_lerp_(inputs, [buffer for buffer, _ in chunk], momentum)  # Nesterov, in the temporaries
        for (_, grad), nesterov in zip(chunk, inputs, strict=True):
            torch.where(skip, grad, nesterov, out=grad)  # in the spent gradient's storage, unless skipped


def _chunks(pairs: list[tuple[torch.Tensor, torch.Tensor]], limit: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """pairs in order, cut where a chunk's first tensors would pass limit bytes (each chunk holds one at least)."""
    chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    size = limit
    for pair in pairs:
        nbytes = pair[0].numel() * pair[0].element_size()
        if size + nbytes > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(pair)
        size += nbytes
    return chunks


def masked_apply(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    weight_decay: float,
    skip: torch.Tensor,
    row_splits: dict[int, list[int]] | None = None,
) -> None:
    """_muon's weight decay and update, in foreach kernels, unless skip: then the decay factor is 1
    and every update (finite: finite_input) is scaled by 0, so each weight keeps its value."""
    torch._foreach_mul_([local(p) for p, _ in pairs], torch.where(skip, 1.0, 1 - lr * weight_decay))
    keep = (~skip).float()
    for scale, scaled in by_scale(pairs, row_splits).items():  # one add per aspect ratio, as the unmasked step
        updates = [u for _, u in scaled]
        torch._foreach_mul_(updates, keep)
        torch._foreach_add_([local(p) for p, _ in scaled], updates, alpha=-lr * scale)


def finite_input(orthogonalize: Orthogonalize, skip: torch.Tensor) -> Orthogonalize:
    """orthogonalize, given zeros in place of a skipped step's momentum, which may hold NaN or Inf
    (an SVD refuses those); its result is scaled by 0 (masked_apply)."""
    return lambda stack, steps: orthogonalize(torch.where(skip.to(stack.device), 0.0, stack), steps)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the storage an update changes), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gradient(p: torch.Tensor) -> torch.Tensor:
    """p's gradient (step updates only parameters that have one)."""
    assert p.grad is not None
    return p.grad


def by_scale(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], row_splits: dict[int, list[int]] | None = None
) -> dict[float, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(parameter, update) pairs by Muon's scale for the update: sqrt(max(1, rows / columns)) of
    the whole matrix (a DTensor's shape is the whole's). A parameter that stacks several matrices
    (row_splits[id(parameter)]: their row counts) comes as (its rows, their update) pairs of each
    part this rank holds rows of, plain tensors, at that part's own scale."""
    grouped: dict[float, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for param, update in pairs:
        parts = (row_splits or {}).get(id(param))
        if parts is None:
            grouped.setdefault(math.sqrt(max(1.0, param.shape[-2] / param.shape[-1])), []).append((param, update))
            continue
        held = local(param)
        for rows, part in zip(parts, part_slices(parts, first_held_row(param), held.shape[0]), strict=True):
            if part.stop > part.start:
                grouped.setdefault(math.sqrt(max(1.0, rows / param.shape[-1])), []).append((held[part], update[part]))
    return grouped


def first_held_row(param: torch.Tensor) -> int:
    """The first row of param this rank holds: 0 unless param is a DTensor sharded by rows
    (FSDP2's Shard(0), split as torch.chunk splits: row_counts)."""
    if not isinstance(param, DTensor):
        return 0
    place, ranks = shards.row_split(param)
    return sum(row_counts(param.shape[0], ranks)[:place])


def muon_entries(groups: list[dict]) -> list[tuple[dict, int, torch.Tensor]]:
    """(group, position among every Muon matrix, parameter) for each Muon group's parameters."""
    params = [(group, p) for group in groups for p in group["params"]]
    return [(group, position, p) for position, (group, p) in enumerate(params)]


def matrix_sharing(
    groups: list[dict],
    replicated_over: dist.ProcessGroup | None,
    device: torch.device | None,
    row_splits: dict[int, list[int]] | None = None,
) -> MatrixSharing:
    """How the Muon groups' matrices are held (see pretrain/optim/muon_sharing.py): DTensors sharded by
    rows over one mesh dimension (FSDP2: the whole mesh; HSDP: "shard", a node's ranks, every node
    then sharing its own matrices alike), whole tensors replicated over a group (DDP), or here
    alone; a parameter in row_splits (by id) is the matrices it stacks by rows, each shared as one."""
    entries = muon_entries([g for g in groups if g["use_muon"]])
    matrices = [p for _, _, p in entries]
    keys = [(tuple(p.shape), group["ns_steps"]) for group, _, p in entries]
    parts = [(row_splits or {}).get(id(p)) for p in matrices]
    device = device or (local(matrices[0]).device if matrices else torch.device("cpu"))
    sharded = [p for p in matrices if isinstance(p, DTensor)]
    if not sharded:
        group = replicated_over if replicated_over is not None and dist.get_world_size(replicated_over) > 1 else None
        return MatrixSharing(keys, "replicated", group, device, parts)
    mesh, dims = sharded[0].device_mesh, {shards.row_mesh_dim(p) for p in sharded}
    if len(sharded) < len(matrices) or any(p.device_mesh != mesh for p in sharded) or len(dims) != 1 or None in dims:
        raise MuonError("Muon shares its matrices over one mesh sharded by rows (FSDP2's Shard(0)); these are held otherwise")
    (dim,) = dims
    return MatrixSharing(keys, "rows", mesh.get_group(dim), device, parts)


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """A matrix inside a transformer block (attention, feed-forward, experts); the embedding and
    the output layer are matrices too, but they map tokens, not hidden states: AdamW's."""
    return param.ndim >= 2 and ".layers." in f".{name}"


def build_muon(model: torch.nn.Module, training: TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    """Muon for the model as trained: the ranks of a DDP model or of FSDP2's mesh share the
    orthogonalizing; it runs on device (the GPU, also when the parameters are offloaded to the host).
    The fused attention.wqkv and feed_forward.w13 are orthogonalized as their parts (Q, K, V; gate, up)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not is_hidden_matrix(n, p)]
    common: dict[str, Any] = {"lr": training.learning_rate, "weight_decay": training.weight_decay}
    groups: list[dict[str, Any]] = [
        common
        | {"params": hidden, "use_muon": True, "momentum": training.muon_momentum, "ns_steps": training.muon_ns_steps}
        | {"lr_scale": training.muon_learning_rate / training.learning_rate},
        common | {"params": [p for p in rest if p.ndim >= 2], "betas": (training.beta1, training.beta2)},
        common | {"params": [p for p in rest if p.ndim < 2], "betas": (training.beta1, training.beta2), "weight_decay": 0.0},
    ]
    names = {id(p): n for n, p in named}
    replicas = model.process_group if isinstance(model, DistributedDataParallel) else None
    orthogonalize = orthogonalizer(training.muon_orthogonalize, device, training.compile)
    model_config = cast(ModelConfig, (model.module if isinstance(model, DistributedDataParallel) else model).cfg)
    splits = {id(p): rows for n, p in named if (rows := fused_layout.row_splits(n, model_config)) is not None}
    return Muon(groups, orthogonalize, names, replicated_over=replicas, device=device, row_splits=splits)
