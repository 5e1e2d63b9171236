"""This launcher's own pulse: how long the process itself was stopped (SIGSTOP or Ctrl-Z, a
suspended job, a machine too starved to run it). A thread that only sleeps and wakes turns
every period; a gap much longer than that between two of its turns is time the whole process
did not run, measured on its own monotonic clock.

A node of several (launcher/nodes/own_silence.py, for launcher/nodes/rendezvous.py) asks this before it
blames another node for a silence, or for ending the job: a node that was itself stopped past
--node-timeout stopped answering first, and the others were right to find it lost (node 0
when node 1 was stopped, node 1 when node 0 was).
"""

from __future__ import annotations

import threading
import time

__all__ = ["Pulse"]


class Pulse:
    """The pauses of this process, as the turns of one sleeping thread see them (beat)."""

    def __init__(self, long_pause: float) -> None:
        """long_pause: the shortest gap between two turns that counts as a pause of the process."""
        self.long_pause = long_pause
        self._lock = threading.Lock()
        self._turn_at = time.monotonic()
        self._last_pause: tuple[float, float] | None = None
        """The latest long pause: (when it began, when it ended)."""

    def beat(self) -> None:
        """One turn of the sleeping thread: a gap since its last turn of long_pause or more was a pause."""
        with self._lock:
            now = time.monotonic()
            if now - self._turn_at >= self.long_pause:
                self._last_pause = (self._turn_at, now)
            self._turn_at = now

    def paused_since(self, since: float) -> float:
        """Seconds of the latest long pause that ended after since, counting one not yet ended
        (the sleeping thread has not had its turn since the process runs again); 0.0 if none."""
        with self._lock:
            ongoing = time.monotonic() - self._turn_at
            if ongoing >= self.long_pause:
                return ongoing
            if self._last_pause is not None and self._last_pause[1] > since:
                began, ended = self._last_pause
                return ended - began
            return 0.0

    @property
    def resumed_at(self) -> float:
        """When the process ran again after its latest long pause (0.0 if none yet)."""
        with self._lock:
            return self._last_pause[1] if self._last_pause is not None else 0.0
