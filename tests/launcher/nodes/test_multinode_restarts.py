"""--max-restarts on several nodes (launcher/nodes/restart_rounds.py): two launchers on 127.0.0.1
with a worker script of their own. A worker killed on node 1 restarts both nodes together; bad
input on node 1 restarts neither; node 1's launcher killed is waited for up to --join-timeout, then
the job stops, or goes on alone with --min-nnodes 1 (each node keeping its own files), or goes on
with node 1 relaunched (also before node 0 opens the round); a stop signal to either node between
attempts stops both; and the restart options' refusals (nodes must agree on them)."""

from __future__ import annotations

import json
import signal
import shutil
import sys
import time
from pathlib import Path

import pytest

from support.processes import free_port, launcher_env, wait_until
from support.runs import assert_one_line_error, run_launcher
from launcher.exit_codes import EXIT_NODE_LOST, EXIT_OTHER_NODE_FAILED
from launcher.nodes.agreement import Member, disagreement, restart_options
from support.nodes import STEP, NodeRun, start_nodes, train_options, worker_command

# Every rank says its attempt and waits for the others; in attempt 0, rank FAIL_RANK does FAIL.
# A later attempt ends at once with 0, but attempt FAIL_ON_WORD, which is killed once told to.
WORKER = """
import os, pathlib, signal, sys, time
shared = pathlib.Path(sys.argv[1])
attempt, rank, world = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
print(f"attempt {attempt}: rank {rank} of {world}", flush=True)
if attempt > 0:
    if attempt == int(os.environ.get("FAIL_ON_WORD", "0")):  # runs until the test's word, then is killed
        (shared / f"attempt{attempt}").write_text("")
        while not (shared / "fail").exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)
if os.environ.get("HOLD_TERM"):  # a teardown that lasts: SIGTERM only says it came
    signal.signal(signal.SIGTERM, lambda *_: (shared / f"term{rank}").write_text(""))
(shared / f"up{rank}").write_text("")
while len(list(shared.glob("up*"))) < world:
    time.sleep(0.01)
if rank == int(os.environ.get("FAIL_RANK", "-1")):
    if os.environ["FAIL"] == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(os.environ["FAIL"]))
time.sleep(600)
"""
RESTARTS = ["--nproc", "1", "--max-restarts", "1", "--restart-backoff", "0", "--node-timeout", "1", "--kill-grace", "2"]


def two_nodes(tmp_path: Path, processes, *options: str, **env: str) -> list[NodeRun]:
    command = worker_command(tmp_path, WORKER)
    return start_nodes(
        tmp_path, processes, [*RESTARTS, "--run-dir", str(tmp_path / "run"), *options, *command], env=launcher_env(**env)
    )


def attempts(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "restarts.jsonl").read_text().splitlines()]


def test_a_worker_killed_on_node_1_restarts_both_nodes_together_and_node_0_records_both_attempts(tmp_path, processes):
    nodes = two_nodes(tmp_path, processes, FAIL_RANK="1", FAIL="sigkill")
    codes = [run.wait(timeout=120) for run in nodes]
    assert codes == [0, 0], nodes[0].text + nodes[1].text
    for run in nodes:
        assert "launcher: restart 1 of 1 in 0 s: CPU1 was killed by SIGKILL" in run.text, run.text
    assert "CPU0:attempt 1: rank 0 of 2" in nodes[0].text and "CPU1:attempt 1: rank 1 of 2" in nodes[1].text
    record = attempts(tmp_path)
    assert [(a["attempt"], a["exit_code"], a["worker"], a["restarted"]) for a in record] == [
        (0, 137, "CPU1", True),
        (1, 0, None, False),
    ]
    assert record[0]["devices"] == ["CPU0", "CPU1"] and record[1]["devices"] == ["CPU0", "CPU1"]
    assert "launcher: attempts: 2 (restarts.jsonl)" in nodes[0].text


def test_bad_input_on_node_1_restarts_neither_node_and_each_exits_as_without_restarts(tmp_path, processes):
    nodes = two_nodes(tmp_path, processes, FAIL_RANK="1", FAIL="2")
    assert [run.wait(timeout=120) for run in nodes] == [EXIT_OTHER_NODE_FAILED, 2], nodes[0].text + nodes[1].text
    for run in nodes:
        assert "launcher: not restarted: bad input (exit 2) fails again the same way" in run.text, run.text
        assert "restart 1" not in run.text
    assert [(a["exit_code"], a["worker"], a["restarted"]) for a in attempts(tmp_path)] == [(2, "CPU1", False)]


