"""One rank of tests/pretrain/distributed/test_hsdp.py's run: 2 "nodes" x 2 gloo ranks on loopback (WORLD_SIZE=4,
LOCAL_WORLD_SIZE=2). The same tiny model trained from the same seed on the same global batch under
DDP, FSDP2 and HSDP (and HSDP with CPU offload), with every collective that FSDP2 and Muon issue
counted by process group and micro-batch; the 2-D mesh and its placements; where each rank's rows
are; Muon under HSDP beside Muon under DDP given the same gradients; and checkpoints saved under
each of HSDP, FSDP and DDP restored under each, through the project's save and restore, with what
was saved and what was restored compared; and emulated float8 (training.float8 "emulate") trained
by the project's train_step under HSDP, FSDP and DDP, with FSDP2's per-step float8 scale precompute
(the trainer's float8_scales hook) on the 2-D mesh. Writes <out>/rank<r>.json, and on rank 0 each saved
state as <out>/saved_<mode>.pt for the single-process restores the test makes itself.

Run as: RANK=r WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/workers/hsdp_worker.py OUT
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import logging
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from pretrain import config as cfg
from pretrain.checkpoint import save_restore
from pretrain.checkpoint.async_save import CheckpointWriter
from pretrain.checkpoint.model_state import named_optimizer_state, whole_tensors
from pretrain.checkpoint.separate_layout import _shard_rows
from pretrain.checkpoint.tiers import Tier
from pretrain.distributed import float8
from pretrain.distributed.parallel import clip_grad_norm, gradient_sync, has_fsdp, is_hybrid, parallelize, unwrap
from pretrain.distributed.runtime import Runtime
from pretrain.hf.init_from import first_row
from pretrain.model.loss import next_token_loss
from pretrain.model.transformer import Transformer
from pretrain.optim.muon import Muon, build_muon
from pretrain.plan import float8 as float8_plan
from pretrain.step import train_step
from support.gloo_rank import report_as_gloo_rank
from support.workers import muon_worker
from support.workers import parallel_worker

CONTEXT, BATCH, ACCUM, STEPS = 16, 2, 2, 3
MODES = ("ddp", "fsdp", "hsdp")
COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
    "all_gather",
    "broadcast",
)


def tiny_config(**training: Any) -> cfg.Config:
    """parallel_worker's tiny model (the same context) without the debug preset's NaN hooks, with
    this worker's batch and a schedule long enough for every step it takes."""
    config = parallel_worker.tiny_config(**({"max_steps": 10, "batch_size": BATCH} | training))
    return dataclasses.replace(config, debug=dataclasses.replace(config.debug, trace_nonfinite=False))


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Different data on each rank (so that averaging matters), the same in every run."""
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, 61, (STEPS * ACCUM + ACCUM, BATCH, CONTEXT + 1), generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@contextmanager
def counted(calls: list[tuple[str, list[int]]]) -> Iterator[None]:
    """Every torch.distributed collective called inside, as (name, the ranks of its group)."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(real)

        def counting(*args: Any, **kwargs: Any) -> Any:
            group = signature.bind(*args, **kwargs).arguments.get("group")
            calls.append((name, dist.get_process_group_ranks(group or dist.group.WORLD)))
            return real(*args, **kwargs)

        return counting

    for name, real in originals.items():
        setattr(dist, name, wrap(name, real))
    try:
        yield
    finally:
        for name, real in originals.items():
            setattr(dist, name, real)


