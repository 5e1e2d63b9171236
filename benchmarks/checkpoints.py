"""Benchmark: how long a checkpoint stalls training, synchronous against asynchronous saves, and
the goodput of a run whose worker is killed every 60 steps, with and without the local tier.

Run from the repository root:

    python benchmarks/checkpoints.py [--quick] [--json FILE] [--markdown FILE] [--note TEXT]

Every run goes through the launcher (`python -m launcher ... --device cpu --nproc 2`, 2 gloo
ranks) in a temporary run directory, and everything is read from what the run leaves there.

Stall: for `small` (DDP and FSDP) and the debug preset (DDP and FSDP), once with
training.async_checkpoint=false and once with true, a run with --saves periodic checkpoints (every
--small-interval or --debug-interval steps, the last a whole interval before the end, so that the
end-of-run save does not wait for it). Rank 0 logs one record per completed save in
metrics.jsonl (`{"checkpoint": {"step", "tier", "async", "stall_s", "write_s", ...}}`): stall_s,
the seconds the training thread was blocked by that save (a synchronous save's whole write; an
asynchronous one's staging copy and any wait for the save before it), and write_s, from the start
of staging to the save's completion. The first periodic save is shown apart (it may pay
once-per-run costs: the staging buffers, where not made ahead); the table gives the median over the other periodic saves (min–max
beside it); the end-of-run save is left out, since every run waits for it, async or not. `small`
keeps its model (153M parameters, vocabulary 50304: the state a checkpoint holds, ~1.8 GB with
AdamW's moments) but trains on the
built-in corpus (no network) with 1 x 64 tokens per rank and step, one micro-batch, uncompiled:
the step is short on a CPU and the checkpoint is what it is for the preset. --quick runs only
`small`, FSDP, both modes.

Goodput: the debug preset for 200 steps with a durable checkpoint every 50 steps, rank 1 SIGKILLed
after steps 60, 120 and 180 (PRETRAIN_FAULTS=0:1:60:sigkill,1:1:120:sigkill,2:1:180:sigkill,
pretrain/run/faults.py) and --max-restarts 3, without the local tier and with one every 10 steps
(training.local_checkpoint_interval, in a temporary --local-checkpoint-dir): the run's
goodput.json (wall time summed over attempts, goodput, and its parts) and the steps each restart
resumed at. --quick skips it.

Progress goes to stderr; the Markdown goes to stdout and, with --markdown, to a file; --json keeps
{"rows": [{"preset", "parallelism", "ranks", "mode", "stall_s", "write_s", ...}], "goodput": [...]}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if Path(sys.path[0]).resolve() == REPO / "benchmarks":  # run as a script: the repository, not benchmarks/
    sys.path[0] = str(REPO)  # (benchmarks/launcher.py would shadow the launcher package there)
from benchmarks.checkpoints_report import (  # noqa: E402
    GOODPUT_HEADER,
    STALL_HEADER,
    GoodputResult,
    Mode,
    StallResult,
    goodput_cells,
    json_report,
    markdown_table,
    periodic,
    read_goodput,
    read_saves,
    resumed_steps,
    stall_cells,
    trained_seconds,
    verdict,
)
from benchmarks.harness import MARKER_VAR, kill_marked, unwind_on_signals  # noqa: E402
from benchmarks.train_report import cpu_model, load_average, machine_line_for  # noqa: E402

RANKS = 2
SMALL_ON_CPU = (
    "data.source=builtin",  # no network: the byte corpus; the model keeps the preset's 50304 rows
    "data.tokenizer=byte",
    "data.context_length=64",
    "training.batch_size=1",
    "training.grad_accum_nums=1",
    "training.compile=false",
)
"""`small` as a CPU can step it in seconds: the model (what a checkpoint holds) unchanged."""


@dataclass(frozen=True)
class StallCase:
    preset: str
    parallelism: str
    mode: Mode


PRESETS = ("small", "debug")
PARALLELISMS = ("ddp", "fsdp")


def stall_cases(quick: bool, presets: Sequence[str] = PRESETS, parallelisms: Sequence[str] = PARALLELISMS) -> list[StallCase]:
    if quick:
        return [StallCase("small", "fsdp", mode) for mode in ("sync", "async")]
    return [StallCase(p, par, mode) for p in presets for par in parallelisms for mode in ("sync", "async")]


def stall_schedule(case: StallCase, args: argparse.Namespace) -> tuple[int, int]:
    """(max_steps, checkpoint_interval) of a stall run: args.saves periodic saves, the last of them a
    whole interval before the end of the run (whose own save would otherwise wait for it)."""
    interval = args.small_interval if case.preset == "small" else args.debug_interval
    return interval * (args.saves + 1), interval


def stall_argv(case: StallCase, args: argparse.Namespace, run_dir: Path) -> list[str]:
    steps, interval = stall_schedule(case, args)
    sets = [
        *(SMALL_ON_CPU if case.preset == "small" else ()),
        f"training.parallelism={case.parallelism}",
        f"training.async_checkpoint={'true' if case.mode == 'async' else 'false'}",
        f"training.checkpoint_interval={interval}",
        "training.local_checkpoint_interval=0",  # durable saves alone (small's preset has a local tier)
        "training.keep_checkpoints=2",  # disk: small's are ~1.8 GB each
        "training.eval_interval=0",  # only after the last step: nothing but saves between steps
    ]
    return [
        *(sys.executable, "-m", "launcher", "--preset", case.preset, "--device", "cpu", "--nproc", str(RANKS)),
        *("--max-steps", str(steps), "--run-dir", str(run_dir)),
        *(arg for item in sets for arg in ("--set", item)),
    ]


def faults(args: argparse.Namespace) -> str:
    """PRETRAIN_FAULTS killing rank 1 after step kill_every x (attempt + 1) in attempts 0.. ."""
    kills = range(args.kill_every, args.goodput_steps, args.kill_every)
    return ",".join(f"{attempt}:1:{step}:sigkill" for attempt, step in enumerate(kills))


def goodput_argv(local: bool, args: argparse.Namespace, run_dir: Path, local_dir: Path) -> list[str]:
    restarts = len(faults(args).split(","))
    sets = [
        f"training.checkpoint_interval={args.durable_interval}",
        f"training.local_checkpoint_interval={args.local_interval if local else 0}",
        "training.eval_interval=0",
    ]
    tier = ["--local-checkpoint-dir", str(local_dir)] if local else []
    return [
        *(sys.executable, "-m", "launcher", "--debug", "--device", "cpu", "--nproc", str(RANKS)),
        *("--max-steps", str(args.goodput_steps), "--max-restarts", str(restarts), "--run-dir", str(run_dir)),
        *tier,
        *(arg for item in sets for arg in ("--set", item)),
    ]


def launch(argv: list[str], work: Path, timeout: float, extra_env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run the launcher in work until it exits or timeout: (exit code or None, its output). Every
    process it starts carries a marker, and whatever is left is killed (benchmarks/harness.py)."""
    marker = uuid.uuid4().hex
    env = {key: value for key, value in os.environ.items() if not key.startswith(("TORCHELASTIC_", "PRETRAIN_FAULTS"))}
    env.update(
        {
            MARKER_VAR: marker,
            "PRETRAIN_RUNS_DIR": str(work / "runs"),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **(extra_env or {}),
        }
    )
    log = work / "output.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_marked(marker)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    output = log.read_text(errors="replace")
    if code != 0:
        tail = "\n".join(output.splitlines()[-8:])
        print(
            f"  warning: exit {'timeout' if code is None else code}: {shlex.join(argv[1:6])} ...; last output:\n{tail}",
            file=sys.stderr,
        )
    return (None if code is None else 128 - code if code < 0 else code), output