def killed_node_1(tmp_path: Path, processes, *options: str, **env: str) -> NodeRun:
    """Node 1's launcher SIGKILLed once both workers run; node 0, left."""
    node0, node1 = two_nodes(tmp_path, processes, "--join-timeout", "4", *options, **env)

    def both_up() -> bool:
        return len(list((tmp_path / "shared").glob("up*"))) == 2 or node0.proc.poll() is not None

    assert wait_until(both_up, timeout=120) and node0.proc.poll() is None, node0.text + node1.text
    node1.proc.send_signal(signal.SIGKILL)
    node1.wait(timeout=30)
    return node0


def test_node_1s_launcher_killed_is_waited_for_up_to_the_join_timeout_then_the_job_stops_with_the_last_code(tmp_path, processes):
    node0 = killed_node_1(tmp_path, processes)
    assert node0.wait(timeout=60) == EXIT_NODE_LOST, node0.text
    assert "launcher: restart 1 of 1 in 0 s: a node was lost" in node0.text
    assert "launcher: waiting up to 4 s (--join-timeout) for node(s) 1 to come back" in node0.text
    assert "launcher: no restart: node(s) 1 did not come back within 4 s (--join-timeout); the job stops" in node0.text
    assert [(a["exit_code"], a["restarted"]) for a in attempts(tmp_path)] == [(EXIT_NODE_LOST, False)]


def test_with_min_nnodes_1_node_0_goes_on_alone_after_node_1_is_lost(tmp_path, processes):
    node0 = killed_node_1(tmp_path, processes, "--min-nnodes", "1")
    assert node0.wait(timeout=60) == 0, node0.text
    assert "launcher: going on with 1 of 2 node(s) (--min-nnodes 1)" in node0.text
    assert "CPU0:attempt 1: rank 0 of 1" in node0.text
    assert "launcher: the only node joined: 1 worker\n" in node0.text and "all 1 nodes" not in node0.text
    assert [(a["exit_code"], a["restarted"], a["devices"]) for a in attempts(tmp_path)] == [
        (EXIT_NODE_LOST, True, ["CPU0", "CPU1"]),
        (0, False, ["CPU0"]),
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--nnodes", "2", "--max-restarts", "1", "--min-nnodes", "3"], "--min-nnodes 3 is more than this job's 2 node(s)"),
        (["--nnodes", "2", "--min-nnodes", "1"], "--min-nnodes only applies to restarts: add --max-restarts N"),
        (["--nnodes", "2", "--max-restarts", "1", "--min-nproc", "1"], "--min-nproc applies to one machine"),
    ],
)
def test_min_nnodes_above_nnodes_or_without_restarts_is_refused_in_one_line(options, message):
    result = run_launcher(*options, "--node-rank", "0", "--master-addr", "127.0.0.1", "--", "true")
    assert_one_line_error(result, message)


def test_a_relaunched_node_1_joins_the_restart_node_0_waits_for(tmp_path, processes):
    node0 = killed_node_1(tmp_path, processes, "--join-timeout", "60")
    assert wait_until(lambda: "for node(s) 1 to come back" in node0.text or node0.proc.poll() is not None, timeout=60), node0.text
    port = node0.proc.args[node0.proc.args.index("--master-port") + 1]
    command = ["--", *node0.proc.args[node0.proc.args.index("--") + 1 :]]
    options = [*RESTARTS, "--run-dir", str(tmp_path / "run"), "--join-timeout", "60", *command]
    (again,) = start_nodes(tmp_path, processes, options, ranks=(1,), port=int(port), env=launcher_env())
    assert [node0.wait(timeout=60), again.wait(timeout=60)] == [0, 0], node0.text + again.text
    assert "launcher: the job is restarting: joining round 1 of the rendezvous" in again.text
    assert "CPU1:attempt 1: rank 1 of 2" in again.text


def relaunched_node_1(tmp_path: Path, processes, node0: NodeRun, *options: str) -> NodeRun:
    """Node 1's launcher started again, to node 0's port and command."""
    port = node0.proc.args[node0.proc.args.index("--master-port") + 1]
    command = ["--", *node0.proc.args[node0.proc.args.index("--") + 1 :]]
    (again,) = start_nodes(
        tmp_path, processes, [*RESTARTS, "--run-dir", str(tmp_path / "run"), *options, *command], ranks=(1,), port=int(port)
    )
    return again


