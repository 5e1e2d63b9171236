"""The GPU acceptance's command: its arguments, the machine it runs on, running the chosen
checks one after another, and the report.

    bash scripts/gpu_check.sh [--quick] [--only ROW[,ROW]] [--output FILE] [--set SECTION.KEY=VALUE ...]

Each check runs in processes of its own (the launcher, a training worker, pytest) under a
timeout, so one that fails, hangs or crashes becomes a row that says so, with its last output
lines under the table, and the others still run. The table (check, result, target, met) goes to
the console and to benchmarks/results/<date>-<gpu>.md (--output FILE instead), with the
machine above it. Rows are also kept in the .json next to it: a later run with --only replaces
its own rows and keeps the others, so the checks can be split over several shorter runs.

Nothing here runs without a GPU: on such a machine it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from benchmarks.gpu_acceptance.checks import CHECKS, Context, Row
from benchmarks.gpu_acceptance.groups import ESTIMATED_S, group_seconds, minutes
from benchmarks.gpu_acceptance.procs import REPO, CheckFailed, smi_query, worker
from benchmarks.gpu_acceptance.workers import WORKERS

RESULTS = REPO / "benchmarks" / "results"
PROG = "gpu_check"


class UsageError(Exception):
    """Bad input or no GPU: one line, exit 2."""


# --- the machine -----------------------------------------------------------------------


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the checks (one line), else None."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no NVIDIA GPU here (nvidia-smi not found); run it on a machine with one"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi -L failed ({error}); check the driver"
    if listed.returncode != 0 or "GPU " not in listed.stdout:
        return "no NVIDIA GPU here (nvidia-smi -L lists none); run it on a machine with one"
    return None


def machine() -> dict[str, Any]:
    """GPU names, driver and CUDA as the driver reports them; torch's view from a child, so
    that this process holds no CUDA context (it would show in the GPU's process list)."""
    gpus = smi_query("index", "name", "driver_version")
    header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60).stdout
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    torch_info = worker("torch", 180)
    return {"gpus": [name for _, name, _ in gpus], "driver": gpus[0][2], "driver_cuda": cuda[1] if cuda else "?", **torch_info}


def short_gpu_name(name: str) -> str:
    """h100 for "NVIDIA H100 80GB HBM3": the model number, lowercase, file-name safe."""
    name = name.replace("NVIDIA", "")
    match = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", name)
    text = match[1] if match else name
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def describe_machine(info: dict[str, Any]) -> str:
    names = sorted(set(info["gpus"]))
    return (
        f"Machine: {len(info['gpus'])} x {', '.join(names)}; driver {info['driver']} (CUDA {info['driver_cuda']}); "
        f"torch {info['torch']} (CUDA {info['torch_cuda']}); Python {info['python']}; "
        f"{datetime.date.today().isoformat()}"
    )


# --- running the checks ----------------------------------------------------------------


def run_check(key: str, ctx: Context) -> list[Row]:
    """One check's rows; whatever goes wrong in it becomes a failed row."""
    check = CHECKS[key]
    started = time.monotonic()
    ctx.log(f"{PROG}: {key} ...")
    try:
        rows = check(ctx)
    except CheckFailed as error:
        rows = [Row(key, f"FAILED: {error}", "-", "no", failure=error.tail)]
    except Exception as error:  # a bug or a surprise in one check must not stop the others
        rows = [Row(key, f"FAILED: {type(error).__name__}: {error}"[:300], "-", "no")]
    for row in rows:
        row.key = key
    ctx.log(f"{PROG}: {key} done in {time.monotonic() - started:.0f} s: " + "; ".join(f"{r.met}" for r in rows))
    return rows


