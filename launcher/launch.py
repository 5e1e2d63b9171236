"""The launch sequence, once the command line is parsed and checked (launcher/cli.py): place the
workers (CPU, or which GPUs, claimed), join the other nodes if there are any, own the run
directory, prepare (launcher/prepare.py), spawn one worker per rank and supervise them
(launcher/supervise/), then settle: release what was held and return the run's exit code. As
torch's run.py sits over its elastic launcher, cli.py sits over this."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from launcher import address_space, local_tier
from launcher.attempts import Attempts
from launcher.compile_cache import kernel_cache_dir
from launcher.gpus.health import HealthWatch
from launcher.gpus.placement import GpuOptions, Placement, place
from launcher.nodes import multinode
from launcher.nodes.node import Layout, NodeSpec
from launcher.nodes.rendezvous import Node
from launcher.nodes.restart_rounds import RestartRounds
from launcher.prepare import prepare_training, training_command
from launcher.processes import torchrun_env
from launcher.processes.torchrun_env import NO_RESTARTS, Restarts
from launcher.processes.worker import StartError, Worker, with_package_root, without_package_root, worker_env
from launcher.restart_plan import Devices
from launcher.rundir import lock
from launcher.rundir.choice import cannot_create, own_run_dir, resume_point, run_dir_path
from launcher.supervise import outcome
from launcher.supervise.goodput import JobLedger, LaunchLedger
from launcher.supervise.restarts import AttemptEnd
from launcher.supervise.printer import Printer, use_colour
from launcher.supervise.supervisor import Supervisor, SupervisorOptions
from pretrain import config as cfg
from pretrain.run import exit_codes
from pretrain.run.files import CACHE_DIR_VAR, PACKAGE_ROOT, RUNS_DIR_VAR, cache_root, create_run_dir, runs_root

STACK_DUMP_SIGNAL = signal.SIGUSR1  # pretrain/__main__.py dumps every thread's stack on it


def launch(args: argparse.Namespace, config: cfg.Config, command: list[str], spec: NodeSpec | None) -> int:
    """Run a checked launch to its end: the run's exit code (the failed worker's, or 0). command is
    the user's own (`-- CMD`), empty for training; spec is this node's place in a job of several,
    None for a single machine."""
    console = Printer(sys.stdout, None, colour=use_colour(sys.stdout))
    options = GpuOptions(
        device=args.device or config.system.device,
        gpus=args.gpus,
        nproc=args.nproc,
        device_id=config.system.device_id,
        min_free_memory=args.min_free_memory,
        max_utilization=args.max_utilization,
        strict=args.strict,
        cpu_fallback=bool(command) or config.preset == "debug",
        own_command=bool(command),
        gpu_vendor=args.gpu_vendor,
    )
    devices = Devices(options, place(options, console))
    try:
        if spec is None:
            return run_placed(args, config, command, devices, console)
        with address_space.loading_numpy():  # several nodes: numpy's first import is here
            from pretrain.data.cache import sigterm_as_exit

        if args.max_restarts > 0:  # a restart is a new round of the rendezvous (launcher/nodes/restart_rounds.py)
            ledger = JobLedger(console.launcher_line) if not command and spec.is_master else None  # goodput: node 0's
            rounds = restarting_job(args, config, command, devices, console, spec, ledger)
            try:
                with sigterm_as_exit():
                    code = rounds.run()
            finally:
                goodput_line = ledger.finish() if ledger is not None else None  # its record closed, whatever the end
                if rounds.owned is not None and not command:
                    local_tier.remove(config, rounds.owned.path)  # the node's local checkpoints, whatever the end
            if goodput_line is not None:
                console.launcher_line(goodput_line)
            return code
        identity = {"command": command} if command else cfg.to_dict(config)
        placement = devices.placement
        with sigterm_as_exit():  # until the supervisor takes the signals: the others are told
            node = multinode.join_job(spec, placement, identity, args.join_timeout, console.launcher_line, args.node_timeout)
            with multinode.telling_others(node):
                code = run_placed(args, config, command, devices, console, node)
            return multinode.settle(node, code, args.stop_timeout + args.kill_grace + args.node_timeout, console.launcher_line)
    finally:
        devices.placement.release()


def restarting_job(
    args: argparse.Namespace,
    config: cfg.Config,
    command: list[str],
    devices: Devices,
    console: Printer,
    spec: NodeSpec,
    ledger: JobLedger | None = None,
) -> RestartRounds:
    """This node's part of a job of several nodes that restarts: each attempt as run_owned runs it.
    ledger: node 0's goodput ledger, one launch for every round (the time between them is restart)."""

    def attempt(
        config: cfg.Config, node: Node, run_dir: Path, port: int, restarts: Restarts, started: Callable[[], None]
    ) -> tuple[int, AttemptEnd]:
        launch = ledger.of(run_dir) if ledger is not None else None
        return run_owned(args, config, command, devices.placement, console, run_dir, node, port, restarts, started, launch)

    return RestartRounds(args, config, command, devices, console, spec, attempt, free_port)


