"""Between the rounds of several nodes (launcher/nodes/between_rounds.py): a stop signal that lands
in a finalizer, where Python drops what the handler raises, still halts the stretch (sent again by
pretrain/run/raising_signals.py). In a process of its own, so that its handlers and hooks are its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from support.finalizer_signal import finalizer_env
from support.processes import ROOT

STRETCH_TAKES_A_SIGNAL_IN_A_FINALIZER = """
import sys
from launcher.nodes.between_rounds import BetweenRounds, Halted
from support.finalizer_signal import sigterm_inside_a_finalizer, wait_for_the_stop
try:
    with BetweenRounds(lambda: None, 1, 3):  # no store to watch: the signal alone halts it
        sigterm_inside_a_finalizer()
        wait_for_the_stop()
except Halted as halted:
    print("halted", halted.halt.node, halted.halt.name, halted.here, sys.unraisablehook is sys.__unraisablehook__)
"""


def test_a_stop_signal_that_lands_in_a_finalizer_between_rounds_still_halts_the_stretch():
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(STRETCH_TAKES_A_SIGNAL_IN_A_FINALIZER)],
        cwd=ROOT,
        env=finalizer_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.splitlines() == ["halted 1 SIGTERM True True"], result.stdout + result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr
