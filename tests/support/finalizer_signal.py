"""For the child scripts of the tests of stop signals that land in a finalizer (where Python drops
what a handler raises): the finalizer that takes SIGTERM, and the wait for the stop it should
still cause. The scripts import it with the tests folder on PYTHONPATH (finalizer_env)."""

from __future__ import annotations

import os
import signal
import time

from support.processes import ROOT, TESTS, launcher_env


class _TakesSigterm:
    def __del__(self) -> None:
        signal.raise_signal(signal.SIGTERM)


def sigterm_inside_a_finalizer() -> None:
    """Run a __del__ that takes SIGTERM: signal.raise_signal runs the Python handler at once, inside
    the finalizer, as a SIGTERM from outside does when it arrives while a weakref callback of the
    import system's module locks runs."""
    _TakesSigterm()  # never bound: finalized here


def wait_for_the_stop(seconds: float = 30.0) -> None:
    """Wait for the stop the signal should have caused; print "not stopped" if it never comes."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)
    print("not stopped", flush=True)


def finalizer_env() -> dict[str, str]:
    """The launcher's environment with the tests folder importable too (for this module)."""
    return launcher_env() | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
