"""Benchmark: how long a run takes to heal after a worker's SIGKILL, this launcher's --max-restarts
against torchrun --max-restarts 1 on the same training script.

Run from the repository root:

    python benchmarks/restarts.py [--repeat N] [--quick] [--markdown PATH] [--note TEXT]

Every setup trains the debug preset on 2 CPU workers (gloo) for --steps steps with a checkpoint
every --checkpoint-interval steps, and may restart once. PRETRAIN_FAULTS=0:1:K:sigkill makes rank 1
SIGKILL itself right after its step line for step K (--kill-step) in the first attempt
(pretrain/run/faults.py); the attempt after it does not meet the fault again. Setups:
- this launcher: `python -m launcher --debug --nproc 2 --max-restarts 1 ...`, with the default
  --restart-backoff (1 s) and with 0, so the backoff's share shows; it resumes from the latest checkpoint.
- torchrun: `python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 pretrain_main.py
  --config C`, C the config.json our first run resolved (its resume emptied). torchrun restarts
  the same command and knows no checkpoint; pretrain_main.py given `--resume auto --run-dir D`
  finds D's latest complete checkpoint itself (none in the first attempt: step 0), so that row
  restarts from the same checkpoint as ours: as fair as torchrun allows. Without them the script
  starts over (a new run directory each attempt, step 0): what torchrun's restart gives by itself.
  These rows use --standalone with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the store shared
  (its default) the second attempt's gloo may read the first attempt's addresses and fail ("Gloo
  connectFullMesh failed ... Connection refused", or hang; pytorch/pytorch#135712); the last row
  runs torchrun's default for one node, the static rendezvous, which always shares it.
Measured from timestamps taken as each output line arrives on this benchmark's pipe: the kill is
the arrival of rank 1's "fault injected: SIGKILL after step K" line; the next attempt's first step
is the first worker step line after it for a step below K (rank 0's own line for step K may still
follow the kill; this launcher's failure summary quotes the dead worker's last lines behind
"launcher:", which are skipped). Also the step it started at, so the steps redone (K + 1 minus
it), the wall time from start to exit, the exit code, and the survivors: processes carrying the
run's marker still alive once the tool has exited (benchmarks/harness.py).
Progress goes to stderr; the Markdown goes to stdout and, with --markdown, to a file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parent.parent
if Path(sys.path[0]).resolve() == REPO / "benchmarks":  # run as a script: the repository, not benchmarks/
    sys.path[0] = str(REPO)  # (benchmarks/launcher.py would shadow the launcher package there)
from benchmarks.harness import MARKER_VAR, count_survivors, free_port, kill_marked, unwind_on_signals  # noqa: E402
from benchmarks.launcher import LineReader  # noqa: E402
from benchmarks.train import cpu_model, load_average, machine_line_for, print_table  # noqa: E402
from launcher.supervise.restarts import STEP_LINE  # noqa: E402

FAULT_LINE = re.compile(r"fault injected: SIGKILL after step (\d+)")
"""The line rank 1 prints just before it SIGKILLs itself (pretrain/run/faults.py)."""
OUR_LINE = "launcher:"
"""How this launcher's own lines start, its quotes of a failed worker's last lines among them."""
HEADER = [
    "run",
    "restarts from",
    "SIGKILL → next attempt's first step (s)",
    "steps redone",
    "total wall time (s)",
    "survivors",
    "exit code",
]


@dataclass(frozen=True)
class Setup:
    """One way of running the benchmark's training with one restart allowed: a row of the table."""

    label: str
    tool: Literal["ours", "torchrun"]
    backoff: float | None = None
    """ours: --restart-backoff (None: the launcher's default)."""
    resume: bool = True
    """torchrun: the script gets --resume auto and a fixed --run-dir, and so finds its checkpoint."""
    rendezvous: Literal["standalone", "static"] = "standalone"
    """torchrun: --standalone with a store of its own per attempt, or the default static rendezvous."""


