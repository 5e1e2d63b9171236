"""A node's launcher frozen (SIGSTOP: Ctrl-Z, a suspended job, a starved machine) past
--node-timeout, then resumed (issue 28, item 9): the other node stops the job naming the frozen
node, and the frozen node, once it runs again, says that it was the one that stopped answering,
not that the other node was lost or failed; both exit 76. Node 1 frozen, then node 0 frozen
(node 0 frozen until node 1 has ended is in tests/launcher/nodes/test_multinode.py)."""

from __future__ import annotations

import re
import signal
import time

import psutil
import pytest

from support.processes import launcher_env, wait_until
from launcher.exit_codes import EXIT_NODE_LOST
from launcher.nodes.pulse import Pulse
from launcher.nodes.rendezvous import BEAT_INTERVAL
from support.nodes import NodeRun, start_nodes, worker_command

# A node's worker, when asked (HOLD_NODE), holds its launcher in its teardown (it ignores SIGTERM)
# until the test releases it: node 0's store still answers when node 1 runs again, or node 1's
# launcher still runs when node 0 does. A worker fails (exit 3) when the test says so (fail<node>),
# as one whose collective lost its peer does.
WORKER = """
import os, pathlib, signal, sys, time
shared = pathlib.Path(sys.argv[1])
if os.environ["NODE_RANK"] == os.environ.get("HOLD_NODE"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
(shared / f"partial-up{os.environ['RANK']}").write_text(str(os.getpid()))
(shared / f"partial-up{os.environ['RANK']}").rename(shared / f"up{os.environ['RANK']}")  # whole when the test reads it
deadline = time.monotonic() + 120
release = [shared / "release", shared / f"release{os.environ['NODE_RANK']}"]  # every node's workers, or one node's
while not any(path.exists() for path in release) and time.monotonic() < deadline:
    if (shared / f"fail{os.environ['NODE_RANK']}").exists():
        sys.exit(3)
    time.sleep(0.02)
"""
NODE_1_LOST = re.compile(r"STOPPED: node 1 \(.*\) was lost: its launcher stopped answering")
FROZEN = re.compile(
    r"this node, node 1 \(.*\), stopped answering for (\d+\.\d) s \(frozen, suspended or starved; --node-timeout 1 s\)"
)


@pytest.fixture
def worker(tmp_path) -> list[str]:
    return worker_command(tmp_path, WORKER)


def frozen_node_1(tmp_path, processes, worker, hold_node_0: bool) -> tuple[NodeRun, NodeRun, float]:
    """Both nodes' workers up, then node 1's launcher stopped until node 0 has found it lost (and,
    unless node 0's worker holds it, ended); node 1 runs again. How long node 1 was stopped."""
    env = launcher_env(HOLD_NODE="0" if hold_node_0 else "")
    options = ["--nproc", "1", "--node-timeout", "1", "--kill-grace", "60", *worker]
    node0, node1 = start_nodes(tmp_path, processes, options, env=env)
    both_up = lambda: len(list((tmp_path / "shared").glob("up*"))) == 2  # noqa: E731
    assert wait_until(lambda: both_up() or node0.proc.poll() is not None or node1.proc.poll() is not None, timeout=120)
    assert both_up(), node0.text + node1.text
    node1.proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        if hold_node_0:
            assert wait_until(lambda: "was lost" in node0.text, timeout=60), node0.text
        else:
            assert wait_until(lambda: node0.proc.poll() is not None, timeout=60), node0.text
    finally:
        node1.proc.send_signal(signal.SIGCONT)
    return node0, node1, time.monotonic() - stopped_at


@pytest.mark.parametrize("hold_node_0", [True, False], ids=["node 0 still up", "node 0 ended"])
def test_a_node_frozen_past_the_node_timeout_says_it_stopped_answering_and_exits_76(tmp_path, processes, worker, hold_node_0):
    node0, node1, frozen_for = frozen_node_1(tmp_path, processes, worker, hold_node_0)
    if hold_node_0:
        assert wait_until(lambda: FROZEN.search(node1.text) is not None or node1.proc.poll() is not None, timeout=60)
        (tmp_path / "shared" / "release").write_text("")
    code1 = node1.wait(timeout=60)
    (tmp_path / "shared" / "release").write_text("")
    assert node0.wait(timeout=60) == EXIT_NODE_LOST, node0.text
    assert NODE_1_LOST.search(node0.text), node0.text
    assert code1 == EXIT_NODE_LOST, node1.text
    said = FROZEN.search(node1.text)
    assert said is not None, node1.text
    # At least the pause that counts as frozen (--node-timeout less a beat: node 0 counts from node 1's
    # last beat, which may come up to a beat before the freeze, more under load), at most the freeze.
    assert 1.0 - BEAT_INTERVAL <= float(said[1]) <= frozen_for + 1.0, (said[0], frozen_for)
    ending = "node 0 found it lost and stopped the job" if hold_node_0 else "node 0 found it lost and ended the job meanwhile"
    assert f"STOPPED: {said[0]}: {ending}" in node1.text, node1.text
    assert "Exit code 76: a node was lost." in node1.text
    assert "node 0 (" not in node1.text and "was lost:" not in node1.text, node1.text


