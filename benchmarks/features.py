"""Benchmark: training speed with AdamW against Muon, and a dense model against a mixture of experts.

Run from the repository root:

    PYTHONPATH=. python benchmarks/features.py [--steps N] [--preset debug] [--device cpu]
        [--gpus WHICH] [--set SECTION.KEY=VALUE ...]

Each combination runs `python -m launcher --preset <preset> --max-steps N --set logging.log_interval=1`
(2 CPU workers on a machine without a GPU; --gpus and --set are passed on, e.g. `--gpus 0` for one
GPU and the offline data of scripts/gpu_check.sh) with its own run directory and a shared dataset
cache, one after another. Measured from the step lines of rank 0: the median tokens/s over the steps
after the first two (the first includes start-up), and the last step's loss. The MoE rows use
model.moe.num_experts=4, top_k=2 (model.ffn_dim per expert, so the block holds 4x the dense
parameters and runs 2 of them per token). Progress goes to stderr; the Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^CPU0:INFO .*?\] Step \[(\d+)/\d+\] \| Loss: (\d+\.\d+).*Tokens/s: ([\d,]+)", re.M)
GPU_STEP = re.compile(r"^(?:r\d+\.)?GPU\d+:INFO .*?\] Step \[(\d+)/\d+\] \| Loss: (\d+\.\d+).*Tokens/s: ([\d,]+)", re.M)
COMBINATIONS = {
    "AdamW, dense": [],
    "Muon, dense": ["training.optimizer=muon"],
    "AdamW, MoE 4x top-2": ["model.moe.num_experts=4", "model.moe.top_k=2"],
    "Muon, MoE 4x top-2": ["training.optimizer=muon", "model.moe.num_experts=4", "model.moe.top_k=2"],
}


def run(name: str, sets: list[str], args: argparse.Namespace, work: Path) -> tuple[float, float]:
    """(median tokens/s after the first two steps, last loss) of one training run."""
    options = ["--preset", args.preset, "--device", args.device, "--max-steps", str(args.steps)]
    options += ["--gpus", args.gpus] if args.gpus else []
    options += ["--run-dir", str(work / re.sub(r"\W+", "-", name)), "--set", "logging.log_interval=1"]
    for assignment in [*args.sets, *sets]:
        options += ["--set", assignment]
    env = dict(os.environ, PYTHONPATH=str(REPO), PRETRAIN_CACHE_DIR=str(work / "cache"), PRETRAIN_RUNS_DIR=str(work / "runs"))
    result = subprocess.run([sys.executable, "-m", "launcher", *options], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{name}: the run failed (exit {result.returncode}):\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    steps = [
        (int(s), float(loss), float(tps.replace(",", "")))
        for s, loss, tps in (STEP.findall(result.stdout) or GPU_STEP.findall(result.stdout))
    ]
    speeds = [tps for step, _, tps in steps if step >= 2]
    if not speeds:
        sys.exit(f"{name}: no step lines after step 1; use --steps 4 or more")
    return statistics.median(speeds), steps[-1][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    parser.add_argument("--preset", choices=["debug", "small"], default="debug")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gpus", metavar="WHICH", help="passed to the launcher, e.g. 0: one GPU (default: every free one)")
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override for every run"
    )
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="features-bench-") as tmp:
        for name, sets in COMBINATIONS.items():
            print(f"running {name} ...", file=sys.stderr, flush=True)
            rows.append((name, *run(name, sets, args, Path(tmp))))
    base = rows[0][1]
    print(
        f"Machine: {os.cpu_count()} CPUs, {platform.platform()}; preset {args.preset}, device {args.device}, {args.steps} steps"
    )
    print()
    print("| run | tokens/s (median, steps 2+) | vs AdamW dense | last loss |")
    print("| --- | --- | --- | --- |")
    for name, speed, loss in rows:
        print(f"| {name} | {speed:,.0f} | {speed / base:.2f}x | {loss:.4f} |")


if __name__ == "__main__":
    main()