def run_stall(case: StallCase, args: argparse.Namespace, work: Path) -> StallResult:
    work.mkdir(parents=True)
    run_dir = work / "run"
    code, output = launch(stall_argv(case, args, run_dir), work, args.timeout)
    steps, _ = stall_schedule(case, args)
    saves, warning = periodic(read_saves(run_dir), steps, case.mode)
    if not saves:
        warning = warning or "no save recorded in metrics.jsonl"
    return StallResult(case.preset, case.parallelism, RANKS, case.mode, code, saves, trained_seconds(output), warning)


def run_goodput(local: bool, args: argparse.Namespace, work: Path) -> GoodputResult:
    work.mkdir(parents=True)
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="checkpoints-bench-local-", dir=shm if shm.is_dir() else None) as local_dir:
        code, output = launch(
            goodput_argv(local, args, work / "run", Path(local_dir)), work, args.timeout, {"PRETRAIN_FAULTS": faults(args)}
        )
    label = f"local tier every {args.local_interval}" if local else "durable only"
    return GoodputResult(label, local, code, read_goodput(work / "run"), resumed_steps(output))


def run_all(args: argparse.Namespace) -> tuple[list[StallResult], list[GoodputResult]]:
    stalls: list[StallResult] = []
    goodputs: list[GoodputResult] = []
    with tempfile.TemporaryDirectory(prefix="checkpoints-bench-") as tmp:
        for number, case in enumerate(stall_cases(args.quick, args.presets, args.parallelisms)):
            started = time.monotonic()
            result = run_stall(case, args, Path(tmp) / f"stall-{number}")
            stalls.append(result)
            print(
                f"[stall] {case.preset} {case.parallelism} {case.mode}: exit {result.exit_code}, {len(result.saves)} saves, "
                f"stall {result.stall_s} s, write {result.write_s} s ({time.monotonic() - started:.0f} s)",
                file=sys.stderr,
            )
        if args.goodput:
            for local in (False, True):
                started = time.monotonic()
                outcome = run_goodput(local, args, Path(tmp) / f"goodput-{int(local)}")
                goodputs.append(outcome)
                share = (outcome.goodput or {}).get("goodput")
                print(
                    f"[goodput] {outcome.label}: exit {outcome.exit_code}, goodput {share} ({time.monotonic() - started:.0f} s)",
                    file=sys.stderr,
                )
    return stalls, goodputs


