"""Benchmark: what the numerical-safety checks cost per training step.

Run from the repository root:

    python benchmarks/debug_checks.py [--device cpu|cuda] [--configs NAME,...] [--steps N] [--warmup N]
                                      [--repeats N] [--cache-dir DIR] [--quick]

Three settings of the debug section (pretrain/debug.py), on every config of --configs
(the workloads of benchmarks/train.py: `debug` is the debug preset's model, `10m` one of ~10M):
1. off:    debug.check_finite=false, debug.trace_nonfinite=false
2. checks: debug.check_finite=true,  debug.trace_nonfinite=false (the default of every preset):
           each step, before the update, check_step reads the loss and gradient norm back to the
           host (one device sync; with more than one rank also one tiny all-reduce)
3. trace:  debug.check_finite=true,  debug.trace_nonfinite=true (the debug preset): forward,
           backward and gradient hooks on every module and parameter, each a device sync
Each measurement is a fresh Python process: `pretrain.train.build` then `train_step` on the
built-in corpus (byte tokenizer), one rank, one micro-batch per step, training.compile=false
everywhere (trace_nonfinite turns compiling off, so the settings would otherwise differ in more
than the checks; on the CPU compiling would also dominate). The --warmup steps are timed apart
and left out; the --steps after them are timed as one stretch, with the device synchronized only
before and after it, so that the host syncs the checks add show up (a sync per step for timing
would hide them). ms/step is that stretch over --steps; each (config, setting) runs --repeats
times, the settings in a rotated order in each round so that neither drift nor the first-run
penalty favours one, and the table shows the median (spread: the fastest and slowest run).
Overhead is the median's change against `off` of the same config. Every setting trains the same
steps from the same seed, so the loss after the last step must be the same in each.
CUDA: bf16 autocast, as training does; CPU: fp32.
Progress goes to stderr; the Markdown table goes to stdout. Exit status 1 when a measurement failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: benchmarks.train and pretrain import from the repository
    sys.path.insert(0, str(REPO))

from benchmarks.train import (RESULT_MARK, WORKLOADS, Outcome, bench_device, config_list,  # noqa: E402
                              cuda_available, machine_line, print_table, progress, synchronize)

SETTINGS: dict[str, tuple[bool, bool]] = {"off": (False, False), "checks": (True, False), "trace": (True, True)}
"""Setting: (debug.check_finite, debug.trace_nonfinite)."""

DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"configs": "debug,10m", "warmup": 2, "steps": 10, "repeats": 5},
    "cuda": {"configs": "debug,small", "warmup": 5, "steps": 30, "repeats": 5},
}
"""Every option left unset takes its device's value here (or --quick's)."""
QUICK: dict[str, Any] = {"configs": "debug", "warmup": 1, "steps": 3, "repeats": 1}


# --- child side: one measurement in this fresh process ------------------------------------------

def measure(job: dict[str, Any]) -> dict[str, Any]:
    import logging

    import torch

    from pretrain import config as cfg
    from pretrain.data.fitting import fit_to_dataset
    from pretrain.data.prepare import prepare
    from pretrain.runtime import Runtime
    from pretrain.train import build, train_step

    device = bench_device(job["device"])
    workload = WORKLOADS[job["config"]]
    check_finite, trace = SETTINGS[job["setting"]]
    warmup, steps = job["warmup"], job["steps"]
    sets = [*workload.sets, f"data.cache_dir={json.dumps(job['cache_dir'])}",
            f"training.batch_size={workload.batch_size}", "training.grad_accum_nums=1",
            f"training.max_steps={warmup + steps}", "training.compile=false",
            "training.activation_checkpointing=false", f"training.use_amp={json.dumps(device.type == 'cuda')}",
            f"system.device={device.type}", "logging.tensorboard=false",
            f"debug.check_finite={json.dumps(check_finite)}", f"debug.trace_nonfinite={json.dumps(trace)}"]
    config = cfg.resolve(preset=workload.preset, sets=sets)
    dataset = prepare(config.data, log=progress)
    config, _ = fit_to_dataset(config, dataset, world_size=1)
    log = logging.getLogger("benchmarks.debug_checks")
    log.addHandler(logging.StreamHandler(sys.stderr))
    log.setLevel(logging.WARNING)
    runtime = Runtime(rank=0, world_size=1, device=device, label="GPU 0" if device.type == "cuda" else "CPU 0")
    with tempfile.TemporaryDirectory(prefix="debug-checks-bench-run-") as run_dir:
        trainer = build(config, runtime, dataset, Path(run_dir), log)
        if (trainer.tracer is not None) != trace or trainer.config.debug.check_finite != check_finite:
            raise RuntimeError(f"build() did not honour setting {job['setting']}")
        for step in range(warmup):
            train_step(trainer, step)
        synchronize(device)
        clock = [time.perf_counter()]
        for step in range(warmup, warmup + steps):
            loss, _, _ = train_step(trainer, step)
            clock.append(time.perf_counter())
        synchronize(device)
        clock[-1] = time.perf_counter()
    if device.type == "cuda":  # the host runs ahead of the GPU: only the whole stretch is its time
        ms_per_step = (clock[-1] - clock[0]) / steps * 1000
    else:  # each step's own time is exact: its median is immune to a burst of other work on the machine
        ms_per_step = statistics.median(b - a for a, b in zip(clock, clock[1:])) * 1000
    return {"ms_per_step": ms_per_step, "loss": float(loss),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "cuda": torch.version.cuda, "threads": torch.get_num_threads()}


# --- parent side: run the children, print the table ----------------------------------------------

def run_job(job: dict[str, Any]) -> Outcome:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    process = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = [line[len(RESULT_MARK):] for line in process.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if process.returncode != 0 or not results:
        lines = process.stderr.strip().splitlines() or [f"exit status {process.returncode}"]
        progress(f"  failed ({process.returncode}); its last output:\n" + "\n".join(lines[-15:]))
        return Outcome(job, error=lines[-1][:160])
    return Outcome(job, result=json.loads(results[-1]))


def jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (config, setting) once per round; round r starts r settings further on."""
    names = list(SETTINGS)
    order = []
    for repeat in range(args.repeats):
        for config in args.configs:
            for i in range(len(names)):
                order.append({"device": args.device, "config": config, "repeat": repeat,
                              "setting": names[(i + repeat) % len(names)], "warmup": args.warmup,
                              "steps": args.steps, "cache_dir": str(args.cache_dir)})
    return order