def test_a_stop_signal_to_a_relaunched_node_while_the_job_runs_stops_it_alone_and_the_next_failure_restarts(tmp_path, processes):
    # Node 1 is lost in attempt 0; node 0 goes on alone (attempt 1, which runs until told to fail).
    # The backoff keeps node 0 between attempts long enough for its watcher to read the store.
    options = ("--max-restarts", "2", "--min-nnodes", "1", "--restart-backoff", "1")
    node0 = killed_node_1(tmp_path, processes, *options, FAIL_ON_WORD="1")
    running = tmp_path / "shared" / "attempt1"
    assert wait_until(lambda: running.exists() or node0.proc.poll() is not None, timeout=120), node0.text
    again = relaunched_node_1(tmp_path, processes, node0, *options, "--join-timeout", "120")
    assert wait_until(lambda: "for its next restart" in again.text or again.proc.poll() is not None, timeout=60), again.text
    again.proc.send_signal(signal.SIGTERM)
    assert again.wait(timeout=60) == 143, again.text
    alone = "launcher: this node (node 1) was stopped by SIGTERM before it rejoined the job; the job goes on without it"
    assert alone in again.text
    (tmp_path / "shared" / "fail").write_text("")  # the job's next failure: a restart, as without the signal
    assert node0.wait(timeout=120) == 0, node0.text
    assert "launcher: restart 2 of 2 in 2 s" in node0.text and "stopped by SIGTERM" not in node0.text, node0.text
    assert "CPU0:attempt 2: rank 0 of 1" in node0.text
    assert [(a["exit_code"], a["restarted"]) for a in attempts(tmp_path)] == [(EXIT_NODE_LOST, True), (137, True), (0, False)]


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["auto", "hsdp"])
def test_a_training_worker_killed_on_node_1_restarts_both_nodes_from_node_0s_checkpoint_with_the_same_losses(
    tmp_path, processes, parallelism
):
    options = train_options(
        tmp_path, tmp_path / "run", "--max-steps", "6", "--set", "training.checkpoint_interval=2", *RESTARTS[2:]
    )
    options += ["--set", f"training.parallelism={parallelism}"]
    nodes = start_nodes(tmp_path, processes, options, env=launcher_env(PRETRAIN_FAULTS="0:1:3:sigkill"))
    assert [run.wait(timeout=240) for run in nodes] == [0, 0], nodes[0].text[-3000:] + nodes[1].text[-3000:]
    assert f"launcher: resuming from {tmp_path / 'run' / 'checkpoints' / 'step_2'}" in nodes[0].text
    for run in nodes:
        steps = [(int(step), loss) for _, _, step, loss in STEP.findall(run.text)]
        first, again = steps[:4], steps[4:]  # steps 0-3, killed after 3; then 2-5 from step_2
        assert [s for s, _ in first] == [0, 1, 2, 3] and [s for s, _ in again] == [2, 3, 4, 5], steps
        assert again[:2] == first[2:], steps
    assert [a["resumed_from"] for a in attempts(tmp_path)] == [None, str(tmp_path / "run" / "checkpoints" / "step_2")]
    if parallelism == "hsdp":  # both attempts: 2 nodes x 1 rank, replicated across the nodes
        assert nodes[0].text.count("parallelism: HSDP over 2 CPU workers (2 nodes x 1") == 2, nodes[0].text


