"""Stop signals that raise an exception in the main thread, and are not lost where Python drops it.

A Python signal handler runs between two bytecodes of the main thread, wherever it is. When that
is inside a finalizer (a `__del__` method, or a weakref callback, as the import system's module
locks use), Python cannot let an exception out of it: it prints "Exception ignored in ..." and
goes on. A stop that a handler raised there was lost, and the process ran on as if no signal had
come (a dataset build under a load of other processes: SIGTERM, then the whole build, then a
timeout). So while DroppedStops is entered, sys.unraisablehook watches for the exceptions its
handlers raised, and sends the same signal again once the finalizer is over; the handler then
raises where the exception can propagate.

Standard library only: the launcher uses it between attempts (launcher/attempts.py) and between
the rounds of several nodes (launcher/nodes/between_rounds.py), the dataset build around its
temporary directory (pretrain/data/cache.py), the launcher benchmarks for their whole process
(benchmarks/harness.py).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

AGAIN_AFTER_S = 0.05
"""How long after a stop was dropped the signal is sent again: long enough for the finalizer
that dropped it to end, short beside any stop's own time."""

Handler = Callable[[int, FrameType | None], Any]


class DroppedStops:
    """While installed (or entered): what a handler from raising() raised and Python dropped in a
    finalizer is not printed, and its signal is sent again AGAIN_AFTER_S later. uninstall() (or
    the exit) gives the previous unraisable hook back, and a signal not yet sent again is not sent."""

    def __init__(self) -> None:
        self._raised: list[tuple[BaseException, int]] = []
        self._again: list[threading.Timer] = []
        self._previous_hook = sys.unraisablehook

    def raising(self, handler: Handler) -> Handler:
        """handler, noting each exception it raises and the signal it came for."""

        @functools.wraps(handler)
        def noted(signum: int, frame: FrameType | None) -> Any:
            try:
                return handler(signum, frame)
            except BaseException as stop:
                self._raised.append((stop, signum))
                raise

        return noted

    def install(self) -> DroppedStops:
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._dropped
        return self

    def uninstall(self) -> None:
        for timer in self._again:
            timer.cancel()
        sys.unraisablehook = self._previous_hook

    def __enter__(self) -> DroppedStops:
        return self.install()

    def __exit__(self, *_: object) -> None:
        self.uninstall()

    def _dropped(self, report: Any) -> None:
        signum = next((sig for stop, sig in self._raised if stop is report.exc_value), None)
        if signum is None:
            self._previous_hook(report)
            return
        timer = threading.Timer(AGAIN_AFTER_S, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        self._again.append(timer)


@contextmanager
def signals_raise(signals: Iterable[int], stop: Callable[[int], BaseException]) -> Iterator[None]:
    """Within (in the main thread): each of signals raises stop(signum), every time it comes, also
    after a finalizer dropped it (DroppedStops). The previous handlers come back afterwards."""

    def raise_stop(signum: int, _frame: FrameType | None) -> None:
        raise stop(signum)

    with DroppedStops() as dropped:
        handler = dropped.raising(raise_stop)
        previous = {sig: signal.signal(sig, handler) for sig in signals}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
