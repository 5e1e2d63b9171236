"""Muon (training.optimizer=muon): momentum, then an orthogonalized update, for the hidden matrices;
AdamW for the rest (embeddings, norms, the output layer), in one torch.optim.Optimizer so that
checkpoints, clipping and the schedule treat it as any other.

A hidden matrix's update is its Nesterov momentum with its singular values pushed towards 1
(U S V^T -> U V^T), by default with a few Newton-Schulz iterations in bfloat16 (Keller Jordan's
quintic). The orthogonalization is chosen by name (training.muon_orthogonalize, registry
ORTHOGONALIZERS), so alternatives can be studied without touching the optimizer. The training
loop sets every group's "lr" from the schedule; a Muon group scales it by its "lr_scale"
(muon_learning_rate / learning_rate), so both follow one schedule.

Each hidden matrix is orthogonalized on one rank, same-shape matrices stacked into one call
(pretrain/optim/muon_sharing.py: which rank, and the collectives): under DDP every rank holds the
averaged gradients and the updates are all-gathered; under FSDP2 a parameter is a DTensor sharded
by rows, its momentum stays sharded, and its rows travel to the owner and back by all-to-all.
The AdamW half is torch's own functional AdamW (fused, or foreach where no fused kernel exists),
with torch.optim.AdamW's state layout, so checkpoints read the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel
from torch.optim.adamw import adamw

from pretrain import registry
from pretrain.plan.compile_prerequisites import missing_compile_prerequisite
from pretrain.config import TrainingConfig
from pretrain.optim.muon_sharing import MatrixSharing, Orthogonalize
from pretrain.optim.optimizers import fusable

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # a quintic that maximises the slope at 0


class MuonError(ValueError):
    """A parameter group Muon cannot update: one line naming it."""


def newton_schulz(grad: torch.Tensor, steps: int) -> torch.Tensor:
    """grad (..., m, n) -> approximately U V^T of its SVD, in bfloat16: singular values land
    in about [0.7, 1.2], which trains as well as exactly 1 and costs a few matmuls."""
    a, b, c = NS_COEFFICIENTS
    x = grad.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def svd_orthogonalize(grad: torch.Tensor, steps: int) -> torch.Tensor:
    """grad -> exactly U V^T (in fp32; steps is unused): the reference Newton-Schulz approximates."""
    u, _, vh = torch.linalg.svd(grad.float(), full_matrices=False)
    return u @ vh


def orthogonalizer(name: str, device: torch.device, compile: bool | None) -> Orthogonalize:
    """training.muon_orthogonalize's function; on CUDA compiled (the element-wise work around its
    matmuls fused), unless compile (training.compile) is false or torch.compile's compiler is
    missing. On CPU eager: a first compile there costs more than it saves."""
    function = registry.load(registry.ORTHOGONALIZERS[name])
    if device.type == "cuda" and compile is not False and missing_compile_prerequisite(device.type) is None:
        return torch.compile(function)
    return function


class Muon(torch.optim.Optimizer):
    """Groups with use_muon=True get Muon (lr * lr_scale, momentum, weight_decay, ns_steps);
    the others AdamW (lr, betas, eps, weight_decay). Hidden matrices only in Muon groups:
    MuonError otherwise. replicated_over: the process group whose ranks hold the same whole
    parameters (DDP), which then share the orthogonalizing; DTensor parameters (FSDP2) share it
    over their mesh. device: where orthogonalizing runs (default: the parameters' device; the
    GPU under CPU offload). self.orthogonalize is what is called, with (k, ..., m, n) stacks."""

    def __init__(
        self,
        groups: list[dict],
        orthogonalize: Orthogonalize,
        names: dict[int, str] | None = None,
        *,
        replicated_over: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
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
        for group in self.param_groups:
            # The fused kernel where there is one (CUDA, CPU: also for parameters offloaded to the host),
            # torch's foreach kernels elsewhere; "fused" also tells load_state_dict to keep "step" beside them.
            group["fused"] = not group["use_muon"] and all(fusable(p) for p in group["params"])
        self.sharing = matrix_sharing(self.param_groups, replicated_over, device)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self._muon([g for g in self.param_groups if g["use_muon"]])
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw(group, [p for p in group["params"] if p.grad is not None])
        return loss

    def _muon(self, groups: list[dict]) -> None:
        """Momentum, then every Muon group's updates from one exchange (sharing.updates), applied per group."""
        entries = [(g, position, p) for g, position, p in muon_entries(groups) if p.grad is not None]
        for group in groups:
            params = [p for g, _, p in entries if g is group]
            grads = [local(gradient(p)) for p in params]
            buffers = [local(self._momentum_buffer(p)) for p in params]
            if params:
                torch._foreach_lerp_(buffers, grads, 1 - group["momentum"])
                torch._foreach_lerp_(grads, buffers, group["momentum"])  # Nesterov, in the spent gradient's storage
        nesterovs = [local(gradient(p)) for _, _, p in entries]
        updates = self.sharing.updates(nesterovs, [position for _, position, _ in entries], self.orthogonalize)
        for group in groups:
            lr = group["lr"] * group["lr_scale"]
            mine = [(p, update) for (g, _, p), update in zip(entries, updates, strict=True) if g is group]
            torch._foreach_mul_([local(p) for p, _ in mine], 1 - lr * group["weight_decay"])
            for scale, pairs in by_scale(mine).items():  # one add per aspect ratio, computed in fp32
                torch._foreach_add_([local(p) for p, _ in pairs], [u for _, u in pairs], alpha=-lr * scale)

    def _momentum_buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(gradient(p))  # a DTensor shard under FSDP2, as p
        return state["momentum_buffer"]

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        """torch's AdamW (fused or foreach) on this group's tensors: no loop over them here."""
        if not params:
            return
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
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the storage an update changes), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gradient(p: torch.Tensor) -> torch.Tensor:
    """p's gradient (step updates only parameters that have one)."""
    assert p.grad is not None
    return p.grad


