"""Which node this launcher is (launcher/nodes/node.py): the flags and Slurm variables that make a
NodeSpec, the numbering and labels of a node's workers, the stop record one node sends the
others, the config comparison the rendezvous makes (launcher/nodes/rendezvous.py's differences),
and a stop signal between attempts (launcher/nodes/between_rounds.py) on a store of one process."""

from __future__ import annotations

import argparse
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.exit_codes import EXIT_NODE_LOST, EXIT_OTHER_NODE_FAILED
from launcher.nodes.between_rounds import BetweenRounds, Halt, Halted, HeldOnceSpawned, halt_key
from launcher.nodes.node import (
    DEFAULT_MASTER_PORT,
    Layout,
    NodeSpec,
    NodeSpecError,
    NodeStop,
    node_spec,
)
from launcher.nodes.agreement import joined_line
from launcher.nodes.rendezvous import differences
from launcher.nodes.restart_rounds import Decision, RestartRounds
from launcher.nodes.slurm import derived_port
from launcher.supervise.restarts import AttemptEnd


def slurm_env(**overrides: str) -> dict[str, str]:
    """The variables of node 2 of a 4-node sbatch job, with `overrides` on top."""
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "host[01-04]",
    }
    env.update(overrides)
    return env


def spec(
    nnodes: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    env: dict[str, str] | None = None,
) -> NodeSpec | None:
    return node_spec(nnodes, node_rank, master_addr, master_port, env or {})


# node_spec from the flags


def test_no_flags_and_no_slurm_is_a_launch_on_this_machine_alone():
    assert spec() is None


def test_one_node_is_a_launch_on_this_machine_alone():
    assert spec(nnodes=1) is None
    assert spec(nnodes=1, node_rank=0) is None


def test_two_nodes_with_rank_and_address_listen_on_the_default_port():
    assert spec(2, 1, "h") == NodeSpec(2, 1, "h", DEFAULT_MASTER_PORT, "flags")
    assert DEFAULT_MASTER_PORT == 29500


def test_master_port_from_the_environment_replaces_the_default():
    assert spec(2, 1, "h", env={"MASTER_PORT": "31000"}) == NodeSpec(2, 1, "h", 31000, "flags")


def test_an_explicit_master_port_wins_over_the_environment():
    result = spec(2, 1, "h", 31001, env={"MASTER_PORT": "31000"})
    assert result is not None and result.master_port == 31001


def test_master_addr_from_the_environment_is_used_when_the_flag_is_missing():
    result = spec(2, 1, env={"MASTER_ADDR": "node0.example"})
    assert result is not None and result.master_addr == "node0.example"


def test_node_zero_is_the_master_and_the_others_are_not():
    zero, one = spec(2, 0, "h"), spec(2, 1, "h")
    assert zero is not None and zero.is_master
    assert one is not None and not one.is_master


def test_an_ipv6_master_addr_is_bracketed_in_the_endpoint():
    for addr in ("::1", "[::1]"):
        result = spec(2, 1, addr, 29600)
        assert result is not None
        assert result.master_addr == "::1"
        assert result.endpoint == "[::1]:29600"
    named = spec(2, 1, "node0", 29600)
    assert named is not None and named.endpoint == "node0:29600"


@pytest.mark.parametrize(("nnodes", "rank"), [(2, 2), (2, -1), (4, 7), (1, 1)])
def test_a_node_rank_out_of_range_is_refused_naming_the_flag_and_the_valid_range(nnodes, rank):
    with pytest.raises(NodeSpecError) as raised:
        spec(nnodes, rank, "h")
    message = str(raised.value)
    assert "--node-rank" in message
    assert f"0 to {nnodes - 1}" in message


@pytest.mark.parametrize("nnodes", [0, -3, 65537])
def test_a_node_count_out_of_range_is_refused(nnodes):
    with pytest.raises(NodeSpecError, match="--nnodes"):
        spec(nnodes, 0, "h")


def test_several_nodes_without_a_node_rank_are_refused_naming_the_flag():
    with pytest.raises(NodeSpecError, match="--node-rank"):
        spec(2, None, "h")


