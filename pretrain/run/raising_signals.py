"""Stop signals that raise an exception in the main thread, and are not lost where Python drops it.

A Python signal handler runs between two bytecodes of the main thread, wherever it is. When that
is inside a finalizer (a `__del__` method, or a weakref callback, as the import system's module
locks use), Python cannot let an exception out of it: it prints "Exception ignored in ..." and
goes on. A stop that a handler raised there was lost, and the process ran on as if no signal had
come (a dataset build under a load of other processes: SIGTERM, then the whole build, then a
timeout). So while the signals raise, sys.unraisablehook watches for the exceptions they raised,
and sends the same signal again once the finalizer is over; it then raises where it can propagate.

Standard library only: the launcher uses it between attempts (launcher/attempts.py), the dataset
build around its temporary directory (pretrain/data/cache.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

AGAIN_AFTER_S = 0.05
"""How long after a stop was dropped the signal is sent again: long enough for the finalizer
that dropped it to end, short beside any stop's own time."""


@contextmanager
def signals_raise(signals: Iterable[int], stop: Callable[[int], BaseException]) -> Iterator[None]:
    """Within (in the main thread): each of signals raises stop(signum), every time it comes. One
    that Python drops in a finalizer is sent again AGAIN_AFTER_S later, and raises then; it is not
    printed. The previous handlers and unraisable hook come back afterwards."""
    raised: list[tuple[BaseException, int]] = []
    """Each exception a handler raised, and its signal."""
    again: list[threading.Timer] = []

    def handler(signum: int, _frame: object) -> None:
        exception = stop(signum)
        raised.append((exception, signum))
        raise exception

    previous_hook = sys.unraisablehook

    def dropped(report: sys.UnraisableHookArgs) -> None:
        signum = next((sig for exception, sig in raised if exception is report.exc_value), None)
        if signum is None:
            previous_hook(report)
            return
        timer = threading.Timer(AGAIN_AFTER_S, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        again.append(timer)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    sys.unraisablehook = dropped
    try:
        yield
    finally:
        for timer in again:
            timer.cancel()
        sys.unraisablehook = previous_hook
        for sig, old in previous.items():
            signal.signal(sig, old)