# --- the report ------------------------------------------------------------------------


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(machine_line: str, rows: list[Row], note: str) -> str:
    lines = ["# GPU acceptance", "", machine_line, "", note, "", "| check | result | target | met? |", "|---|---|---|---|"]
    lines += [f"| {cell(r.check)} | {cell(r.result)} | {cell(r.target)} | {r.met} |" for r in rows]
    failures = [r for r in rows if r.failure]
    if failures:
        lines += ["", "## Output of what failed", ""]
        for r in failures:
            lines += [f"{r.check}:", "", "```", r.failure.strip()[-6000:], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def merge(previous: list[Row], new: list[Row]) -> list[Row]:
    """The new rows replace the earlier ones of the same checks; in the order of CHECKS."""
    done = {r.key for r in new}
    rows = [r for r in previous if r.key not in done] + new
    order = list(CHECKS)
    return sorted(rows, key=lambda r: order.index(r.key) if r.key in order else len(order))


def write_report(path: Path, machine_line: str, rows: list[Row], note: str) -> str:
    sidecar = path.with_suffix(".json")
    previous: list[Row] = []
    if sidecar.exists():
        try:
            saved = json.loads(sidecar.read_text())
            if saved.get("machine") == machine_line.rsplit(";", 1)[0]:
                previous = [Row(**r) for r in saved["rows"]]
        except (ValueError, TypeError, KeyError):
            previous = []
    rows = merge(previous, rows)
    text = render(machine_line, rows, note)
    path.parent.mkdir(parents=True, exist_ok=True)
    sidecar.write_text(
        json.dumps({"machine": machine_line.rsplit(";", 1)[0], "rows": [dataclasses.asdict(r) for r in rows]}, indent=1)
    )
    path.write_text(text)
    return text


# --- command line ----------------------------------------------------------------------


class Formatter(argparse.HelpFormatter):
    def _fill_text(self, text: str, width: int, indent: str) -> str:  # check names are not split at a hyphen
        return textwrap.fill(
            " ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise UsageError(f"{message}; see --help")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = Parser(
        prog="bash scripts/gpu_check.sh",
        formatter_class=Formatter,
        description="Run every GPU path of this project once (NVML, the launch scripts, a NaN run, "
        "throughput and MFU, compile cache, bf16, NCCL and its failures, host synchronizations, "
        "graph breaks and recompiles, torchrun, the allocator, fp32 and flash attention, the memory "
        "estimate, asynchronous checkpoints) and write "
        "one Markdown table of the results. Needs an NVIDIA GPU.",
        epilog=f"checks: {', '.join(CHECKS)}",
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps everywhere (about half the time)")
    parser.add_argument(
        "--only",
        metavar="ROW[,ROW]",
        help="run only these checks (names below); their rows replace the same rows of an earlier run in the same file",
    )
    parser.add_argument(
        "--output", metavar="FILE", type=Path, help="write the table here (default: benchmarks/results/<date>-<gpu>.md)"
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="config override for the small and 8B-shaped runs, e.g. --set data.source=text "
        "--set data.path=/data/fineweb; without any data.* the built-in corpus and the byte "
        "tokenizer are used (no network needed)",
    )
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    names = [n.strip() for n in (args.only or ",".join(CHECKS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise UsageError(f"--only: unknown check {', '.join(unknown) or '(none given)'}; choose from {', '.join(CHECKS)}")
    args.checks = list(dict.fromkeys(names))
    check_sets(args.sets)
    if args.output is not None and args.output.exists() and args.output.is_dir():
        raise UsageError(f"--output {args.output} is a directory; name a file")
    return args


def check_sets(sets: list[str]) -> None:
    from pretrain import config as cfg

    try:
        cfg.resolve(preset="small", sets=sets)
    except cfg.ConfigError as error:
        raise UsageError(str(error)) from None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.worker:
            name, *rest = args.worker
            WORKERS[name](*rest)
            return 0
        if (reason := no_gpu_reason()) is not None:
            raise UsageError(reason)
        try:
            info = machine()
        except (CheckFailed, subprocess.SubprocessError, OSError) as error:
            last = (getattr(error, "tail", "") or str(error)).strip().splitlines()[-1:]
            raise UsageError(f"cannot read the machine: {error}" + (f" ({last[0]})" if last else "")) from None
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    return run_checks(args, info)


def run_checks(args: argparse.Namespace, info: dict[str, Any]) -> int:
    gpus = [int(i) for i, _ in (row[:2] for row in smi_query("index", "name"))]
    machine_line = describe_machine(info)
    output = args.output or RESULTS / f"{datetime.date.today().isoformat()}-{short_gpu_name(info['gpus'][0])}.md"
    print(machine_line, flush=True)
    estimate = minutes(group_seconds(args.checks, ESTIMATED_S))
    print(f"{PROG}: {len(args.checks)} check(s), about {estimate:g} minutes on H100s (estimated)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        uses_own_data = any(s.startswith("data.") for s in args.sets)
        ctx = Context(
            quick=args.quick,
            sets=args.sets,
            gpus=gpus,
            tmp=Path(tmp),
            log=lambda line: print(line, file=sys.stderr, flush=True),
            data_note="data from --set" if uses_own_data else "built-in corpus, byte tokenizer: no network",
        )
        rows = [row for key in args.checks for row in run_check(key, ctx)]
    note = (
        f"`bash scripts/gpu_check.sh{' --quick' if args.quick else ''}"
        + (f" --only {','.join(args.checks)}" if args.only else "")
        + "`; "
        + (
            "small and 8B-shaped runs on the built-in corpus with the byte tokenizer (no network)"
            if not any(s.startswith("data.") for s in args.sets)
            else f"data: {' '.join(args.sets)}"
        )
    )
    text = write_report(output, machine_line, rows, note)
    print(text)
    print(f"{PROG}: table written to {output}", file=sys.stderr)
    return 0 if all(r.met != "no" for r in rows) else 1
