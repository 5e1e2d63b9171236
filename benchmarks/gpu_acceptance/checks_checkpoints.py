"""GPU check `checkpoints` (issue 41): asynchronous checkpoints and the local tier on one GPU.

`small` on one GPU through the launcher, uncompiled (the compile would only lengthen the check),
STEPS steps with a durable checkpoint every INTERVAL steps, twice from the same seed on the same
batches: once with training.async_checkpoint=false and once true. Rank 0 logs each completed save
in metrics.jsonl (pretrain/observe/metrics.py log_checkpoint: {"kind": "checkpoint", "checkpoint":
{"step", "tier", "async", "stall_s", "write_s", "path"}}) and each step's loss (log_interval 1).
Then the async run's last periodic checkpoint is compared with the sync run's of the same step,
tensor by tensor (a process of its own: `python -m benchmarks.gpu_acceptance.checks_checkpoints
compare A B`), and a third launch resumes from it to the end with a local checkpoint every
LOCAL_INTERVAL steps in its default place (/dev/shm).

Rows: the stall (the median of the periodic saves after the first, as benchmarks/checkpoints.py
takes it: the first may pay once-per-run costs; the end-of-run save, which every run waits for,
left out) and write time of each mode, async's at most MAX_STALL_SHARE of sync's, with the staged
copy's size; the async run's losses against the sync run's, step for step; the two checkpoints'
tensors; the resumed run's losses against the uninterrupted run's; the local tier's saves landing
in /dev/shm and removed when the run ended.

"Equal" means bit for bit where this GPU reproduces a run: the two runs' losses before the first
save (where no checkpoint can have changed anything) are identical. Where they are not (GPU
kernels that accumulate in a varying order: flash attention's backward may), the losses are held
to LOSS_TOLERANCE and the tensors' comparison is only reported.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu_acceptance.context import Context, Row, sets_args
from benchmarks.gpu_acceptance.procs import Proc, child_env, emit, results, run

PRESET = "small"
INTERVAL = 10
"""Steps between durable checkpoints: about 3 s of `small`'s uncompiled steps on an H100, longer
than an asynchronous write of its 1.7 GiB to a local disk, so that a save does not wait for the
previous one (which would be a stall of its own)."""
STEPS = 40
QUICK_STEPS = 30
"""Periodic saves at 10, 20, 30 (10, 20 with --quick), then the end-of-run save."""
LOCAL_INTERVAL = 4
"""The resumed run's local checkpoints (below INTERVAL): two saves in its last INTERVAL steps."""
MAX_STALL_SHARE = 0.10
"""The issue's bar: the asynchronous stall at most 10% of the synchronous one."""
LOSS_TOLERANCE = 1e-3
"""The largest relative loss gap accepted where the GPU does not reproduce a run bit for bit: a
wrong batch or optimizer state moves a loss by more early in training (the debug preset's
consecutive batches differ by several percent), kernels that sum in a varying order, over a few
tens of steps, by less (not yet measured on a GPU: a later run may have to widen it)."""
RUN_TIMEOUT_S = 150
"""One of the two runs: the launch (~20 s), STEPS uncompiled steps (~0.3 s each on an H100, 2 s
allowed), 4 saves of 1.7 GiB (written synchronously at 1-2 GB/s: ~5 s each), the evaluation and
the export after the last step."""
RESUME_TIMEOUT_S = 100
"""The resumed run: the launch, loading the checkpoint, INTERVAL steps, 2 local saves and the last."""
COMPARE_TIMEOUT_S = 45
"""Importing torch and reading two checkpoints (2 x 1.7 GiB, still in the page cache)."""
CHECKPOINT_FILES = ("model.pt", "optimizer.pt")
"""A single-process (DDP) checkpoint's tensors (pretrain/checkpoint/save_restore.py)."""
STAGED_LINE = re.compile(r"checkpoints: asynchronous, staged in ([\d.]+ [GM]iB) of host memory")
"""The launcher's plan line (pretrain/plan/parallelism.py) for an asynchronous run."""
LOCAL_OFF_LINE = re.compile(r"warning: no local checkpoints[^\n]*")
"""The launcher's line when the local tier is off (pretrain/checkpoint/tiers.py, launcher/local_tier.py)."""
SHM = "/dev/shm/"


@dataclass(frozen=True)
class Plan:
    """What the check runs: the preset, the schedule, where (the launcher's device options) and the
    data's --set options. The GPU's is plan_for(ctx); the tests run the debug preset on a CPU."""

    preset: str
    steps: int
    interval: int
    local_interval: int
    where: list[str]
    data_sets: list[str] = field(default_factory=list)
    label: str = "1 GPU"
    """Where it runs, in the rows' names."""

    @property
    def resume_step(self) -> int:
        """The last periodic checkpoint: the resumed run starts there."""
        return self.steps - self.interval


