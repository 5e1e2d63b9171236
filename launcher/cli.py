"""Command line of the launcher, and the only sys.exit.

python -m launcher [options]                 train: `python -m pretrain` on every device
python -m launcher [options] -- CMD [ARGS]   any command, supervised, one per device
python -m launcher gpus [criteria]           the GPU table, with the verdict on each GPU
python -m launcher --nnodes N --node-rank R --master-addr HOST [...]   one node of N (docs/multinode.md)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from launcher import address_space
from launcher.gpus import nvml, selection, table
from launcher.nodes import multinode
from launcher.supervise import outcome
from launcher.rundir import lock
from launcher.processes import torchrun_env
from launcher.address_space import is_out_of_memory, refusal
from launcher.errors import UsageError
from launcher.exit_codes import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_NO_ADDRESS_SPACE, EXIT_USAGE, by_signal
from launcher.rundir.choice import cannot_create, own_run_dir, resume_point, run_dir_path
from launcher.compile_cache import kernel_cache_dir
from launcher.nodes.node import Layout
from launcher.nodes.rendezvous import Node, NodeInterrupted, NodeStopped
from launcher.gpus.placement import DEFAULT_CPU_WORKERS, GpuOptions, Placement, place
from launcher.supervise.printer import Printer, use_colour
from launcher.supervise.supervisor import Supervisor, SupervisorOptions
from launcher.processes.worker import StartError, Worker, check_runnable, with_package_root, without_package_root, worker_env
from pretrain import config as cfg
from pretrain.run import exit_codes
from pretrain.run.command_name import command_name
from pretrain.run.refusal import Refusal
from pretrain.run.thread_env import bad_thread_variable
from pretrain.run.files import (
    CACHE_DIR_VAR,
    PACKAGE_ROOT,
    RUNS_DIR_VAR,
    cache_root,
    create_run_dir,
    os_error_message,
    runs_root,
)

MAX_KILL_GRACE = 3600
MAX_STOP_TIMEOUT = 86400
STACK_DUMP_SIGNAL = signal.SIGUSR1  # pretrain/__main__.py dumps every thread's stack on it
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
    multinode.add_arguments(parser)
    cfg.add_arguments(parser)
    return parser


def add_criteria_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--min-free-memory",
        default=selection.DEFAULT_MIN_FREE_MEMORY,
        metavar="AMOUNT",
        help="a GPU is free with at least this much memory free: a share of its memory "
        "(90%%) or an amount (20GiB) (default: " + selection.DEFAULT_MIN_FREE_MEMORY.replace("%", "%%") + ")",
    )
    parser.add_argument(
        "--max-utilization",
        default=f"{selection.DEFAULT_MAX_UTILIZATION:g}",
        metavar="PERCENT",
        help="a GPU is free when busy at most this share of the time, averaged over "
        f"{nvml.UTILIZATION_WINDOW:g} s (default: {selection.DEFAULT_MAX_UTILIZATION:g})",
    )


def show_gpus(argv: Sequence[str]) -> int:
    """`python -m launcher gpus`: every GPU and the verdict on it; claims nothing."""
    parser = argparse.ArgumentParser(
        prog=f"{program()} gpus", description="Show this machine's GPUs and which the launcher counts as free."
    )
    add_criteria_arguments(parser)
    args = parser.parse_args(argv)
    criteria = selection.Criteria.parse(args.min_free_memory, args.max_utilization)
    # What applies to a listing (not the training launch's --device cpu): why there is nothing to list.
    try:
        gpus = nvml.discover()
    except nvml.NoGpuDriver as error:
        raise UsageError(f"no NVIDIA driver ({error}): no GPU to show; `nvidia-smi` checks the driver") from None
    except nvml.NvmlFailure as error:
        # Its message ends in the training launch's way out, "or use --device cpu": not this command's.
        raise UsageError(str(error).removesuffix(", or use --device cpu")) from None
    if not gpus:
        raise UsageError("the NVIDIA driver reports no GPU: none to show; `nvidia-smi -L` lists what it sees")
    visible = selection.visible_ids(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    print(table.render([selection.judge(gpu, criteria, visible) for gpu in gpus]))
    return 0


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Options before `--`, the command after it."""
    argv = list(argv)
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_workers(
    placement: Placement,
    command: list[str],
    training: bool = False,
    layout: Layout | None = None,
    master_port: int | None = None,
    compile_cache: str | None = None,
    run_dir: Path | None = None,
    logs_dir: Path | None = None,
) -> list[Worker]:
    """One worker per rank. Training workers get HF_HUB_OFFLINE=1: the launcher has already
    fetched what they read from the Hugging Face Hub (the dataset's files, pinned to a commit, and
    the tokenizer), so none of them asks the Hub again, and N ranks never make N requests. They
    also get the roots, absolute, so they find the dataset the launcher prepared, and this
    project on PYTHONPATH when Python would not find it otherwise (a clone, not installed). The
    user's own command gets the user's PYTHONPATH, without this project's packages. layout:
    where this node's workers sit in a job of several nodes (default: this machine alone).
    compile_cache: their TORCHINDUCTOR_CACHE_DIR (launcher/compile_cache.py), None for torch's default.
    run_dir names the run (TORCHELASTIC_RUN_ID); each worker's TORCHELASTIC_ERROR_FILE is in
    logs_dir, beside its log (launcher/processes/torchrun_env.py); without them, both are empty."""
    layout = layout or Layout(placement.world_size)
    port, cpus = master_port or free_port(), os.cpu_count() or 1
    base = dict(os.environ)
    if training:
        base = with_package_root(base, PACKAGE_ROOT) | {
            "HF_HUB_OFFLINE": "1",
            RUNS_DIR_VAR: str(runs_root()),
            CACHE_DIR_VAR: str(cache_root()),
        }
    else:
        base = without_package_root(base, PACKAGE_ROOT)
    workers = []
    for local in range(placement.world_size):
        gpu = placement.gpus[local] if placement.device == "cuda" else None
        rank = layout.global_rank(local)
        label = layout.label(placement.label(local), local)
        error_file = torchrun_env.error_file(logs_dir, label) if logs_dir is not None else None
        env = worker_env(
            base,
            rank=rank,
            world_size=layout.world_size,
            local_rank=local,
            local_world_size=placement.world_size,
            node_rank=layout.node_rank,
            master_addr=layout.master_addr,
            master_port=port,
            gpu=placement.cuda_visible_devices(local),
            gpu_id=gpu.id if gpu else None,
            cuda_device_index=placement.cuda_device_index(local),
            cpu_count=cpus,
            compile_cache=compile_cache,
            nnodes=layout.nnodes,
            run_id=torchrun_env.run_id(run_dir) if run_dir is not None else "",
            error_file=torchrun_env.fresh_error_file(error_file) if error_file is not None else "",
        )
        workers.append(Worker(rank=rank, label=label, argv=command, env=env))
    return workers


