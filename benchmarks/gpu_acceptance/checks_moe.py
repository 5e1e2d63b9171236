"""GPU check `moe` (issue 39): dropless mixture of experts against capacity routing, on `small`.

The `small` preset with 4 experts, top-2, trained twice from the same seed on the same batches,
compiled, one process each (this module run as `python -m benchmarks.gpu_acceptance.checks_moe
dropless|capacity ...`): once dropless (model.moe.capacity_factor null: grouped matmuls, no
padding) and once with capacity factor CAPACITY_FACTOR (MegaBlocks' capacity routing, every
expert's buffer padded to 1.25 x its fair share). Rows: each run's tokens/s, MFU and the
token-expert assignments it dropped over its steps, and dropless's tokens/s over capacity's.

First, in a short process of its own (`... checks_moe kernel`), the grouped matmul this GPU runs
(pretrain/model/moe_dropless.py experts_kernel, as training places it) against a per-expert loop,
on bf16 experts one of which gets no token: the outputs, the tokens' gradient and the experts'
weight gradients within bf16's rounding, and the empty expert's weight gradient exactly 0. The row
also says what torch's kernel alone gave that expert (pytorch/pytorch#172439: non-zero on B200,
which the zeroing on compute capability 10.x covers), so a lent GPU tells whether the workaround
is still needed.

Dropless runs the experts' FLOPs of top_k per token, capacity routing 1.25 times them (its
padding); the issue's H200 measurement had the capacity-routed MoE at 0.62x dense tokens/s. The
MegaBlocks paper reports dropless up to 40% faster than capacity-based MoE at their scale; here
the target is that dropless is not slower and drops nothing.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from benchmarks.gpu_acceptance.context import Context, Row
from benchmarks.gpu_acceptance.procs import child_env, emit, results, run

EXPERTS, TOP_K = 4, 2
CAPACITY_FACTOR = 1.25
"""The capacity run's factor: the default before dropless."""
STEPS = 40
QUICK_STEPS = 25
TIMED_FROM = 10
"""Steps before this one are left out of tokens/s and MFU (the compile, the allocator's warm-up)."""
RUN_TIMEOUT_S = 200
"""One run: the launch, a cold compile of `small`'s blocks and head with experts (about 90 s on an
H100), and STEPS steps of 65,536 tokens; the two runs' 400 s within a group's 7.5 minutes."""
MODES = ("dropless", "capacity")
KERNEL_TIMEOUT_S = 45
"""The kernel comparison's process: a CUDA context and a few small matmuls."""
KERNEL_TOLERANCE = 2e-2
"""The largest error the comparison accepts, relative to the largest value compared: bf16's rounding."""


def run_argv(mode: str, steps: int, data_sets: list[str]) -> list[str]:
    """The command of one run: this module, in a process of its own."""
    return [sys.executable, "-m", "benchmarks.gpu_acceptance.checks_moe", mode, str(steps), json.dumps(data_sets)]


def run_sets(mode: str, steps: int) -> list[str]:
    """The --set options of one run besides the data's: the experts, the routing, compiled."""
    factor = "null" if mode == "dropless" else str(CAPACITY_FACTOR)
    return [
        f"model.moe.num_experts={EXPERTS}",
        f"model.moe.top_k={TOP_K}",
        f"model.moe.capacity_factor={factor}",
        f"training.max_steps={steps}",
        "training.warmup_steps=5",
        "training.eval_interval=0",
        "training.compile=true",
        "logging.tensorboard=false",
        "system.device=cuda",
    ]


def speed_rows(dropless: dict[str, Any], capacity: dict[str, Any]) -> list[Row]:
    """Each run's tokens/s, MFU and dropped assignments, and dropless's speed over capacity's."""
    rows = []
    for mode, r in (("dropless", dropless), ("capacity", capacity)):
        routing = "dropless" if mode == "dropless" else f"capacity factor {CAPACITY_FACTOR}"
        mfu = "n.a." if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        finite = all(math.isfinite(loss) for loss in r["losses"])
        dropped_ok = r["dropped"] == 0 if mode == "dropless" else r["dropped"] >= 0
        rows.append(
            Row(
                f"`small` MoE {EXPERTS}x top-{TOP_K}, {routing}, 1 GPU, compiled: tokens/s, dropped assignments",
                f"{r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}; {r['dropped']:,} of {r['assignments']:,} "
                f"token-expert assignments dropped over {len(r['losses'])} steps; last loss {r['losses'][-1]:.4f}",
                "0 dropped; loss finite" if mode == "dropless" else "measured; loss finite",
                "yes" if finite and dropped_ok else "no",
            )
        )
    ratio = dropless["tokens_per_s"] / capacity["tokens_per_s"]
    rows.append(
        Row(
            f"MoE dropless vs capacity {CAPACITY_FACTOR} tokens/s, `small` {EXPERTS}x top-{TOP_K}",
            f"{ratio:.2f}x ({dropless['tokens_per_s']:,.0f} vs {capacity['tokens_per_s']:,.0f} tokens/s)",
            "at least 1.0x (capacity pads the experts' FLOPs 1.25x; MegaBlocks: up to 1.4x)",
            "yes" if ratio >= 1.0 else "no",
        )
    )
    return rows


