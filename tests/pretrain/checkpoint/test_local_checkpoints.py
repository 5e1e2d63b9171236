"""The local checkpoint tier end to end (issue 41's Done-when, shortened): a worker killed between
local checkpoints resumes from the newest one, not the older durable one, with the losses of an
uninterrupted run; the local tier is gone when the run ends; a local directory that cannot hold it
is refused before any worker starts."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from support.processes import launcher_env
from support.runs import losses, run_launcher as launch
from support.nodes import STEP, start_nodes, train_options
from pretrain.checkpoint import local_dirs

# Durable every 10 steps, local every 4: rank 1 killed after step index 13 (14 steps done) leaves
# durable step_10 and local step_12, the newer.
TIERS = ["--set", "training.checkpoint_interval=10", "--set", "training.local_checkpoint_interval=4"]


def train(tmp_path: Path, name: str, *options: str, faults: str = "") -> subprocess.CompletedProcess:
    argv = ["--debug", "--device", "cpu", "--nproc", "2", "--max-steps", "20", "--run-dir", str(tmp_path / name)]
    argv += ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--local-checkpoint-dir", str(tmp_path / "local"), *TIERS]
    return launch(*argv, *options, timeout=240, **({"PRETRAIN_FAULTS": faults} if faults else {}))


def final_loss(stdout: str) -> str:
    (loss,) = set(re.findall(r"Training complete: \d+ steps in [\d.]+s, final loss ([\d.]+)", stdout))
    return loss


def test_a_worker_killed_between_local_checkpoints_resumes_from_the_newest_with_the_uninterrupted_runs_losses(tmp_path):
    plain = train(tmp_path, "plain")
    assert plain.returncode == 0, plain.stdout[-3000:]
    healed = train(tmp_path, "healed", "--max-restarts", "1", "--restart-backoff", "0", faults="0:1:13:sigkill")
    assert healed.returncode == 0, healed.stdout[-3000:]
    local = tmp_path / "local" / local_dirs.run_key(tmp_path / "healed")
    assert f"launcher: resuming from {local / 'step_12'} (local)" in healed.stdout
    assert final_loss(healed.stdout) == final_loss(plain.stdout)
    reference, redone = losses(tmp_path / "plain"), losses(tmp_path / "healed")
    assert sorted(redone) == sorted(reference) == list(range(20))
    for step, values in redone.items():  # steps 12 and 13 ran twice: the same loss each time
        assert values == [reference[step][0]] * len(values), step
    (first, second) = [json.loads(line) for line in (tmp_path / "healed" / "restarts.jsonl").read_text().splitlines()]
    assert second["resumed_from"] == str(local / "step_12")
    # Only the durable checkpoints are left: the local tier went with the run, the directory named stays.
    assert (tmp_path / "local").is_dir() and not any((tmp_path / "local").iterdir())
    assert sorted(path.name for path in (tmp_path / "healed" / "checkpoints").iterdir()) == ["step_10", "step_20"]


def test_a_local_directory_that_cannot_hold_the_tier_is_refused_before_any_worker_starts(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    argv = [
        "--debug",
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "r"),
        "--local-checkpoint-dir",
        str(blocked),
    ]
    result = launch(*argv, "--set", f"data.cache_dir={tmp_path / 'cache'}", *TIERS, timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr
    assert result.stderr.count("\n") == 1
    key = local_dirs.run_key(tmp_path / "r")
    assert result.stderr.startswith(f"launcher: error: --local-checkpoint-dir {blocked}: {blocked / key} is not writable")
    assert not (tmp_path / "r" / "logs" / "CPU0.log").exists()
    run_dir = ["--run-dir", str(tmp_path / "r2")]
    interval = launch("--debug", "--device", "cpu", *run_dir, *TIERS, "--set", "training.checkpoint_interval=4", timeout=60)
    assert interval.returncode == 2 and interval.stderr.count("\n") == 1, interval.stdout[-2000:] + interval.stderr
    assert "training.local_checkpoint_interval: must be below training.checkpoint_interval (got 4, checkpoint_interval 4)" in (
        interval.stderr
    )
    assert not (tmp_path / "r2").exists()


def test_two_nodes_restart_from_the_local_checkpoint_both_have_each_reading_its_own(tmp_path, processes):
    # Durable every 4 steps, local every 2: a worker killed after step index 6 leaves durable step_4
    # and local step_6 on both nodes (each in its own node<k>/, one worker per node).
    local = tmp_path / "local"
    options = ["--max-steps", "8", "--local-checkpoint-dir", str(local), "--max-restarts", "1", "--restart-backoff", "0"]
    options += ["--set", "training.checkpoint_interval=4", "--set", "training.local_checkpoint_interval=2"]
    # Written synchronously: in the background, rank 1's step_6 may still be in flight when it is
    # killed (a loaded machine), and nodes that disagree rightly resume from the durable step_4.
    options += ["--set", "training.async_checkpoint=false"]
    nodes = start_nodes(
        tmp_path,
        processes,
        train_options(tmp_path, tmp_path / "run", *options),
        env=launcher_env(PRETRAIN_FAULTS="0:1:6:sigkill"),
    )
    assert [run.wait(timeout=240) for run in nodes] == [0, 0], nodes[0].text[-3000:] + nodes[1].text[-3000:]
    base = local / local_dirs.run_key(tmp_path / "run")
    assert f"launcher: resuming from {base / 'node0' / 'step_6'} (local)" in nodes[0].text
    for run in nodes:
        steps = [(int(step), loss) for _, _, step, loss in STEP.findall(run.text)]
        assert [step for step, _ in steps] == [0, 1, 2, 3, 4, 5, 6, 6, 7], steps  # killed after 6: only step 6 again
        assert steps[6] == steps[7], steps  # redone from step_6 with the same loss
    assert not base.exists()  # every node removed its local tier