def check_command(command: list[str]) -> None:
    """Refuse, before anything is claimed or written, a command a shell could not run (126, 127)."""
    check_runnable(command[0], os.environ.get("PATH"))


def prepare_training(config: cfg.Config, placement: Placement, printer: Printer, node: Node | None = None) -> cfg.Config:
    """Prepare the dataset once (per node), check one global batch fits the data and the model
    fits the GPUs, and choose DDP or FSDP and what is recomputed (pretrain/plan/parallelism.py), before
    anything is spawned or written; return the config as the workers will run it (training.parallelism
    "ddp" or "fsdp", activation_checkpointing never "auto", loss_chunk_tokens never null).
    In a job of several nodes, the whole job's worker count and smallest GPU decide."""
    with address_space.loading_numpy():  # its first import: a limit on address space is one line
        from pretrain.data.fitting import fit_to_dataset
    from pretrain.data.cache import sigterm_as_exit
    from pretrain.data.hub import choose_hub_files, follow_checkpoint
    from pretrain.data.prepare import prepare
    from pretrain.plan.parallelism import host_memory_bytes, plan_parallelism, planned_gpu_memory, with_gpu_memory

    from pretrain.evaluation import hellaswag
    from pretrain.observe import wandb_log
    from pretrain.plan.compile_prerequisites import compile_off_line, compile_requested, missing_compile_prerequisite
    from pretrain.hf.init_checkpoint import check_fits, for_workers

    if config.logging.wandb and not wandb_log.is_installed():
        raise UsageError(wandb_log.MISSING)
    # Before the data: weights that cannot be found, or do not fit the model, stop the launch at once.
    config, init = for_workers(config, printer.launcher_line)
    if config.evaluation.data:  # a damaged benchmark file is found now, not after the first interval
        data = hellaswag.checked_data(config.evaluation.data, config.evaluation.max_examples)
        config = dataclasses.replace(config, evaluation=dataclasses.replace(config.evaluation, data=data))
    config = dataclasses.replace(config, system=dataclasses.replace(config.system, device=placement.device))
    if compile_requested(config, placement.device) and (missing := missing_compile_prerequisite(placement.device)):
        # Said once here, not once per worker, and the workers get compile off in their config.
        printer.launcher_line(f"warning: {compile_off_line(missing)}")
        config = dataclasses.replace(config, training=dataclasses.replace(config.training, compile=False))
    # Every rank must agree on the mode, and the smallest GPU decides whether it fits.
    gpu_memory = min(gpu.memory_total for gpu in placement.gpus) if placement.device == "cuda" else None
    if node is not None:
        gpu_memory = node.smallest_gpu_memory
    gpu_memory = planned_gpu_memory(config, gpu_memory)
    if gpu_memory is not None:  # the workers plan on this very figure (pretrain/build.py)
        config = with_gpu_memory(config, gpu_memory)
    world_size = node.world_size if node is not None else placement.world_size
    host_memory = host_memory_bytes()
    if config.model.vocab_size is not None:
        # The model's size is known before the data: a run that fits neither the GPUs nor this
        # machine's memory is refused now, not after a long download or tokenization.
        plan_parallelism(config, world_size, gpu_memory, host_memory)
    # A Hub dataset's file count is fixed here, for this world size, and written into the config
    # the workers get: every rank then prepares (finds) exactly these files.
    config = choose_hub_files(follow_checkpoint(config), world_size, printer.launcher_line)
    with sigterm_as_exit():
        dataset_dir = prepare(config.data, log=printer.launcher_line)
    config, length = fit_to_dataset(config, dataset_dir, world_size)
    if init is not None:  # again, with the vocabulary the tokenizer has set
        check_fits(init, config)
    printer.launcher_line(f"run length: {length.describe()}")
    config, line = plan_parallelism(config, world_size, gpu_memory, host_memory)
    printer.launcher_line(line)
    return config