KERNEL_CHECK = "MoE grouped matmul vs a per-expert loop, bf16, an expert with no token: outputs and gradients"


def kernel_row(found: dict[str, Any]) -> Row:
    """The kernel comparison's row (kernel_comparison's result)."""
    if not found["grouped"]:
        return Row(KERNEL_CHECK, f"grouped matmuls do not run on this GPU ({found['kernel']})", "runs", "n.a.")
    error, empty, raw = found["max_relative_error"], found["empty_gradient"], found["raw_empty_gradient"]
    return Row(
        KERNEL_CHECK,
        f"largest error {error:.2g} of the largest value; the empty expert's weight gradient {empty:.3g} "
        f"(torch's kernel alone: {raw:.3g}); {found['kernel']}",
        f"error at most {KERNEL_TOLERANCE}; the empty expert's gradient exactly 0",
        "yes" if error <= KERNEL_TOLERANCE and empty == 0 else "no",
    )


def check_moe(ctx: Context) -> list[Row]:
    gpu = str(ctx.gpus[0])
    steps = QUICK_STEPS if ctx.quick else STEPS
    env = child_env(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=gpu)
    proc = run(run_argv("kernel", 0, []), KERNEL_TIMEOUT_S, env)
    found = results(proc.out)
    if proc.ok and found:
        rows = [kernel_row(found[-1])]
    else:
        rows = [Row(KERNEL_CHECK, f"FAILED: {proc.how()} after {proc.seconds:.0f} s", "runs", "no", failure=proc.tail())]
    measured: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        proc = run(run_argv(mode, steps, ctx.small_sets), RUN_TIMEOUT_S, env)
        found = results(proc.out)
        if not proc.ok or not found:
            name = f"MoE dropless vs capacity, `small` {EXPERTS}x top-{TOP_K}, {mode} run"
            return [*rows, Row(name, f"FAILED: {proc.how()} after {proc.seconds:.0f} s", "runs", "no", failure=proc.tail())]
        measured[mode] = found[-1]
    return [*rows, *speed_rows(measured["dropless"], measured["capacity"])]


MOE_CHECKS = {"moe": check_moe}
"""Registered in checks.CHECKS after the others."""


# --- one run, in a process of its own ------------------------------------------------------------


def measure(mode: str, steps: int, data_sets: list[str]) -> dict[str, Any]:
    """Train `small` with EXPERTS experts for steps steps on this process's GPU, dropless or with
    capacity; the losses, tokens/s and MFU of the steps from TIMED_FROM, and the assignments
    dropped over every step (summed on the device, read once at the end)."""
    import logging
    import tempfile
    from pathlib import Path

    import torch

    from pretrain import config as cfg
    from pretrain.build import build
    from pretrain.data.fitting import fit_to_dataset
    from pretrain.data.prepare import prepare
    from pretrain.distributed.runtime import Runtime
    from pretrain.plan.parallelism import plan_parallelism
    from benchmarks.gpu_acceptance.timed_steps import timed_steps

    config = cfg.resolve(preset="small", sets=[*data_sets, *run_sets(mode, steps)])
    dataset = prepare(config.data, log=lambda line: print(line, file=sys.stderr))
    config, _ = fit_to_dataset(config, dataset, world_size=1)
    torch.cuda.set_device(0)
    # the launcher's plan for this GPU (checkpointing, the loss chunk), alike for both runs
    config, _ = plan_parallelism(config, 1, torch.cuda.get_device_properties(0).total_memory, None, 1)
    device = torch.device("cuda", 0)
    runtime = Runtime(rank=0, world_size=1, device=device, label="GPU 0")
    dropped = torch.zeros((), dtype=torch.int64, device=device)

    def count_dropped(trainer: Any) -> None:
        for count in trainer.counts.values():
            dropped.add_(count)

    with tempfile.TemporaryDirectory(prefix="gpu-check-moe-") as run_dir:
        trainer = build(config, runtime, dataset, Path(run_dir), logging.getLogger("gpu_check"))
        timed = timed_steps(trainer, steps, TIMED_FROM, count_dropped)
    return {
        "losses": timed.losses,
        "tokens_per_s": timed.tokens_per_s,
        "mfu": timed.mfu,
        "dropped": int(dropped),
        "assignments": trainer.tokens_per_step * steps * TOP_K * config.model.n_layers,
    }


