"""What a restart runs on and resumes from, shared by the attempts of one machine
(launcher/attempts.py) and the restart rounds of several (launcher/nodes/restart_rounds.py): the
devices placed again (as many as the first attempt had, else down to --min-nproc, else waited for up
to --join-timeout), the checkpoint (the run's latest complete one, else where the first attempt
started), and the first attempt's global batch kept on another world size through gradient
accumulation; with the warning that a run without checkpoints restarts at step 0."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import UsageError
from launcher.gpus import health, vendors
from launcher.gpus.placement import GpuOptions, Placement, place
from launcher.gpus.request import DeviceError, parse_request
from launcher.gpus.selection import find
from launcher.supervise.printer import Printer
from pretrain import config as cfg

RETRY_SECONDS = 5.0
"""How often a restart that waits for its devices looks for them again."""


@dataclass
class Devices:
    """What the workers run on: the options they were chosen by, and the current placement, which
    a restart replaces (RestartPlan.place_again)."""

    options: GpuOptions
    placement: Placement


@dataclass
class RestartPlan:
    """A run's first attempt, as a restart starts from it: the devices again and the restart's config."""

    args: argparse.Namespace
    config: cfg.Config
    """The first attempt's config (its resume resolved: the exact checkpoint, or "")."""
    command: list[str]
    run_dir: Path
    console: Printer
    local_choice: Callable[[Path | None, int], Path | None] | None = None
    """Several nodes: the local checkpoint every node has that a restart on world_size workers takes
    over the durable one given (launcher/local_tier.py, agreed), None for the durable one; None: this
    machine's own local tier (pretrain/checkpoint/tiers.py, newest)."""

    @property
    def training(self) -> bool:
        return not self.command

    def place_again(self, devices: Devices, first_world: int) -> Placement:
        """Devices for the next attempt: as many as the first had, else (--min-nproc) down to M,
        else wait for them up to --join-timeout, then stop (one line)."""
        low = self.args.min_nproc or first_world
        deadline = time.monotonic() + self.args.join_timeout
        said = False
        while True:
            problems = []
            for size in range(first_world, low - 1, -1):
                try:
                    return place(sized(devices, size), self.console)
                except DeviceError as error:
                    problems.append(str(error))
            if not said:
                fewer = "" if low < first_world else " (--min-nproc M would go on with fewer)"
                self.console.launcher_line(
                    f"waiting up to {self.args.join_timeout:g} s for {first_world} free, healthy device(s) to restart on"
                    f"{fewer}; the restart asked for the run's count: {problems[0]}"
                )
                said = True
            if time.monotonic() >= deadline:
                raise DeviceError(
                    f"no restart: {problems[0]}; waited {self.args.join_timeout:g} s (--join-timeout) for "
                    f"{first_world} device(s)" + (f" or at least {low} (--min-nproc)" if low < first_world else "")
                )
            time.sleep(min(RETRY_SECONDS, max(0.0, deadline - time.monotonic())))

    def restart_config(self, world_size: int, first_world: int) -> cfg.Config:
        """The first attempt's config, resuming from restart_point() on world_size workers with the
        first attempt's global batch."""
        if not self.training:
            return self.config
        checkpoint = self.restart_point(world_size)
        training = dataclasses.replace(self.config.training, resume=str(checkpoint) if checkpoint else "")
        if world_size != first_world:
            batch = global_batch(self.config.training, first_world)
            training = dataclasses.replace(training, global_batch_size=batch)
            self.console.launcher_line(
                f"{world_size} worker(s) instead of {first_world}: the global batch stays {batch} sequences "
                "(more gradient accumulation per worker)"
            )
        return dataclasses.replace(self.config, training=training)

    def restart_point(self, world_size: int) -> Path | None:
        """The checkpoint a restart on world_size workers resumes from, said in a line: the run
        directory's latest complete one if it is newer than where the first attempt started, else
        where the first attempt started (a checkpoint --resume named, maybe another run's; refused
        in one line if it is no longer complete), else none: step 0, with training.init_from's
        weights if it names some. A newer checkpoint of the run passed over as damaged is named, as
        `--resume auto` names it."""
        from pretrain.checkpoint import tiers
        from pretrain.checkpoint.resume import ResumeError, checkpoint_at, damaged, latest

        say = self.console.launcher_line
        first = Path(self.config.training.resume) if self.config.training.resume else None
        durable = latest(self.run_dir / "checkpoints", world_size)
        if self.local_choice is not None:
            local = self.local_choice(durable, world_size)
            own = local if local is not None and (durable is None or tiers.steps_of(local) > tiers.steps_of(durable)) else durable
        else:
            local_dir = tiers.local_dir_of(self.config, self.run_dir, tiers.NodePlace())
            own = tiers.newest(self.run_dir / "checkpoints", local_dir, world_size, say)
        # Later local ones (damaged, or not on every node) are of the continuation this restart
        # abandons: each node's launcher removes them as it takes its local tier (launcher/local_tier.py).
        checkpoint = own.resolve() if own is not None else None
        if first is not None and (checkpoint is None or steps_of(checkpoint) <= steps_of(first)):
            try:
                checkpoint = checkpoint_at(first, world_size)
            except ResumeError as error:
                raise ResumeError(
                    f"the checkpoint the run started from cannot be resumed any more: {error}; put it back, "
                    "or continue the run from another with --resume"
                ) from None
        for skipped in damaged(self.run_dir / "checkpoints", steps_of(checkpoint) if checkpoint else -1, world_size):
            say(f"warning: not resuming from the later {skipped}")
        if checkpoint is not None:
            where = " (where the run started: it has no newer complete checkpoint)" if checkpoint == first else ""
            in_local = own is not None and checkpoint == own.resolve() and own.parent != self.run_dir / "checkpoints"
            tier = " (local)" if in_local else ""
            say(f"resuming from {checkpoint}{tier}{where}")
        elif init_from := self.config.training.init_from:
            say(f"no complete checkpoint yet: starting again at step 0 from training.init_from's weights ({init_from})")
        else:
            say("no complete checkpoint yet: starting again at step 0")
        return checkpoint


