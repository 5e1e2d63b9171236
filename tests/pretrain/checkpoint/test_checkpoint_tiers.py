"""Two checkpoint tiers (pretrain/checkpoint/tiers.py): which tier a step saves to, which checkpoint a
restart takes (the newest complete of either tier; a local one only when every node has it), where
the local tier goes and when it is refused or off, and its removal at the run's end."""

from __future__ import annotations


import pytest

from support.processes import one_line_error
from pretrain.checkpoint import local_dirs, tiers
from pretrain.checkpoint.files import checkpoint_problem
from pretrain.checkpoint.resume import resolve_resume
from pretrain.config import ConfigError
from support.checkpointing import checkpoint, config


def test_a_local_checkpoint_is_due_between_the_durable_ones_and_durable_wins_when_both_are():
    both = config("training.checkpoint_interval=20", "training.local_checkpoint_interval=5")
    saved = {step: tiers.due(step, both) for step in range(1, 41) if tiers.due(step, both)}
    assert saved == {5: "local", 10: "local", 15: "local", 20: "durable", 25: "local", 30: "local", 35: "local", 40: "durable"}
    durable_only = config("training.checkpoint_interval=20")
    assert [step for step in range(1, 41) if tiers.due(step, durable_only)] == [20, 40]
    local_only = config("training.local_checkpoint_interval=5")
    assert {tiers.due(step, local_only) for step in range(5, 41, 5)} == {"local"}


def test_the_newest_checkpoint_of_either_tier_is_taken_and_a_tie_goes_to_the_durable_one(tmp_path):
    durable, local = tmp_path / "run" / "checkpoints", tmp_path / "local"
    checkpoint(durable, 20)
    assert tiers.newest(durable, local, 1) == durable / "step_20"  # no local tier yet
    checkpoint(local, 15)
    assert tiers.newest(durable, local, 1) == durable / "step_20"  # the durable one is newer
    checkpoint(local, 25)
    assert tiers.newest(durable, local, 1) == local / "step_25"
    checkpoint(durable, 25)
    assert tiers.newest(durable, local, 1) == durable / "step_25"
    assert tiers.newest(tmp_path / "none", local, 1) == local / "step_25"  # no durable one at all
    assert tiers.newest(durable, None, 1) == durable / "step_25"


def test_a_damaged_local_checkpoint_is_skipped_for_the_durable_one_saying_so(tmp_path):
    durable, local = tmp_path / "run" / "checkpoints", tmp_path / "local"
    checkpoint(durable, 20)
    damaged = checkpoint(local, 25)
    (damaged / "optimizer.pt").write_bytes(b"cut short")
    said: list[str] = []
    assert tiers.newest(durable, local, 1, said.append) == durable / "step_20"
    assert said == [
        f"warning: local checkpoint {damaged} is damaged (optimizer.pt is damaged (not a whole torch.save file)); "
        f"resuming from the durable {durable / 'step_20'}"
    ]


def test_resume_auto_in_a_run_directory_continues_a_newer_local_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "shm")
    run = tmp_path / "runs" / "r1"
    checkpoint(run / "checkpoints", 20)
    run_config = config("training.checkpoint_interval=20", "training.local_checkpoint_interval=5")
    local = tiers.base_of(run_config, run)
    checkpoint(local, 25)
    local_dirs.claim(local, run)
    assert tiers.local_dir_of(run_config, run, tiers.NodePlace()) == local
    assert resolve_resume("auto", str(run), tmp_path / "runs", 1, run_config) == (run, local / "step_25")
    assert resolve_resume("auto", str(run), tmp_path / "runs", 1) == (run, (run / "checkpoints" / "step_20").resolve())


def test_a_local_directory_that_another_run_owns_or_no_run_owns_is_never_resumed(tmp_path, monkeypatch):
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "shm")
    run, other = tmp_path / "runs" / "r1", tmp_path / "elsewhere" / "r1"
    checkpoint(run / "checkpoints", 20)
    run_config = config("training.checkpoint_interval=20", "training.local_checkpoint_interval=5")
    local = tiers.base_of(run_config, run)
    checkpoint(local, 25)  # no owner.json: nobody's (not this code's)
    durable = (run / "checkpoints" / "step_20").resolve()
    assert resolve_resume("auto", str(run), tmp_path / "runs", 1, run_config) == (run, durable)
    local_dirs.claim(local, other)  # another run's (a hash shared by chance, or a directory put there)
    assert tiers.local_dir_of(run_config, run, tiers.NodePlace()) is None
    assert resolve_resume("auto", str(run), tmp_path / "runs", 1, run_config) == (run, durable)


