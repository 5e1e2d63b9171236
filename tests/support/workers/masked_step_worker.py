"""One rank of tests/pretrain/test_masked_step.py's two-rank run (gloo, CPU): with AdamW and with Muon,
under DDP and under FSDP2, a good step, then two steps where only rank 1's loss is not finite (once its loss alone,
its gradients finite, so that rank 0 sees nothing wrong itself; once its gradients too), then a
good step again, under debug.on_nonfinite=skip. Writes <out>/rank<r>.json: per "optimizer
parallelism", what
changed in each step (weights, optimizer state), the skips counted, and whether the update was
issued before the flags were read.

Run as: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/workers/masked_step_worker.py OUT
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch

from support.checkpointing import resolved
from support.gloo_rank import report_as_gloo_rank
from pretrain import step as step_module, train
from pretrain.build import build
from pretrain.distributed.runtime import Runtime, setup_logging
from pretrain.model.loss import Loss

OUT = Path(sys.argv[1])
SETS = (
    "debug.check_finite=true",
    "debug.trace_nonfinite=false",
    "debug.on_nonfinite=skip",
    "training.cpu_offload=false",
)
BAD = {1: "loss", 2: "gradients"}
"""Rank 1's bad steps: its loss alone not finite, or its loss and (so every rank's) gradients."""


def config(optimizer: str, parallelism: str = "ddp"):
    sets = (*SETS, f"training.optimizer={optimizer}", f"training.parallelism={parallelism}")
    return resolved(OUT / "cache", *sets, world_size=2)[0]


def spoiled(loss: Loss, how: str) -> Loss:
    """loss with rank 1's cross-entropy Inf (how "loss"), or its total NaN, which makes every gradient NaN."""
    if how == "loss":
        return loss._replace(cross_entropy=loss.cross_entropy + float("inf"))
    return loss._replace(total=loss.total * float("nan"), cross_entropy=loss.cross_entropy * float("nan"))


def snapshot(trainer) -> tuple[dict, dict]:
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return weights, copy.deepcopy(trainer.optimizer.state_dict()["state"])


def same(first: object, second: object) -> bool:
    if isinstance(first, dict):
        return isinstance(second, dict) and first.keys() == second.keys() and all(same(first[k], second[k]) for k in first)
    return torch.equal(torch.as_tensor(first), torch.as_tensor(second))


def run(runtime: Runtime, optimizer: str, parallelism: str) -> dict:
    run_dir = OUT / f"run-{optimizer}-{parallelism}"
    trainer = build(config(optimizer, parallelism), runtime, resolved(OUT / "cache")[1], run_dir, setup_logging("w", "ERROR"))
    original = step_module.next_token_loss
    order: list[str] = []
    reading = torch.Tensor.tolist

    def read(self: torch.Tensor, *args: Any) -> Any:
        order.append("read")
        return reading(self, *args)

    step_method = trainer.optimizer.step

    def stepped(closure: Any = None) -> Any:
        order.append("step")
        return step_method(closure)

    trainer.optimizer.step = stepped  # type: ignore[method-assign]
    seen: dict = {"mode": trainer.mode, "changed": [], "skipped": [], "order": []}
    for step in range(4):
        how = BAD.get(step) if runtime.rank == 1 else None
        step_module.next_token_loss = (lambda *a, how=how, **k: spoiled(original(*a, **k), how)) if how else original
        before = snapshot(trainer)
        order.clear()
        torch.Tensor.tolist = read  # type: ignore[assignment,method-assign]
        try:
            train.train_step(trainer, step)
        finally:
            torch.Tensor.tolist = reading  # type: ignore[method-assign]
            step_module.next_token_loss = original
        after = snapshot(trainer)
        seen["changed"].append({"weights": not same(before[0], after[0]), "state": not same(before[1], after[1])})
        seen["skipped"].append(trainer.skipped_steps)
        seen["order"].append(list(order))
    return seen


def measure(runtime: Runtime) -> dict:
    return {f"{o} {p}": run(runtime, o, p) for o in ("adamw", "muon") for p in ("ddp", "fsdp")}


if __name__ == "__main__":
    report_as_gloo_rank(config("adamw"), measure)