def by_scale(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[float, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(parameter, update) pairs by Muon's scale for the update: sqrt(max(1, rows / columns)) of
    the whole matrix (a DTensor's shape is the whole's)."""
    grouped: dict[float, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for param, update in pairs:
        grouped.setdefault(math.sqrt(max(1.0, param.shape[-2] / param.shape[-1])), []).append((param, update))
    return grouped


def muon_entries(groups: list[dict]) -> list[tuple[dict, int, torch.Tensor]]:
    """(group, position among every Muon matrix, parameter) for each Muon group's parameters."""
    params = [(group, p) for group in groups for p in group["params"]]
    return [(group, position, p) for position, (group, p) in enumerate(params)]


def matrix_sharing(groups: list[dict], replicated_over: dist.ProcessGroup | None, device: torch.device | None) -> MatrixSharing:
    """How the Muon groups' matrices are held (see pretrain/optim/muon_sharing.py): DTensors sharded by
    rows over one mesh (FSDP2), whole tensors replicated over a group (DDP), or here alone."""
    entries = muon_entries([g for g in groups if g["use_muon"]])
    matrices = [p for _, _, p in entries]
    keys = [(tuple(p.shape), group["ns_steps"]) for group, _, p in entries]
    device = device or (local(matrices[0]).device if matrices else torch.device("cpu"))
    sharded = [p for p in matrices if isinstance(p, DTensor)]
    if not sharded:
        group = replicated_over if replicated_over is not None and dist.get_world_size(replicated_over) > 1 else None
        return MatrixSharing(keys, "replicated", group, device)
    mesh = sharded[0].device_mesh
    if len(sharded) < len(matrices) or any(p.device_mesh != mesh or tuple(p.placements) != (Shard(0),) for p in sharded):
        raise MuonError("Muon shares its matrices over one mesh sharded by rows (FSDP2's Shard(0)); these are held otherwise")
    return MatrixSharing(keys, "rows", mesh.get_group(), device)


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """A matrix inside a transformer block (attention, feed-forward, experts); the embedding and
    the output layer are matrices too, but they map tokens, not hidden states: AdamW's."""
    return param.ndim >= 2 and ".layers." in f".{name}"


def build_muon(model: torch.nn.Module, training: TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    """Muon for the model as trained: the ranks of a DDP model or of FSDP2's mesh share the
    orthogonalizing; it runs on device (the GPU, also when the parameters are offloaded to the host)."""
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
    return Muon(groups, orthogonalize, names, replicated_over=replicas, device=device)