SETUPS = (
    Setup("this launcher, --restart-backoff 1 (default)", "ours"),
    Setup("this launcher, --restart-backoff 0", "ours", backoff=0.0),
    Setup("torchrun --standalone, script resumes (--resume auto --run-dir)", "torchrun"),
    Setup("torchrun --standalone, script starts over (no --resume)", "torchrun", resume=False),
    Setup("torchrun as is (static rendezvous), script resumes", "torchrun", rendezvous="static"),
)


@dataclass(frozen=True)
class Restart:
    """The kill and the next attempt's first step, as the output lines showed them."""

    killed_at: float
    killed_step: int
    next_at: float | None = None
    next_step: int | None = None
    """The step the next attempt started at (None: no next attempt trained a step)."""

    @property
    def seconds(self) -> float | None:
        return None if self.next_at is None else self.next_at - self.killed_at

    @property
    def redone(self) -> int | None:
        """Steps trained twice: from the next attempt's first step to the killed one."""
        return None if self.next_step is None else self.killed_step + 1 - self.next_step


@dataclass(frozen=True)
class RunResult:
    exit_code: int | None
    """None: still running at --timeout (then killed)."""
    survivors: int | None
    wall_s: float
    restart: Restart | None


def restart_timing(lines: Sequence[tuple[float, str]]) -> Restart | None:
    """From (arrival time, line) pairs: the kill and the next attempt's first step; None
    without a fault line. The first attempt's steps end at the killed step, so the first
    worker step line below it after the kill is the next attempt's."""
    killed: Restart | None = None
    for arrived, line in lines:
        if line.startswith(OUR_LINE):
            continue
        if killed is None:
            if match := FAULT_LINE.search(line):
                killed = Restart(arrived, int(match[1]))
        elif (step := STEP_LINE.search(line)) and int(step[1]) < killed.killed_step:
            return Restart(killed.killed_at, killed.killed_step, arrived, int(step[1]))
    return killed


