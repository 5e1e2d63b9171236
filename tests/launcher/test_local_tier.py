"""The local checkpoint tier as the launcher handles it (launcher/local_tier.py): decided on every
node alike before any worker starts, taken for the run, the local checkpoint every node has chosen
for a restart, the tier removed at the end, and the tiers of runs that ended without removing theirs
removed at a launch's start."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher import local_tier as launcher_local_tier
from pretrain.checkpoint import local_dirs, tiers
from support.checkpointing import checkpoint, config


class FakeNode:
    """What launcher/local_tier.py reads of a round's Node: its place, and the round's after/ keys."""

    def __init__(self, rank: int, board: dict, nnodes: int = 2, nproc: int = 1) -> None:
        self.spec = SimpleNamespace(nnodes=nnodes, own_rank=rank)
        self.rank, self.nproc, self.world_size, self.loss_after = rank, nproc, nnodes * nproc, 5.0
        self.board = board

    def post(self, key: str, value: dict) -> None:
        self.board[key] = value

    def read(self, key: str) -> dict | None:
        return self.board.get(key)

    def check_going(self) -> None:
        pass


@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])  # HSDP saves FSDP's sharded format
def test_the_launcher_turns_the_local_tier_off_for_the_sharded_format_on_several_nodes(tmp_path, monkeypatch, mode):
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "shm")
    sharded = config("training.local_checkpoint_interval=5", f"training.parallelism={mode}")
    said: list[str] = []
    board = {launcher_local_tier.USABLE.format(rank=1): {"usable": False}}
    decided = launcher_local_tier.decide(sharded, tmp_path / "r1", FakeNode(0, board), said.append)
    assert decided.training.local_checkpoint_interval == 0
    assert said == [tiers.sharded_off_line(2)] and "cannot be resumed from per-node directories" in said[0]


def test_a_node_whose_plan_left_the_local_tier_out_turns_it_off_on_every_node(tmp_path, monkeypatch):
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    board: dict = {}
    # Node 1's memory plan turned it off (no host memory for it there): it still answers, and waits for node 0's.
    board[launcher_local_tier.USABLE.format(rank=0)] = {"usable": True}
    planned_off = launcher_local_tier.decide(config(), tmp_path / "r1", FakeNode(1, board), None)
    assert planned_off.training.local_checkpoint_interval == 0
    assert board[launcher_local_tier.USABLE.format(rank=1)] == {"usable": False}
    said: list[str] = []
    wanted = config("training.local_checkpoint_interval=5")
    decided = launcher_local_tier.decide(wanted, tmp_path / "r1", FakeNode(0, board), said.append)
    assert decided.training.local_checkpoint_interval == 0
    assert said == ["warning: no local checkpoints on any node: node(s) 1 cannot hold them; only the durable ones"]


def test_the_local_tier_is_removed_at_the_end_and_the_users_directory_when_nothing_else_is_in_it(tmp_path, monkeypatch):
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "shm")
    run_config = config("training.local_checkpoint_interval=5")
    r1, r2 = tmp_path / "runs" / "r1", tmp_path / "runs" / "r2"
    first, second = tiers.base_of(run_config, r1), tiers.base_of(run_config, r2)
    checkpoint(first / "node0", 15)
    local_dirs.claim(first / "node0", r1)
    checkpoint(second, 10)
    local_dirs.claim(second, r2)
    launcher_local_tier.remove(run_config, r1)
    assert not first.exists() and second.exists()  # another run's tier stays
    launcher_local_tier.remove(run_config, r2)
    assert not tiers.local_root(run_config).exists() and (tmp_path / "shm").is_dir()
    named = config("training.local_checkpoint_interval=5", f"training.local_checkpoint_dir={tmp_path / 'mine'}")
    r3 = tmp_path / "runs" / "r3"
    checkpoint(tiers.base_of(named, r3), 5)
    launcher_local_tier.remove(named, r3)
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())  # the user's own directory stays


def test_two_nodes_resume_a_local_checkpoint_only_when_both_have_the_same_step(tmp_path):
    run_config = config(
        "training.checkpoint_interval=20",
        "training.local_checkpoint_interval=5",
        f"training.local_checkpoint_dir={tmp_path / 'local'}",
    )
    run = tmp_path / "runs" / "r1"
    base = tiers.base_of(run_config, run)
    durable = checkpoint(run / "checkpoints", 20, world_size=2)
    for rank in (0, 1):
        checkpoint(base / f"node{rank}", 25, world_size=2, ranks=range(rank, rank + 1))
        local_dirs.claim(base / f"node{rank}", run)
    board: dict = {}
    node0, node1 = FakeNode(0, board), FakeNode(1, board)
    said: list[str] = []
    assert launcher_local_tier.report(node1, run_config, run, first_world=2) == 25
    assert launcher_local_tier.agreed(node0, run_config, run, durable, 2, said.append) == base / "node0" / "step_25"
    assert said == []
    # Node 1 was killed before its step_25 was whole: both go back to the durable step_20.
    (base / "node1" / "step_25" / "model.pt").unlink()
    board.clear()
    assert launcher_local_tier.report(node1, run_config, run, first_world=2) is None
    assert launcher_local_tier.agreed(node0, run_config, run, durable, 2, said.append) is None
    assert said == ["the nodes' newest local checkpoints differ (node 0: step_25, node 1: none): resuming from the durable one"]
    # A restart on another world size (--min-nproc) lays the ranks out anew: no local checkpoint is reported.
    board.clear()
    assert launcher_local_tier.report(node0, run_config, run, first_world=4) is None


def test_on_several_nodes_one_node_without_room_turns_the_local_tier_off_on_every_node(tmp_path, monkeypatch):
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    run_config = config("training.local_checkpoint_interval=5")
    node1_says = launcher_local_tier.USABLE.format(rank=1)
    board: dict = {node1_says: {"usable": False}}
    said: list[str] = []
    decided = launcher_local_tier.decide(run_config, tmp_path / "r1", FakeNode(0, board), said.append)
    assert decided.training.local_checkpoint_interval == 0  # the same config as node 1's: no "different config"
    assert said == ["warning: no local checkpoints on any node: node(s) 1 cannot hold them; only the durable ones"]
    assert board[launcher_local_tier.USABLE.format(rank=0)] == {"usable": True}
    assert not any((tmp_path / "shm").iterdir())
    board[node1_says] = {"usable": True}
    decided = launcher_local_tier.decide(run_config, tmp_path / "r1", FakeNode(0, board), said.append)
    assert decided.training.local_checkpoint_interval == 5


def test_each_nodes_launcher_removes_its_local_checkpoints_later_than_the_one_the_restart_resumes(tmp_path):
    run = tmp_path / "runs" / "r1"
    run_config = config(
        "training.checkpoint_interval=20",
        "training.local_checkpoint_interval=5",
        f"training.local_checkpoint_dir={tmp_path / 'local'}",
    )
    base = tiers.base_of(run_config, run)
    durable = checkpoint(run / "checkpoints", 20, world_size=2)
    for rank in (0, 1):
        checkpoint(base / f"node{rank}", 15, world_size=2, ranks=range(rank, rank + 1))
        local_dirs.claim(base / f"node{rank}", run)
    checkpoint(base / "node1", 25, world_size=2, ranks=range(1, 2))  # node 0 never finished its step_25
    board: dict = {}
    restart = dataclasses.replace(run_config, training=dataclasses.replace(run_config.training, resume=str(durable)))
    for rank in (1, 0):
        board[launcher_local_tier.USABLE.format(rank=1 - rank)] = {"usable": True}
        launcher_local_tier.decide(restart, run, FakeNode(rank, board), None)
    # Not a later restart's to take: were node 0 to reach step_25 again, they would "agree" on different states.
    assert sorted(path.name for path in (base / "node1").iterdir()) == ["owner.json", "step_15"]
    assert sorted(path.name for path in (base / "node0").iterdir()) == ["owner.json", "step_15"]


def test_a_launch_removes_the_local_tiers_of_runs_that_ended_without_removing_theirs(tmp_path, monkeypatch):
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "shm")
    dead = subprocess.Popen(["true"])
    dead.wait()
    runs = tmp_path / "runs"
    root = local_dirs.default_root()

    def tier(run: Path, pid: int, node: str = "") -> Path:
        run.mkdir(parents=True, exist_ok=True)
        directory = root / local_dirs.run_key(run) / node
        checkpoint(directory, 5)
        local_dirs.claim(directory, run, pid)
        return directory

    killed = tier(runs / "killed", dead.pid)  # its launcher was killed by SIGKILL
    deleted = tier(runs / "deleted", os.getpid())
    shutil.rmtree(runs / "deleted")  # its run directory was deleted
    live = tier(runs / "live", os.getpid())  # another run, training now
    mine = tier(runs / "mine", dead.pid)  # this launch's own (a --resume auto after a SIGKILL)
    node1 = tier(runs / "nodes", dead.pid, "node1")
    node0 = tier(runs / "nodes", os.getpid(), "node0")  # a node of it on this host still runs
    owner = json.loads((killed / "owner.json").read_text())
    (root / "stray").mkdir()  # not a tier: left alone
    elsewhere = tier(runs / "elsewhere", dead.pid)
    (elsewhere / "owner.json").write_text(json.dumps(owner | {"host": "another-host", "run_dir": str(runs / "elsewhere")}))
    run_config = config("training.local_checkpoint_interval=5")
    resumed = dataclasses.replace(run_config, training=dataclasses.replace(run_config.training, resume=str(mine / "step_5")))
    launcher_local_tier.decide(resumed, runs / "mine", None, None)  # this launch: a --resume auto of "mine"
    assert not killed.exists() and not deleted.exists() and not node1.exists()
    assert live.is_dir() and node0.is_dir() and (root / "stray").is_dir() and elsewhere.is_dir()
    assert (mine / "step_5").is_dir() and local_dirs.owned_by(mine, runs / "mine")  # this launch's own, kept
    assert local_dirs.sweep_stale([root], None) == []  # nothing stale is left
