"""A launched worker's environment against torchrun's (launcher/processes/torchrun_env.py): the same
variables, with values that mean the same, so what recognizes torchrun recognizes the launcher:
torch's env:// init, its @record error files, Lightning Fabric's TorchElasticEnvironment."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from support.processes import ROOT, launcher_env
from launcher.processes import torchrun_env
from launcher.processes.torchrun_env import Restarts
from launcher.processes.worker import worker_env
from support.nodes import start_nodes, worker_command

# Writes its environment to <out>/<RANK>.json; with --init, joins the job through torch's env://
# (gloo) and writes the all-reduced sum of the ranks + 1 too.
DUMP = """
import json, os, sys
from pathlib import Path
out = Path(sys.argv[1])
result = {"env": dict(os.environ)}
if "--init" in sys.argv:
    import torch, torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    total = torch.tensor(float(dist.get_rank() + 1))
    dist.all_reduce(total)
    result["sum"] = total.item()
    dist.destroy_process_group()
(out / (os.environ["RANK"] + ".json")).write_text(json.dumps(result))
"""

FABRIC = """
import json, sys
import torch
from lightning_fabric import Fabric
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum")
print("FABRIC " + json.dumps({
    "environment": type(fabric.strategy.cluster_environment).__name__,
    "global_rank": fabric.global_rank,
    "world_size": fabric.world_size,
    "sum": total.item(),
}), flush=True)
"""

RECORDED_FAILURE = """
import os, sys
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 cannot go on")

main()
"""

SAME_VALUE = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
]
"""Variables whose value is the same under both: numbering, role, restarts, torch's signal list."""


def clean_env() -> dict[str, str]:
    """The test's environment without what a launcher sets, so what each adds shows."""
    ours = worker_env({}, rank=0, world_size=1, master_port=1, gpu=None, cpu_count=1, compile_cache=None)
    return {k: v for k, v in launcher_env().items() if k not in ours and k != "PYTHONUNBUFFERED"}


def dumps(out: Path, ranks: int) -> list[dict]:
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(ranks)]


