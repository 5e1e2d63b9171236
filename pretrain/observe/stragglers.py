"""Stragglers: the rank that is persistently slower than the others, named in one line.

Each rank times its own compute in every step: the forward and loss of each of the step's
micro-batches, summed. Under DDP no collective runs there (DDP all-reduces gradients during the
last micro-batch's backward, and broadcasts no buffers), so a fast rank's figure holds no wait
for a slow one. Under FSDP2 each group's forward starts by all-gathering its weights, where a
fast rank waits for a slow one: the timing leaves those stretches out (exclude_collectives wraps
each FSDP parameter group's pre_forward, its all-gather and the wait for it, in a pause of the
timer), so what is left is again the rank's own work and the slow rank stands out. The timing
adds no device synchronization: on a GPU a pair of CUDA events around each stretch, on the
current stream, read only at a logging step, after the step line has synchronized; on a CPU
time.perf_counter. Over logging.straggler_window steps a rank keeps the median of its steps;
at the first logging step once a window is full, the ranks exchange that one number (one
all-gather of a few bytes per window) and rank 0 logs a line for each rank slower than the
median of all ranks by more than logging.straggler_threshold:

    straggler: GPU5 1.31x the median over the last 50 steps

On several nodes a rank is named as the launcher's prefixes name it there, with its node
(`straggler: r10.GPU5 (node 1) ...`: rank 10, on GPU 5 of node 1's machine), since every machine
has a GPU5. The launcher appends the GPU's throttle reasons to such a line; it finds it by the
prefix `straggler: <label> `, the label its own worker lines carry. docs/training.md#stragglers
says what the figure is on a GPU and on a CPU."""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from pretrain.config import Config
from pretrain.distributed.runtime import Runtime

LABEL_BYTES = 16
"""A rank's label ("GPU5", "CPU12") travels with its median, as character codes."""
PREFIX = "straggler: "
T = TypeVar("T")


class StepTimer(Protocol):
    """A rank's compute time per step, from intervals opened and closed within each step."""

    def new_step(self) -> None: ...
    def begin(self) -> None: ...
    def end(self) -> None: ...
    def is_open(self) -> bool:
        """Whether an interval is open: begun and not yet ended."""
        ...

    def drain(self) -> list[float]:
        """The seconds of each step since the last drain, oldest first."""
        ...


@dataclass
class HostTimer:
    """On a CPU the work is done when the call returns: time.perf_counter around it."""

    keep: int
    """The most recent steps kept between drains (the window: older ones would not be used)."""
    steps: deque[float] = field(init=False)
    began: float | None = None
    """When the open interval began; None while none is open."""

    def __post_init__(self) -> None:
        self.steps = deque(maxlen=self.keep)

    def new_step(self) -> None:
        self.steps.append(0.0)

    def begin(self) -> None:
        self.began = time.perf_counter()

    def end(self) -> None:
        assert self.began is not None
        self.steps[-1] += time.perf_counter() - self.began
        self.began = None

    def is_open(self) -> bool:
        return self.began is not None

    def drain(self) -> list[float]:
        drained = list(self.steps)
        self.steps.clear()
        return drained