def run_all(all_jobs: list[dict[str, Any]]) -> list[Outcome]:
    outcomes = []
    for i, job in enumerate(all_jobs, 1):
        progress(f"[{i}/{len(all_jobs)}] {job['config']}, {job['setting']}, round {job['repeat'] + 1} ...")
        outcomes.append(outcome := run_job(job))
        if outcome.result:
            progress(f"  {outcome.result['ms_per_step']:.1f} ms/step")
    return outcomes


def overhead(ms: float, baseline: float | None) -> str:
    return "" if baseline is None else f"{(ms / baseline - 1) * 100:+.1f}%"


def rows(args: argparse.Namespace, outcomes: list[Outcome]) -> list[list[str]]:
    table = []
    for config in args.configs:
        workload = WORKLOADS[config]
        name = f"{config} ({workload.about})"
        medians: dict[str, float] = {}
        for setting in SETTINGS:
            mine = [o for o in outcomes if o.job["config"] == config and o.job["setting"] == setting]
            runs = [o.result for o in mine if o.result]
            failed = [o.error for o in mine if o.error]
            if not runs:
                table.append([name, setting, f"failed: {failed[0] if failed else 'not run'}", "", "", "", ""])
                continue
            times = [r["ms_per_step"] for r in runs]
            medians[setting] = median = statistics.median(times)
            losses = sorted({f"{r['loss']:.4f}" for r in runs})
            spread = f"{min(times):.1f}–{max(times):.1f}" + (f" ({len(failed)} failed)" if failed else "")
            table.append([name, setting, f"{median:.1f}", f"{1000 / median:.2f}", overhead(median, medians.get("off")),
                          spread, ", ".join(losses)])
    return table


def print_report(args: argparse.Namespace, outcomes: list[Outcome], elapsed: float) -> None:
    print(machine_line(args.device, outcomes))
    precision = "bf16 autocast" if args.device == "cuda" else "fp32"
    print(f"\nStep time of `train_step` with the numerical checks off, on (`checks`, every preset's default) and "
          f"tracing (`trace`, the debug preset): built-in corpus, byte tokenizer, 1 rank, 1 micro-batch per step, "
          f"{precision}, training.compile=false; {args.steps} timed step(s) after {args.warmup} warm-up step(s), "
          f"a fresh process per run, {args.repeats} run(s) per row in rotated order; ms/step: the median run; "
          f"overhead: against `off` of the same config.\n")
    print_table(["config", "setting", "ms/step (median)", "steps/s", "overhead vs off", "spread (ms/step)",
                 f"loss after step {args.warmup + args.steps}"], rows(args, outcomes))
    print(f"\nTotal {elapsed:.0f} s.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cpu, cuda = DEFAULTS["cpu"], DEFAULTS["cuda"]

    def default(name: str) -> str:
        return f"default: cpu {cpu[name]}, cuda {cuda[name]}"

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(DEFAULTS), default="cpu", help="where to measure (default cpu)")
    parser.add_argument("--configs", type=config_list, help=f"comma-separated, from {', '.join(WORKLOADS)} "
                                                            f"({default('configs')})")
    parser.add_argument("--steps", type=int, help=f"timed training steps per run ({default('steps')})")
    parser.add_argument("--warmup", type=int, help=f"untimed warm-up steps before them ({default('warmup')})")
    parser.add_argument("--repeats", type=int, help=f"runs (fresh processes) per config and setting "
                                                    f"({default('repeats')})")
    parser.add_argument("--cache-dir", type=Path, default=REPO / "cache" / "datasets",
                        help="data.cache_dir for the prepared corpus (default: the project cache)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return args
    for name, value in {**DEFAULTS[args.device], **(QUICK if args.quick else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, config_list(value) if name == "configs" else value)
    if args.steps < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--steps and --repeats must be at least 1, --warmup not negative")
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
    outcomes = run_all(jobs(args))
    print_report(args, outcomes, time.monotonic() - started)
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
