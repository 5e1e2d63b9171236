"""GPU checks of torch.compile's costs: the time to the first step with a fresh and a warm
compile cache against the same launch uncompiled (`compile-cache`), and `small` under each
training.compile_mode: tokens/s, MFU and what its compile costs (`compile-modes`: default and
reduce-overhead; `compile-autotune`: the two max-autotune modes, each group within a device call)."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass

from benchmarks.gpu_acceptance.context import Context, Row, sets_args
from benchmarks.gpu_acceptance.procs import CheckFailed, child_env, failed, launcher, run, worker

FIRST_STEP = re.compile(r"\] Step \[0/")
WARM_SHARE = 0.25
"""compile-cache's target: a warm launch spends at most this share of a cold one's compile time
(cold - floor) beyond the floor."""


@dataclass(frozen=True)
class FirstStep:
    """Seconds from launch to the first step line: uncompiled (the floor), compiled with a fresh
    compile cache (cold), and again with the cache the cold launch filled (warm)."""

    floor: float
    cold: float
    warm: float

    @property
    def limit(self) -> float:
        """The most warm may take: the floor and WARM_SHARE of the cold launch's compile."""
        return self.floor + WARM_SHARE * (self.cold - self.floor)

    @property
    def warm_share(self) -> float | None:
        """What the warm launch spends beyond the floor, as a share of the cold launch's (None: cold <= floor)."""
        return (self.warm - self.floor) / (self.cold - self.floor) if self.cold > self.floor else None


def compile_cache_row(times: FirstStep) -> Row:
    share = times.warm_share
    spent = (
        f"warm spends {100 * share:.0f}% of the cold compile ({times.cold - times.floor:.1f} s) beyond the floor"
        if share is not None
        else "cold no slower than the floor"
    )
    result = (
        f"floor (training.compile=false) {times.floor:.1f} s; cold {times.cold:.1f} s; warm {times.warm:.1f} s: "
        f"{spent}; limit {times.limit:.1f} s"
    )
    return Row(
        "time to first step, `small`: uncompiled (floor), compiled with a fresh cache (cold), then with that cache (warm)",
        result,
        f"warm <= floor + {100 * WARM_SHARE:.0f}% of (cold - floor)",
        "yes" if share is not None and times.warm <= times.limit else "no",
    )


def check_compile_cache(ctx: Context) -> list[Row]:
    """Time from launch to the first step line: uncompiled, then twice compiled with one fresh
    inductor cache. The uncompiled launch goes first, so each of the three finds the data prepared
    and the libraries in the page cache."""
    cache = ctx.tmp / "inductor-cache"
    env = child_env(TORCHINDUCTOR_CACHE_DIR=str(cache))
    env.pop("TRITON_CACHE_DIR", None)  # inductor then keeps Triton's kernels in its own cache too
    base = ["--preset", "small", "--gpus", str(ctx.gpus[0]), "--max-steps", "2"]
    sets = [*ctx.small_sets, "training.eval_interval=0", "logging.tensorboard=false"]
    prepared = run([sys.executable, "prepare_dataset.py", "--preset", "small", *sets_args(ctx.small_sets)], 60)
    if not prepared.ok:
        raise failed("prepare_dataset.py", prepared)
    times = []
    launches = (("floor", "false", 60), ("cold", "true", 210), ("warm", "true", 120))  # 450 s with the preparation
    for attempt, compiled, timeout in launches:
        proc = launcher(
            *base,
            *sets_args([*sets, f"training.compile={compiled}"]),
            "--run-dir",
            ctx.run_dir(f"compile-{attempt}"),
            timeout=timeout,
            env=env,
            first_match=FIRST_STEP,
        )
        if not proc.ok or proc.first_match_s is None:
            raise failed(f"{attempt} launch", proc)
        times.append(proc.first_match_s)
    return [compile_cache_row(FirstStep(*times))]


# --- compile modes -------------------------------------------------------------------------------

MODES_TIMEOUT_S = {"default": 210, "reduce-overhead": 210, "max-autotune-no-cudagraphs": 300, "max-autotune": 150}
"""Each mode's worker: a launch, its cold compile (max-autotune's benchmarks every matmul's
configurations), 3 warm-up and the timed steps; each check's together at most 450 s."""
STEPS, QUICK_STEPS = 20, 10


def compile_mode_row(mode: str, r: dict, note: str = "") -> Row:
    """One mode's run: tokens/s, MFU, and the warm-up's time beyond its steps' (the compile)."""
    asked = r.get("compile_mode", mode)
    mfu = "n.a." if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return Row(
        f"`small`, compiled, training.compile_mode={mode}, 1 GPU ({r['shape']})",
        f"{r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, {r['step_s'] * 1000:.0f} ms per step; compile: first step "
        f"{r['first_step_s']:.0f} s, warm-up {r['warmup_extra_s']:.0f} s beyond its steps{note}; loss {r['loss']:.3f}"
        + ("" if asked == mode else f"; ran as {asked}"),
        "measured: tokens/s against compile time",
        "n.a." if asked == mode and r["compiled"] else "no",
    )


def mode_runs(ctx: Context, modes: tuple[str, ...], shared_cache: bool) -> list[Row]:
    """Each mode in a worker of its own with a fresh inductor cache (shared_cache: one for all,
    so a later mode's autotuning finds the earlier's results, and its row says so)."""
    steps = str(QUICK_STEPS if ctx.quick else STEPS)
    rows = []
    for i, mode in enumerate(modes):
        cache = ctx.tmp / ("autotune-cache" if shared_cache else f"inductor-{mode}")
        env = child_env(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(ctx.gpus[0]), TORCHINDUCTOR_CACHE_DIR=str(cache))
        env.pop("TRITON_CACHE_DIR", None)
        try:
            r = worker("small-run", MODES_TIMEOUT_S[mode], steps, "0", json.dumps(ctx.small_sets), mode, env=env)
        except CheckFailed as error:
            name = f"`small`, compiled, training.compile_mode={mode}, 1 GPU"
            rows.append(Row(name, f"FAILED: {error}", "measured", "no", failure=error.tail))
            continue
        note = f" (autotuning cached by {modes[0]} above)" if shared_cache and i else ""
        rows.append(compile_mode_row(mode, r, note))
    return rows


def check_compile_modes(ctx: Context) -> list[Row]:
    return mode_runs(ctx, ("default", "reduce-overhead"), shared_cache=False)


def check_compile_autotune(ctx: Context) -> list[Row]:
    return mode_runs(ctx, ("max-autotune-no-cudagraphs", "max-autotune"), shared_cache=True)


COMPILE_CHECKS = {
    "compile-cache": check_compile_cache,
    "compile-modes": check_compile_modes,
    "compile-autotune": check_compile_autotune,
}
"""Registered in checks.CHECKS after production-shape."""