@dataclass
class CudaTimer:
    """On a GPU the host runs ahead of the kernels: a CUDA event pair around each interval, on
    the current stream, read at drain(), which the caller makes only after a synchronization
    (the step line's), so elapsed_time waits for nothing. Drained events are used again, so a
    step with many intervals (two per FSDP group per micro-batch) creates no new ones."""

    keep: int
    """The most recent steps kept between drains (the window), so a long log_interval holds few events."""
    steps: deque[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = field(init=False)
    began: torch.cuda.Event | None = None
    """The open interval's start event; None while none is open."""
    spare: list[torch.cuda.Event] = field(default_factory=list)
    """Events read at a drain, to record again."""

    def __post_init__(self) -> None:
        self.steps = deque(maxlen=self.keep)

    def new_step(self) -> None:
        self.steps.append([])

    def _recorded(self) -> torch.cuda.Event:
        event = self.spare.pop() if self.spare else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        self.began = self._recorded()

    def end(self) -> None:
        assert self.began is not None
        self.steps[-1].append((self.began, self._recorded()))
        self.began = None

    def is_open(self) -> bool:
        return self.began is not None

    def drain(self) -> list[float]:
        drained = list(self.steps)
        self.steps.clear()
        if drained and drained[-1]:
            drained[-1][-1][1].synchronize()  # already done after the step line's sync: returns at once
        seconds = [sum(start.elapsed_time(stop) for start, stop in pairs) / 1000 for pairs in drained]
        self.spare.extend(event for pairs in drained for pair in pairs for event in pair)
        return seconds


def slower_ranks(medians: Sequence[tuple[str, float]], threshold: float) -> list[tuple[str, float]]:
    """(label, ratio to the median of all ranks) of every rank above threshold times that median, slowest first."""
    middle = statistics.median(seconds for _, seconds in medians)
    if middle <= 0:
        return []
    slow = [(label, seconds / middle) for label, seconds in medians if seconds > threshold * middle]
    return sorted(slow, key=lambda named: -named[1])


def straggler_line(label: str, ratio: float, steps: int) -> str:
    return f"{PREFIX}{label} {ratio:.2f}x the median over the last {steps} steps"


def short_label(runtime_label: str) -> str:
    """A rank as the launcher's line prefixes name it: "GPU 5" -> "GPU5"."""
    return runtime_label.replace(" ", "")


def on_nodes(medians: Sequence[tuple[str, float]], per_node: int) -> list[tuple[str, float]]:
    """Several nodes: each rank's (label, median) named as the launcher names the rank's worker
    (r10.GPU5 for a GPU, whose number is the same on every machine; CPU10, a global rank already)
    and its node (rank // workers per node, as the launcher numbers them)."""
    return [
        (f"{label if label.startswith('CPU') else f'r{rank}.{label}'} (node {rank // per_node})", seconds)
        for rank, (label, seconds) in enumerate(medians)
    ]


def exchange(seconds: float, runtime: Runtime) -> list[tuple[str, float]]:
    """Every rank's (label, median seconds), in rank order: one all-gather of 1 + LABEL_BYTES
    float64 values per rank (136 bytes), on the device the process group reduces there."""
    codes = short_label(runtime.label).encode()[:LABEL_BYTES].ljust(LABEL_BYTES, b"\0")
    mine = torch.tensor([seconds, *codes], dtype=torch.float64, device=runtime.device)  # (1 + LABEL_BYTES,)
    gathered = [torch.empty_like(mine) for _ in range(runtime.world_size)]
    dist.all_gather(gathered, mine)
    rows = torch.stack(gathered).tolist()  # (world, 1 + LABEL_BYTES); one host read per window
    return [(bytes(int(code) for code in row[1:]).rstrip(b"\0").decode(), row[0]) for row in rows]


@dataclass
class StragglerWatch:
    """This rank's compute times over the current window, and the exchange that ends a window."""

    window: int
    threshold: float
    timer: StepTimer
    seconds: list[float] = field(default_factory=list)
    """The compute time of each step of the window so far (the last `window` steps at most)."""
    per_node: int | None = None
    """On several nodes, each node's workers (the line then names each rank's node); None on one."""
    warning: str | None = None
    """A line rank 0 logs at the first logging step (the FSDP all-gathers could not be left out), then None."""

    def at_logging_step(self, runtime: Runtime, log_warning: Callable[[str], None]) -> None:
        """Called by every rank at every logging step, after the step line: once a window is full,
        the exchange, and rank 0's line for each straggler; then the next window starts."""
        if self.warning is not None:
            if runtime.is_main:
                log_warning(self.warning)
            self.warning = None
        self.seconds = (self.seconds + self.timer.drain())[-self.window :]
        if len(self.seconds) < self.window:
            return
        medians = exchange(statistics.median(self.seconds), runtime)
        self.seconds = []
        if self.per_node is not None:
            medians = on_nodes(medians, self.per_node)
        if runtime.is_main:
            for label, ratio in slower_ranks(medians, self.threshold):
                log_warning(straggler_line(label, ratio, self.window))


def watch_for(config: Config, runtime: Runtime, model: nn.Module | None = None) -> StragglerWatch | None:
    """The watch of this rank; None with one rank (nobody to compare with) or logging.straggler_window=0.
    Under FSDP2 (model holds FSDP modules) its timer leaves the forward's all-gathers out."""
    window = config.logging.straggler_window
    if not runtime.distributed or window == 0:
        return None
    timer: StepTimer = CudaTimer(window) if runtime.device.type == "cuda" else HostTimer(window)
    watch = StragglerWatch(window, config.logging.straggler_threshold, timer, per_node=per_node(os.environ, runtime.world_size))
    if model is not None and exclude_collectives(model, timer) is None:
        watch.warning = (
            f"Stragglers under FSDP: torch {torch.__version__}'s FSDP2 does not expose its parameter groups' pre_forward, "
            "so each rank's figure includes waiting in the others' all-gathers and a slow rank is not named"
        )
    return watch


def exclude_collectives(model: nn.Module, timer: StepTimer) -> int | None:
    """Under FSDP2, leave each parameter group's pre_forward out of the timer's intervals: there
    the group's all-gather is issued and waited for (on a CPU gloo blocks the host until every
    rank has joined it; on a GPU the current stream waits for the all-gather stream), and its
    output copied out. The number of groups wrapped (0 for a model without FSDP2), or None when
    this torch's FSDP2 does not have them where torch 2.13 keeps them (nothing is wrapped then).
    The wrapper runs inside FSDP2's own forward pre-hook, which torch.compile never traces, so it
    adds no graph break; outside an open interval (evaluation, a checkpointed block recomputed in
    the backward) it only calls through."""
    states = {
        id(state): state for module in model.modules() if isinstance(module, FSDPModule) for state in [module._get_fsdp_state()]
    }
    groups = [group for state in states.values() for group in getattr(state, "_fsdp_param_groups", [None])]
    if any(group is None or not callable(getattr(group, "pre_forward", None)) for group in groups):
        return None
    for group in groups:
        group.pre_forward = paused_around(group.pre_forward, timer)
    return len(groups)


def paused_around(gather: Callable[..., T], timer: StepTimer) -> Callable[..., T]:
    """gather with the timer's open interval, if one is, ended before it and a new one begun after."""

    @functools.wraps(gather)
    def paused(*args: object, **kwargs: object) -> T:
        if not timer.is_open():
            return gather(*args, **kwargs)
        timer.end()
        try:
            return gather(*args, **kwargs)
        finally:
            timer.begin()

    return paused


def per_node(env: Mapping[str, str], world_size: int) -> int | None:
    """Each node's workers when the job has several nodes (GROUP_WORLD_SIZE and LOCAL_WORLD_SIZE,
    as torchrun and the launcher set them), else None."""
    try:
        nodes, local = int(env.get("GROUP_WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", str(world_size)))
    except ValueError:
        return None
    return local if nodes > 1 and local > 0 else None