def test_node_0_killed_is_still_blamed_on_node_1_which_was_not_frozen(tmp_path, processes, worker):
    node0, node1 = start_nodes(tmp_path, processes, ["--nproc", "1", "--node-timeout", "1", "--kill-grace", "60", *worker])
    both_up = lambda: len(list((tmp_path / "shared").glob("up*"))) == 2  # noqa: E731
    assert wait_until(lambda: both_up() or node0.proc.poll() is not None or node1.proc.poll() is not None, timeout=120)
    assert both_up(), node0.text + node1.text
    node0.proc.send_signal(signal.SIGKILL)
    assert node1.wait(timeout=60) == EXIT_NODE_LOST, node1.text
    assert re.search(r"STOPPED: node 0 \(.*\) was lost: its launcher closed the rendezvous connection", node1.text), node1.text
    assert "this node" not in node1.text.split("all 2 nodes joined")[-1].replace("this node's", ""), node1.text


NODE_0_LOST = re.compile(r"node 0 \(.*\) was lost: its launcher stopped answering")
NODE_0_FROZEN = re.compile(
    r"STOPPED: this node, node 0 \(.*\), stopped answering for (\d+\.\d) s \(frozen, suspended or starved; "
    r"--node-timeout 1 s\): the other nodes found it lost and stopped the job\."
)


def frozen_node_0(tmp_path, processes, worker, fail_worker: bool = False) -> tuple[NodeRun, NodeRun, float]:
    """Both nodes' workers up, then node 0's launcher stopped until node 1 (its worker holding it
    in the teardown) has found it lost, and, if fail_worker, node 0's worker has failed; node 0
    runs again. How long it was stopped."""
    options = ["--nproc", "1", "--node-timeout", "1", "--kill-grace", "60", *worker]
    node0, node1 = start_nodes(tmp_path, processes, options, env=launcher_env(HOLD_NODE="1"))
    both_up = lambda: len(list((tmp_path / "shared").glob("up*"))) == 2  # noqa: E731
    assert wait_until(lambda: both_up() or node0.proc.poll() is not None or node1.proc.poll() is not None, timeout=120)
    assert both_up(), node0.text + node1.text
    node0.proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        assert wait_until(lambda: NODE_0_LOST.search(node1.text) is not None, timeout=60), node1.text
        if fail_worker:
            (tmp_path / "shared" / "fail0").write_text("")
            worker0 = psutil.Process(int((tmp_path / "shared" / "up0").read_text()))
            assert wait_until(lambda: worker0.status() == psutil.STATUS_ZOMBIE, timeout=30)  # exited; not yet reaped
    finally:
        node0.proc.send_signal(signal.SIGCONT)
    return node0, node1, time.monotonic() - stopped_at


def assert_node_0_says_it_stopped_answering(node0: NodeRun, frozen_for: float) -> None:
    assert node0.wait(timeout=60) == EXIT_NODE_LOST, node0.text
    said = NODE_0_FROZEN.search(node0.text)
    assert said is not None, node0.text
    assert 0.5 <= float(said[1]) <= frozen_for + 1.0, (said[0], frozen_for)  # at least the pulse's long pause
    assert "Exit code 76: a node was lost." in node0.text, node0.text
    assert "node 1 (" not in node0.text and "failed first" not in node0.text, node0.text


def test_node_0_frozen_while_node_1_stops_its_workers_says_it_stopped_answering_and_exits_76(tmp_path, processes, worker):
    """Node 1's worker holds its launcher in the teardown: node 0 runs again while node 1 still
    answers, and learns from node 1's end (or its silence) that node 1 found it lost."""
    node0, node1, frozen_for = frozen_node_0(tmp_path, processes, worker)
    wait_until(lambda: "STOPPED:" in node0.text, timeout=2.5)  # node 0 runs on for a while (longer than 2 x 1 s)
    (tmp_path / "shared" / "release1").write_text("")
    assert node1.wait(timeout=60) == EXIT_NODE_LOST, node1.text
    assert "STOPPED: node 0 (" in node1.text and NODE_0_LOST.search(node1.text), node1.text
    assert_node_0_says_it_stopped_answering(node0, frozen_for)


def test_node_0s_worker_failing_after_node_0_was_frozen_is_a_consequence_not_the_first_failure(tmp_path, processes, worker):
    """Node 0's worker failed while node 0's launcher was frozen (as one does when node 1 stops
    its workers): node 0, once it runs again, tells why the job stopped (before node 1 has ended),
    and that its worker's failure followed."""
    node0, node1, frozen_for = frozen_node_0(tmp_path, processes, worker, fail_worker=True)
    assert wait_until(lambda: re.search("STOPPED:|FAILED:", node0.text) or node0.proc.poll() is not None, timeout=60)
    (tmp_path / "shared" / "release1").write_text("")
    assert_node_0_says_it_stopped_answering(node0, frozen_for)
    assert "CPU0 here failed after that (exit code 3): a consequence." in node0.text, node0.text
    assert "FAILED" not in node0.text, node0.text
    assert node1.wait(timeout=60) == EXIT_NODE_LOST, node1.text


# --- the pulse: how long this process was stopped, on its own clock -------------------------


class Clock:
    """time.monotonic for launcher.nodes.pulse, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr("launcher.nodes.pulse.time.monotonic", clock)
    return clock


def test_a_gap_between_two_turns_of_at_least_long_pause_is_a_pause_of_the_process(clock):
    pulse = Pulse(long_pause=0.5)
    clock.now += 0.2
    pulse.beat()
    clock.now += 0.4  # a slow turn, not a pause
    pulse.beat()
    assert pulse.paused_since(0.0) == 0.0 and pulse.resumed_at == 0.0
    clock.now += 25.0
    assert pulse.paused_since(0.0) == pytest.approx(25.0)  # still paused: the turn has not come
    pulse.beat()
    clock.now += 0.2
    pulse.beat()
    assert pulse.paused_since(100.0) == pytest.approx(25.0) and pulse.resumed_at == pytest.approx(125.6)
    assert pulse.paused_since(126.0) == 0.0  # a pause that ended before: not this silence's
