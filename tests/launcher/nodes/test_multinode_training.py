"""Training across two nodes: two launchers on 127.0.0.1, one CPU worker each (gloo), and across
two network namespaces where the tests run as root. A single world of 2 with the losses of one
launcher with 2 workers; checkpoints resumed across node counts; FSDP shards; Ctrl-C on one node;
a training worker killed on node 1 (docs/multinode.md)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from support.processes import ROOT, free_port, launcher_env, wait_until
from support.runs import run_launcher
from launcher.exit_codes import EXIT_OTHER_NODE_FAILED
from support.nodes import STEP, MARKER, NodeRun, start_nodes, losses, train_options, training_worker, marked_processes


# --- training across two nodes ------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Four steps on two nodes, four steps on one launcher with two workers, then each resumed
    to six steps on the other layout."""
    tmp_path = tmp_path_factory.mktemp("multinode")
    started: list[subprocess.Popen] = []

    def processes(argv, **options):
        started.append(subprocess.Popen(argv, start_new_session=True, **options))
        return started[-1]

    def two_nodes(name: str, *more: str) -> list[NodeRun]:
        runs = start_nodes(tmp_path, processes, train_options(tmp_path, tmp_path / name, *more))
        for run in runs:
            run.wait()
        return runs

    def one_node(name: str, *more: str) -> subprocess.CompletedProcess:
        options = train_options(tmp_path, tmp_path / name, *more)
        options[options.index("--nproc") + 1] = "2"
        return run_launcher(*options, timeout=240)

    nodes = two_nodes("two", "--max-steps", "4")
    single = one_node("one", "--max-steps", "4")
    resumed_on_one = one_node("two-then-one", "--max-steps", "6", "--resume", str(tmp_path / "two" / "checkpoints" / "step_4"))
    resumed_on_two = two_nodes("one-then-two", "--max-steps", "6", "--resume", str(tmp_path / "one" / "checkpoints" / "step_4"))
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return tmp_path, nodes, single, resumed_on_one, resumed_on_two


@pytest.mark.slow
def test_two_nodes_train_one_world_of_two_with_the_losses_of_one_launcher_with_two_workers(trained):
    _, nodes, single, _, _ = trained
    assert [run.proc.returncode for run in nodes] == [0, 0], nodes[0].text[-2000:] + nodes[1].text[-2000:]
    assert single.returncode == 0, single.stdout[-2000:]
    on_nodes = losses(nodes[0].text) | losses(nodes[1].text)
    assert set(on_nodes) == {(f"CPU{rank}", step) for rank in (0, 1) for step in range(4)}
    assert on_nodes == losses(single.stdout)
    assert "all 2 nodes joined: 2 workers, 1 on each node" in nodes[0].text
    assert "DDP over 2 CPU workers" in nodes[1].text


@pytest.mark.slow
def test_each_node_prints_only_its_own_workers_and_keeps_its_own_logs(trained):
    tmp_path, nodes, _, _, _ = trained
    assert "CPU1:" not in nodes[0].text and "CPU0:" not in nodes[1].text
    logs = tmp_path / "two" / "logs"
    assert sorted(p.relative_to(logs).as_posix() for p in logs.rglob("*.log")) == [
        "node0/combined.log",
        "node0/cpu0.log",
        "node1/combined.log",
        "node1/cpu1.log",
    ]
    assert (tmp_path / "two" / "workers.node0.json").exists() and (tmp_path / "two" / "workers.node1.json").exists()


@pytest.mark.slow
def test_a_checkpoint_of_two_nodes_resumes_on_one_and_the_reverse_with_the_same_losses(trained):
    _, _, _, on_one, on_two = trained
    assert on_one.returncode == 0, on_one.stdout[-2000:]
    assert [run.proc.returncode for run in on_two] == [0, 0], on_two[0].text[-2000:]
    assert "resuming from" in on_one.stdout and "resuming from" in on_two[0].text
    continued_on_two = losses(on_two[0].text) | losses(on_two[1].text)
    assert set(continued_on_two) == {(f"CPU{rank}", step) for rank in (0, 1) for step in (4, 5)}
    assert continued_on_two == losses(on_one.stdout)


