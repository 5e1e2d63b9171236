"""Benchmark: what the numerical-safety checks cost per training step.

Run from the repository root:

    python benchmarks/debug_checks.py [--device cpu|cuda] [--configs NAME,...] [--steps N] [--warmup N]
                                      [--block N] [--repeats N] [--threads N] [--cache-dir DIR] [--quick]

Three settings of the debug section (pretrain/numerics/debug.py), on every config of --configs (the
workloads of benchmarks/train.py: `debug` is the debug preset's model, `10m` one of ~10M):
1. off:    debug.check_finite=false, debug.trace_nonfinite=false
2. checks: debug.check_finite=true,  debug.trace_nonfinite=false (the default of every preset):
           each step, before the update, check_step reads the loss and gradient norm back to the
           host (one device sync; with more than one rank also one tiny all-reduce)
3. trace:  debug.check_finite=true,  debug.trace_nonfinite=true (the debug preset): forward,
           backward and gradient hooks on every module and parameter, each a device sync
How: `pretrain.build.build` then `train_step` on the built-in corpus (byte tokenizer), one rank,
one micro-batch per step, training.compile=false everywhere (trace_nonfinite turns compiling off,
so the settings would otherwise differ in more than the checks; on the CPU compiling would also
dominate). CUDA: bf16 autocast, as training does; CPU: fp32.

Noise: a shared machine's load comes and goes within seconds (on 2 CPU cores another busy process
can slow a step many times over), so the settings are not measured one after the other. Each run
is a fresh Python process per config that builds one trainer per setting, from the same seed on
the same data, and takes turns: a block of --block steps of each setting in a round, the order
rotated every round, each block timed with the device synchronized only at its ends (a sync per
step would hide the host syncs the checks add; on the CPU a block of 1 step is exact). The
--warmup steps (rounds of them) are left out. ms/step: the median block, over all rounds of all --repeats runs, per
step. Overhead: the median, over those rounds, of a setting's block time over `off`'s in the same
round, so a burst of load that slows a round slows the three settings alike. Spread: the fastest
and slowest run's median. The settings train the same steps, so their losses after the last step
must agree. On a CPU other work shares, --threads 1 steadies the numbers most: torch's threads
wait for each other at every operation, so one of them losing its core stalls them all.
Progress goes to stderr; the Markdown table goes to stdout. Exit status 1 when a measurement failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if Path(sys.path[0]).resolve() == REPO / "benchmarks":  # run as a script: the repository, not benchmarks/
    sys.path[0] = str(REPO)  # (whose launcher.py would shadow the launcher package)

from benchmarks.train import (  # noqa: E402
    RESULT_MARK,
    WORKLOADS,
    Outcome,
    bench_device,
    config_list,
    run_job,
    cuda_available,
    machine_line,
    print_table,
    progress,
    synchronize,
)

SETTINGS: dict[str, tuple[bool, bool]] = {"off": (False, False), "checks": (True, False), "trace": (True, True)}
"""Setting: (debug.check_finite, debug.trace_nonfinite)."""

DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"configs": "debug,10m", "warmup": 2, "steps": 20, "block": 1, "repeats": 3},
    "cuda": {"configs": "debug,small", "warmup": 20, "steps": 100, "block": 10, "repeats": 3},
}
"""Every option left unset takes its device's value here (or --quick's). Steps and warm-up are per setting."""
QUICK: dict[str, Any] = {"configs": "debug", "warmup": 1, "steps": 4, "block": 1, "repeats": 1}


# --- child side: one run, the three settings taking turns in this fresh process -------------------


def measure(job: dict[str, Any]) -> dict[str, Any]:
    import logging

    import torch

    from pretrain import config as cfg
    from pretrain.data.fitting import fit_to_dataset
    from pretrain.data.prepare import prepare
    from pretrain.distributed.runtime import Runtime
    from pretrain.build import build
    from pretrain.train import train_step

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    device = bench_device(job["device"])
    workload = WORKLOADS[job["config"]]
    block, rounds, warmup = job["block"], job["steps"] // job["block"], job["warmup"] // job["block"]
    log = logging.getLogger("benchmarks.debug_checks")
    log.addHandler(logging.StreamHandler(sys.stderr))
    log.setLevel(logging.WARNING)
    runtime = Runtime(rank=0, world_size=1, device=device, label="GPU 0" if device.type == "cuda" else "CPU 0")
    trainers = {}
    with tempfile.TemporaryDirectory(prefix="debug-checks-bench-run-") as run_dirs:
        for setting, (check_finite, trace) in SETTINGS.items():
            sets = [
                *workload.sets,
                f"data.cache_dir={json.dumps(job['cache_dir'])}",
                f"training.batch_size={workload.batch_size}",
                "training.grad_accum_nums=1",
                f"training.max_steps={(warmup + rounds) * block}",
                "training.compile=false",
                "training.activation_checkpointing=false",
                f"training.use_amp={json.dumps(device.type == 'cuda')}",
                f"system.device={device.type}",
                "logging.tensorboard=false",
                f"debug.check_finite={json.dumps(check_finite)}",
                f"debug.trace_nonfinite={json.dumps(trace)}",
            ]
            config = cfg.resolve(preset=workload.preset, sets=sets)
            dataset = prepare(config.data, log=progress)
            config, _ = fit_to_dataset(config, dataset, world_size=1)
            run_dir = Path(run_dirs) / setting
            run_dir.mkdir()
            trainers[setting] = trainer = build(config, runtime, dataset, run_dir, log)
            if (trainer.tracer is not None) != trace or trainer.config.debug.check_finite != check_finite:
                raise RuntimeError(f"build() did not honour setting {setting}")
        names, steps, losses = list(SETTINGS), dict.fromkeys(SETTINGS, 0), {}
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(warmup + rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                synchronize(device)
                started = time.perf_counter()
                for _ in range(block):
                    loss, _, _ = train_step(trainers[name], steps[name])
                    steps[name] += 1
                synchronize(device)
                if round_ >= warmup:
                    times[name].append((time.perf_counter() - started) / block * 1000)
                losses[name] = float(loss)
        return {
            "ms_per_step": times,
            "loss": losses,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "cuda": torch.version.cuda,
            "threads": torch.get_num_threads(),
        }


# --- parent side: run the children, print the table ----------------------------------------------


def run_all(args: argparse.Namespace) -> list[Outcome]:
    jobs = [
        {
            "device": args.device,
            "config": config,
            "repeat": repeat,
            "warmup": args.warmup,
            "steps": args.steps,
            "block": args.block,
            "threads": args.threads,
            "cache_dir": str(args.cache_dir),
        }
        for repeat in range(args.repeats)
        for config in args.configs
    ]
    outcomes = []
    for i, job in enumerate(jobs, 1):
        progress(f"[{i}/{len(jobs)}] {job['config']}, run {job['repeat'] + 1} ...")
        outcomes.append(outcome := run_job(job, Path(__file__)))
        if outcome.result:
            progress(
                "  "
                + ", ".join(f"{name} {statistics.median(ms):.1f}" for name, ms in outcome.result["ms_per_step"].items())
                + " ms/step"
            )
    return outcomes


def config_rows(name: str, runs: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for setting in SETTINGS:
        times = [ms for r in runs for ms in r["ms_per_step"][setting]]
        median = statistics.median(times)
        ratio = statistics.median(
            ms / off for r in runs for ms, off in zip(r["ms_per_step"][setting], r["ms_per_step"]["off"], strict=True)
        )
        per_run = [statistics.median(r["ms_per_step"][setting]) for r in runs]
        losses = ", ".join(sorted({f"{r['loss'][setting]:.4f}" for r in runs}))
        rows.append(
            [
                name,
                setting,
                f"{median:.1f}",
                f"{1000 / median:.2f}",
                f"{(ratio - 1) * 100:+.1f}%",
                f"{min(per_run):.1f}–{max(per_run):.1f}",
                losses,
            ]
        )
    return rows


def rows(args: argparse.Namespace, outcomes: list[Outcome]) -> list[list[str]]:
    table = []
    for config in args.configs:
        name = f"{config} ({WORKLOADS[config].about})"
        mine = [o for o in outcomes if o.job["config"] == config]
        runs, failed = [o.result for o in mine if o.result], [o.error for o in mine if o.error]
        if not runs:
            table.append([name, "all", f"failed: {failed[0]}", "", "", "", ""])
            continue
        table += config_rows(name + (f" ({len(failed)} of {len(mine)} runs failed)" if failed else ""), runs)
    return table


def print_report(args: argparse.Namespace, outcomes: list[Outcome], elapsed: float) -> None:
    print(machine_line(args.device, outcomes))
    precision = "bf16 autocast" if args.device == "cuda" else "fp32"
    print(
        f"\nStep time of `train_step` with the numerical checks off, on (`checks`: every preset's default) and "
        f"tracing (`trace`: the debug preset): built-in corpus, byte tokenizer, 1 rank, 1 micro-batch per step, "
        f"{precision}, training.compile=false. {args.repeats} run(s) per config, each a fresh process in which "
        f"the three settings take turns, {args.block} step(s) at a time in rotated order, {args.steps} timed "
        f"step(s) each after {args.warmup} warm-up step(s). ms/step: median over all timed blocks; "
        f"overhead: median over rounds of the time against `off`'s in the same round; spread: the fastest and "
        f"slowest run's median.\n"
    )
    print_table(
        [
            "config",
            "setting",
            "ms/step (median)",
            "steps/s",
            "overhead vs off",
            "spread (ms/step)",
            f"loss after step {args.warmup + args.steps}",
        ],
        rows(args, outcomes),
    )
    print(f"\nTotal {elapsed:.0f} s.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cpu, cuda = DEFAULTS["cpu"], DEFAULTS["cuda"]

    def default(name: str) -> str:
        return f"default: cpu {cpu[name]}, cuda {cuda[name]}"

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(DEFAULTS), default="cpu", help="where to measure (default cpu)")
    parser.add_argument(
        "--configs", type=config_list, help=f"comma-separated, from {', '.join(WORKLOADS)} ({default('configs')})"
    )
    parser.add_argument("--steps", type=int, help=f"timed steps per setting and run, a multiple of --block ({default('steps')})")
    parser.add_argument(
        "--warmup", type=int, help=f"untimed steps per setting first, a multiple of --block ({default('warmup')})"
    )
    parser.add_argument(
        "--block", type=int, help=f"steps a setting runs before the next takes its turn, timed as one ({default('block')})"
    )
    parser.add_argument("--repeats", type=int, help=f"runs (fresh processes) per config ({default('repeats')})")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch.set_num_threads in each run (default 0: torch's own choice, one per core); "
        "1 makes a CPU that other work shares far less noisy",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=REPO / "cache" / "datasets",
        help="data.cache_dir for the prepared corpus (default: the project cache)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return args
    for name, value in {**DEFAULTS[args.device], **(QUICK if args.quick else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, config_list(value) if name == "configs" else value)
    if (
        args.block < 1
        or args.repeats < 1
        or args.steps < 1
        or args.warmup < 0
        or args.threads < 0
        or args.steps % args.block
        or args.warmup % args.block
    ):
        parser.error(
            "--block, --repeats and --steps must be at least 1, --warmup and --threads not negative, and "
            "--steps and --warmup multiples of --block"
        )
    if args.device == "cuda" and not cuda_available():
        parser.error("--device cuda: no CUDA GPU is visible here; use --device cpu")
    args.cache_dir = args.cache_dir.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        print(RESULT_MARK + json.dumps(measure(json.loads(args.child))), flush=True)
        return 0
    started = time.monotonic()
    outcomes = run_all(args)
    print_report(args, outcomes, time.monotonic() - started)
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
