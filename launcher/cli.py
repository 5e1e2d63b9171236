"""Command line of the launcher: the options parsed and checked, then handed to the launch
(launcher/launch.py), and every error mapped to its exit code here, with the only sys.exit.

python -m launcher [options]                 train: `python -m pretrain` on every device
python -m launcher [options] -- CMD [ARGS]   any command, supervised, one per device
python -m launcher gpus [criteria]           the GPU table, with the verdict on each GPU
python -m launcher --nnodes N --node-rank R --master-addr HOST [...]   one node of N (docs/multinode.md)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from launcher.gpus import nvml, request, selection, table, vendors
from launcher.gpus.devices import NoGpuDriver
from launcher.nodes import multinode
from launcher.address_space import is_out_of_memory, refusal
from launcher import attempts
from launcher.errors import UsageError
from launcher.launch import launch
from launcher.exit_codes import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_NO_ADDRESS_SPACE, EXIT_USAGE, by_signal
from launcher.nodes.rendezvous import NodeInterrupted, NodeStopped
from launcher.gpus.placement import DEFAULT_CPU_WORKERS
from launcher.processes.worker import check_runnable
from pretrain import config as cfg
from pretrain.run import faults
from pretrain.run.command_name import command_name
from pretrain.run.refusal import Refusal
from pretrain.run.thread_env import bad_thread_variable
from pretrain.run.files import (
    CACHE_DIR_VAR,
    RUNS_DIR_VAR,
    os_error_message,
)

MAX_KILL_GRACE = 3600
MAX_STOP_TIMEOUT = 86400
CONSOLE_COMMAND = "pretrain-launch"  # pyproject.toml [project.scripts]


def program() -> str:
    """The name the user typed: the installed command, or `python -m launcher`."""
    return command_name("launcher", CONSOLE_COMMAND)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program(),
        description="Run one training process per device, prefix their output, stop them all on "
        "the first failure. With `-- COMMAND ...`, supervise any command instead.",
        epilog=f"`{program()} gpus` shows this machine's GPUs and the verdict on each.",
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], help="override system.device (auto: every GPU, else CPU workers)"
    )
    parser.add_argument(
        "--gpus",
        metavar="WHICH",
        help="all (default: every free GPU), auto:N (the N freest), a list of GPU ids or "
        "UUIDs such as 0,3, or none (CPU workers)",
    )
    parser.add_argument(
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        type=int,
        metavar="N",
        help=f"CPU worker processes (default {DEFAULT_CPU_WORKERS}); on GPUs, same as --gpus auto:N",
    )
    add_criteria_arguments(parser)
    add_vendor_argument(parser)
    parser.add_argument("--strict", action="store_true", help="refuse a busy GPU named in --gpus instead of warning")
    parser.add_argument("--run-dir", metavar="DIR", help="run directory (default: <runs dir>/<run-id>/)")
    parser.add_argument("--runs-dir", metavar="DIR", help=f"where new run directories go (default: ${RUNS_DIR_VAR}, else ./runs)")
    parser.add_argument(
        "--cache-dir", metavar="DIR", help=f"prepared datasets and compiled kernels (default: ${CACHE_DIR_VAR}, else ./cache)"
    )
    parser.add_argument(
        "--kill-grace",
        type=float,
        default=5.0,
        metavar="S",
        help="after a failure, seconds between SIGTERM and SIGKILL for the other workers (default: 5)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="on Ctrl-C or SIGTERM, seconds the workers get to finish their step and save "
        "a checkpoint before they are killed (default: 120)",
    )
    parser.add_argument(
        "--hang-timeout", type=float, metavar="S", help="a worker that prints nothing for S seconds has failed (default: off)"
    )
    attempts.add_arguments(parser)
    multinode.add_arguments(parser)
    cfg.add_arguments(parser)
    return parser


def add_criteria_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--min-free-memory",
        default=request.DEFAULT_MIN_FREE_MEMORY,
        metavar="AMOUNT",
        help="a GPU is free with at least this much memory free: a share of its memory "
        "(90%%) or an amount (20GiB) (default: " + request.DEFAULT_MIN_FREE_MEMORY.replace("%", "%%") + ")",
    )
    parser.add_argument(
        "--max-utilization",
        default=f"{request.DEFAULT_MAX_UTILIZATION:g}",
        metavar="PERCENT",
        help="a GPU is free when busy at most this share of the time, averaged over "
        f"{nvml.UTILIZATION_WINDOW:g} s (default: {request.DEFAULT_MAX_UTILIZATION:g})",
    )


def add_vendor_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu-vendor",
        choices=vendors.VENDORS,
        help="on a machine with both NVIDIA and AMD GPUs, which this launch uses (default: the one there is)",
    )


def show_gpus(argv: Sequence[str]) -> int:
    """`python -m launcher gpus`: every GPU and the verdict on it; claims nothing."""
    parser = argparse.ArgumentParser(
        prog=f"{program()} gpus", description="Show this machine's GPUs and which the launcher counts as free."
    )
    add_criteria_arguments(parser)
    add_vendor_argument(parser)
    args = parser.parse_args(argv)
    criteria = request.Criteria.parse(args.min_free_memory, args.max_utilization)
    # What applies to a listing (not the training launch's --device cpu): why there is nothing to list.
    backend = vendors.backend(args.gpu_vendor)
    vendor: vendors.Vendor = "amd" if backend is not nvml else "nvidia"
    try:
        gpus = vendors.discover_requested(args.gpu_vendor)  # a --gpu-vendor whose driver is missing: its own line
    except NoGpuDriver as error:
        raise UsageError(
            f"no NVIDIA or AMD GPU driver ({error}): no GPU to show; `nvidia-smi` or `amd-smi list` checks the driver"
        ) from None
    except Refusal as error:
        # Its message ends in the training launch's way out, "or use --device cpu": not this command's.
        raise UsageError(str(error).removesuffix(", or use --device cpu")) from None
    if not gpus:
        raise UsageError(
            f"the {vendors.NAMES[vendor]} driver reports no GPU: none to show; "
            f"{'`amd-smi list`' if vendor == 'amd' else '`nvidia-smi -L`'} lists what it sees"
        )
    limits = selection.visibility_limits(gpus, os.environ)
    visible = selection.visible_ids(gpus, limits)
    hidden_by = selection.limiting_names(limits)
    print(table.render([selection.judge(gpu, criteria, visible, hidden_by=hidden_by) for gpu in gpus]))
    return 0


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Options before `--`, the command after it."""
    argv = list(argv)
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, []