def test_several_nodes_without_a_master_addr_are_refused_naming_the_flag():
    with pytest.raises(NodeSpecError, match="--master-addr"):
        spec(2, 1)


@pytest.mark.parametrize(
    "flags",
    [{"node_rank": 1}, {"master_addr": "h"}, {"master_port": 29600}, {"node_rank": 0, "master_addr": "h"}],
)
def test_node_options_without_nnodes_are_refused_naming_nnodes(flags):
    with pytest.raises(NodeSpecError, match="--nnodes"):
        spec(**flags)


@pytest.mark.parametrize("port", [65536, 70000, -1])
def test_a_master_port_out_of_range_is_refused(port):
    with pytest.raises(NodeSpecError, match="--master-port"):
        spec(2, 1, "h", port)


def test_a_master_port_of_zero_is_refused():
    with pytest.raises(NodeSpecError, match="--master-port"):
        spec(2, 1, "h", 0)


def test_a_master_port_of_zero_in_the_environment_is_refused():
    with pytest.raises(NodeSpecError, match="MASTER_PORT"):
        spec(2, 1, "h", env={"MASTER_PORT": "0"})


def test_a_master_port_out_of_range_in_the_environment_is_refused():
    with pytest.raises(NodeSpecError):
        spec(2, 1, "h", env={"MASTER_PORT": "70000"})


@pytest.mark.parametrize("value", ["abc", "29500x", "-1", "1.5"])
def test_a_bad_master_port_in_the_environment_is_refused_naming_it(value):
    with pytest.raises(NodeSpecError, match="MASTER_PORT"):
        spec(2, 1, "h", env={"MASTER_PORT": value})


def test_a_blank_master_port_in_the_environment_is_ignored():
    result = spec(2, 1, "h", env={"MASTER_PORT": "  "})
    assert result is not None and result.master_port == DEFAULT_MASTER_PORT


@pytest.mark.parametrize("addr", ["node 0", "a/b", "http://node0", "h;rm", " h", "h\t"])
def test_a_nonsense_master_addr_is_refused(addr):
    with pytest.raises(NodeSpecError, match="--master-addr"):
        spec(2, 1, addr)


def test_a_master_addr_with_a_trailing_newline_is_refused():
    with pytest.raises(NodeSpecError, match="--master-addr"):
        spec(2, 1, "h\n")


# node_spec under Slurm


def test_a_slurm_job_of_several_nodes_gives_its_nodes_rank_first_host_and_derived_port():
    assert spec(env=slurm_env()) == NodeSpec(4, 2, "host01", derived_port(123456), "Slurm")


def test_the_derived_port_is_the_same_for_every_node_of_the_job():
    specs = [spec(env=slurm_env(SLURM_NODEID=str(rank))) for rank in range(4)]
    assert {s.master_port for s in specs if s is not None} == {derived_port(123456)}
    assert [s.node_rank for s in specs if s is not None] == [0, 1, 2, 3]


def test_an_explicit_master_port_wins_over_the_slurm_port():
    result = spec(master_port=31000, env=slurm_env())
    assert result is not None
    assert result.master_port == 31000
    assert (result.nnodes, result.node_rank, result.master_addr) == (4, 2, "host01")


def test_an_explicit_node_rank_and_master_addr_win_over_slurm():
    result = spec(node_rank=3, master_addr="other", env=slurm_env())
    assert result is not None
    assert (result.nnodes, result.node_rank, result.master_addr) == (4, 3, "other")


def test_an_explicit_nnodes_wins_over_slurm_and_names_the_flags_as_source():
    result = spec(nnodes=3, env=slurm_env())
    assert result == NodeSpec(3, 2, "host01", derived_port(123456), "flags")


def test_master_port_in_a_slurm_job_environment_wins_over_the_derived_port():
    result = spec(env=slurm_env(MASTER_PORT="31000"))
    assert result is not None and result.master_port == 31000


def test_a_one_node_slurm_allocation_is_a_launch_on_this_machine_alone():
    assert spec(env=slurm_env(SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_NODELIST="host01")) is None