def plan_for(ctx: Context) -> Plan:
    steps = QUICK_STEPS if ctx.quick else STEPS
    return Plan(PRESET, steps, INTERVAL, LOCAL_INTERVAL, ["--gpus", str(ctx.gpus[0])], ctx.small_sets)


def run_sets(plan: Plan, asynchronous: bool, local: bool) -> list[str]:
    """The --set options of a run besides the data's."""
    return [
        *plan.data_sets,
        f"training.async_checkpoint={'true' if asynchronous else 'false'}",
        f"training.checkpoint_interval={plan.interval}",
        f"training.local_checkpoint_interval={plan.local_interval if local else 0}",  # `small` has one every 100
        "training.keep_checkpoints=2",  # the one compared and the last: disk, 1.7 GiB each
        "training.parallelism=ddp",  # one process: model.pt and optimizer.pt, compared tensor by tensor
        "training.compile=false",
        "training.eval_interval=0",  # only after the last step: nothing but saves between steps
        "logging.log_interval=1",  # every step's loss in metrics.jsonl
        "logging.tensorboard=false",
    ]


def launch_argv(plan: Plan, run_dir: Path, asynchronous: bool, resume: Path | None = None) -> list[str]:
    local = resume is not None  # the local tier in the resumed run only: the stalls compared are durable saves alone
    return [
        *(sys.executable, "-m", "launcher", "--preset", plan.preset, *plan.where),
        *("--max-steps", str(plan.steps), "--run-dir", str(run_dir)),
        *(("--resume", str(resume)) if resume is not None else ()),
        *sets_args(run_sets(plan, asynchronous, local)),
    ]