def gather_values(value: float) -> list[float]:
    """[every rank's value], in rank order."""
    mine = torch.tensor(value, dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [float(t) for t in gathered]


def full(value: Any) -> Any:
    """A state's tensors whole (a collective for DTensors), recursively, detached on the CPU."""
    if isinstance(value, dict):
        return {key: full(entry) for key, entry in value.items()}
    if isinstance(value, torch.Tensor):
        return (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
    return value


def whole_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": full(unwrap(model).state_dict()), "optimizer": full(named_optimizer_state(optimizer, model)["state"])}


def largest_difference(first: Any, second: Any) -> float:
    """The largest absolute difference between two whole states (inf where their keys differ)."""
    if isinstance(first, dict):
        if not isinstance(second, dict) or first.keys() != second.keys():
            return float("inf")
        return max((largest_difference(first[k], second[k]) for k in first), default=0.0)
    return float((torch.as_tensor(first).double() - torch.as_tensor(second).double()).abs().max())


def all_reduce_flags(model: torch.nn.Module) -> list[bool]:
    """Whether each FSDP2 parameter group all-reduces its gradients on the next backward."""
    return [
        group.all_reduce_grads
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
    ]


def meta_model(config: cfg.Config, runtime: Runtime, mode: str) -> torch.nn.Module:
    with torch.device("meta"):
        model = Transformer(config.model, CONTEXT)
    return parallelize(model, config, runtime, mode)


@dataclasses.dataclass
class Position:
    """The data loader's position, all a checkpoint reads and restores of it."""

    epoch: int = 0
    batch_index: int = 0
    batches_per_epoch: int = 1000

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch_index = state["epoch"], state["batch_index"]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(())


class Unrecorded:
    """A metrics log that records nothing (the asynchronous writer reports each save to one)."""

    def log_checkpoint(self, *args: Any) -> None:
        pass


@dataclasses.dataclass
class Saving:
    """What save_restore reads and restores of a trainer (pretrain/checkpoint/trainer_state.py)."""

    config: cfg.Config
    runtime: Runtime
    model: torch.nn.Module
    mode: str
    optimizer: torch.optim.Optimizer
    run_dir: Path
    loader: Any = dataclasses.field(default_factory=Position)  # a Position, in TrainBatches' place
    log: logging.Logger = dataclasses.field(default_factory=lambda: logging.getLogger("hsdp_worker"))
    metrics: Any = dataclasses.field(default_factory=Unrecorded)
    checkpoints: Any = None
    batches: Iterator[Any] = dataclasses.field(default_factory=lambda: iter(()))


def train(config: cfg.Config, runtime: Runtime, mode: str) -> tuple[dict, torch.nn.Module, torch.optim.Optimizer]:
    """STEPS optimizer steps of ACCUM micro-batches from a model built on the meta device: the
    mean loss and gradient norm of each step, the collectives of each micro-batch, the
    all-reduce flags after each step, and the weights at the start and the end."""
    model = meta_model(config, runtime, mode)
    reference = Transformer(config.model, CONTEXT, seed=config.training.seed).state_dict()
    start = dict(whole_tensors(model))  # the export's gather, one tensor at a time
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = iter(batches(runtime.rank))
    record: dict = {"losses": [], "grad_norms": [], "collectives": [], "flags_after_step": []}
    record["start_differs_from_one_process"] = largest_difference(start, dict(reference))
    for _ in range(STEPS):
        loss_sum = torch.zeros(())
        micro_batches = []
        for micro in range(ACCUM):
            x, y = next(data)
            calls: list[tuple[str, list[int]]] = []
            with counted(calls), gradient_sync(model, micro == ACCUM - 1):
                loss = next_token_loss(model, x, y).total / ACCUM
                loss.backward()
                if micro < ACCUM - 1:
                    record.setdefault("flags_inside_no_sync", all_reduce_flags(model))
            micro_batches.append(calls)
            loss_sum += loss.detach()
        record["collectives"].append(micro_batches)
        record["flags_after_step"].append(all_reduce_flags(model))
        dist.all_reduce(loss_sum)
        record["losses"].append(float(loss_sum) / runtime.world_size)
        record["grad_norms"].append(gather_values(float(clip_grad_norm(model, 0.5))))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    record["state"] = {name: t.flatten().tolist() for name, t in full(unwrap(model).state_dict()).items()}
    record["hybrid"] = is_hybrid(model)
    return record, model, optimizer


def layout(model: torch.nn.Module) -> dict:
    """The mesh and placements of the sharded weights, and whether each rank's rows are where
    init_from (first_row) and a separate-layout checkpoint (_shard_rows) expect them."""
    params = dict(unwrap(model).named_parameters())
    wqkv = params["layers.0.attention.wqkv.weight"]
    assert isinstance(wqkv, DTensor)
    mesh = wqkv.device_mesh
    rows_in_place = []
    for param in params.values():
        assert isinstance(param, DTensor)
        whole, mine, start = full(param), param.to_local().detach(), first_row(param)
        separate = _shard_rows(whole, param)
        rows_in_place.append(
            torch.equal(whole[start : start + mine.shape[0]], mine) and separate is not None and torch.equal(separate, mine)
        )
    return {
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names or ()),
        "placements": sorted({str(tuple(p.placements)) for p in params.values() if isinstance(p, DTensor)}),
        "shard_group": dist.get_process_group_ranks(mesh.get_group("shard")),
        "replicate_group": dist.get_process_group_ranks(mesh.get_group("replicate")),
        "rows_in_place": all(rows_in_place),
    }


def flag_reset_after_error(config: cfg.Config, runtime: Runtime) -> list[bool]:
    """The all-reduce flags after a micro-batch without sync ended in an error."""
    model = meta_model(config, runtime, "hsdp")
    try:
        with gradient_sync(model, False):
            raise RuntimeError("a failed micro-batch")
    except RuntimeError:
        pass
    return all_reduce_flags(model)


def muon(runtime: Runtime) -> dict:
    """Muon under HSDP and under DDP given the same whole gradients, step for step: the largest
    difference of their weights (hidden matrices, the rest) and each one's from one process
    (muon_worker.compare's reference), the largest update, and the collectives of HSDP's steps."""
    config = muon_worker.tiny_config()
    models = {mode: meta_model(config, runtime, mode) for mode in ("ddp", "hsdp")}
    reference = Transformer(config.model, CONTEXT, seed=config.training.seed)
    optimizers = {mode: build_muon(model, config.training, runtime.device) for mode, model in models.items()}
    single = build_muon(reference, config.training, runtime.device)
    hsdp = optimizers["hsdp"]
    assert isinstance(hsdp, Muon)
    counts = {"flops": 0, "matrices": 0}
    muon_worker.count_flops(hsdp, counts)
    calls: list[tuple[str, list[int]]] = []
    record: dict = {"hsdp_vs_ddp": [], "hsdp_vs_single": [], "largest_update": [], "sharing": hsdp.sharing.held}
    record["sharing_ranks"] = hsdp.sharing.world_size
    for step in range(muon_worker.STEPS):
        before = muon_worker.weights(reference)
        grads = muon_worker.gradients(step, reference)
        for mode, model in [*models.items(), ("single", reference)]:
            opt = single if mode == "single" else optimizers[mode]
            muon_worker.set_gradients(model, grads)
            for group in opt.param_groups:
                group["lr"] = muon_worker.LR
            with counted(calls if mode == "hsdp" else []):
                opt.step()
            opt.zero_grad(set_to_none=True)
        ours, ddp, theirs = (muon_worker.weights(m) for m in (models["hsdp"], models["ddp"], reference))
        record["hsdp_vs_ddp"].append(largest_difference(ours, ddp))
        record["hsdp_vs_single"].append(largest_difference(ours, theirs))
        record["largest_update"].append(
            max(float((theirs[n] - before[n]).abs().max()) for n in theirs if n.startswith("layers."))
        )
    record["collectives"] = calls
    record["matrices_per_rank"] = gather_values(counts["matrices"] / muon_worker.STEPS)
    return record


def checkpoints(config: cfg.Config, runtime: Runtime, out: Path, trained: dict[str, tuple]) -> dict:
    """Each mode's trained model and optimizer saved (save_restore.save; HSDP's also by the
    asynchronous writer, restored into FSDP), then restored into a fresh model of each mode: the
    largest difference between what was saved and what each restore holds; rank 0 writes each
    saved state to out/saved_<mode>.pt. The HSDP restore into
    HSDP takes one more step beside the run that saved: the same loss."""
    saved, paths = {}, {}
    for mode, (_, model, optimizer) in trained.items():
        trainer = Saving(config, runtime, model, mode, optimizer, out / f"saved_{mode}", Position(0, STEPS * ACCUM))
        paths[mode] = save_restore.save(trainer, STEPS, trainer.run_dir)
        saved[mode] = whole_state(model, optimizer)
        if runtime.is_main:
            torch.save(saved[mode], out / f"saved_{mode}.pt")
    # HSDP's state saved again by the asynchronous writer (DCP's background save on its own gloo group)
    trainer = Saving(config, runtime, trained["hsdp"][1], "hsdp", trained["hsdp"][2], out / "async", Position(0, STEPS * ACCUM))
    writer = CheckpointWriter(trainer, True, dist.new_group(backend="gloo"))
    paths["hsdp_async"] = writer.save(STEPS, Tier("durable", out / "async" / "checkpoints", 1, False), wait=True)
    writer.close()
    saved["hsdp_async"] = saved["hsdp"]
    record: dict = {"paths": {mode: str(path) for mode, path in paths.items()}, "restored": {}}
    for target in MODES:
        for source in [*MODES, "hsdp_async"] if target == "fsdp" else MODES:
            model = meta_model(config, runtime, target)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            trainer = Saving(config, runtime, model, target, optimizer, out / f"{source}_into_{target}")
            steps = save_restore.restore(trainer, paths[source])
            restored = whole_state(model, optimizer)
            record["restored"][f"{source} into {target}"] = {
                "steps": steps,
                "position": trainer.loader.state_dict(),
                "difference": largest_difference(restored, saved[source]),
            }
            if source == target == "hsdp":
                record["continued"] = [one_more_step(m, o, runtime) for m, o in [trained["hsdp"][1:], (model, optimizer)]]
    return record


def one_more_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, runtime: Runtime) -> float:
    """One more optimizer step on the data after the trained steps: its mean loss over the ranks."""
    total = torch.zeros(())
    for micro, (x, y) in enumerate(batches(runtime.rank)[STEPS * ACCUM :]):
        with gradient_sync(model, micro == ACCUM - 1):
            loss = next_token_loss(model, x, y).total / ACCUM
            loss.backward()
        total += loss.detach()
    clip_grad_norm(model, 0.5)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        x, y = batches(runtime.rank)[0]
        after = next_token_loss(model, x, y).total.detach()
    dist.all_reduce(after)
    return float(after) / runtime.world_size