def test_the_master_of_a_mixed_node_list_is_its_first_host():
    result = spec(env=slurm_env(SLURM_JOB_NODELIST="a,b[3-5]"))
    assert result is not None and result.master_addr == "a"


@pytest.mark.parametrize(
    "broken",
    [{"SLURM_NNODES": "four"}, {"SLURM_NODEID": "9"}, {"SLURM_JOB_NODELIST": "host[01-"}, {"SLURM_JOB_ID": "x"}],
)
def test_a_broken_slurm_environment_without_flags_is_refused_pointing_at_nnodes(broken):
    with pytest.raises(NodeSpecError, match="--nnodes"):
        spec(env=slurm_env(**broken))


def test_a_broken_slurm_environment_is_ignored_when_the_flags_say_everything():
    result = spec(2, 1, "h", env=slurm_env(SLURM_NNODES="four"))
    assert result == NodeSpec(2, 1, "h", DEFAULT_MASTER_PORT, "flags")


def test_a_shell_without_slurm_nodeid_is_not_a_slurm_launch():
    env = slurm_env()
    del env["SLURM_NODEID"]
    assert spec(env=env) is None


# Layout


def test_global_ranks_put_node_zeros_workers_first():
    layout = Layout(nproc=4, node_rank=2, nnodes=3)
    assert [layout.global_rank(local) for local in range(4)] == [8, 9, 10, 11]
    assert Layout(nproc=4).global_rank(3) == 3


def test_world_size_counts_every_worker_of_every_node():
    assert Layout(nproc=4, node_rank=1, nnodes=3).world_size == 12
    assert Layout(nproc=2).world_size == 2


def test_one_node_keeps_its_labels_as_given():
    layout = Layout(nproc=4)
    assert layout.label("GPU2", 2) == "GPU2"
    assert layout.label("CPU1", 1) == "CPU1"


def test_several_nodes_put_the_global_rank_in_front_of_a_gpu_label():
    label = Layout(nproc=4, node_rank=2, nnodes=3).label("GPU2", 2)
    assert label == "r10.GPU2"
    assert "GPU2:" in label + ":"  # `grep GPU2:` still finds its lines


def test_several_nodes_number_cpu_workers_by_global_rank():
    layout = Layout(nproc=4, node_rank=2, nnodes=3)
    assert layout.label("CPU1", 1) == "CPU9"
    assert Layout(nproc=2, node_rank=0, nnodes=2).label("CPU0", 0) == "CPU0"


# NodeStop


def test_a_stop_record_survives_a_json_round_trip():
    stop = NodeStop(node=1, host="gpu02", kind="failed", detail="exited with 3", label="GPU2", rank=6, exit_code=3)
    assert NodeStop.from_json(stop.to_json()) == stop
    assert NodeStop.from_json(stop.to_json().encode()) == stop
    lost = NodeStop(node=3, host="", kind="lost", detail="no beat for 30 s")
    assert NodeStop.from_json(lost.to_json()) == lost


@pytest.mark.parametrize("text", ["garbage", "", "[1, 2]", "null", '"x"', '{"node": 1}', '{"bogus": 1}', b"\xff\xfe"])
def test_an_unreadable_stop_record_becomes_an_error_instead_of_raising(text):
    stop = NodeStop.from_json(text)
    assert stop.kind == "error"
    assert stop.node == -1
    assert "unreadable" in stop.detail


def test_a_lost_node_makes_the_others_exit_76_and_a_failure_or_error_75():
    assert EXIT_NODE_LOST == 76 and EXIT_OTHER_NODE_FAILED == 75
    assert NodeStop(1, "h", "lost").our_exit_code == 76
    assert NodeStop(1, "h", "failed").our_exit_code == 75
    assert NodeStop(1, "h", "error").our_exit_code == 75


def test_a_failure_description_names_the_node_host_worker_and_rank():
    text = NodeStop(1, "gpu02", "failed", "exited with 3", label="r6.GPU2", rank=6, exit_code=3).describe()
    assert "node 1" in text
    assert "gpu02" in text
    assert "r6.GPU2" in text
    assert "rank 6" in text
    assert "exited with 3" in text