def check_command(command: list[str]) -> None:
    """Refuse, before anything is claimed or written, a command a shell could not run (126, 127)."""
    check_runnable(command[0], os.environ.get("PATH"))


def set_roots(runs_dir: str | None, cache_dir: str | None) -> None:
    """--runs-dir and --cache-dir: set for this launch as their environment variables would,
    read by this process (the dataset is prepared here) and passed on to the workers."""
    for option, variable, value in (("--runs-dir", RUNS_DIR_VAR, runs_dir), ("--cache-dir", CACHE_DIR_VAR, cache_dir)):
        if value is not None:
            if not value:
                raise UsageError(f"{option} must not be empty; leave it out for the default")
            os.environ[variable] = str(Path(value).expanduser().resolve())


def check_seconds(option: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:  # also refuses nan and inf
        raise UsageError(f"{option} must be between {low:g} and {high:g} seconds (got {value:g})")


def run(argv: Sequence[str]) -> int:
    if list(argv[:1]) == ["gpus"]:
        return show_gpus(argv[1:])
    options, command = split_command(argv)
    args = build_parser().parse_args(options)
    check_seconds("--kill-grace", args.kill_grace, 0, MAX_KILL_GRACE)
    check_seconds("--stop-timeout", args.stop_timeout, 0, MAX_STOP_TIMEOUT)
    check_seconds("--join-timeout", args.join_timeout, 1, MAX_STOP_TIMEOUT)
    check_seconds("--node-timeout", args.node_timeout, 1, MAX_STOP_TIMEOUT)
    if args.hang_timeout is not None:
        check_seconds("--hang-timeout", args.hang_timeout, 1, MAX_STOP_TIMEOUT)
    if problem := bad_thread_variable(os.environ):  # the workers get them (launcher/processes/worker.py)
        raise UsageError(problem)
    faults.parse(os.environ.get(faults.FAULTS_VAR, ""))  # a malformed PRETRAIN_FAULTS: one line, before any worker
    spec = multinode.spec_from(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    attempts.check_arguments(args, spec.nnodes if spec is not None else 1)
    set_roots(args.runs_dir, args.cache_dir)
    config = cfg.from_args(args)
    if command:
        check_command(command)
    return launch(args, config, command, spec)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # The reader of our output went away (`| head`) before a worker started; afterwards the
        # supervisor stops the run gracefully instead (launcher/supervise/printer.py on_console_closed).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        code = EXIT_BROKEN_PIPE
    except NodeStopped as stopped:
        print(f"launcher: {stopped}; exit code {stopped.stop.our_exit_code}", file=sys.stderr)
        code = stopped.stop.our_exit_code
    except NodeInterrupted as interrupted:
        print(f"launcher: {interrupted}", file=sys.stderr)
        code = by_signal(interrupted.interrupt.signum)
    except Refusal as error:  # bad input, one line: 2; a worker's command: 126 or 127; a lost run directory: 74
        print(f"launcher: error: {error}", file=sys.stderr)
        if isinstance(error, request.DeviceError) and error.verdicts:
            print(table.render(error.verdicts), file=sys.stderr)
        code = error.exit_code
    except OSError as error:  # an unwritable cache directory, a full disk, no memory left to fork
        print(f"launcher: error: {refusal() if is_out_of_memory(error) else os_error_message(error)}", file=sys.stderr)
        code = EXIT_USAGE
    except (MemoryError, RuntimeError, ImportError, SystemError) as error:  # the launcher's own, under `ulimit -v`
        if not is_out_of_memory(error):
            raise
        print(f"launcher: error: {refusal()}", file=sys.stderr)
        code = EXIT_NO_ADDRESS_SPACE
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    sys.exit(code)