def float8_config() -> cfg.Config:
    """The tiny model with emulated float8 matmuls (every Linear in a block is a multiple of 16:
    dim 32, ffn_dim 64) under bf16 autocast, as float8 needs, and debug.check_finite off: the step
    then updates as an ordinary run's does, without the check's extra all-reduce."""
    config = tiny_config(use_amp=True, float8="emulate")
    return dataclasses.replace(config, debug=dataclasses.replace(config.debug, check_finite=False))


def float8_train(config: cfg.Config, runtime: Runtime, mode: str) -> dict:
    """STEPS optimizer steps of pretrain/step.py's train_step (autocast, accumulation, clipping,
    the update, then the trainer's float8_scales hook, set as pretrain/build.py sets it) on this
    worker's batches: the mean loss of each step over the ranks, and after each step whether every
    float8 weight holds a precomputed scale and how far it is from the one its whole weight gives."""
    model = meta_model(config, runtime, mode)
    data = iter(batches(runtime.rank))
    trainer = types.SimpleNamespace(
        config=config,
        runtime=runtime,
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        loader=Position(),
        batches=data,
        tracer=None,
        stragglers=None,
        faults=None,
        skips_in_a_row=0,
        aux_losses={},
        counts={},
        float8_scales=float8.scale_precompute(model, config, has_fsdp(model)),  # build.py's call
    )
    linears = [m for m in unwrap(model).modules() if float8.is_float8(m)]
    e4m3 = torch.finfo(torch.float8_e4m3fn).max
    record: dict = {"losses": [], "scales_set": [], "scale_error": [], "float8_linears": len(linears)}
    record["hook"] = trainer.float8_scales is not None
    for step in range(STEPS):
        loss, _, _ = train_step(trainer, step)  # type: ignore[arg-type]
        dist.all_reduce(loss)
        record["losses"].append(float(loss) / runtime.world_size)
        scales = [getattr(m.weight._local_tensor, "_precomputed_scale", None) for m in linears if isinstance(m.weight, DTensor)]
        record["scales_set"].append(len(scales) == len(linears) and all(s is not None for s in scales))
        if record["scales_set"][-1]:
            whole = [e4m3 / full(m.weight).abs().max().double() for m in linears]
            record["scale_error"].append(max(float((s.double() / w - 1).abs()) for s, w in zip(scales, whole, strict=True)))
    return record


