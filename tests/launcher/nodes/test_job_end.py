"""How node 0 reads a job's attempt (launcher/nodes/job_end.py), also when a stop signal ends its
wait for the attempt early: the end of the node whose failure stopped the job is waited for (it may
be posted after node 0's signal on a loaded machine), within a bound, and only where that node will
post one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from launcher.exit_codes import EXIT_NODE_LOST, EXIT_OTHER_NODE_FAILED
from launcher.nodes.job_end import end_record, posted_ends, job_end
from launcher.nodes.node import NodeStop
from launcher.supervise.restarts import AttemptEnd, judge

KILLED = AttemptEnd(137, worker="node1:CPU1", rank=1, how="killed by SIGKILL", step=3)
OURS = AttemptEnd(EXIT_OTHER_NODE_FAILED, how="stopped: node 1 failed", step=3)


@dataclass
class Spec:
    nnodes: int = 2


@dataclass
class TwoNodes:
    """Node 0's view of node 0's store: node 1's end appears after `late` reads of it."""

    first: NodeStop | None
    late: int
    ours: AttemptEnd = OURS
    rank: int = 0
    spec: Spec = field(default_factory=Spec)
    lost: dict[int, NodeStop] = field(default_factory=dict)
    reads: int = 0

    def read(self, key: str) -> dict[str, Any] | None:
        if key == "end/0":
            return end_record(self.ours)
        self.reads += 1
        return end_record(KILLED) if self.reads > self.late else None

    def first_stop(self) -> NodeStop | None:
        return self.first


def failed(node: int) -> NodeStop:
    return NodeStop(
        node=node, host=f"host{node}", kind="failed", detail="killed by SIGKILL", label=f"CPU{node}", rank=node, exit_code=137
    )


def test_the_end_of_the_node_that_failed_first_is_waited_for_and_is_the_jobs_end():
    node = TwoNodes(first=failed(1), late=3)
    end = job_end(node, posted_ends(node, seconds=60, poll=0))  # type: ignore[arg-type]
    assert node.reads == 4 and end.exit_code == 137 and end.worker == "node1:CPU1"


def test_without_that_end_within_the_bound_the_job_reads_as_that_nodes_launcher_failing():
    node = TwoNodes(first=failed(1), late=10**9)
    end = job_end(node, posted_ends(node, seconds=0, poll=0))  # type: ignore[arg-type]
    assert end.exit_code == EXIT_OTHER_NODE_FAILED


def test_nothing_is_waited_for_after_a_lost_node_or_a_word_of_node_0s_own():
    lost = NodeStop(node=1, host="host1", kind="lost", detail="no heartbeat for 5 s")
    node = TwoNodes(first=lost, late=10**9, lost={1: lost})
    assert job_end(node, posted_ends(node, seconds=60, poll=0)).exit_code == EXIT_NODE_LOST  # type: ignore[arg-type]
    own = TwoNodes(first=failed(0), late=10**9)
    assert posted_ends(own, seconds=60, poll=0) == {0: OURS}  # type: ignore[arg-type]


def test_a_stop_signal_to_node_0_just_before_it_finds_a_node_lost_ends_the_job_instead_of_restarting_it():
    # SIGTERM to node 0 while node 1's launcher is dead but not yet found lost: the lost node is still
    # the job's end (exit 76), and the stop asked for still holds, as on one machine.
    lost = NodeStop(node=1, host="host1", kind="lost", detail="its launcher stopped answering 1.0 s ago")
    signalled = AttemptEnd(143, how="stopped by SIGTERM", step=3, stopped=True)
    node = TwoNodes(first=lost, late=10**9, lost={1: lost}, ours=signalled)
    end = job_end(node, posted_ends(node, seconds=60, poll=0))  # type: ignore[arg-type]
    assert (end.exit_code, end.lost_node, end.stopped) == (EXIT_NODE_LOST, True, True)
    assert judge(end, 0, 1, None, training=True).restart is False
    unsignalled = TwoNodes(first=lost, late=10**9, lost={1: lost})
    lost_only = job_end(unsignalled, posted_ends(unsignalled, seconds=60, poll=0))  # type: ignore[arg-type]
    assert not lost_only.stopped and judge(lost_only, 0, 1, None, training=True).restart is True


def test_a_stop_asked_for_on_node_0_holds_when_another_nodes_failure_is_the_jobs_end_too():
    # Node 1's worker killed, node 0 told to stop meanwhile: the job's end is node 1's, and not restarted.
    signalled = AttemptEnd(143, how="stopped by SIGTERM", step=3, stopped=True)
    node = TwoNodes(first=failed(1), late=0, ours=signalled)
    end = job_end(node, posted_ends(node, seconds=60, poll=0))  # type: ignore[arg-type]
    assert (end.exit_code, end.worker, end.stopped) == (137, "node1:CPU1", True)
    assert judge(end, 0, 1, None, training=True).restart is False