def report(stalls: list[StallResult], goodputs: list[GoodputResult], args: argparse.Namespace, elapsed: float) -> str:
    where = f"CPU {cpu_model()}, {os.cpu_count()} cores, no GPU, load average {load_average()} at the end"
    lines = [
        f"# {datetime.date.today().isoformat()}: checkpoint stalls, synchronous and asynchronous, and goodput under faults",
        "",
        f"Command: `{shlex.join(['python', 'benchmarks/checkpoints.py', *args.argv])}`",
        "",
        machine_line_for(where) + (f". {args.note}" if args.note else ""),
        "",
        f"Stall runs: 2 CPU workers (gloo), {args.saves} periodic saves each, the last a whole interval before the end; "
        f"`small` a checkpoint every {args.small_interval} steps (its model and AdamW state, trained on the built-in corpus "
        f"at 1 x 64 tokens per rank and step, uncompiled), debug every {args.debug_interval}. Per save, from rank 0's "
        "records in metrics.jsonl: stall = seconds the training thread was blocked, write = staging start to the save's "
        "completion. The first save is set apart (it may pay once-per-run costs: the staging buffers, where not made "
        "ahead); stall and write per save: the median over the other periodic saves (min–max); the end-of-run save is "
        "left out (every run waits for it). Training (s): rank 0's training loop, steps and saves together.",
        "",
        *markdown_table(STALL_HEADER, [stall_cells(r, stalls) for r in stalls]),
        "",
        verdict(stalls),
    ]
    if goodputs:
        lines += [
            "",
            f"Goodput runs: debug preset, {args.goodput_steps} steps, 2 CPU workers, a durable checkpoint every "
            f"{args.durable_interval} steps, `PRETRAIN_FAULTS={faults(args)}`, `--max-restarts "
            f"{len(faults(args).split(','))}`; with the local tier: `training.local_checkpoint_interval={args.local_interval}` "
            "in a temporary directory under /dev/shm. From the run's goodput.json (seconds summed over attempts); parts / "
            "wall: the parts' sum over the wall time.",
            "",
            *markdown_table(GOODPUT_HEADER, [goodput_cells(g) for g in goodputs]),
        ]
    lines += ["", f"Total {elapsed:.0f} s."]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only small, FSDP, sync and async; no goodput runs")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the rows as JSON to FILE")
    parser.add_argument("--markdown", type=Path, metavar="FILE", help="also write the Markdown to FILE")
    parser.add_argument("--note", default="", help="a sentence about the machine for the results")
    parser.add_argument(
        "--presets", type=names(PRESETS), default=list(PRESETS), help="the stall runs' presets (default small,debug)"
    )
    parser.add_argument(
        "--parallelisms",
        type=names(PARALLELISMS),
        default=list(PARALLELISMS),
        help="the stall runs' parallelisms (default ddp,fsdp)",
    )
    parser.add_argument("--no-goodput", dest="goodput", action="store_false", help="skip the goodput runs")
    parser.add_argument("--saves", type=int, default=4, help="periodic saves per stall run, the first set apart (default 4)")
    parser.add_argument(
        "--small-interval",
        type=int,
        default=5,
        help="small's checkpoint interval (default 5: a background write ends before the next save)",
    )
    parser.add_argument("--debug-interval", type=int, default=4, help="the debug stall runs' checkpoint interval (default 4)")
    parser.add_argument("--goodput-steps", type=int, default=200, help="steps of a goodput run (default 200)")
    parser.add_argument("--kill-every", type=int, default=60, help="rank 1 is killed after every this many steps (default 60)")
    parser.add_argument("--durable-interval", type=int, default=50, help="the goodput runs' checkpoint_interval (default 50)")
    parser.add_argument("--local-interval", type=int, default=10, help="the local tier's interval (default 10)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take before it is killed (default 600)")
    args = parser.parse_args(argv)
    for name in (
        "saves",
        "small_interval",
        "debug_interval",
        "goodput_steps",
        "kill_every",
        "durable_interval",
        "local_interval",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.local_interval < args.durable_interval:
        parser.error("--local-interval must be below --durable-interval (training.local_checkpoint_interval's rule)")
    if args.kill_every >= args.goodput_steps:
        parser.error("--kill-every must be below --goodput-steps, so that a worker is killed at least once")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.goodput = False
    return args


def names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated list of some of choices."""

    def parse(text: str) -> list[str]:
        chosen = [name for name in text.split(",") if name]
        if not chosen or any(name not in choices for name in chosen):
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list of {', '.join(choices)}")
        return chosen

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    unwind_on_signals()  # through launch's cleanup
    started = time.monotonic()
    stalls, goodputs = run_all(args)
    text = report(stalls, goodputs, args, time.monotonic() - started)
    print(text, end="")
    if args.markdown:
        args.markdown.write_text(text)
        print(f"written to {args.markdown}", file=sys.stderr)
    if args.json:
        meta = {
            "command": ["python", "benchmarks/checkpoints.py", *args.argv],
            "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        }
        args.json.write_text(json.dumps(json_report(stalls, goodputs, meta), indent=2) + "\n")
        print(f"written to {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