def test_two_runs_of_the_same_name_in_different_places_have_their_own_local_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "shm")
    run_config = config("training.local_checkpoint_interval=5")
    first, second = tiers.base_of(run_config, tmp_path / "a" / "exp"), tiers.base_of(run_config, tmp_path / "b" / "exp")
    assert first != second and first.parent == second.parent
    assert first.name.startswith("exp-") and second.name.startswith("exp-")
    assert tiers.base_of(run_config, tmp_path / "a" / "." / "exp") == first  # the same directory: the same tier


def test_a_fresh_start_empties_the_runs_local_directory_and_a_resume_removes_the_later_ones(tmp_path):
    run, local = tmp_path / "runs" / "r1", tmp_path / "local" / "r1"
    for steps in (5, 10, 15):
        checkpoint(local, steps)
    (local / "step_20.tmp").mkdir()
    (local / "notes.txt").write_text("not the tier's")
    local_dirs.claim(local, run)  # an earlier attempt's
    tiers.take(local, run, str(local / "step_10"))
    assert local_dirs.owned_by(local, run)
    assert sorted(path.name for path in local.iterdir()) == ["notes.txt", "owner.json", "step_10", "step_5"]
    tiers.take(local, run, "")  # a fresh start: none of them is this continuation's
    assert sorted(path.name for path in local.iterdir()) == ["notes.txt", "owner.json"]
    checkpoint(local, 5)
    tiers.take(local, tmp_path / "runs" / "r2", str(local / "step_5"))  # owned by another run: its checkpoints go
    assert sorted(path.name for path in local.iterdir()) == ["notes.txt", "owner.json"]
    assert local_dirs.owned_by(local, tmp_path / "runs" / "r2")


def test_nodes_with_different_local_steps_fall_back_to_the_durable_one():
    assert tiers.agreed_step(20, [25, 25]) == 25
    assert tiers.agreed_step(None, [15, 15, 15]) == 15
    assert tiers.agreed_step(20, [25, 20]) is None  # node 1 was killed before its step_25 was whole
    assert tiers.agreed_step(20, [25, None]) is None  # node 1 has none (a new machine)
    assert tiers.agreed_step(20, [20, 20]) is None  # not newer: the durable one
    assert tiers.agreed_step(20, []) is None