@pytest.mark.slow
def test_under_hsdp_node_0_goes_on_alone_with_min_nnodes_1_as_fsdp_from_the_checkpoint_both_nodes_saved(tmp_path, processes):
    options = train_options(tmp_path, tmp_path / "run", "--max-steps", "6", "--set", "training.checkpoint_interval=2")
    options += [*RESTARTS[2:], "--join-timeout", "3", "--min-nnodes", "1", "--set", "training.parallelism=hsdp"]
    # Rank 1 stalls the job at step 3 (sleeping 30 s), so step_2 is the checkpoint node 0 takes alone.
    nodes = start_nodes(tmp_path, processes, options, env=launcher_env(PRETRAIN_FAULTS="0:1:3:sleep=30"))
    saved = tmp_path / "run" / "checkpoints" / "step_2" / "state.json"
    assert wait_until(lambda: saved.exists() or any(n.proc.poll() is not None for n in nodes), timeout=240), nodes[0].text
    nodes[1].proc.send_signal(signal.SIGKILL)
    assert nodes[0].wait(timeout=240) == 0, nodes[0].text[-4000:]
    text = nodes[0].text
    assert "launcher: going on with 1 of 2 node(s) (--min-nnodes 1)" in text
    assert "launcher: the only node joined: 1 worker" in text
    assert "parallelism: none, one CPU worker; warning: training.parallelism=hsdp on one node is FSDP" in text, text
    assert "parallelism: HSDP over 2 CPU workers" in text
    record = attempts(tmp_path)
    assert [a["restarted"] for a in record] == [True, False] and record[1]["exit_code"] == 0, record
    resumed = record[1]["resumed_from"]
    assert resumed is not None and int(resumed.rsplit("_", 1)[1]) >= 2, record
    steps = [int(step) for _, _, step, _ in STEP.findall(text)]
    assert steps[-1] == 5, steps


