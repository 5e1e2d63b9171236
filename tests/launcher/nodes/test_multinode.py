"""Several nodes: two (or three) launchers on 127.0.0.1 as machines, with small worker scripts:
a worker failing on node 1, node 1's launcher SIGKILLed, a frozen node 0, a node that never
arrives or left before the job formed, Slurm's variables, and bad input (docs/multinode.md).
Training across nodes: tests/launcher/nodes/test_multinode_training.py."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from support.processes import ROOT, free_port, launcher_env, wait_until
from support.runs import assert_one_line_error, run_launcher
from launcher.exit_codes import EXIT_NODE_LOST, EXIT_OTHER_NODE_FAILED
from support.nodes import MARKER, NodeRun, marked_processes, runs_in, start_nodes, train_options, worker_command


WORKER = """
import os, pathlib, sys, time
shared = pathlib.Path(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# The line first, in one write (under PYTHONUNBUFFERED each piece of a print is a write of its own),
# then the file: a peer that sees every up file and fails knows every line is out (a rank stopped
# in the middle of its print showed "up" alone, in a CI run).
print(f"up {rank} {os.environ['LOCAL_RANK']} {os.environ['NODE_RANK']} {world} {os.environ['LOCAL_WORLD_SIZE']}", flush=True)
(shared / f"up{rank}").write_text(str(os.getpid()))
while len(list(shared.glob("up*"))) < world:
    time.sleep(0.01)
if rank == int(os.environ.get("FAIL_RANK", "-1")):
    (shared / "failed_at.partial").write_text(repr(time.monotonic()))
    (shared / "failed_at.partial").rename(shared / "failed_at")  # whole when the test sees it
    sys.exit(7)
time.sleep(600)
"""


@pytest.fixture
def worker(tmp_path) -> list[str]:
    return worker_command(tmp_path, WORKER)


def test_a_worker_failing_on_node_1_stops_both_nodes_within_3_seconds(tmp_path, processes, worker):
    marker = uuid.uuid4().hex
    env = launcher_env(FAIL_RANK="1", **{MARKER: marker})
    nodes = start_nodes(tmp_path, processes, ["--nproc", "1", "--kill-grace", "2", *worker], env=env)
    assert wait_until(lambda: (tmp_path / "shared" / "failed_at").exists(), timeout=120), nodes[0].text + nodes[1].text
    failed_at = float((tmp_path / "shared" / "failed_at").read_text())
    codes = [run.wait(timeout=30) for run in nodes]
    both_exited = time.monotonic() - failed_at
    assert codes == [EXIT_OTHER_NODE_FAILED, 7], nodes[0].text + nodes[1].text
    assert both_exited < 3.0, (both_exited, nodes[0].text[-1500:], nodes[1].text[-1500:])
    assert "node 1 (" in nodes[0].text and "failed first: CPU1 (rank 1) exit code 7" in nodes[0].text
    assert f"Exit code {EXIT_OTHER_NODE_FAILED}: another node failed." in nodes[0].text
    assert "FAILED: CPU1 (rank 1) failed first" in nodes[1].text and "told the other nodes to stop" in nodes[1].text
    assert wait_until(lambda: not marked_processes(marker), timeout=2.0)


# Node 0's worker finishes at once; node 1's fails once node 0's supervisor is done with its own
# (it has written workers.node0.json in the run directory both share).
FINISHES_FIRST = """
import os, pathlib, sys, time
if os.environ["RANK"] == "0":
    sys.exit(0)
record = pathlib.Path(os.environ["PRETRAIN_RUNS_DIR"]) / os.environ["TORCHELASTIC_RUN_ID"] / "workers.node0.json"
while not record.exists():
    time.sleep(0.01)
sys.exit(2)
"""


def test_node_0_whose_workers_finished_exits_75_when_node_1_fails_afterwards(tmp_path, processes):
    command = worker_command(tmp_path, FINISHES_FIRST)
    nodes = start_nodes(tmp_path, processes, ["--nproc", "1", *command])
    codes = [run.wait(timeout=60) for run in nodes]
    assert codes == [EXIT_OTHER_NODE_FAILED, 2], nodes[0].text + nodes[1].text
    assert re.search(r"launcher: node 1 \(.*\) failed after this node's workers had finished \(exit code 2\)", nodes[0].text)
    assert f"launcher: exit code {EXIT_OTHER_NODE_FAILED}: another node failed" in nodes[0].text


def test_node_1s_launcher_killed_stops_node_0_within_5_seconds_naming_the_lost_node(tmp_path, processes, worker):
    marker = uuid.uuid4().hex
    env = launcher_env(**{MARKER: marker})
    nodes = start_nodes(tmp_path, processes, ["--nproc", "1", "--kill-grace", "2", *worker], env=env)
    assert wait_until(lambda: len(list((tmp_path / "shared").glob("up*"))) == 2, timeout=120), nodes[0].text + nodes[1].text
    killed_at = time.monotonic()
    nodes[1].proc.send_signal(signal.SIGKILL)
    code = nodes[0].wait(timeout=30)
    stopped_after = time.monotonic() - killed_at
    assert code == EXIT_NODE_LOST, nodes[0].text
    assert stopped_after < 5.0
    assert re.search(r"STOPPED: node 1 \(.*\) was lost: its launcher stopped answering", nodes[0].text), nodes[0].text
    assert wait_until(lambda: not marked_processes(marker), timeout=2.0), [p.cmdline() for p in marked_processes(marker)]


def test_workers_get_global_ranks_and_each_nodes_local_ranks(tmp_path, processes, worker):
    nodes = start_nodes(tmp_path, processes, ["--nproc", "2", *worker], env=launcher_env(FAIL_RANK="3"))
    codes = [run.wait(timeout=120) for run in nodes]
    assert codes == [EXIT_OTHER_NODE_FAILED, 7]
    # RANK LOCAL_RANK NODE_RANK WORLD_SIZE LOCAL_WORLD_SIZE, each line under its global CPU label
    assert "CPU0:up 0 0 0 4 2" in nodes[0].text and "CPU1:up 1 1 0 4 2" in nodes[0].text
    assert "CPU2:up 2 0 1 4 2" in nodes[1].text and "CPU3:up 3 1 1 4 2" in nodes[1].text


def test_gpu_prefixes_put_the_global_rank_before_the_gpu(tmp_path, processes, worker, scripted_gpus):
    scripted_gpus([{}, {}])
    port = free_port()
    nodes = []
    for rank in (1, 0):  # each "machine" claims its own GPUs 0 and 1
        env = launcher_env(FAIL_RANK="2", LAUNCHER_CLAIMS_NAMESPACE=f"multinode-test-{uuid.uuid4().hex[:8]}")
        nodes += start_nodes(tmp_path, processes, ["--gpus", "0,1", *worker], ranks=(rank,), port=port, env=env)
    nodes.reverse()
    assert [run.wait(timeout=120) for run in nodes] == [EXIT_OTHER_NODE_FAILED, 7]
    assert "r0.GPU0:up 0 0 0 4 2" in nodes[0].text and "r1.GPU1:up 1 1 0 4 2" in nodes[0].text
    assert "r2.GPU0:up 2 0 1 4 2" in nodes[1].text and "r3.GPU1:up 3 1 1 4 2" in nodes[1].text
    # `grep GPU1:` still finds one node's GPU 1
    assert [line for line in nodes[1].text.splitlines() if "GPU1:" in line] == ["r3.GPU1:up 3 1 1 4 2"]


def test_slurm_variables_alone_place_each_node(tmp_path, processes, worker):
    port = free_port()
    nodes = []
    for rank in (1, 0):
        env = launcher_env(
            FAIL_RANK="1",
            SLURM_JOB_ID="4242",
            SLURM_NNODES="2",
            SLURM_NODEID=str(rank),
            SLURM_JOB_NODELIST="localhost,otherhost",
            MASTER_PORT=str(port),
        )
        out = tmp_path / f"slurm{rank}.out"
        with out.open("w") as handle:
            argv = [sys.executable, "-m", "launcher", "--nproc", "1", *worker]
            nodes.append(
                NodeRun(
                    rank, processes(argv, cwd=ROOT, env=env | runs_in(tmp_path), stdout=handle, stderr=subprocess.STDOUT), out
                )
            )
    node1, node0 = nodes
    assert [node0.wait(120), node1.wait(120)] == [EXIT_OTHER_NODE_FAILED, 7], node0.text + node1.text
    assert f"node 0 of 2: rendezvous on localhost:{port}" in node0.text


def test_a_node_that_never_arrives_is_named_by_node_0s_join_timeout(tmp_path, processes, worker):
    nodes = start_nodes(tmp_path, processes, ["--nproc", "1", "--join-timeout", "2", *worker], nnodes=3, ranks=(0, 2))
    codes = [run.wait(timeout=60) for run in nodes]
    assert codes == [2, 2]
    assert "launcher: error: node(s) 1 of 3 never joined within 2 s (--join-timeout)" in nodes[0].text
    assert "node 0 refused the job: node(s) 1 of 3 never joined" in nodes[1].text
    assert "Traceback" not in nodes[0].text + nodes[1].text


# --- bad input ----------------------------------------------------------------------------


def test_a_node_rank_out_of_range_is_one_line():
    result = run_launcher("--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "--", "true")
    assert_one_line_error(result, "--node-rank 2 is out of range for --nnodes 2 (node ranks are 0 to 1)")


def test_an_unreachable_master_times_out_with_one_line_naming_it():
    port = free_port()
    result = run_launcher(
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--join-timeout",
        "1",
        "--",
        "true",
    )
    assert_one_line_error(result, f"cannot reach node 0 at 127.0.0.1:{port} within 1 s (--join-timeout)", quiet_stdout=False)


def test_a_port_in_use_on_node_0_is_one_line(tmp_path):
    with socket_listening() as port:
        result = run_launcher(
            "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port), "--", "true"
        )
    assert_one_line_error(result, f"--master-port {port} is in use on this machine", quiet_stdout=False)


def test_nodes_with_different_process_counts_are_refused_on_every_node(tmp_path, processes, worker):
    port = free_port()
    nodes = [
        *start_nodes(tmp_path, processes, ["--nproc", "2", *worker], ranks=(1,), port=port),
        *start_nodes(tmp_path, processes, ["--nproc", "1", *worker], ranks=(0,), port=port),
    ][::-1]
    codes = [run.wait(timeout=60) for run in nodes]
    assert codes == [2, 2]
    refusal = "the nodes start different numbers of workers (node 0: 1, node 1: 2)"
    assert refusal in nodes[0].text and f"node 0 refused the job: {refusal}" in nodes[1].text


def test_nodes_given_different_configs_are_refused_naming_the_key(tmp_path, processes):
    port = free_port()
    options = train_options(tmp_path, tmp_path / "run")
    nodes = [
        *start_nodes(tmp_path, processes, [*options, "--max-steps", "3"], ranks=(1,), port=port),
        *start_nodes(tmp_path, processes, [*options, "--max-steps", "4"], ranks=(0,), port=port),
    ][::-1]
    assert [run.wait(timeout=60) for run in nodes] == [2, 2]
    assert "was given a different config from node 0 (training.max_steps)" in nodes[0].text


class socket_listening:
    """A port held by something else for the length of a with block."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen()
        return self.sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_multinode_flags_accept_underscores_as_torchrun_does():
    result = run_launcher("--nnodes", "2", "--node_rank", "5", "--master_addr", "h", "--master_port", "1", "--", "true")
    assert_one_line_error(result, "--node-rank 5 is out of range")


def test_a_node_timeout_below_one_second_is_refused():
    result = run_launcher("--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--node-timeout", "0.2", "--", "true")
    assert_one_line_error(result, "--node-timeout must be between 1 and")


def test_every_node_runs_in_node_0s_run_directory_and_says_so_when_given_another(tmp_path, processes, worker):
    port, env = free_port(), launcher_env(FAIL_RANK="1")
    nodes = [
        *start_nodes(
            tmp_path, processes, ["--nproc", "1", "--run-dir", str(tmp_path / "mine"), *worker], ranks=(1,), port=port, env=env
        ),
        *start_nodes(
            tmp_path, processes, ["--nproc", "1", "--run-dir", str(tmp_path / "main"), *worker], ranks=(0,), port=port, env=env
        ),
    ][::-1]
    assert [run.wait(timeout=120) for run in nodes] == [EXIT_OTHER_NODE_FAILED, 7]
    assert (
        f"warning: --run-dir {tmp_path / 'mine'} is not node 0's; every node uses node 0's, {tmp_path / 'main'}" in nodes[1].text
    )
    assert (tmp_path / "main" / "workers.node1.json").exists() and not (tmp_path / "mine").exists()


# --- the review's cases: frozen node 0, three nodes, a node that left before the job formed ----


def test_a_node_0_frozen_during_the_join_is_one_line_on_the_others_not_a_hang(tmp_path, processes, worker):
    port = free_port()
    node0, node1 = start_nodes(
        tmp_path, processes, ["--nproc", "1", "--node-timeout", "1", *worker], nnodes=3, ranks=(0, 1), port=port
    )
    assert wait_until(lambda: "joined the rendezvous" in node1.text, timeout=60), node1.text
    node0.proc.send_signal(signal.SIGSTOP)
    try:
        assert node1.wait(timeout=30) == 2
    finally:
        node0.proc.send_signal(signal.SIGCONT)
    assert "launcher: error: lost the rendezvous on 127.0.0.1:" in node1.text and "no answer within 1 s" in node1.text


def test_node_0_frozen_past_the_node_timeout_stops_both_nodes_and_says_it_stopped_answering_once_it_wakes(
    tmp_path, processes, worker
):
    nodes = start_nodes(tmp_path, processes, ["--nproc", "1", "--node-timeout", "1", *worker])
    assert wait_until(lambda: len(list((tmp_path / "shared").glob("up*"))) == 2, timeout=120), nodes[0].text + nodes[1].text
    nodes[0].proc.send_signal(signal.SIGSTOP)
    try:
        assert nodes[1].wait(timeout=30) == EXIT_NODE_LOST
    finally:
        nodes[0].proc.send_signal(signal.SIGCONT)
    assert nodes[0].wait(timeout=30) == EXIT_NODE_LOST, nodes[0].text
    assert "STOPPED: node 0 (" in nodes[1].text and "was lost: its launcher stopped answering" in nodes[1].text
    assert re.search(
        r"STOPPED: this node, node 0 \(.*\), stopped answering for \d+\.\d s \(frozen, suspended or starved; "
        r"--node-timeout 1 s\): the other nodes found it lost and stopped the job",
        nodes[0].text,
    ), nodes[0].text
    assert "node 1 (" not in nodes[0].text, nodes[0].text


def test_with_three_nodes_a_lost_one_is_named_by_both_others_which_exit_76(tmp_path, processes, worker):
    nodes = start_nodes(tmp_path, processes, ["--nproc", "1", *worker], nnodes=3)
    assert wait_until(lambda: len(list((tmp_path / "shared").glob("up*"))) == 3, timeout=120), "".join(n.text for n in nodes)
    nodes[1].proc.send_signal(signal.SIGKILL)
    assert [nodes[0].wait(timeout=30), nodes[2].wait(timeout=30)] == [EXIT_NODE_LOST, EXIT_NODE_LOST]
    for node in (nodes[0], nodes[2]):
        assert re.search(r"STOPPED: node 1 \(.*\) was lost", node.text), node.text


def test_a_node_killed_before_the_job_formed_can_join_again(tmp_path, processes, worker):
    port = free_port()
    options = ["--nproc", "1", "--node-timeout", "1", "--join-timeout", "60", *worker]
    node0, first = start_nodes(tmp_path, processes, options, nnodes=3, ranks=(0, 1), port=port, env=launcher_env(FAIL_RANK="2"))
    assert wait_until(lambda: "joined the rendezvous" in first.text, timeout=60), first.text
    first.proc.send_signal(signal.SIGKILL)
    assert wait_until(lambda: "left before the job formed" in node0.text, timeout=30), node0.text
    again, node2 = start_nodes(tmp_path, processes, options, nnodes=3, ranks=(1, 2), port=port, env=launcher_env(FAIL_RANK="2"))
    assert [node0.wait(timeout=60), again.wait(timeout=60), node2.wait(timeout=60)] == [
        EXIT_OTHER_NODE_FAILED,
        EXIT_OTHER_NODE_FAILED,
        7,
    ], node0.text + again.text + node2.text


@pytest.mark.parametrize(
    ("options", "env", "message"),
    [
        (["--master-addr", "a..b", "--node-rank", "1"], {}, "--master-addr a..b: unknown host"),
        (["--master-addr", "127.0.0.1", "--node-rank", "1"], {"MASTER_PORT": "²"}, "MASTER_PORT='²' is not a port number"),
    ],
)
def test_odd_addresses_and_ports_are_one_line(options, env, message):
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--nnodes", "2", "--join-timeout", "1", *options, "--", "true"],
        cwd=ROOT,
        env=launcher_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_line_error(result, message, quiet_stdout=False)


def test_a_flag_port_wins_over_a_bad_master_port_variable():
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"]
        + ["--master-port", str(port), "--join-timeout", "1", "--", "true"],
        cwd=ROOT,
        env=launcher_env(MASTER_PORT="abc"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_line_error(result, f"cannot reach node 0 at 127.0.0.1:{port}", quiet_stdout=False)