def tool_argv(setup: Setup, args: argparse.Namespace, work: Path, config: Path | None) -> list[str]:
    python = sys.executable
    if setup.tool == "ours":
        backoff = [] if setup.backoff is None else ["--restart-backoff", f"{setup.backoff:g}"]
        return [
            *(python, "-m", "launcher", "--debug", "--device", "cpu", "--nproc", "2", "--max-restarts", "1"),
            *backoff,
            *("--max-steps", str(args.steps), "--set", f"training.checkpoint_interval={args.checkpoint_interval}"),
            *("--run-dir", str(work / "run")),
        ]
    if config is None:
        raise RuntimeError("torchrun's setups need the config.json of this launcher's first run, which wrote none")
    rendezvous = ["--standalone"] if setup.rendezvous == "standalone" else ["--master-port", str(free_port())]
    resume = ["--resume", "auto", "--run-dir", str(work / "run")] if setup.resume else []
    return [
        *(python, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", "2", "--max-restarts", "1"),
        *("pretrain_main.py", "--config", str(config), *resume),
    ]


def tool_env(setup: Setup, marker: str, kill_step: int, work: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHELASTIC_")}
    env.update(
        {
            MARKER_VAR: marker,
            "PRETRAIN_FAULTS": f"0:1:{kill_step}:sigkill",
            "PRETRAIN_RUNS_DIR": str(work / "runs"),  # where a run without --run-dir goes
            "PYTHONUNBUFFERED": "1",  # torchrun's own lines, block-buffered on a pipe otherwise
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
    )
    if setup.tool == "torchrun" and setup.rendezvous == "standalone":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def run_once(setup: Setup, args: argparse.Namespace, work: Path, config: Path | None) -> RunResult:
    """Run one setup in work (a fresh directory) until it exits or --timeout; measure."""
    marker = uuid.uuid4().hex
    work.mkdir(parents=True)
    proc, reader = None, None
    try:
        started = time.monotonic()
        proc = subprocess.Popen(
            tool_argv(setup, args, work, config),
            env=tool_env(setup, marker, args.kill_step, work),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert proc.stdout is not None  # a pipe
        reader = LineReader(proc.stdout)
        try:
            returncode: int | None = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        wall_s = time.monotonic() - started
        survivors = count_survivors({marker}) if returncode is not None else None
    finally:
        kill_marked(marker)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if reader is not None:
            reader.join(timeout=5)
    lines = [(arrived, line.decode(errors="replace")) for arrived, line in reader.lines]
    restart = restart_timing(lines)
    if restart is None or restart.next_at is None or returncode != 0:  # show why
        tail = "".join(line for _, line in lines[-8:])
        print(f"  warning: {setup.label}: exit {returncode}, restart {restart}; its last output:\n{tail}", file=sys.stderr)
    exit_code = None if returncode is None else 128 - returncode if returncode < 0 else returncode
    return RunResult(exit_code, survivors, wall_s, restart)


def resume_emptied(config_json: Path, dest: Path) -> Path:
    """Our run's resolved config, written to dest for torchrun's runs, with no resume in it (our
    restart wrote the checkpoint it resumed from there): a command line's --resume decides."""
    config = json.loads(config_json.read_text())
    config["training"]["resume"] = ""
    dest.write_text(json.dumps(config, indent=2) + "\n")
    return dest


Results = dict[Setup, list[RunResult]]


def run_all(args: argparse.Namespace) -> Results:
    """Every setup args.repeat times, interleaved so that drift on the machine hits all alike."""
    results: Results = {}
    with tempfile.TemporaryDirectory(prefix="restarts-bench-") as tmp:
        config: Path | None = None
        for i in range(args.repeat):
            for number, setup in enumerate(SETUPS):
                work = Path(tmp) / f"{i}-{number}"
                result = run_once(setup, args, work, config)
                if config is None and setup.tool == "ours" and (work / "run" / "config.json").exists():
                    config = resume_emptied(work / "run" / "config.json", Path(tmp) / "config.json")
                results.setdefault(setup, []).append(result)
                seconds = result.restart.seconds if result.restart else None
                print(
                    f"[{i + 1}/{args.repeat}] {setup.label}: exit={result.exit_code} survivors={result.survivors} "
                    f"restart={'none' if seconds is None else f'{seconds:.2f} s'} wall={result.wall_s:.1f} s",
                    file=sys.stderr,
                )
    return results


def spread(values: Sequence[float], runs: int, fmt: str) -> str:
    """median (min–max), one value when all agree, and how many runs had one when not all did."""
    if not values:
        return "—"
    low, high = min(values), max(values)
    cell = f"{statistics.median(values):{fmt}}" + (f" ({low:{fmt}}–{high:{fmt}})" if high != low else "")
    return cell if len(values) == runs else f"{cell}; {len(values)} of {runs} runs"


def row(setup: Setup, runs: list[RunResult]) -> list[str]:
    restarts = [r.restart for r in runs if r.restart is not None and r.restart.next_step is not None]
    starts = sorted({r.next_step for r in restarts if r.next_step is not None})
    codes = sorted({"timeout" if r.exit_code is None else str(r.exit_code) for r in runs})
    return [
        setup.label,
        ", ".join(f"checkpoint step_{s}" if s else "step 0" for s in starts) or "no restart",
        spread([s for r in restarts if (s := r.seconds) is not None], len(runs), ".2f"),
        spread([n for r in restarts if (n := r.redone) is not None], len(runs), ".0f"),
        spread([r.wall_s for r in runs], len(runs), ".1f"),
        spread([r.survivors for r in runs if r.survivors is not None], len(runs), ".0f"),
        ", ".join(codes),
    ]


def backoff_share(results: Results) -> str | None:
    """The default backoff's part of our time to the next first step, from our two rows' medians."""
    default, zero = (
        [s for r in results.get(SETUPS[i], []) if r.restart and (s := r.restart.seconds) is not None] for i in (0, 1)
    )
    if not default or not zero:
        return None
    with_it, without = statistics.median(default), statistics.median(zero)
    share = (
        f"The backoff's share: {with_it - without:.2f} s of our {with_it:.2f} s (median with the default "
        f"1 s minus the median with 0); the rest is the teardown and the next attempt's start-up"
    )
    if min(default) <= max(zero):  # the start-up varied by more than the backoff
        return f"{share}, which varied here by more than the backoff: the two rows' ranges overlap."
    return f"{share}."


def report(results: Results, args: argparse.Namespace, elapsed: float) -> str:
    """The Markdown: a heading, the command and the machine, what was measured, the table."""
    where = f"CPU {cpu_model()}, {os.cpu_count()} cores, load average {load_average()} at the end"
    setup = (
        f"Debug preset on 2 CPU workers (gloo), {args.steps} steps, a checkpoint every {args.checkpoint_interval} "
        f"steps; `PRETRAIN_FAULTS=0:1:{args.kill_step}:sigkill` (rank 1 SIGKILLs itself right after its step "
        f"{args.kill_step} line in the first attempt); one restart allowed (`--max-restarts 1`). {args.repeat} "
        "run(s) per row, the rows interleaved; cells: median (min–max) over the runs."
    )
    measured = (
        "Times from the arrival of each output line on the benchmark's pipe: from rank 1's fault line (the kill) "
        f"to the first worker step line below step {args.kill_step} (the next attempt's first step). Steps redone: "
        f"{args.kill_step} + 1 minus the step the next attempt started at. Wall time: from start to exit. "
        "Survivors: processes of the run still alive once the tool has exited."
    )
    torchrun = (
        "torchrun restarts the same command and knows no checkpoint: `pretrain_main.py --resume auto --run-dir D` "
        "finds D's latest complete checkpoint itself (none in the first attempt), the fairest torchrun allows; "
        "without them each attempt starts over at step 0 in a new run directory. Both run the config.json this "
        "launcher resolved. The --standalone rows set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which the "
        "attempts share one store and the second attempt's gloo may read the first's addresses and fail "
        "(pytorch/pytorch#135712); the static rendezvous, torchrun's default on one node, always shares it, so its "
        "restart works or not by which rank of the second attempt reaches the store first."
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_table(HEADER, [row(s, runs) for s, runs in results.items()])
    lines = [
        f"# {datetime.date.today().isoformat()}: restarts after a SIGKILL, this launcher against torchrun",
        "",
        f"Command: `{shlex.join(['python', 'benchmarks/restarts.py', *args.argv])}`",
        "",
        machine_line_for(where) + (f". {args.note}" if args.note else ""),
        "",
        setup,
        "",
        measured,
        "",
        torchrun,
        "",
        out.getvalue().rstrip("\n"),
        "",
        *filter(None, [backoff_share(results)]),
        f"Total {elapsed:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per setup (default 3)")
    parser.add_argument("--quick", action="store_true", help="one run per setup")
    parser.add_argument("--steps", type=int, default=30, help="training steps of a run (default 30)")
    parser.add_argument("--checkpoint-interval", type=int, default=10, help="steps between checkpoints (default 10)")
    parser.add_argument("--kill-step", type=int, default=15, help="the step after which rank 1 is SIGKILLed (default 15)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a run may take before it is killed (default 180)")
    parser.add_argument("--markdown", type=Path, metavar="PATH", help="also write the Markdown to PATH")
    parser.add_argument("--note", default="", help="a sentence about the machine for the results, e.g. what else ran on it")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.timeout <= 0 or args.checkpoint_interval < 1:
        parser.error("--repeat and --checkpoint-interval must be at least 1 and --timeout positive")
    if not 0 < args.kill_step < args.steps or args.kill_step % args.checkpoint_interval == 0:
        parser.error(
            f"--kill-step {args.kill_step}: give a step above 0, below --steps ({args.steps}) and not a multiple of "
            f"--checkpoint-interval ({args.checkpoint_interval}), so that the next attempt starts below it"
        )
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.repeat = 1
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    unwind_on_signals()  # through run_once's cleanup
    started = time.monotonic()
    results = run_all(args)
    text = report(results, args, time.monotonic() - started)
    print(text, end="")
    if args.markdown:
        args.markdown.write_text(text)
        print(f"written to {args.markdown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