def compare_argv(first: Path, second: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.gpu_acceptance.checks_checkpoints", "compare", str(first), str(second)]


# --- what a run leaves ---------------------------------------------------------------------------


@dataclass
class Finished:
    """A finished run: every step's loss and every save, from its metrics.jsonl; its output."""

    losses: dict[int, float]
    saves: list[dict[str, Any]]
    out: str


def records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """metrics.jsonl's records; a line that does not parse (a killed writer's half line) skipped."""
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            found.append(record)
    return found


def read_run(run_dir: Path, out: str) -> Finished:
    path = run_dir / "metrics.jsonl"
    found = records(path.read_text().splitlines()) if path.exists() else []
    losses = {int(r["step"]): float(r["loss"]) for r in found if r.get("kind") == "train" and r.get("loss") is not None}
    saves = [r["checkpoint"] for r in found if r.get("kind") == "checkpoint" and isinstance(r.get("checkpoint"), dict)]
    return Finished(losses, saves, out)


def periodic(saves: list[dict[str, Any]], steps: int, tier: str = "durable") -> list[dict[str, Any]]:
    """The saves of tier before the last step (the end of a run waits for its save in either mode)."""
    return [s for s in saves if s["tier"] == tier and s["step"] < steps]


def medians(saves: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(stall, write) medians of the saves after the first (all of them when there is one)."""
    steady = saves[1:] or saves
    if not steady:
        return None
    return statistics.median(s["stall_s"] for s in steady), statistics.median(s["write_s"] for s in steady)


def staged_size(out: str) -> str | None:
    match = STAGED_LINE.search(out)
    return match[1] if match else None


# --- the rows --------------------------------------------------------------------------------------


def stall_row(plan: Plan, sync: Finished, async_: Finished) -> Row:
    by_mode = {"sync": periodic(sync.saves, plan.steps), "async": periodic(async_.saves, plan.steps)}
    name = f"checkpoint stall, `{plan.preset}` on {plan.label}, async vs sync, every {plan.interval} of {plan.steps} steps"
    target = (
        f"async stall at most {MAX_STALL_SHARE:.0%} of sync (median of the periodic saves after the first; "
        "the end-of-run save left out)"
    )
    figures = {mode: medians(saves) for mode, saves in by_mode.items()}
    sync_figures, async_figures = figures["sync"], figures["async"]
    if sync_figures is None or async_figures is None:
        missing = " and ".join(mode for mode, found in figures.items() if found is None)
        return Row(name, f"FAILED: no periodic save recorded in the {missing} run", target, "no")
    wrong = [f"{mode} step {s['step']}" for mode, saves in by_mode.items() for s in saves if s["async"] != (mode == "async")]
    (sync_stall, sync_write), (async_stall, async_write) = sync_figures, async_figures
    share = async_stall / sync_stall if sync_stall > 0 else math.inf
    firsts = "/".join(f"{saves[0]['stall_s']:.2f}" for saves in by_mode.values())
    result = (
        f"async {async_stall:.3f} s stall, {async_write:.2f} s write; sync {sync_stall:.3f} s stall, {sync_write:.2f} s "
        f"write; async/sync {share:.1%}; first save's stall {firsts} s (sync/async); "
        f"staged {staged_size(async_.out) or 'n.a.'}; {len(by_mode['async'])} periodic saves each"
    )
    if wrong:
        result += f"; but saved in the other mode: {', '.join(wrong)}"
    return Row(name, result, target, "yes" if share <= MAX_STALL_SHARE and not wrong else "no")


def gaps(first: dict[int, float], second: dict[int, float], steps: Iterable[int]) -> list[tuple[int, float]]:
    """(step, relative gap) of each of steps; a step one of the runs lacks is an infinite gap."""
    found = []
    for step in steps:
        a, b = first.get(step), second.get(step)
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            found.append((step, math.inf))
        else:
            found.append((step, abs(a - b) / abs(b) if b else abs(a - b)))
    return found


def reproducible(plan: Plan, sync: Finished, async_: Finished) -> bool:
    """Whether this GPU reproduced the run bit for bit before the first save (nothing a checkpoint
    did can differ there): then equal means identical."""
    return all(gap == 0 for _, gap in gaps(sync.losses, async_.losses, range(plan.interval)))


def verdict(found: list[tuple[int, float]], exact: bool) -> tuple[str, bool]:
    """The largest gap in words, and whether it is accepted (exact: only 0)."""
    step, worst = max(found, key=lambda item: item[1])
    if worst == 0:
        return "identical at every step", True
    words = "missing or not finite" if math.isinf(worst) else f"largest relative gap {worst:.1e}"
    return f"{words} at step {step}", worst <= (0 if exact else LOSS_TOLERANCE)


def equal_target(exact: bool) -> str:
    if exact:
        return "identical step for step (this GPU reproduced the steps before the first save bit for bit)"
    return f"within {LOSS_TOLERANCE:g} (this GPU did not reproduce the steps before the first save bit for bit)"


def losses_row(plan: Plan, sync: Finished, async_: Finished) -> Row:
    exact = reproducible(plan, sync, async_)
    words, ok = verdict(gaps(async_.losses, sync.losses, range(plan.steps)), exact)
    name = f"`{plan.preset}` losses with async checkpoints vs sync, same seed and batches, {plan.steps} steps"
    before = max(gap for _, gap in gaps(async_.losses, sync.losses, range(plan.interval)))
    result = words + ("" if exact else f"; before the first save already {before:.1e}")
    return Row(name, result, equal_target(exact), "yes" if ok else "no")


def contents_row(plan: Plan, found: dict[str, Any], exact: bool) -> Row:
    """The async run's checkpoint against the sync run's of the same step (compare_checkpoints)."""
    name = f"async step_{plan.resume_step} vs sync step_{plan.resume_step}: {' and '.join(CHECKPOINT_FILES)} tensors"
    size = f"{found['tensors']} tensors, {found['bytes'] / 2**30:.2f} GiB"
    if not found["different"]:
        return Row(name, f"identical bit for bit ({size})", "bit for bit", "yes")
    result = (
        f"{found['count_different']} of {found['tensors']} tensors differ ({', '.join(found['different'])}); "
        f"largest relative difference {found['max_relative']:.1e}; {size}"
    )
    if exact:
        return Row(name, result, "bit for bit", "no")
    return Row(name, result, "bit for bit where the GPU reproduces a run: measured", "n.a.")


def resume_row(plan: Plan, uninterrupted: Finished, resumed: Finished, exact: bool) -> Row:
    start = plan.resume_step
    name = f"resume from the async step_{start}: losses of steps {start}-{plan.steps - 1} vs the uninterrupted run's"
    if not resumed.losses or min(resumed.losses) != start:
        began = min(resumed.losses, default=None)
        return Row(name, f"FAILED: the resumed run's first step is {began}, not {start}", equal_target(exact), "no")
    words, ok = verdict(gaps(resumed.losses, uninterrupted.losses, range(start, plan.steps)), exact)
    first = f"first resumed step {resumed.losses[start]:.6f} vs {uninterrupted.losses.get(start, math.nan):.6f}"
    return Row(name, f"{first}; {words}", equal_target(exact), "yes" if ok else "no")


def local_row(plan: Plan, resumed: Finished) -> Row:
    """The resumed run's local tier: its saves in /dev/shm, gone once the run ended."""
    name = f"local checkpoint tier in /dev/shm, every {plan.local_interval} steps (the resumed run)"
    target = "saves land in /dev/shm; removed when the run ends"
    local = periodic(resumed.saves, plan.steps, "local")
    if not local:
        if (off := LOCAL_OFF_LINE.search(resumed.out)) is not None:
            return Row(name, f"off on this machine: {off[0]}", target, "n.a.")
        return Row(name, "FAILED: no local save recorded and no line saying why", target, "no")
    paths = [s["path"] for s in local]
    elsewhere = [p for p in paths if not p.startswith(SHM)]
    left = [p for p in paths if Path(p).exists()]
    stall, write = medians(local) or (math.nan, math.nan)
    result = f"{len(local)} saves in {Path(paths[-1]).parent}; stall {stall:.3f} s, write {write:.2f} s (median after the first)"
    result += f"; not in /dev/shm: {', '.join(elsewhere)}" if elsewhere else ""
    result += f"; left after the run: {', '.join(left)}" if left else "; removed at the end"
    return Row(name, result, target, "no" if elsewhere or left else "yes")


# --- the check ---------------------------------------------------------------------------------------


def failed_row(what: str, proc: Proc) -> Row:
    return Row(f"checkpoints: {what}", f"FAILED: {proc.how()} after {proc.seconds:.0f} s", "runs", "no", failure=proc.tail())


def measure(plan: Plan, tmp: Path, env: dict[str, str] | None = None, runner: Callable[..., Proc] | None = None) -> list[Row]:
    """The check's launches and comparison under plan, in run directories under tmp; its rows."""
    runner = runner or run
    finished: dict[str, Finished] = {}
    for mode in ("sync", "async"):
        run_dir = tmp / f"checkpoints-{mode}"
        proc = runner(launch_argv(plan, run_dir, mode == "async"), RUN_TIMEOUT_S, env)
        if not proc.ok:
            return [failed_row(f"the {mode} run, `{plan.preset}`, {plan.steps} steps", proc)]
        finished[mode] = read_run(run_dir, proc.out)
    sync, async_ = finished["sync"], finished["async"]
    exact = reproducible(plan, sync, async_)
    rows = [stall_row(plan, sync, async_), losses_row(plan, sync, async_)]
    name = f"step_{plan.resume_step}"
    checkpoint = tmp / "checkpoints-async" / "checkpoints" / name
    proc = runner(compare_argv(tmp / "checkpoints-sync" / "checkpoints" / name, checkpoint), COMPARE_TIMEOUT_S, env)
    found = results(proc.out)
    rows.append(contents_row(plan, found[-1], exact) if proc.ok and found else failed_row(f"comparing the {name}s", proc))
    run_dir = tmp / "checkpoints-resumed"
    proc = runner(launch_argv(plan, run_dir, True, resume=checkpoint), RESUME_TIMEOUT_S, env)
    if not proc.ok:
        return [*rows, failed_row(f"the run resumed from the async {name}", proc)]
    resumed = read_run(run_dir, proc.out)
    return [*rows, resume_row(plan, async_, resumed, exact), local_row(plan, resumed)]


def check_checkpoints(ctx: Context) -> list[Row]:
    return measure(plan_for(ctx), ctx.tmp, child_env())


CHECKPOINT_CHECKS = {"checkpoints": check_checkpoints}
"""Registered in checks.CHECKS after the others."""


# --- the comparison, in a process of its own ------------------------------------------------------


def compare_checkpoints(first: Path, second: Path) -> dict[str, Any]:
    """The two checkpoints' CHECKPOINT_FILES tensor by tensor, bit for bit: how many tensors and
    bytes, which differ (the first few names, and how many), and the largest difference of one
    relative to its norm. Entries that are not tensors (hyperparameters) must be equal too."""
    import torch

    def flat(value: Any, prefix: str) -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}.{key}").items()}
        if isinstance(value, list | tuple):
            return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{prefix}.{i}").items()}
        return {prefix: value}

    def bits(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().reshape(-1).contiguous().view(torch.uint8)

    tensors, size, different, worst = 0, 0, [], 0.0
    for file in CHECKPOINT_FILES:
        a, b = (flat(torch.load(path / file, map_location="cpu", weights_only=True, mmap=True), file) for path in (first, second))
        for key in sorted(a.keys() | b.keys()):
            x, y = a.get(key), b.get(key)
            if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or key not in a.keys() & b.keys() or x != y:
                    different.append(key)
                continue
            tensors += 1
            size += x.numel() * x.element_size()
            if x.shape == y.shape and x.dtype == y.dtype and torch.equal(bits(x), bits(y)):
                continue
            different.append(key)
            if x.shape == y.shape and x.is_floating_point():  # NaNs (bit-equal or not, counted above) left out
                norm = float(y.float().nan_to_num(nan=0.0).norm())
                gap = float((x.float() - y.float()).nan_to_num(nan=0.0).norm())
                worst = max(worst, gap / norm if norm else math.inf)
            else:
                worst = math.inf
    found = {"tensors": tensors, "bytes": size, "different": different[:5], "count_different": len(different)}
    return {**found, "max_relative": worst}


if __name__ == "__main__":
    emit(compare_checkpoints(Path(sys.argv[2]), Path(sys.argv[3])))
