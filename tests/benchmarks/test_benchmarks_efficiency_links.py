"""benchmarks/efficiency.py's bytes by link: a collective counts as inter-node when its process
group spans nodes (node-major ranks), else intra-node; one-node rows say so (inter 0); and on 2
loopback nodes x 2 gloo ranks HSDP sends across nodes only its gradient all-reduce (and the finite
check), within 1.1x of the minimum, where FSDP over every rank sends its all-gathers and
reduce-scatters."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import efficiency, efficiency_groups, efficiency_links as links  # noqa: E402
from benchmarks import efficiency_counters as counters  # noqa: E402
from benchmarks.efficiency_report import Row  # noqa: E402

TINY = ["model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64", "debug.trace_nonfinite=false"]


def test_a_group_within_a_node_is_intra_node_and_one_across_nodes_inter_node():
    assert links.link_of([0, 1], ranks_per_node=2) == links.INTRA
    assert links.link_of([2, 3], ranks_per_node=2) == links.INTRA
    assert links.link_of([0, 2], ranks_per_node=2) == links.INTER  # the same local rank on two nodes
    assert links.link_of([1, 2], ranks_per_node=2) == links.INTER  # neighbours, but on two nodes
    assert links.link_of(range(4), ranks_per_node=4) == links.INTRA


def test_workers_are_numbered_node_major_as_torchrun_numbers_them():
    env = links.node_env(rank=3, nodes=2, ranks_per_node=2)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "1", "2")
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("1", "2")


def _count_by_group(rank: int, port: int, out: str) -> None:
    """One of 4 gloo ranks (2 nodes x 2): the same all-reduce on a node's group, a group across
    nodes and every rank, as a c10d op and as a functional collective; rank 0 writes what its
    counter attributed to each link."""
    os.environ.update(links.node_env(rank, 2, 2))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    node = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    counter = counters.DispatchCounter(lambda tensor: False, ranks_per_node=2)
    with counter:
        dist.all_reduce(torch.zeros(10), group=node)  # 40 bytes within the node
        functional.all_reduce(torch.zeros(20), "sum", node).wait()  # 80 within
        dist.all_reduce(torch.zeros(3), group=across)  # 12 across
        functional.all_reduce(torch.zeros(5), "sum", across).wait()  # 20 across
        gathered = torch.zeros(4 * 2)
        dist.all_gather_into_tensor(gathered, torch.ones(2))  # 32 across (every rank)
    if rank == 0:
        Path(out).write_text(repr(dict(counter.link_bytes)))
    dist.barrier()
    dist.destroy_process_group()


def test_the_counter_attributes_each_collective_to_its_process_groups_link(tmp_path):
    from launcher.launch import free_port

    out = tmp_path / "links.txt"
    mp.spawn(_count_by_group, args=(free_port(), str(out)), nprocs=4)
    assert eval(out.read_text()) == {"intra_node/all_reduce": 120, "inter_node/all_reduce": 32, "inter_node/all_gather": 32}


def test_one_node_rows_carry_nodes_their_parallelism_and_no_inter_node_bytes():
    count = {"true_tokens_per_step": 1000, "parameters": 100, "gather_bytes": 260, "plan": {"parallelism": "ddp"}}
    eager = [{"collective_bytes_by_link_per_step": {"inter_node": {}, "intra_node": {"all_reduce": 432.0}}}] * 2
    values = links.link_values(Row("small", "dense", 2, "none"), count, eager, scale=2.0)
    assert values == {
        "nodes": 1,
        "parallelism": "ddp",
        "inter_node_bytes_per_token": 0,
        "inter_node_minimum_bytes_per_token": 0,
        "intra_node_bytes_per_token": pytest.approx(0.864),  # every byte, scaled as collective_bytes_per_token
        "inter_node_bytes_by_kind": {},
    }
    one = links.link_values(Row("small", "dense", 1, "none"), count, [{"collective_bytes_by_link_per_step": {}}], 1.0)
    assert (one["parallelism"], one["inter_node_bytes_per_token"], one["intra_node_bytes_per_token"]) == ("none", 0, 0)
    assert set(links.link_values(Row("small", "dense", 1, "none"), count, [], 1.0)) <= set(efficiency.KEYS)


def test_the_inter_node_minimum_is_hsdps_shard_all_reduce_and_all_of_fsdps_and_ddps():
    count = {"true_tokens_per_step": 1000, "parameters": 100, "gather_bytes": 260}
    two_by_two = Row("small", "dense", 2, "none", nodes=2)
    hsdp = count | {"plan": {"parallelism": "hsdp"}}
    minimum = {"all_gather": 0.26, "reduce_scatter": 0.4, "all_reduce": (4 * 100 / 2 + 32) / 1000}  # the shard's all-reduce
    assert links.minimum_bytes(hsdp, two_by_two) == pytest.approx(minimum)
    assert links.inter_node_minimum(hsdp, two_by_two) == pytest.approx(minimum["all_reduce"])
    fsdp, ddp = (count | {"plan": {"parallelism": mode}} for mode in ("fsdp", "ddp"))
    assert links.inter_node_minimum(fsdp, two_by_two) == pytest.approx((260 + 400 + 32) / 1000)
    assert links.inter_node_minimum(ddp, two_by_two) == pytest.approx((400 + 32) / 1000)
    assert links.inter_node_minimum(hsdp, Row("small", "dense", 2, "none")) == 0


def test_on_several_nodes_each_row_runs_as_hsdp_and_fsdp_and_quick_has_the_production_pair():
    args = efficiency.parse_args(["--quick", "--nodes", "2", "--no-markdown"])
    rows = efficiency.rows_of(args)
    production = [r for r in rows if r.preset == "production"]
    assert [(r.nodes, r.ranks, r.parallelism, r.activation_checkpointing) for r in production] == [
        (2, 2, "hsdp", "full"),
        (2, 2, "fsdp", "full"),
    ]
    job = efficiency.job(production[0], args, '"full"', compiled=False)
    assert (job["nodes"], job["ranks"], job["world"]) == (2, 2, 4)
    assert "training.parallelism=hsdp" in job["true_sets"] and "training.parallelism=fsdp" not in job["true_sets"]
    assert [r.nodes for r in efficiency.rows_of(efficiency.parse_args(["--quick"]))] == [1] * len(efficiency.QUICK)


def test_on_two_loopback_nodes_hsdp_sends_across_nodes_only_its_gradient_all_reduce(tmp_path):
    """A tiny debug model with 2 micro-batches per step, both ways in one group of 2 x 2 gloo ranks:
    HSDP's all-gathers and reduce-scatters stay within the node, its cross-node bytes are the
    all-reduce's (once per step, the gradient shard) within 1.1x of the minimum; FSDP's cross nodes."""
    sets = [
        "data.source=builtin",
        "data.tokenizer=byte",
        f"data.cache_dir={tmp_path / 'cache'}",
        "system.device=cpu",
        "logging.tensorboard=false",
        "training.batch_size=1",
        "data.context_length=32",
        "training.grad_accum_nums=2",
        "training.eval_batches=1",
        "training.max_steps=20",
        "debug.check_finite=true",
        *TINY,
    ]
    rows, jobs = [], []
    for mode in links.SHARDED_ACROSS_NODES:
        rows.append(Row("debug", "dense", 2, "none", nodes=2, parallelism=mode))
        mode_sets = [*sets, f"training.parallelism={mode}"]
        jobs.append({"name": rows[-1].name, "preset": "debug", "nodes": 2, "ranks": 2, "world": 4})
        jobs[-1] |= {"true_sets": mode_sets, "run_sets": mode_sets, "plan_gpu_bytes": 80 * 2**30, "compile": False}
    counts = efficiency_groups.count_all(jobs, tmp_path, timeout=120)
    per_rank, error = efficiency_groups.run_group(jobs, 2, tmp_path, timeout=120, nodes=2)
    assert not error
    failed = [r["error"] for rank in per_rank for r in rank if "error" in r] + [c["error"] for c in counts if "error" in c]
    assert not failed, failed
    hsdp, fsdp = (efficiency.combine(row, counts[i], [r[i] for r in per_rank]).values for i, row in enumerate(rows))
    assert (hsdp["nodes"], hsdp["parallelism"], fsdp["parallelism"]) == (2, "hsdp", "fsdp")
    assert set(hsdp["inter_node_bytes_by_kind"]) == {"all_reduce"}, hsdp["inter_node_bytes_by_kind"]
    assert hsdp["inter_node_minimum_bytes_per_token"] <= hsdp["inter_node_bytes_per_token"]
    assert hsdp["inter_node_bytes_per_token"] <= 1.1 * hsdp["inter_node_minimum_bytes_per_token"]
    assert hsdp["intra_node_bytes_per_token"] > 2 * hsdp["inter_node_bytes_per_token"]  # the gathers and reduce-scatters
    assert {"all_gather", "reduce_scatter"} <= set(fsdp["inter_node_bytes_by_kind"]) and fsdp["intra_node_bytes_per_token"] == 0
    assert hsdp["inter_node_bytes_per_token"] < fsdp["inter_node_bytes_per_token"] / 4


def test_nodes_below_one_is_refused_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        efficiency.parse_args(["--nodes", "0"])
    assert exit_info.value.code == 2 and "--nodes must be 1 or more" in capsys.readouterr().err
