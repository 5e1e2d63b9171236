"""Rule 5 of launcher/supervise/supervisor.py: a job of several nodes, with the other nodes played by a
fake (the real ones, through node 0's store, are in tests/launcher/nodes/test_multinode.py)."""

from __future__ import annotations

import io
import os
import signal
import threading
from collections.abc import Callable

from launcher.exit_codes import EXIT_NODE_LOST, EXIT_OTHER_NODE_FAILED
from launcher.nodes.node import NodeInterrupt, NodeStop
from launcher.supervise.printer import Printer
from launcher.supervise.supervisor import Supervisor, SupervisorOptions
from test_supervisor import FAILS_WITH_7, SLEEPS, make_worker

NODE_1_FAILED = NodeStop(1, "gpu-b", "failed", "exit code 9", "CPU3", 3, 9)


class OtherNodes:
    """The other nodes: they may have stopped the job already (earlier), and record what this
    node tells them; stop_when_ready() has them stop the job once this node's workers are up."""

    def __init__(self, earlier: NodeStop | None = None) -> None:
        self.earlier = earlier
        self.told: list[tuple[str, int, int, str]] = []
        self.emit: Callable[[NodeStop | NodeInterrupt], None] | None = None
        self.interrupts: list[int] = []
        self.interrupt: NodeInterrupt | None = None

    def on_stop(self, emit: Callable[[NodeStop], None]) -> None:
        self.emit = emit

    def report_failure(self, label: str, rank: int, exit_code: int, how: str) -> NodeStop | None:
        self.told.append((label, rank, exit_code, how))
        return self.earlier

    def report_interrupt(self, signum: int) -> None:
        self.interrupts.append(signum)

    def interrupted(self) -> NodeInterrupt | None:
        return self.interrupt


def failing_and_sleeping(script) -> list:
    """CPU0 exits 7 once CPU1 is up."""
    return [make_worker(0, script(FAILS_WITH_7, "fails.py")), make_worker(1, script(SLEEPS, "sleeps.py"))]


def run(workers, tmp_path, peers: OtherNodes, **options) -> tuple[int, str]:
    console = io.StringIO()
    (tmp_path / "logs").mkdir(exist_ok=True)
    supervisor = Supervisor(
        workers, Printer(console, tmp_path / "logs"), SupervisorOptions(kill_grace=2.0, **options), peers=peers
    )
    return supervisor.run(), console.getvalue()


def test_this_nodes_first_failure_is_told_to_the_other_nodes_and_decides_its_exit_code(tmp_path, script):
    peers = OtherNodes()
    code, out = run(failing_and_sleeping(script), tmp_path, peers)
    assert code == 7
    assert peers.told == [("CPU0", 0, 7, "exit code 7")]
    assert "told the other nodes to stop" in out and "FAILED: CPU0 (rank 0) failed first" in out


def test_a_failure_here_after_another_nodes_is_a_consequence_and_exits_75(tmp_path, script):
    peers = OtherNodes(earlier=NODE_1_FAILED)
    code, out = run(failing_and_sleeping(script), tmp_path, peers)
    assert code == EXIT_OTHER_NODE_FAILED
    assert "STOPPED: node 1 (gpu-b) failed first: CPU3 (rank 3) exit code 9." in out
    assert "CPU0 here failed after that (exit code 7): a consequence." in out
    assert "FAILED:" not in out


def test_the_same_agreed_exit_code_on_every_node_is_every_nodes_exit_code(tmp_path, script):
    peers = OtherNodes(earlier=NodeStop(1, "gpu-b", "failed", "exit code 7", "CPU3", 3, 7))
    code, out = run(failing_and_sleeping(script), tmp_path, peers, agreed_exit_codes=frozenset({7}))
    assert code == 7 and "STOPPED" not in out


def test_another_nodes_word_stops_every_worker_here_and_exits_75(tmp_path, script):
    peers = OtherNodes()
    ready = tmp_path / "peer-ready"
    workers = [make_worker(0, script(SLEEPS, "a.py")), make_worker(1, script(SLEEPS, "b.py"))]

    def stop_once_ready() -> None:
        while not ready.exists() or peers.emit is None:
            threading.Event().wait(0.01)
        peers.emit(NODE_1_FAILED)

    threading.Thread(target=stop_once_ready, daemon=True).start()
    code, out = run(workers, tmp_path, peers)
    assert code == EXIT_OTHER_NODE_FAILED
    assert "node 1 (gpu-b) failed first: CPU3 (rank 3) exit code 9; stopping this node's 2 worker(s)" in out
    assert "Exit code 75: another node failed." in out
    assert peers.told == []  # the workers it stopped are no failure of this node's


def test_a_lost_node_stops_every_worker_here_and_exits_76(tmp_path, script):
    peers = OtherNodes()
    ready = tmp_path / "peer-ready"
    lost = NodeStop(1, "gpu-b", "lost", "its launcher stopped answering 3.0 s ago")

    def stop_once_ready() -> None:
        while not ready.exists() or peers.emit is None:
            threading.Event().wait(0.01)
        peers.emit(lost)

    threading.Thread(target=stop_once_ready, daemon=True).start()
    code, out = run([make_worker(0, script(SLEEPS, "a.py"))], tmp_path, peers)
    assert code == EXIT_NODE_LOST
    assert "STOPPED: node 1 (gpu-b) was lost: its launcher stopped answering 3.0 s ago." in out


# Stops on SIGTERM as a training worker does (exit 143), once its peer is up.
STOPS_ON_SIGTERM = """
    import signal, sys, time
    from pathlib import Path
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print("up", flush=True)
    Path(__file__).with_name("peer-ready").touch()
    time.sleep(60)
"""


def test_another_node_asked_to_stop_stops_this_node_gracefully_with_the_same_code(tmp_path, script):
    peers = OtherNodes()
    ready = tmp_path / "peer-ready"

    def interrupt_once_ready() -> None:
        while not ready.exists() or peers.emit is None:
            threading.Event().wait(0.01)
        peers.emit(NodeInterrupt(0, signal.SIGINT))

    threading.Thread(target=interrupt_once_ready, daemon=True).start()
    code, out = run([make_worker(0, script(STOPS_ON_SIGTERM, "a.py"))], tmp_path, peers, stop_leaders_only=True)
    assert code == 128 + signal.SIGINT
    assert "node 0 was asked to stop (SIGINT); so is this node" in out and "FAILED" not in out
    assert peers.interrupts == []  # not told back


def test_a_worker_stopped_as_asked_before_the_word_arrives_is_no_failure(tmp_path, script):
    """The ranks agree on the step to stop at: this node's worker may exit 143 before its
    launcher hears that another node was interrupted."""
    peers = OtherNodes()
    peers.interrupt = NodeInterrupt(0, signal.SIGTERM)
    code, out = run([make_worker(0, script("import sys; sys.exit(143)", "a.py"))], tmp_path, peers)
    assert code == 128 + signal.SIGTERM
    assert "FAILED" not in out and peers.told == []


def test_this_nodes_own_stop_signal_is_told_to_the_other_nodes(tmp_path, script):
    peers = OtherNodes()
    ready = tmp_path / "peer-ready"

    def signal_once_ready() -> None:
        while not ready.exists():
            threading.Event().wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_once_ready, daemon=True).start()
    code, _ = run([make_worker(0, script(STOPS_ON_SIGTERM, "a.py"))], tmp_path, peers, stop_leaders_only=True)
    assert code == 128 + signal.SIGTERM
    assert peers.interrupts == [signal.SIGTERM]
