"""A graceful stop: SIGTERM or SIGINT asks the training loop to finish its current step,
save a checkpoint and exit with 128 + the signal. A second signal, a second or more after
the first, ends the process at once: one sooner is the same request arriving twice (Slurm
signals every process of a job, and the launcher forwards its own SIGTERM as well).

The launcher sends SIGTERM on Ctrl-C; a scheduler (Slurm, Kubernetes) sends it before a
preemption. The signal can reach the ranks between two different steps, so after every
step the ranks agree (one tiny all-reduce) and all stop after the same one."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from pretrain.runtime import Runtime

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_AFTER_SECONDS = 1.0


class Stopped(Exception):
    """Training stopped on request after a checkpoint was saved."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._received_at = 0.0

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
        elif now - self._received_at >= REPEAT_AFTER_SECONDS:  # asked again: end now, as the signal would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def agreed(self, runtime: Runtime) -> int | None:
        """The stop signal if any rank received one, else None. A collective: every rank
        calls it at the same point of every step."""
        if not runtime.distributed:
            return self.signum
        flag = torch.tensor([self.signum or 0], device=runtime.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None
