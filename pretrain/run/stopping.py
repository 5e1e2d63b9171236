"""A graceful stop: SIGTERM, SIGINT or SIGHUP asks the training loop to finish its current
step, save a checkpoint and exit with the signal's exit code (pretrain/run/exit_codes.py by_signal).
A second SIGTERM or SIGINT, a second or more after the first, ends the process at once: one
sooner is the same request arriving twice (Slurm signals every process of a job, and the
launcher forwards its own SIGTERM as well).
A SIGHUP never ends it at once: a terminal that closes is no request to hurry, and its hang-up
can arrive more than once.

The launcher sends SIGTERM on Ctrl-C; a scheduler (Slurm, Kubernetes) sends it before a
preemption. The signal can reach the ranks between two different steps, so every step the
ranks agree and all stop after the same one. With debug.check_finite (the default) the
agreement rides on the finite check's all-reduce (pretrain/numerics/debug.py agree_on_step), taken
after the backward pass: with several ranks, a signal that arrives later in a step is acted on
after the next one (or, during the last step, not at all: the run completes). Without the check, agreed()
makes its own all-reduce after the step. Either way, one host synchronization per step."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from pretrain.distributed.runtime import Runtime

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
ESCALATING = frozenset({signal.SIGTERM, signal.SIGINT})
"""The stop signals that, sent again later, end the process at once."""
REPEAT_AFTER_SECONDS = 1.0


class Stopped(Exception):
    """Training stopped on request after a checkpoint was saved."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


_UNSETTLED = object()


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        """The first stop signal this process received (None: none yet)."""
        self._received_at = 0.0
        self._settled: object = _UNSETTLED
        """What the ranks agreed on this step through another collective, until agreed() takes it."""

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Handle the stop signals inside the block; the previous handlers come back after."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._received_at = signum, now
        elif signum in ESCALATING and now - self._received_at >= REPEAT_AFTER_SECONDS:
            # Asked again: end now, as the signal would.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def settle(self, signum: int | None) -> None:
        """The ranks already agreed on this step's stop (signum, or None) through another
        collective; the next agreed() returns it and makes none of its own."""
        self._settled = signum

    def agreed(self, runtime: Runtime) -> int | None:
        """The stop signal if any rank received one, else None. Unless settle() gave this
        step's answer, a collective: every rank calls it at the same point of every step."""
        settled, self._settled = self._settled, _UNSETTLED
        if not runtime.distributed:
            return self.signum  # nothing to agree on: a signal that came after the check counts too
        if settled is not _UNSETTLED:
            return settled  # type: ignore[return-value]
        # Filled on the device from a kernel argument: torch.tensor([...], device=cuda) would be a
        # blocking host-to-device copy, a second synchronization next to .item().
        flag = torch.full((1,), self.signum or 0, dtype=torch.long, device=runtime.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None