def run_placed(
    args: argparse.Namespace,
    config: cfg.Config,
    command: list[str],
    devices: Devices,
    console: Printer,
    node: Node | None = None,
) -> int:
    """Take the run directory, prepare, spawn and supervise, on devices already chosen (and
    claimed), again after a transient failure when --max-restarts allows (launcher/attempts.py).
    In a job of several nodes, node 0 chooses the run directory and the checkpoint to resume, and
    the others take them (the run directory is on a filesystem they share)."""
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
            world_size = node.world_size if node is not None else devices.placement.world_size
            owned, config = resume_point(config, args.run_dir, console, world_size)
        master_port = free_port()
        if node is not None:
            node.share("run", {"run_dir": str(owned.path), "resume": config.training.resume, "worker_port": master_port})
    attempts = Attempts(args, config, command, owned.path, console)
    # The goodput ledger (launcher/supervise/goodput.py): node 0's launcher, training only.
    keeps = not command and (node is None or node.spec.is_master)
    ledger = LaunchLedger(owned.path, say=console.launcher_line) if keeps else None

    def attempt(config: cfg.Config, restarts: Restarts, started: Callable[[], None]) -> tuple[int, AttemptEnd]:
        port = master_port if restarts.count == 0 else free_port()  # the last one's may linger
        return run_owned(args, config, command, devices.placement, console, owned.path, node, port, restarts, started, ledger)

    try:
        code = attempts.run(attempt, devices)
    except BaseException:
        if not attempts.started:
            owned.abandon()  # nothing left behind by a launch that ends in an error before it starts
        elif ledger is not None:
            ledger.finish()
        raise
    finally:
        if not command:
            local_tier.remove(config, owned.path)  # the node's local checkpoints, whatever the end
    if ledger is not None and (line := ledger.finish()) is not None:
        if node is None:
            with attempts.logged():  # to combined.log too
                attempts.console.launcher_line(line)
        else:  # several nodes: node 0's console (attempts.logged() writes logs/combined.log, not logs/node0/)
            console.launcher_line(line)
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
    restarts: Restarts = NO_RESTARTS,
    started: Callable[[], None] = lambda: None,
    ledger: LaunchLedger | None = None,
) -> tuple[int, AttemptEnd]:
    """One attempt: prepare (training), spawn and supervise; its exit code and how it ended.
    started: called once every worker is spawned (launcher/attempts.py: the attempt has begun).
    ledger: the launch's goodput record, told of the attempt's spawn and end."""
    generic = bool(command)
    kernels = None  # the user's own command keeps the user's (or torch's) compile cache
    if not generic:
        config = prepare_training(config, placement, console, node, first_attempt=restarts.count == 0, run_dir=run_dir)
        config = local_tier.decide(config, run_dir, node, console.launcher_line if restarts.count == 0 else None)
        kernels = kernel_cache_dir(config, placement.device, console.launcher_line)
        if node is not None:
            multinode.agree_on_config(node, cfg.to_dict(config))
    if node is not None:
        node.check_going()  # another node stopped the job while this one prepared
    logs_dir = run_dir / "logs" if node is None else run_dir / "logs" / f"node{node.spec.own_rank}"
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
        workers = make_workers(
            placement, command, not generic, layout, master_port, kernels, run_dir=run_dir, logs_dir=logs_dir, restarts=restarts
        )
        for worker in workers if not generic else []:  # the local tier decided: every rank takes it as it is
            worker.env |= local_tier.env(config, run_dir, node)
        if ledger is not None:  # the launch's number, for the workers' goodput records
            for worker in workers:
                worker.env |= ledger.env()
        options = SupervisorOptions(
            kill_grace=args.kill_grace,
            stop_timeout=args.stop_timeout,
            hang_timeout=args.hang_timeout,
            run_dir=run_dir,
            logs_dir=logs_dir,
            exit_record="workers.json" if node is None else f"workers.node{node.spec.own_rank}.json",
            adopt_orphans=True,
            stack_dump_signal=None if generic else STACK_DUMP_SIGNAL,
            stop_leaders_only=not generic,
            exit_meanings={} if generic else exit_codes.MEANINGS,
            agreed_exit_codes=frozenset() if generic else exit_codes.AGREED,
            consequence_exit_codes=frozenset() if generic else exit_codes.CONSEQUENCES,
            stop_exit_codes=frozenset() if generic else exit_codes.STOPPED,
        )
        supervisor = Supervisor(workers, printer, options, peers=node)
        gpus = placement.gpus if placement.device == "cuda" else ()
        gpu_watch = HealthWatch(gpus, [worker.label for worker in workers], supervisor.say)
        supervisor.clocks_of = gpu_watch.clocks
        try:
            # The run's GPUs watched for new errors and slowdowns while it lasts (launcher/gpus/health.py),
            # from when every worker is spawned.
            watching = contextlib.ExitStack()

            def on_started() -> None:
                watching.enter_context(gpu_watch)
                if ledger is not None:
                    ledger.spawned(restarts.count)
                started()

            supervisor.on_started = on_started
            try:
                with watching:
                    code = supervisor.run()
            finally:
                if ledger is not None:
                    ledger.ended(restarts.count, supervisor.failed_at())
            return code, supervisor.attempt_end(code)
        except StartError as error:  # workers.json says which worker, why, and the exit code
            if warning := outcome.write_exit_record(run_dir, outcome.start_failure_record(workers, error), options.exit_record):
                printer.launcher_line(warning)
            raise
    finally:
        printer.close()


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
    restarts: Restarts = NO_RESTARTS,
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
    logs_dir, beside its log (launcher/processes/torchrun_env.py); without them, both are empty.
    restarts: this attempt's number and the budget (TORCHELASTIC_RESTART_COUNT, _MAX_RESTARTS)."""
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
            gpu=placement.visible_devices(local),
            visibility_variable=placement.visibility_variable(),
            gpu_id=gpu.id if gpu else None,
            cuda_device_index=placement.cuda_device_index(local),
            cpu_count=cpus,
            compile_cache=compile_cache,
            nnodes=layout.nnodes,
            run_id=torchrun_env.run_id(run_dir) if run_dir is not None else "",
            error_file=torchrun_env.fresh_error_file(error_file) if error_file is not None else "",
            restarts=restarts,
        )
        workers.append(Worker(rank=rank, label=label, argv=command, env=env))
    return workers
