"""training.grad_accum_nums "auto" (pretrain/config/loading.py, pretrain/plan/parallelism.py): the
largest micro-batch that fits the GPU, accumulated to keep training.global_batch_size; the same
losses as the explicit split; one line, exit 2, when there is no global batch to keep."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import ROOT, launcher_env, one_line_error
from support.memory_configs import with_training
from pretrain import config as cfg
from pretrain.config import ConfigError
from pretrain.config.batch import micro_batch_choices
from pretrain.plan.gpu_memory import GIB, estimate, fits_gpu
from pretrain.plan.parallelism import plan_parallelism, undecided


def auto_small(global_batch: int = 64) -> cfg.Config:
    return cfg.resolve("small", sets=["training.grad_accum_nums=auto", f"training.global_batch_size={global_batch}"])


@pytest.mark.parametrize("gpu_gib", [12, 16, 24, 40, 80])
def test_auto_picks_the_largest_micro_batch_that_fits_and_keeps_the_global_batch(gpu_gib):
    config = auto_small()
    planned, line = plan_parallelism(config, 1, gpu_gib * GIB)
    t = planned.training
    assert t.batch_size * t.grad_accum_nums == 64  # the global batch, on one GPU
    assert fits_gpu(estimate(planned, 1, "ddp").total, gpu_gib * GIB)
    larger = [b for b in range(t.batch_size + 1, 65) if 64 % b == 0]
    for batch in larger:  # every larger micro-batch that keeps the global batch, with what was recomputed
        bigger = with_training(planned, batch_size=batch, grad_accum_nums=64 // batch)
        assert not fits_gpu(estimate(bigger, 1, "ddp").total, gpu_gib * GIB)
    assert line.endswith(f"; micro-batch: {t.batch_size} sequences x {t.grad_accum_nums} per step (grad_accum_nums auto)")


def test_a_larger_gpu_gets_a_larger_micro_batch_and_fewer_of_them():
    small_gpu, _ = plan_parallelism(auto_small(), 1, 12 * GIB)
    large_gpu, _ = plan_parallelism(auto_small(), 1, 80 * GIB)
    assert small_gpu.training.batch_size < large_gpu.training.batch_size
    assert small_gpu.training.grad_accum_nums > large_gpu.training.grad_accum_nums


def test_a_global_batch_above_the_largest_micro_batch_is_split_within_both_bounds():
    """2^20 sequences on one rank: no micro-batch above 65536 (training.batch_size's bound) is offered,
    nor one that would need more than 65536 micro-batches; the divisors are found without counting
    up to the share (2^32 is allowed)."""
    config = cfg.resolve(preset="small", sets=["training.grad_accum_nums=auto", "training.global_batch_size=1048576"])
    assert micro_batch_choices(config, 1) == [2**k for k in range(16, 3, -1)]  # 65536 x 16 ... 16 x 65536
    huge = cfg.resolve(preset="small", sets=["training.grad_accum_nums=auto", "training.global_batch_size=4294967296"])
    assert micro_batch_choices(huge, 1) == [65536]


def test_auto_splits_the_global_batch_over_the_ranks():
    planned, _ = plan_parallelism(auto_small(64), 4, 80 * GIB)
    t = planned.training
    assert t.batch_size * t.grad_accum_nums * 4 == 64


def test_on_cpu_workers_auto_keeps_the_largest_micro_batch_up_to_batch_size():
    # no GPU memory to fill: training.batch_size bounds the micro-batch, accumulation keeps the global batch
    config = cfg.resolve(
        "debug", sets=["training.grad_accum_nums=auto", "training.global_batch_size=24", "training.batch_size=5"]
    )
    planned, line = plan_parallelism(config, 1, None)
    assert (planned.training.batch_size, planned.training.grad_accum_nums) == (4, 6)  # 4 divides 24, 5 does not
    assert "micro-batch: 4 sequences x 6 per step" in line


def test_auto_is_left_to_the_plan_and_read_as_a_number_only_after_it():
    config = auto_small()
    assert undecided(with_training(config, parallelism="ddp", activation_checkpointing="none", cpu_offload=False))
    with pytest.raises(ValueError, match='still "auto"'):
        cfg.grad_accum_nums(config)
    planned, _ = plan_parallelism(config, 1, 80 * GIB)
    assert cfg.grad_accum_nums(planned) == planned.training.grad_accum_nums
    # the run's length counts the global batch, whichever split the plan takes
    batch, accum = cfg.batch_split(config, 1)
    assert batch * accum == 64


def test_auto_without_a_global_batch_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        cfg.resolve("small", sets=["training.grad_accum_nums=auto"])
    message = one_line_error(error)
    assert message.startswith('training.grad_accum_nums "auto" keeps training.global_batch_size, which is 0; set it')


def test_auto_with_a_global_batch_the_ranks_cannot_share_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        cfg.with_world_size(auto_small(30), 4)
    assert one_line_error(error) == (
        'training.global_batch_size 30 does not split over 4 rank(s), as training.grad_accum_nums "auto" needs '
        "(each rank takes an equal share); use 28 or 32"
    )


def test_auto_accepts_the_global_batch_from_a_later_layer():
    # each layer is checked as it comes, but "auto" needs its global batch only once all are applied
    config = cfg.resolve("small", sets=["training.grad_accum_nums=auto", "training.global_batch_size=32"])
    assert config.training.grad_accum_nums == "auto"


def test_grad_accum_nums_is_a_number_or_auto():
    with pytest.raises(ConfigError) as error:
        cfg.resolve("small", sets=["training.grad_accum_nums=0"])
    assert "training.grad_accum_nums" in one_line_error(error) and '"auto"' in one_line_error(error)


# --- through pretrain_main.py -----------------------------------------------------------


def pretrain_main(*sets: str, cache: Path, run_dir: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(ROOT / "pretrain_main.py"), "--debug", "--max-steps", "3"]
    if run_dir is not None:
        argv += ["--run-dir", str(run_dir)]
    for assignment in ("system.device=cpu", f"data.cache_dir={cache}", *sets):
        argv += ["--set", assignment]
    return subprocess.run(argv, env=launcher_env(), capture_output=True, text=True, timeout=timeout)


def test_auto_without_a_global_batch_is_one_line_and_exit_2_from_pretrain_main(tmp_path):
    result = pretrain_main("training.grad_accum_nums=auto", cache=tmp_path / "cache")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('pretrain: error: training.grad_accum_nums "auto" keeps')


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if "loss" in record and "val_loss" not in record]


def test_auto_trains_to_the_explicit_splits_losses(tmp_path):
    cache = tmp_path / "cache"
    explicit = pretrain_main("training.batch_size=2", "training.grad_accum_nums=4", cache=cache, run_dir=tmp_path / "explicit")
    assert explicit.returncode == 0, explicit.stderr[-3000:]
    # on CPU, "auto" takes the largest micro-batch up to batch_size that divides the global batch: 4 x 2
    auto = pretrain_main(
        "training.batch_size=4",
        "training.grad_accum_nums=auto",
        "training.global_batch_size=8",
        cache=cache,
        run_dir=tmp_path / "auto",
    )
    assert auto.returncode == 0, auto.stderr[-3000:]
    saved = json.loads((tmp_path / "auto" / "config.json").read_text())["training"]
    assert (saved["batch_size"], saved["grad_accum_nums"]) == (4, 2)  # the run records the numbers it trained with
    assert re.search(r"4 x 128 tokens per micro-batch, 2 micro-batches per step", auto.stdout + auto.stderr)
    expected, got = losses(tmp_path / "explicit"), losses(tmp_path / "auto")
    assert len(expected) == len(got) == 3
    assert got == pytest.approx(expected, rel=1e-5)  # the same 8 sequences a step, summed in another order


def test_the_launcher_refuses_a_global_batch_its_workers_cannot_share_before_it_prepares_any_data(tmp_path):
    argv = [sys.executable, "-m", "launcher", "--debug", "--nproc", "2", "--runs-dir", str(tmp_path / "runs")]
    for assignment in ("training.grad_accum_nums=auto", "training.global_batch_size=7", f"data.cache_dir={tmp_path / 'cache'}"):
        argv += ["--set", assignment]
    result = subprocess.run(argv, env=launcher_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    assert "does not split over 2 rank(s)" in result.stdout + result.stderr
    assert "dataset" not in result.stdout + result.stderr and not (tmp_path / "cache").exists()