def training_command(config: cfg.Config, run_dir: Path, printer: Printer) -> list[str]:
    """Write the resolved config into the run directory; return the worker command."""
    config_path = run_dir / "config.json"
    cfg.save(config, config_path)
    printer.launcher_line(f"run directory: {run_dir}")
    return [sys.executable, "-m", "pretrain", "--config", str(config_path), "--run-dir", str(run_dir)]


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
    spec = multinode.spec_from(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    set_roots(args.runs_dir, args.cache_dir)
    config = cfg.from_args(args)
    if command:
        check_command(command)
    console = Printer(sys.stdout, None, colour=use_colour(sys.stdout))
    placement = place(
        GpuOptions(
            device=args.device or config.system.device,
            gpus=args.gpus,
            nproc=args.nproc,
            device_id=config.system.device_id,
            min_free_memory=args.min_free_memory,
            max_utilization=args.max_utilization,
            strict=args.strict,
            cpu_fallback=bool(command) or config.preset == "debug",
            own_command=bool(command),
        ),
        console,
    )
    try:
        if spec is None:
            return run_placed(args, config, command, placement, console)
        with address_space.loading_numpy():  # several nodes: numpy's first import is here
            from pretrain.data.cache import sigterm_as_exit

        identity = {"command": command} if command else cfg.to_dict(config)
        with sigterm_as_exit():  # until the supervisor takes the signals: the others are told
            node = multinode.join_job(spec, placement, identity, args.join_timeout, console.launcher_line, args.node_timeout)
            with multinode.telling_others(node):
                code = run_placed(args, config, command, placement, console, node)
            return multinode.settle(node, code, args.stop_timeout + args.kill_grace + args.node_timeout, console.launcher_line)
    finally:
        placement.release()


def run_placed(
    args: argparse.Namespace,
    config: cfg.Config,
    command: list[str],
    placement: Placement,
    console: Printer,
    node: Node | None = None,
) -> int:
    """Take the run directory, prepare, spawn and supervise, on devices already chosen (and
    claimed). In a job of several nodes, node 0 chooses the run directory and the checkpoint to
    resume, and the others take them (the run directory is on a filesystem they share)."""
    if node is not None and not node.spec.is_master:
        plan = node.receive("run")
        if args.run_dir and run_dir_path(args.run_dir) != Path(plan["run_dir"]):
            console.launcher_line(
                f"warning: --run-dir {args.run_dir} is not node 0's; every node uses node 0's, {plan['run_dir']}"
            )
        owned = own_run_dir(Path(plan["run_dir"]), lock_name=lock.node_lock_name(node.rank))
        config = dataclasses.replace(config, training=dataclasses.replace(config.training, resume=plan["resume"]))
        master_port = int(plan["worker_port"])
    else:
        if command:
            owned = own_run_dir(run_dir_path(args.run_dir))
        else:
            # The checkpoint first: a resumed run reads the Hub files its checkpoint was trained on.
            world_size = node.world_size if node is not None else placement.world_size
            owned, config = resume_point(config, args.run_dir, console, world_size)
        master_port = free_port()
        if node is not None:
            node.share("run", {"run_dir": str(owned.path), "resume": config.training.resume, "worker_port": master_port})
    try:
        code = run_owned(args, config, command, placement, console, owned.path, node, master_port)
    except BaseException:
        owned.abandon()  # nothing left behind by a launch that ends in an error before it starts
        raise
    owned.release()
    return code


def run_owned(
    args: argparse.Namespace,
    config: cfg.Config,
    command: list[str],
    placement: Placement,
    console: Printer,
    run_dir: Path,
    node: Node | None = None,
    master_port: int | None = None,
) -> int:
    generic = bool(command)
    kernels = None  # the user's own command keeps the user's (or torch's) compile cache
    if not generic:
        config = prepare_training(config, placement, console, node)
        kernels = kernel_cache_dir(config, placement.device, console.launcher_line)
        if node is not None:
            multinode.agree_on_config(node, cfg.to_dict(config))
    if node is not None:
        node.check_going()  # another node stopped the job while this one prepared
    logs_dir = run_dir / "logs" if node is None else run_dir / "logs" / f"node{node.rank}"
    try:
        create_run_dir(run_dir)
        logs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise cannot_create(run_dir, error) from None
    printer = Printer(sys.stdout, logs_dir, colour=use_colour(sys.stdout))
    try:
        if not command:
            command = training_command(config, run_dir, printer)
        layout = multinode.layout(node, placement)
        workers = make_workers(placement, command, not generic, layout, master_port, kernels, run_dir=run_dir, logs_dir=logs_dir)
        options = SupervisorOptions(
            kill_grace=args.kill_grace,
            stop_timeout=args.stop_timeout,
            hang_timeout=args.hang_timeout,
            run_dir=run_dir,
            logs_dir=logs_dir,
            exit_record="workers.json" if node is None else f"workers.node{node.rank}.json",
            adopt_orphans=True,
            stack_dump_signal=None if generic else STACK_DUMP_SIGNAL,
            stop_leaders_only=not generic,
            exit_meanings={} if generic else exit_codes.MEANINGS,
            agreed_exit_codes=frozenset() if generic else exit_codes.AGREED,
            consequence_exit_codes=frozenset() if generic else exit_codes.CONSEQUENCES,
        )
        try:
            return Supervisor(workers, printer, options, peers=node).run()
        except StartError as error:  # workers.json says which worker, why, and the exit code
            if warning := outcome.write_exit_record(run_dir, outcome.start_failure_record(workers, error), options.exit_record):
                printer.launcher_line(warning)
            raise
    finally:
        printer.close()


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
        if isinstance(error, selection.DeviceError) and error.verdicts:
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
    if "torch" in sys.modules:
        # Several nodes: torch (the TCPStore) makes the interpreter's own exit take ~0.5 s,
        # which every node would add to its teardown. Nothing of ours runs at exit: the
        # workers are gone, the logs closed, the locks die with the process.
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