def test_lost_and_error_descriptions_name_the_node_and_say_what_happened():
    lost = NodeStop(3, "gpu04", "lost", "no beat for 30 s").describe()
    assert "node 3 (gpu04)" in lost and "lost" in lost and "no beat for 30 s" in lost
    error = NodeStop(2, "", "error", "config differs").describe()
    assert "node 2" in error and "()" not in error and "error" in error and "config differs" in error


# differences


def test_equal_configs_have_no_differences():
    config = {"training": {"max_steps": 10, "lr": 0.1}, "name": "x"}
    assert differences(config, {"training": {"max_steps": 10, "lr": 0.1}, "name": "x"}) == []
    assert differences({}, {}) == []


def test_a_nested_difference_is_named_by_its_dotted_key():
    a = {"training": {"max_steps": 10, "lr": 0.1}, "model": {"layers": 2}}
    b = {"training": {"max_steps": 20, "lr": 0.1}, "model": {"layers": 2}}
    assert differences(a, b) == ["training.max_steps"]


def test_every_difference_is_named_in_sorted_order():
    a = {"z": 1, "a": {"b": {"c": 1}}}
    b = {"z": 2, "a": {"b": {"c": 2}}}
    assert differences(a, b) == ["a.b.c", "z"]


def test_a_key_present_on_one_side_only_is_named():
    assert differences({"training": {"max_steps": 10}}, {"training": {"max_steps": 10, "seed": 1}}) == ["training.seed"]
    assert differences({"extra": 1}, {}) == ["extra"]


def test_configs_that_are_not_dicts_and_differ_are_named_as_the_config():
    assert differences(1, 2) == ["the config"]
    assert differences({"a": 1}, None) == ["the config"]


@pytest.mark.parametrize(
    ("nnodes", "world_size", "nproc", "line"),
    [
        (1, 1, 1, "the only node joined: 1 worker"),
        (1, 2, 2, "the only node joined: 2 workers"),
        (2, 2, 1, "all 2 nodes joined: 2 workers, 1 on each node"),
        (3, 12, 4, "all 3 nodes joined: 12 workers, 4 on each node"),
    ],
)
def test_the_joined_line_says_one_node_and_one_worker_in_the_singular(nnodes, world_size, nproc, line):
    assert joined_line(nnodes, world_size, nproc) == line


# A stop signal between attempts


class Store:
    """Node 0's store as the stop between attempts uses it; every node's connection to it."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}
        self.lock = threading.Lock()

    def check(self, keys: list[str]) -> bool:
        return all(key in self.keys for key in keys)

    def get(self, key: str) -> bytes:
        return self.keys[key].encode()

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value

    def compare_set(self, key: str, expected: str, value: str) -> bytes:
        with self.lock:
            if key not in self.keys and expected == "":
                self.keys[key] = value
            return self.keys.get(key, expected).encode()

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.keys[key] = str(int(self.keys.get(key, "0")) + amount)
            return int(self.keys[key])


def node_of_job(store: Store, rank: int, roster: list[int], said: list[str]) -> RestartRounds:
    """Node `rank`'s part of a job of two nodes that restarts, its store connections `store`."""
    args = argparse.Namespace(node_timeout=60.0, max_restarts=1, stop_timeout=1.0, kill_grace=1.0)
    console = SimpleNamespace(launcher_line=said.append)
    spec = NodeSpec(2, rank, "127.0.0.1", 29500, "flags")
    job = RestartRounds(args, None, ["true"], None, console, spec, None, None, hosted=store if rank == 0 else None, roster=roster)
    job._client = lambda: store
    return job