def kernel_comparison(device: Any, kernel: Any = None, tokens: int = 512, dim: int = 256, ffn_dim: int = 512) -> dict[str, Any]:
    """dropless_experts on device (with the kernel training places there, or the one given) against
    a per-expert loop in the same dtype, on EXPERTS experts top-TOP_K of which expert 2 gets no
    token: the largest error over the outputs, the tokens' gradient and the weight gradients
    relative to the largest value compared, the empty expert's largest weight gradient, and what
    it is without the zeroing (torch's kernel alone). Runs anywhere grouped matmuls do (tested on CPU)."""
    import torch
    import torch.nn.functional as F

    from pretrain.model.moe_dropless import dropless_experts, experts_kernel, grouped_mm_runs

    kernel = kernel or experts_kernel(device)
    yes_no = {True: "yes", False: "no"}
    described = f"host sync {yes_no[kernel.host_sync]}, empty experts' gradients zeroed {yes_no[kernel.zero_empty_gradients]}"
    if not grouped_mm_runs(torch.bfloat16, kernel, dim, ffn_dim):
        return {"grouped": False, "kernel": described}
    generator = torch.Generator().manual_seed(0)
    choices = torch.tensor([e for e in range(EXPERTS) if e != 2])  # expert 2: no token
    experts = torch.stack([choices[torch.randperm(len(choices), generator=generator)[:TOP_K]] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=generator).softmax(-1)
    x = torch.randn(tokens, dim, generator=generator)
    w = [torch.randn(EXPERTS, *shape, generator=generator) * 0.05 for shape in ((dim, ffn_dim), (dim, ffn_dim), (ffn_dim, dim))]
    grad_out = torch.randn(tokens, dim, generator=generator)
    experts, weights, x, grad_out = (t.to(device) for t in (experts, weights, x, grad_out))

    def grads(forward: Any) -> list[Any]:
        inputs = [x.clone().requires_grad_(), *(t.to(device, copy=True).requires_grad_() for t in w)]
        out = forward(*inputs)
        (out.float() * grad_out).sum().backward()
        return [out.detach().float(), *(t.grad.float() for t in inputs if t.grad is not None)]

    def loop(tokens_: Any, w1: Any, w3: Any, w2: Any) -> Any:
        out = torch.zeros_like(tokens_)
        for expert in range(EXPERTS):
            for choice in range(TOP_K):
                rows = (experts[:, choice] == expert).nonzero().squeeze(-1)
                h = tokens_[rows].to(torch.bfloat16)
                y = (F.silu(h @ w1[expert].to(torch.bfloat16)) * (h @ w3[expert].to(torch.bfloat16))) @ w2[expert].to(
                    torch.bfloat16
                )
                out = out.index_add(0, rows, (y * weights[rows, choice].to(y.dtype).unsqueeze(-1)).to(out.dtype))
        return out

    mine = grads(
        lambda t, w1, w3, w2: dropless_experts(t, experts, weights, w1, w3, w2, torch.bfloat16, kernel.zero_empty_gradients)
    )
    raw = grads(lambda t, w1, w3, w2: dropless_experts(t, experts, weights, w1, w3, w2, torch.bfloat16, False))
    want = grads(loop)
    error = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) for a, b in zip(mine, want, strict=True))
    return {
        "grouped": True,
        "kernel": described,
        "max_relative_error": error,
        "empty_gradient": max(float(g[2].abs().max()) for g in mine[2:]),
        "raw_empty_gradient": max(float(g[2].abs().nan_to_num(nan=float("inf")).max()) for g in raw[2:]),
    }


if __name__ == "__main__":
    if sys.argv[1] == "kernel":
        import torch

        emit(kernel_comparison(torch.device("cuda", 0)))
    else:
        emit(measure(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])))