def test_a_nodes_local_checkpoint_is_complete_with_its_own_ranks_random_generators(tmp_path):
    node1 = checkpoint(tmp_path / "run1" / "node1", 15, world_size=4, ranks=range(2, 4))
    assert checkpoint_problem(node1, 4, range(2, 4)) is None
    assert "rng_rank0.pt is missing" in (checkpoint_problem(node1, 4) or "")  # as a durable one, incomplete
    assert tiers.local_steps(node1.parent, 4, range(2, 4)) == 15
    assert tiers.local_steps(node1.parent, 4, range(0, 2)) is None
    place = tiers.NodePlace(nodes=2, node_rank=1, per_node=2)
    assert place.ranks == range(2, 4)
    assert tiers.on_this_node(tmp_path / "run1" / "node0" / "step_15", node1.parent) == node1
    assert tiers.on_this_node(tmp_path / "run1" / "checkpoints" / "step_15", node1.parent).parent.name == "checkpoints"
    assert tiers.this_node({"GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == place
    assert tiers.this_node({}) == tiers.NodePlace()


def test_a_resume_from_the_local_checkpoint_node_0_chose_reads_this_nodes_own_copy(tmp_path, monkeypatch):
    run_config = config("training.local_checkpoint_interval=5", f"training.local_checkpoint_dir={tmp_path / 'local'}")
    run = tmp_path / "runs" / "r1"
    base = tiers.base_of(run_config, run)
    checkpoint(base / "node0", 15, world_size=4, ranks=range(0, 2))
    mine = checkpoint(base / "node1", 15, world_size=4, ranks=range(2, 4))
    local_dirs.claim(base / "node1", run)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_resume(str(base / "node0" / "step_15"), str(run), tmp_path / "runs", 4, run_config) == (run, mine.resolve())


def test_local_checkpoint_interval_not_below_checkpoint_interval_is_refused_in_one_line():
    for sets in (["training.checkpoint_interval=20", "training.local_checkpoint_interval=20"],
                 ["training.checkpoint_interval=20", "training.local_checkpoint_interval=40"]):  # fmt: skip
        with pytest.raises(ConfigError) as refused:
            config(*sets)
        local = sets[1].rpartition("=")[2]
        assert one_line_error(refused) == (
            f"--set: training.local_checkpoint_interval: must be below training.checkpoint_interval (got {local}, "
            "checkpoint_interval 20): the local tier is the frequent one; lower it, or set it to 0 for durable checkpoints alone"
        )
    assert (
        config("training.checkpoint_interval=0", "training.local_checkpoint_interval=5").training.local_checkpoint_interval == 5
    )
    with pytest.raises(ConfigError, match="training.local_checkpoint_interval: must not be negative"):
        config("training.local_checkpoint_interval=-1")


def test_the_default_local_directory_is_per_user_and_per_run_in_dev_shm(tmp_path, monkeypatch):
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    run_config = config("training.local_checkpoint_interval=5")
    run = tmp_path / "runs" / "2026-01-01_run"
    base = tiers.local_base(run_config, run)
    assert base is not None and base.parent.name.startswith("pretrain-") and base.name == local_dirs.run_key(run)
    assert base.name.startswith("2026-01-01_run-") and base.parent.parent == tmp_path / "shm" and base.is_dir()
    alone = tiers.run_tiers(run_config, run, sharded=False, environ={})
    assert alone["local"] == tiers.Tier("local", base, 1, False) and local_dirs.owned_by(base, run)
    node1 = {"GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "1"}
    assert tiers.run_tiers(run_config, run, sharded=False, environ=node1)["local"].directory == base / "node1"
    assert "local" not in tiers.run_tiers(config(), run, sharded=False, environ={})  # local_checkpoint_interval 0


def test_the_default_local_directory_without_room_turns_the_tier_off_with_one_warning_line(tmp_path, monkeypatch):
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    monkeypatch.setattr(tiers, "checkpoint_bytes", lambda model: 1 << 60)
    said: list[str] = []
    assert tiers.local_base(config("training.local_checkpoint_interval=5"), tmp_path / "r1", said.append) is None
    (line,) = said
    assert line.startswith("warning: no local checkpoints (") and "too small for two checkpoints of" in line
    assert line.endswith("with --local-checkpoint-dir")
    assert not any((tmp_path / "shm").iterdir())  # nothing left behind
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "no-shm")
    said.clear()
    assert tiers.local_base(config("training.local_checkpoint_interval=5"), tmp_path / "r1", said.append) is None
    assert said == [
        f"warning: no local checkpoints ({tmp_path / 'no-shm'} does not exist); only the durable ones every "
        "training.checkpoint_interval steps; name a directory with room for 2147483648.00 GiB with --local-checkpoint-dir"
    ]


def test_a_named_local_directory_that_is_not_writable_or_too_small_is_refused_in_one_line(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"  # a directory cannot be made inside it (and root may write anywhere else)
    blocked.write_text("")
    named = config("training.local_checkpoint_interval=5", f"training.local_checkpoint_dir={blocked}")
    with pytest.raises(tiers.LocalDirError) as refused:
        tiers.local_base(named, tmp_path / "r1")
    message = one_line_error(refused)
    key = local_dirs.run_key(tmp_path / "r1")
    assert message.startswith(f"--local-checkpoint-dir {blocked}: {blocked / key} is not writable (Not a directory); ")
    assert message.endswith(" MiB (two checkpoints), or set training.local_checkpoint_interval=0")
    monkeypatch.setattr(tiers, "checkpoint_bytes", lambda model: 1 << 60)
    named = config("training.local_checkpoint_interval=5", f"training.local_checkpoint_dir={tmp_path / 'small'}")
    with pytest.raises(tiers.LocalDirError) as refused:
        tiers.local_base(named, tmp_path / "r1")
    message = one_line_error(refused)
    assert "free, too small for two checkpoints of 1073741824.00 GiB" in message
    assert message.endswith("(two checkpoints), or set training.local_checkpoint_interval=0")
    assert refused.value.exit_code == 2


def test_a_local_directory_that_is_holds_or_is_inside_the_run_directory_or_the_runs_root_is_refused(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    monkeypatch.setenv("PRETRAIN_RUNS_DIR", str(runs))
    run = runs / "exp"
    for named, clash in (
        (runs, f"it is the runs root {runs}"),
        (run, f"it is the run directory {run}"),
        (run / "local", f"it is inside the run directory {run}"),
        (tmp_path, f"it holds the run directory {run}"),
    ):
        with pytest.raises(tiers.LocalDirError) as refused:
            tiers.local_base(config("training.local_checkpoint_interval=5", f"training.local_checkpoint_dir={named}"), run)
        assert one_line_error(refused) == (
            f"--local-checkpoint-dir {named}: {clash}; name a directory of its own, outside the run directory and the "
            "runs root, or set training.local_checkpoint_interval=0"
        )
    assert not run.exists()  # refused before anything was made
    monkeypatch.setattr(local_dirs, "SHM", tmp_path)  # the default /dev/shm/pretrain-<user> inside the runs root
    monkeypatch.setenv("PRETRAIN_RUNS_DIR", str(tmp_path))
    said: list[str] = []
    assert tiers.local_base(config("training.local_checkpoint_interval=5"), tmp_path / "exp", said.append) is None
    assert len(said) == 1 and f"it is inside the runs root {tmp_path}" in said[0]


def test_removing_a_local_tier_removes_only_what_the_tier_put_there(tmp_path):
    run = tmp_path / "runs" / "r1"
    named = config("training.local_checkpoint_interval=5", f"training.local_checkpoint_dir={tmp_path / 'mine'}")
    base = tiers.base_of(named, run)
    (base / "checkpoints").mkdir(parents=True)  # not the tier's: something of the user's that happens to be there
    (base / "metrics.jsonl").write_text("{}")
    checkpoint(base, 15)
    (base / "step_20.tmp").mkdir()
    local_dirs.claim(base, run)
    tiers.remove_run_local(named, run)
    assert sorted(path.name for path in base.iterdir()) == ["checkpoints", "metrics.jsonl"]
    (base / "metrics.jsonl").unlink()
    (base / "checkpoints").rmdir()
    checkpoint(base, 15)
    tiers.remove_run_local(named, run)
    assert not base.exists() and (tmp_path / "mine").is_dir()  # emptied and removed; the named directory stays


def test_later_local_checkpoints_are_discarded_when_a_resume_takes_an_earlier_one(tmp_path):
    local = tmp_path / "local"
    checkpoint(local, 15)
    checkpoint(local, 25)
    assert [path.name for path in tiers.discard_later(local, 20)] == ["step_25"]
    assert sorted(path.name for path in local.iterdir()) == ["step_15"]


def test_under_the_launcher_every_rank_takes_the_local_directory_it_decided_without_checking_it_again(tmp_path, monkeypatch):
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "shm")
    monkeypatch.setattr(tiers, "checkpoint_bytes", lambda model: 1 << 60)  # a check here would find no room
    run_config = config("training.local_checkpoint_interval=5")
    decided = {tiers.LOCAL_DIR_VAR: str(tmp_path / "decided")}
    found = tiers.run_tiers(run_config, tmp_path / "r1", sharded=False, environ=decided)
    assert found["local"] == tiers.Tier("local", tmp_path / "decided", 1, False)
    assert not (tmp_path / "shm").exists()  # nothing probed


def test_without_the_launcher_one_rank_without_room_turns_the_local_tier_off_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(local_dirs, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    run_config = config("training.local_checkpoint_interval=5")
    answers: list[bool] = []

    def another_rank_has_no_room(usable: bool) -> bool:
        answers.append(usable)
        return False

    said: list[str] = []
    found = tiers.run_tiers(run_config, tmp_path / "r1", False, said.append, another_rank_has_no_room, environ={})
    assert answers == [True] and "local" not in found
    assert said == ["warning: no local checkpoints: another rank's local directory cannot hold them; only the durable ones"]
    assert not any((tmp_path / "shm").iterdir())  # nothing left behind
    assert "local" in tiers.run_tiers(run_config, tmp_path / "r1", False, said.append, lambda usable: usable, environ={})


def test_a_damaged_local_checkpoint_says_what_is_resumed_instead(tmp_path):
    durable, local = tmp_path / "run" / "checkpoints", tmp_path / "local"
    damaged = checkpoint(local, 25)
    (damaged / "optimizer.pt").write_bytes(b"cut short")
    said: list[str] = []
    assert tiers.newest(durable, local, 1, said.append) is None
    assert said == [
        f"warning: local checkpoint {damaged} is damaged (optimizer.pt is damaged (not a whole torch.save file)); "
        "no other checkpoint to resume: starting at step 0"
    ]
    earlier = checkpoint(local, 15)
    said.clear()
    assert tiers.newest(durable, local, 1, said.append) == earlier
    assert said == [
        f"warning: local checkpoint {damaged} is damaged (optimizer.pt is damaged (not a whole torch.save file)); "
        f"resuming from the local {earlier}"
    ]