def test_min_nnodes_with_a_global_batch_fewer_nodes_cannot_keep_is_refused_before_the_join():
    # 3 nodes x 1 worker x batch 8 = 24 sequences: 2 nodes (2 x 8) cannot keep them
    options = ["--nnodes", "3", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    result = run_launcher("--debug", "--device", "cpu", "--nproc", "1", *options, "--max-restarts", "1", "--min-nnodes", "2")
    assert_one_line_error(
        result, "--min-nnodes 2: the global batch of 24 sequences cannot be kept on 2 node(s) of 1 worker(s)", quiet_stdout=False
    )
    assert "rendezvous" not in result.stdout


PROMPT = 5.0
"""Seconds from a stop signal between attempts to the other node's exit: 0.04-0.3 s measured (two
idle cores), where each window below would otherwise last 20 s or more."""


def stop_and_time(nodes: list[NodeRun], stopped: int) -> float:
    """SIGTERM to nodes[stopped]; both must exit 143. The seconds until the other node had exited."""
    other = nodes[1 - stopped]
    signalled = time.monotonic()
    nodes[stopped].proc.send_signal(signal.SIGTERM)
    assert other.wait(timeout=120) == 143, other.text
    took = time.monotonic() - signalled
    assert nodes[stopped].wait(timeout=60) == 143, nodes[stopped].text
    print(f"node {1 - stopped} exited {took:.2f} s after the signal to node {stopped}")
    return took


def restarting_after_node_1s_kill(tmp_path: Path, processes, *options: str) -> list[NodeRun]:
    """Both nodes, once node 1's worker was SIGKILLed and node 0 has decided the restart (both wait the backoff)."""
    nodes = two_nodes(tmp_path, processes, *options, FAIL_RANK="1", FAIL="sigkill")
    said = "launcher: restart 1 of 1 in 60 s"
    assert wait_until(lambda: all(said in run.text or run.proc.poll() is not None for run in nodes), timeout=120)
    assert all(run.proc.poll() is None for run in nodes), nodes[0].text + nodes[1].text
    return nodes


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stop_signal_to_either_node_during_the_backoff_stops_both_at_once_and_node_0_records_no_restart(
    tmp_path, processes, stopped
):
    nodes = restarting_after_node_1s_kill(tmp_path, processes, "--restart-backoff", "60")
    # Decided, not yet made: the record does not say "restarted" before the next attempt begins.
    [decided] = attempts(tmp_path)
    assert not decided["restarted"] and decided["why"].endswith("(restart 1 pending)"), decided
    took = stop_and_time(nodes, stopped)
    other = nodes[1 - stopped]
    assert took < PROMPT, (took, other.text)  # where the backoff alone is 60 s
    here = f"launcher: this node (node {stopped}) was stopped by SIGTERM before the restart; every node stops"
    assert here in nodes[stopped].text
    assert f"launcher: node {stopped} was stopped by SIGTERM before the restart; so is this node" in other.text
    for run in nodes:
        assert "cannot reach node 0" not in run.text and "attempt 1:" not in run.text, run.text
    assert [(a["exit_code"], a["restarted"], a["why"]) for a in attempts(tmp_path)] == [
        (137, False, f"stopped by SIGTERM on node {stopped} before the restart")
    ]
    assert "launcher: attempts: 1 (restarts.jsonl)" in nodes[0].text


def test_node_1_relaunched_before_node_0_opens_the_next_round_waits_for_it_and_joins(tmp_path, processes):
    waits = ("--restart-backoff", "15", "--join-timeout", "60")
    node0 = killed_node_1(tmp_path, processes, *waits)
    again = relaunched_node_1(tmp_path, processes, node0, *waits)
    assert [node0.wait(timeout=120), again.wait(timeout=60)] == [0, 0], node0.text + again.text
    assert "launcher: the job runs without this node: waiting up to 60 s (--join-timeout) for its next restart" in again.text
    assert "already joined" not in again.text
    assert "launcher: the job is restarting: joining round 1 of the rendezvous" in again.text
    assert "CPU1:attempt 1: rank 1 of 2" in again.text


@pytest.mark.parametrize(("node0", "node1"), [("0", "1"), ("1", "2")])
def test_nodes_started_with_different_max_restarts_are_refused_in_one_line_naming_both(tmp_path, processes, node0, node1):
    command = ["--nproc", "1", "--run-dir", str(tmp_path / "run"), "--", sys.executable, "-c", "pass"]
    port = free_port()
    runs = [
        start_nodes(tmp_path, processes, ["--max-restarts", restarts, *command], ranks=(rank,), port=port)[0]
        for rank, restarts in ((0, node0), (1, node1))
    ]
    assert [run.wait(timeout=120) for run in runs] == [2, 2], runs[0].text + runs[1].text
    node0_was = "without --max-restarts" if node0 == "0" else f"with --max-restarts {node0}"  # 0: restarts off, the default
    problem = f"was started with --max-restarts {node1} and node 0 {node0_was}; "
    problem += "give every node the same --max-restarts"
    assert problem in runs[0].text and problem in runs[1].text
    assert "CPU0:" not in runs[0].text and "CPU1:" not in runs[1].text  # no worker started


def test_after_min_nnodes_renumbers_the_nodes_each_writes_only_its_own_logs_and_workers_record(tmp_path, processes):
    command = worker_command(tmp_path, WORKER)
    options = [*RESTARTS, "--run-dir", str(tmp_path / "run"), "--join-timeout", "3", "--min-nnodes", "2", *command]
    nodes = start_nodes(tmp_path, processes, options, nnodes=3)
    assert wait_until(lambda: len(list((tmp_path / "shared").glob("up*"))) == 3, timeout=180), "".join(n.text for n in nodes)
    nodes[1].proc.send_signal(signal.SIGKILL)
    assert [nodes[0].wait(timeout=120), nodes[2].wait(timeout=60)] == [0, 0], nodes[0].text + nodes[2].text
    assert "CPU1:attempt 1: rank 1 of 2" in nodes[2].text  # node 2 is the round's node 1
    run = tmp_path / "run"
    assert "attempt 1: rank 1 of 2" in (run / "logs" / "node2" / "combined.log").read_text()
    assert "attempt 1" not in (run / "logs" / "node1" / "combined.log").read_text()
    assert not (run / "workers.node1.json").exists()  # node 1's launcher was killed before writing it
    assert json.loads((run / "workers.node2.json").read_text())


@pytest.mark.parametrize(
    ("ours", "theirs", "problem"),
    [
        ((1, None, 1.0), (1, 1, 1.0), "node 1 (b) was started with --min-nnodes 1 and node 0 without --min-nnodes"),
        ((1, None, 1.0), (1, None, 5.0), "started with --restart-backoff 5 and node 0 with --restart-backoff 1; give every"),
        ((2, 1, 1.0), (2, 1, 1.0), None),
        ((2, 1, None), (2, 1, 1.0), None),  # --restart-backoff not given is its default, 1 s
        ((0, None, None), (2, None, None), "was started with --max-restarts 2 and node 0 without --max-restarts;"),
    ],
)
def test_nodes_with_different_min_nnodes_or_backoff_are_refused_naming_both_values(ours, theirs, problem):
    members = [Member(n, host, 1, 1, "cpu", restarts=restart_options(*o)) for n, host, o in ((0, "a", ours), (1, "b", theirs))]
    found = disagreement(members)
    assert found == problem if problem is None else (found is not None and problem in found)


def test_an_attempt_after_a_restart_that_ends_before_its_workers_start_records_no_restart(tmp_path, processes):
    nodes = two_nodes(tmp_path, processes, "--restart-backoff", "5", FAIL_RANK="1", FAIL="sigkill")
    said = "launcher: restart 1 of 1 in 5 s"
    assert wait_until(lambda: said in nodes[0].text or nodes[0].proc.poll() is not None, timeout=120), nodes[0].text
    # During the backoff, node 0's logs directory becomes a file: its next attempt cannot start.
    logs = tmp_path / "run" / "logs" / "node0"
    shutil.rmtree(logs)
    logs.write_text("in the way\n")
    assert nodes[0].wait(timeout=60) != 0, nodes[0].text
    [record] = attempts(tmp_path)
    assert (record["exit_code"], record["restarted"]) == (137, False), record
    assert record["why"].startswith("no restart: "), record
    assert "launcher: attempts: 1 (restarts.jsonl)" in nodes[0].text
    nodes[1].wait(timeout=60)


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stop_signal_to_either_node_while_node_0_tears_its_workers_down_stops_both_at_once(tmp_path, processes, stopped):
    # Node 0's worker holds SIGTERM: its teardown would last --kill-grace 20 s, then the restart.
    options = ("--kill-grace", "20")
    nodes = two_nodes(tmp_path, processes, *options, FAIL_RANK="1", FAIL="sigkill", HOLD_TERM="1")
    assert wait_until(lambda: (tmp_path / "shared" / "term0").exists(), timeout=120), nodes[0].text + nodes[1].text
    took = stop_and_time(nodes, stopped)
    assert took < PROMPT, (took, nodes[0].text, nodes[1].text)
    for run in nodes:
        assert "attempt 1:" not in run.text and "restart 1 of 1" not in run.text, run.text
    if stopped == 0:  # its first signal, in a failure's teardown, is no "second signal"
        assert "launcher: received SIGTERM while stopping: killing every worker now" in nodes[0].text, nodes[0].text
        assert "second signal" not in nodes[0].text
    assert [(a["exit_code"], a["restarted"], a["why"]) for a in attempts(tmp_path)] == [
        (137, False, f"stopped by SIGTERM on node {stopped} before the restart")
    ]


@pytest.mark.slow
def test_a_stop_signal_to_node_0_just_after_node_1_died_ends_the_job_without_a_restart(tmp_path, processes):
    # The signal comes before node 0 can find node 1 lost (--node-timeout 1 s) or, on a loaded
    # machine, after it: either way the stop asked for is never undone (launcher/nodes/job_end.py).
    node0 = killed_node_1(tmp_path, processes, "--restart-backoff", "15", "--join-timeout", "60")
    node0.proc.send_signal(signal.SIGTERM)
    assert node0.wait(timeout=120) in (EXIT_NODE_LOST, 143), node0.text
    assert "launcher: restart 1 of" not in node0.text
    assert [a["restarted"] for a in attempts(tmp_path)] == [False]


@pytest.mark.slow
@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stop_signal_to_node_0_or_to_a_relaunched_node_1_waiting_for_the_next_round_stops_both_at_once(
    tmp_path, processes, stopped
):
    # Without it, node 0 would wait out the backoff (15 s) and --join-timeout (60 s) for node 1,
    # and node 1 would find node 0's store gone (exit 2).
    waits = ("--restart-backoff", "15", "--join-timeout", "60")
    node0 = killed_node_1(tmp_path, processes, *waits)
    # Node 0 in its backoff: a launcher relaunched at once could otherwise be signalled before node 0
    # has found node 1 lost, while the attempt still runs (a stop then ends the job: test_job_end.py).
    assert wait_until(lambda: "restart 1 of 1 in 15 s" in node0.text or node0.proc.poll() is not None, timeout=60), node0.text
    again = relaunched_node_1(tmp_path, processes, node0, *waits)
    assert wait_until(lambda: "for its next restart" in again.text or again.proc.poll() is not None, timeout=60), again.text
    nodes = [node0, again]
    took = stop_and_time(nodes, stopped)
    assert took < PROMPT, (took, node0.text, again.text)
    assert f"node {stopped} was stopped by SIGTERM before the restart; so is this node" in nodes[1 - stopped].text
    assert [(a["restarted"], a["why"]) for a in attempts(tmp_path)] == [
        (False, f"stopped by SIGTERM on node {stopped} before the restart")
    ]