@pytest.mark.slow
def test_under_fsdp_each_nodes_rank_writes_its_shard_and_one_node_resumes_them(tmp_path, processes):
    options = train_options(tmp_path, tmp_path / "run", "--max-steps", "2", "--set", "training.parallelism=fsdp")
    nodes = start_nodes(tmp_path, processes, options)
    assert [run.wait() for run in nodes] == [0, 0], nodes[0].text[-3000:] + nodes[1].text[-3000:]
    checkpoint = tmp_path / "run" / "checkpoints" / "step_2"
    assert sorted(p.name for p in (checkpoint / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (checkpoint / "rng_rank0.pt").exists() and (checkpoint / "rng_rank1.pt").exists()
    resumed = train_options(tmp_path, tmp_path / "resumed", "--max-steps", "3", "--resume", str(checkpoint))
    resumed[resumed.index("--nproc") + 1] = "2"
    result = run_launcher(*resumed, "--set", "training.parallelism=fsdp", timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"resuming from {checkpoint}" in result.stdout
    assert set(losses(result.stdout)) == {("CPU0", 2), ("CPU1", 2)}


@pytest.mark.slow
def test_ctrl_c_on_node_0_stops_both_nodes_gracefully_at_one_step_with_a_checkpoint(tmp_path, processes):
    options = train_options(tmp_path, tmp_path / "run", "--max-steps", "100000")
    nodes = start_nodes(tmp_path, processes, options)
    assert wait_until(lambda: all(STEP.search(run.text) for run in nodes), timeout=180), nodes[0].text + nodes[1].text
    nodes[0].proc.send_signal(signal.SIGINT)
    codes = [run.wait(timeout=60) for run in nodes]
    assert codes == [130, 130], nodes[0].text[-3000:] + nodes[1].text[-3000:]
    assert "node 0 was asked to stop (SIGINT); so is this node" in nodes[1].text
    saved = [re.search(r"Stopped by SIGTERM after step \d+; checkpoint saved to (\S+)", run.text) for run in nodes]
    assert all(saved) and saved[0][1] == saved[1][1] and Path(saved[0][1]).is_dir()
    assert "FAILED" not in nodes[0].text + nodes[1].text


@pytest.mark.slow
def test_a_training_worker_killed_on_node_1_stops_both_nodes_within_3_seconds(tmp_path, processes):
    marker = uuid.uuid4().hex
    options = train_options(tmp_path, tmp_path / "run", "--max-steps", "100000", "--kill-grace", "2")
    nodes = start_nodes(tmp_path, processes, options, env=launcher_env(**{MARKER: marker}))
    assert wait_until(lambda: all(STEP.search(run.text) for run in nodes), timeout=180), nodes[0].text + nodes[1].text
    worker = training_worker(nodes[1].proc)
    assert worker is not None
    killed_at = time.monotonic()
    worker.kill()
    codes = [run.wait(timeout=30) for run in nodes]
    both_exited = time.monotonic() - killed_at
    assert codes == [EXIT_OTHER_NODE_FAILED, 128 + signal.SIGKILL], nodes[0].text[-3000:] + nodes[1].text[-3000:]
    assert both_exited < 3.0, (both_exited, nodes[0].text[-1500:], nodes[1].text[-1500:])
    assert "failed first: CPU1 (rank 1) killed by SIGKILL" in nodes[0].text
    assert wait_until(lambda: not marked_processes(marker), timeout=2.0)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The debug preset for three steps on two loopback nodes of two CPU ranks each, under HSDP
    (sharded within a node, replicated across) and under FSDP over all four ranks."""
    tmp_path = tmp_path_factory.mktemp("hsdp")
    started: list[subprocess.Popen] = []

    def processes(argv, **options):
        started.append(subprocess.Popen(argv, start_new_session=True, **options))
        return started[-1]

    runs = {}
    for mode in ("hsdp", "fsdp"):
        options = train_options(tmp_path, tmp_path / mode, "--max-steps", "3", "--set", f"training.parallelism={mode}")
        options[options.index("--nproc") + 1] = "2"
        runs[mode] = start_nodes(tmp_path, processes, options)
        for run in runs[mode]:
            run.wait()
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return runs


@pytest.mark.slow
def test_two_nodes_of_two_ranks_under_hsdp_train_to_fsdps_losses(sharded):
    for mode, nodes in sharded.items():
        assert [run.proc.returncode for run in nodes] == [0, 0], (mode, nodes[0].text[-3000:], nodes[1].text[-3000:])
    assert "parallelism: HSDP over 4 CPU workers (2 nodes x 2" in sharded["hsdp"][0].text
    assert "parallelism: FSDP over 4 CPU workers" in sharded["fsdp"][0].text
    hsdp, fsdp = ({key: float(loss) for run in sharded[mode] for key, loss in losses(run.text).items()} for mode in sharded)
    assert set(hsdp) == set(fsdp) == {(f"CPU{rank}", step) for rank in range(4) for step in range(3)}
    assert hsdp == pytest.approx(fsdp, abs=2e-4), (hsdp, fsdp)  # printed to 4 decimals


# Every worker says it is up, then waits until every worker of the job is (files in a shared
# directory: a handshake, not a sleep); the one on rank FAIL_RANK then exits 7.

# --- across two network namespaces (root only) ----------------------------------------------

NETNS_ADDRESSES = ("10.231.0.1", "10.231.0.2")


@pytest.fixture
def two_namespaces():
    """Two network namespaces joined by a veth pair, as two machines on one link; skipped where
    they cannot be made (not root, no `ip`, a container without the capability)."""
    tag = uuid.uuid4().hex[:6]
    names, links = (f"mn{tag}a", f"mn{tag}b"), (f"vm{tag}a", f"vm{tag}b")

    def ip(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", *args], capture_output=True, text=True)

    if os.geteuid() != 0 or shutil.which("ip") is None or ip("netns", "add", names[0]).returncode != 0:
        pytest.skip("network namespaces need root and `ip netns`")
    try:
        setup = [
            ("netns", "add", names[1]),
            ("link", "add", links[0], "type", "veth", "peer", "name", links[1]),
        ]
        for ns, link, address in zip(names, links, NETNS_ADDRESSES, strict=True):
            setup += [
                ("link", "set", link, "netns", ns),
                ("-n", ns, "addr", "add", f"{address}/24", "dev", link),
                ("-n", ns, "link", "set", link, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in setup:
            result = ip(*step)
            if result.returncode != 0:
                pytest.skip(f"cannot set up network namespaces: ip {' '.join(step)}: {result.stderr.strip()}")
        yield list(zip(names, links, strict=True))
    finally:
        for ns in names:
            ip("netns", "del", ns)


@pytest.mark.slow
def test_two_nodes_in_two_network_namespaces_train_one_world(tmp_path, processes, two_namespaces):
    port = free_port()
    runs = []
    for rank in (1, 0):
        ns, link = two_namespaces[rank]
        out = tmp_path / f"ns-node{rank}.out"
        flags = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", NETNS_ADDRESSES[0], "--master-port", str(port)]
        options = train_options(tmp_path, tmp_path / "run", "--max-steps", "3")
        # gloo finds its own address through the interface named here, as on a real cluster
        argv = [
            "ip",
            "netns",
            "exec",
            ns,
            "env",
            f"GLOO_SOCKET_IFNAME={link}",
            sys.executable,
            "-m",
            "launcher",
            *flags,
            *options,
        ]
        with out.open("w") as handle:
            runs.append(
                NodeRun(rank, processes(argv, cwd=ROOT, env=launcher_env(), stdout=handle, stderr=subprocess.STDOUT), out)
            )
    node1, node0 = runs
    assert [node0.wait(), node1.wait()] == [0, 0], node0.text[-3000:] + node1.text[-3000:]
    assert f"rendezvous on {NETNS_ADDRESSES[0]}:{port}" in node0.text
    assert set(losses(node0.text) | losses(node1.text)) == {(f"CPU{rank}", step) for rank in (0, 1) for step in range(3)}