def test_a_stop_node_0_reads_from_the_rounds_interrupt_reaches_the_stopped_node_waiting_for_node_0s_decision():
    # Node 1's supervisor took a SIGTERM during training while node 0 tore a failure down: node 0
    # read it from the round's interrupt key; node 1 waits for node 0's decision between attempts.
    store, said0, said1 = Store(), [], []
    node0, node1 = node_of_job(store, 0, [0, 1], said0), node_of_job(store, 1, [0, 1], said1)
    node0.between = 1
    codes: list[int] = []
    read = Halted(Halt(1, signal.SIGTERM), here=False)
    teller = threading.Thread(target=lambda: codes.append(node0._halted(read, None, None, None)))
    with pytest.raises(Halted) as raised:
        with BetweenRounds(lambda: store, 1, 1):  # node 1's stretch, until node 0's word
            teller.start()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # short waits, as the launcher's: the relay lands between two
                time.sleep(0.01)
    assert (raised.value.halt, raised.value.here, raised.value.number) == (Halt(1, signal.SIGTERM), True, 1)
    assert node1._halted(raised.value, None, None, None) == 143
    teller.join(60)
    assert codes == [143]  # node 0 waited for node 1's word that it had read the halt, then stopped
    assert said0 == [Halt(1, signal.SIGTERM).line(here=False)]
    assert said1 == [Halt(1, signal.SIGTERM).line(here=True)]


@pytest.mark.parametrize("restart", [False, True])
def test_a_stop_signal_held_just_after_the_workers_ended_stops_every_node_only_when_a_restart_was_decided(restart):
    store, said = Store(), []
    job = node_of_job(store, 0, [0], said)
    node = SimpleNamespace(
        rank=0,
        spec=job.spec,
        post=lambda key, value: None,
        interrupted=lambda: None,
        finish=lambda code, wait: None,
        report_interrupt=lambda signum: None,
        others_done={},
        lost={},
    )

    def attempt(config, node, run_dir, port, restarts, spawned):
        spawned()
        signal.raise_signal(signal.SIGTERM)  # once the supervisor has given the signals back
        return 0, AttemptEnd(0)

    job.owned, job.attempt = SimpleNamespace(path=Path("run")), attempt
    job._join = lambda spec, namespace: node
    job._plan = lambda node, number: (None, 0, number)
    job._decide = lambda node, number, previous, entry, code: (Decision(restart, "why"), None)
    assert job._attempts() == 143
    assert [key for key in store.keys if "halted" in key] == ([halt_key(1)] if restart else [])
    stopped = Halt(0, signal.SIGTERM).line(here=True)
    assert said == ([stopped] if restart else ["received SIGTERM after this node's workers had ended; exit code 143"])


def test_a_stop_signal_held_after_a_failed_attempt_stops_every_node_at_once_not_after_node_0s_decision():
    # Node 0 may still be tearing its workers down (up to --kill-grace): the word must reach it now.
    store, said, reported = Store(), [], []
    job = node_of_job(store, 1, [0, 1], said)
    node = SimpleNamespace(rank=1, spec=job.spec, post=lambda key, value: None, report_interrupt=reported.append)

    def attempt(config, node, run_dir, port, restarts, spawned):
        spawned()
        signal.raise_signal(signal.SIGTERM)  # once the supervisor has given the signals back
        return 137, AttemptEnd(137, "CPU1", 1, "killed by SIGKILL")

    def decide(*_: object) -> None:
        raise AssertionError("the held signal waited for node 0's decision")

    job.owned, job.attempt = SimpleNamespace(path=Path("run")), attempt
    job._join = lambda spec, namespace: node
    job._plan = lambda node, number: (None, 0, number)
    job._decide = decide
    job._rejoin = lambda: None  # node 1 of the job's first round
    assert job._attempts() == 143
    assert halt_key(1) in store.keys and reported == [signal.SIGTERM]  # the halt, and the round's interrupt
    assert said == [Halt(1, signal.SIGTERM).line(here=True)]


def test_the_stretch_between_attempts_takes_the_stop_signals_straight_from_the_attempts_hold():
    before = signal.getsignal(signal.SIGTERM)
    held: list[int] = []
    with HeldOnceSpawned([None], held) as hold:
        with pytest.raises(Halted) as raised:
            with hold.hand_over(BetweenRounds(Store, 0, 1)):
                signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) == before  # the launcher's own handler again, not the hold's
    assert raised.value.here and held == [] and signal.getsignal(signal.SIGTERM) == before