def float8_runs(runtime: Runtime) -> dict | None:
    """float8_train under HSDP and FSDP over all 4 ranks (the pair the test compares), and DDP
    (no float8 all-gather and no precompute: each rank casts its whole weights); None where
    torchao is missing or does not run on this torch (test_float8.py skips there too)."""
    if importlib.util.find_spec("torchao") is None or float8_plan.torchao_version_problem():
        return None
    config = float8_config()
    return {mode: float8_train(config, runtime, mode) for mode in ("hsdp", "fsdp", "ddp")}


def measure(runtime: Runtime) -> dict:
    out = Path(sys.argv[1])
    config = tiny_config()
    trained = {mode: train(config, runtime, mode) for mode in MODES}
    result: dict = {mode: record for mode, (record, _, _) in trained.items()}
    result["ranks_per_node"], result["nodes"] = runtime.ranks_per_node, runtime.nodes
    result["layout"] = layout(trained["hsdp"][1])
    result["hsdp_offload"] = train(tiny_config(cpu_offload=True), runtime, "hsdp")[0]
    result["flags_after_error"] = flag_reset_after_error(config, runtime)
    result["muon"] = muon(runtime)
    result["checkpoints"] = checkpoints(config, runtime, out, trained)
    result["float8"] = float8_runs(runtime)  # last: the only part that imports torchao
    return result


if __name__ == "__main__":
    report_as_gloo_rank(tiny_config(), measure)