def sized(devices: Devices, size: int) -> GpuOptions:
    """The first attempt's device options, asking for size workers: CPU workers, the size freest
    healthy GPUs, or, where --gpus (or system.device_id) named the GPUs, the first size of those
    that pass their health check now (DeviceError when fewer do)."""
    options = devices.options
    if devices.placement.device == "cpu":
        return dataclasses.replace(options, nproc=size)
    named = parse_request(options.gpus).ids if options.gpus is not None else ()
    if options.device_id is not None:
        named = (str(options.device_id),)
    if not named:
        return dataclasses.replace(options, gpus=f"auto:{size}", nproc=None)
    gpus = vendors.backend(options.gpu_vendor).discover(window=0)
    failing = {name: health.assess(find(gpus, name, "--gpus names").health) for name in named}
    healthy = [name for name in named if failing[name].healthy]
    if len(healthy) < size:
        reasons = "; ".join(f"GPU {name}: {a.describe()}" for name, a in failing.items() if not a.healthy)
        raise DeviceError(f"{len(healthy)} of the {len(named)} GPUs --gpus names pass their health check ({reasons})")
    return dataclasses.replace(options, gpus=",".join(healthy[:size]), device_id=None, nproc=None)


def warn_without_checkpoints(config: cfg.Config, say: Callable[[str], None]) -> None:
    """A run that saves no checkpoint before its end restarts at step 0: say so before it starts."""
    if config.training.checkpoint_interval == 0:
        say(
            "warning: training.checkpoint_interval is 0 (no checkpoint before the end): a restart starts again "
            "at step 0; set it (e.g. --set training.checkpoint_interval=100) to restart from the last checkpoint"
        )


def check_global_batch_kept(
    training: cfg.TrainingConfig, world_size: int, sizes: range, option: str, unit: str, per_unit: int = 1
) -> None:
    """A restart onto `size` units (workers, or nodes of per_unit workers) for each size in sizes keeps
    the global batch the first attempt trains on world_size ranks, or this refuses it in one line."""
    batch = global_batch(training, world_size)
    for size in sizes:  # under grad_accum_nums "auto" the plan fits the micro-batch to each size's share
        auto = training.grad_accum_nums == "auto"
        micro = 1 if auto else training.batch_size
        if batch % (micro * per_unit * size):
            rule = (
                f"not a multiple of {per_unit * size}: grad_accum_nums auto shares it equally over the workers"
                if auto
                else f"not a multiple of training.batch_size {training.batch_size} x {per_unit * size}"
            )
            raise UsageError(
                f"{option} {sizes.start}: the global batch of {batch} sequences cannot be kept on {size} {unit}"
                f" ({rule}); raise {option}, or set training.global_batch_size to a multiple of every such product"
            )


def global_batch(training: cfg.TrainingConfig, world_size: int) -> int:
    """Sequences per optimizer step over all ranks, as the first attempt trains them."""
    return training.global_batch_size or training.batch_size * cfg.grad_accum_nums(training) * world_size


def steps_of(checkpoint: Path) -> int:
    """The steps a checkpoint holds (its state.json's steps_done; -1 when it cannot be read)."""
    try:
        steps = json.loads((checkpoint / "state.json").read_text(encoding="utf-8"))["steps_done"]
    except (OSError, ValueError, KeyError, TypeError):
        return -1
    return steps if isinstance(steps, int) else -1
