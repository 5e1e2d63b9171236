"""Stop signals that raise (pretrain/run/raising_signals.py): one that lands in a finalizer, where
Python drops what it raises, still stops the block; what others' finalizers raise is still printed.
Each in a process of its own, so that its signal handlers and hooks are its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from support.finalizer_signal import finalizer_env
from support.processes import ROOT

FINALIZER_TAKES_THE_SIGNAL = """
import signal, sys
from pretrain.data.cache import sigterm_as_exit
from support.finalizer_signal import sigterm_inside_a_finalizer, wait_for_the_stop
try:
    with sigterm_as_exit():
        sigterm_inside_a_finalizer()
        wait_for_the_stop()
except SystemExit as stopped:
    restored = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, sys.unraisablehook is sys.__unraisablehook__
    print("stopped", stopped.code, *restored)
"""


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=finalizer_env(), capture_output=True, text=True, timeout=60
    )


def test_a_stop_signal_that_lands_in_a_finalizer_still_stops_the_block_with_its_exit_code():
    result = run(FINALIZER_TAKES_THE_SIGNAL)
    assert result.stdout.splitlines() == ["stopped 143 True True"], result.stdout + result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr  # the dropped stop was ours: not printed


def test_what_another_finalizer_raises_is_still_printed_and_a_signal_after_it_still_stops():
    code = """
        import os, signal, sys
        from pretrain.run.raising_signals import signals_raise
        class Broken:
            def __del__(self):
                raise ValueError("a finalizer's own error")
        try:
            with signals_raise([signal.SIGHUP], lambda signum: SystemExit(128 + signum)):
                Broken()
                os.kill(os.getpid(), signal.SIGHUP)
                print("not stopped", flush=True)
        except SystemExit as stopped:
            print("stopped", stopped.code)
    """
    result = run(code)
    assert result.stdout.splitlines() == ["stopped 129"], result.stdout + result.stderr
    assert "Exception ignored" in result.stderr and "ValueError: a finalizer's own error" in result.stderr