def dump_under(argv: list[str], tmp_path: Path, name: str) -> list[dict]:
    """Run argv + [dump.py, out] (argv ends in the interpreter torchrun leaves out) under
    clean_env(); each rank's dump, in rank order."""
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    result = subprocess.run(
        [*argv, str(script), str(out)], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return dumps(out, 2)


def test_a_launched_worker_gets_every_variable_torchrun_gives_meaning_the_same(tmp_path):
    torchrun = dump_under(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2"],
        tmp_path,
        "torchrun",
    )
    ours = dump_under(
        [sys.executable, "-m", "launcher", "--device", "cpu", "--nproc", "2", "--runs-dir", str(tmp_path), "--", sys.executable],
        tmp_path,
        "ours",
    )
    base = clean_env()
    for rank, (theirs, mine) in enumerate(zip((d["env"] for d in torchrun), (d["env"] for d in ours), strict=True)):
        given_by_torchrun = {k for k, v in theirs.items() if base.get(k) != v}
        assert given_by_torchrun - set(mine) == set(), f"rank {rank} lacks what torchrun gives"
        assert {k: mine[k] for k in SAME_VALUE} == {k: theirs[k] for k in SAME_VALUE}
        assert mine["RANK"] == str(rank) and mine["GROUP_RANK"] == "0" and mine["ROLE_NAME"] == "default"
        # Where the job's store is: both on this machine, a port of its own.
        assert socket.gethostbyname(mine["MASTER_ADDR"]) == socket.gethostbyname(theirs["MASTER_ADDR"]) == "127.0.0.1"
        assert 0 < int(mine["MASTER_PORT"]) < 65536
        # torchrun's agent hosts that store ("True"); here the rank-0 worker does, as torch's
        # env:// does for any other value (the next tests init through it).
        assert (theirs["TORCHELASTIC_USE_AGENT_STORE"], mine["TORCHELASTIC_USE_AGENT_STORE"]) == ("True", "False")
        # NCCL's asynchronous error handling on: 1 (torchrun) and 3 (torch's default) both end
        # the process on a failed collective; 3 does not first abort the communicators.
        assert (theirs["TORCH_NCCL_ASYNC_ERROR_HANDLING"], mine["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == ("1", "3")
        assert int(mine["OMP_NUM_THREADS"]) >= 1  # a bound per worker: torchrun's 1, ours cores / workers
    (run_dir,) = tmp_path.glob("2*-*")  # the command's own run directory, under --runs-dir
    mine = [d["env"] for d in ours]
    assert {e["TORCHELASTIC_RUN_ID"] for e in mine} == {run_dir.name}
    assert len({e["MASTER_PORT"] for e in mine}) == 1
    assert [e["TORCHELASTIC_ERROR_FILE"] for e in mine] == [str(run_dir / "logs" / f"cpu{r}.error.json") for r in (0, 1)]


def launch_two_cpu_workers(script: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """python -m launcher --device cpu --nproc 2 [options] -- python script."""
    return subprocess.run(
        [sys.executable, "-m", "launcher", "--device", "cpu", "--nproc", "2", *options, "--", sys.executable, str(script)],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_worker_wrapped_in_torchs_record_writes_its_error_file_beside_its_log(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "cpu0.error.json").write_text("an earlier launch's error")
    script = tmp_path / "fails.py"
    script.write_text(RECORDED_FAILURE)
    result = launch_two_cpu_workers(script, "--run-dir", str(run_dir))
    assert result.returncode == 1, result.stdout + result.stderr
    error = json.loads((run_dir / "logs" / "cpu1.error.json").read_text())
    assert error["message"]["message"] == "ValueError: rank 1 cannot go on"
    assert not (run_dir / "logs" / "cpu0.error.json").exists()  # the stale one is gone; rank 0 did not fail


def test_lightning_fabric_under_the_launcher_detects_torchelastic(tmp_path):
    script = tmp_path / "fabric_worker.py"
    script.write_text(FABRIC)
    result = launch_two_cpu_workers(script, "--runs-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    seen = [json.loads(line.split("FABRIC ", 1)[1]) for line in result.stdout.splitlines() if "FABRIC " in line]
    assert sorted(seen, key=lambda worker: worker["global_rank"]) == [
        {"environment": "TorchElasticEnvironment", "global_rank": rank, "world_size": 2, "sum": 3.0} for rank in (0, 1)
    ], result.stdout


def test_two_nodes_workers_get_torchruns_variables_and_init_through_env(tmp_path, processes):
    worker = worker_command(tmp_path, DUMP)
    shared = worker[-1]
    nodes = start_nodes(tmp_path, processes, ["--nproc", "1", *worker, "--init"])
    codes = [node.wait(timeout=120) for node in nodes]
    assert codes == [0, 0], nodes[0].text + nodes[1].text
    results = dumps(Path(shared), 2)
    assert [r["sum"] for r in results] == [3.0, 3.0]  # both joined one gloo job through env://
    envs = [r["env"] for r in results]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "0", "2"),
        ("1", "0", "1", "2"),
    ]
    assert [(e["ROLE_RANK"], e["ROLE_WORLD_SIZE"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "2", "2", "1"),
        ("1", "2", "2", "1"),
    ]
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {run_dir.name}  # one id for the job, as --rdzv-id
    assert [e["TORCHELASTIC_ERROR_FILE"] for e in envs] == [
        str(run_dir / "logs" / "node0" / "cpu0.error.json"),
        str(run_dir / "logs" / "node1" / "cpu1.error.json"),
    ]


def test_worker_environment_takes_restarts_from_one_place_and_overrides_an_outer_torchruns():
    outer = {"TORCHELASTIC_RUN_ID": "outer", "GROUP_RANK": "5", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    env = worker_env(
        outer,
        rank=3,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        node_rank=1,
        nnodes=2,
        master_port=1,
        gpu=None,
        cpu_count=1,
        compile_cache=None,
        run_id="run-7",
        restarts=Restarts(count=2, maximum=3),
    )
    assert {k: env[k] for k in ["TORCHELASTIC_RUN_ID", "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"]} == {
        "TORCHELASTIC_RUN_ID": "run-7",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("2", "3")


def test_worker_environment_keeps_the_users_nccl_error_handling():
    env = worker_env(
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, rank=0, world_size=1, master_port=1, gpu="0", cpu_count=1, compile_cache=None
    )
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_the_docs_say_the_restart_count_is_the_attempts_number_under_max_restarts():
    # What the workers see (tests/launcher/test_restarting_runs.py: 0, then 1 after a restart); the docs
    # said it was always 0, "the launcher restarts no worker".
    design = (ROOT / "docs" / "design.md").read_text().splitlines()
    (row,) = [line for line in design if line.startswith("| `TORCHELASTIC_RESTART_COUNT`")]
    for text in (row, " ".join((torchrun_env.__doc__ or "").split())):
        assert "restarts no worker" not in text and "--max-restarts" in text and "after the first restart" in text
