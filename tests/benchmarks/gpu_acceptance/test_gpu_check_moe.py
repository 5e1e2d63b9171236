"""The GPU check `moe` (benchmarks/gpu_acceptance/checks_moe.py) where no GPU is needed: its runs'
configs, the rows it makes of their results, and a failed run becoming a `no` row."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.gpu_acceptance import checks, checks_moe, groups, procs
from pretrain import config as cfg
from pretrain.model.moe_dropless import ExpertsKernel
from support.grouped_kernels import nan_for_empty_groups


def measured(tokens_per_s: float, dropped: int) -> dict:
    return {"losses": [5.0, 4.0], "tokens_per_s": tokens_per_s, "mfu": 0.3, "dropped": dropped, "assignments": 1000}


def test_the_two_runs_are_small_with_four_experts_top_2_dropless_and_capacity_1_25_compiled():
    configs = {mode: cfg.resolve(preset="small", sets=checks_moe.run_sets(mode, 10)) for mode in checks_moe.MODES}
    assert configs["dropless"].model.moe.capacity_factor is None
    assert configs["capacity"].model.moe.capacity_factor == 1.25
    for config in configs.values():
        assert (config.model.moe.num_experts, config.model.moe.top_k) == (4, 2)
        assert config.training.compile is True and config.training.max_steps == 10


def test_the_rows_give_each_runs_speed_and_drops_and_dropless_must_drop_none_and_be_no_slower():
    rows = checks_moe.speed_rows(measured(1200.0, 0), measured(1000.0, 37))
    assert [row.met for row in rows] == ["yes", "yes", "yes"]
    assert "0 of 1,000 token-expert assignments dropped" in rows[0].result
    assert "37 of 1,000" in rows[1].result and rows[2].result.startswith("1.20x")
    assert [row.met for row in checks_moe.speed_rows(measured(900.0, 0), measured(1000.0, 37))][2] == "no"
    assert checks_moe.speed_rows(measured(1200.0, 3), measured(1000.0, 37))[0].met == "no"  # dropless dropped some


def test_the_check_runs_dropless_then_capacity_on_the_chosen_gpu_and_a_failed_run_is_a_no_row(monkeypatch, tmp_path):
    seen = []

    def fake_run(argv, timeout, env):
        mode = argv[argv.index("benchmarks.gpu_acceptance.checks_moe") + 1]
        seen.append((mode, env["CUDA_VISIBLE_DEVICES"], timeout))
        if mode == "kernel":
            return procs.Proc(argv, 0, procs.RESULT_MARK + json.dumps(KERNEL_RESULT) + "\n", 20.0)
        if mode == "capacity" and fail:
            return procs.Proc(argv, 1, "Traceback ...\nRuntimeError: boom\n", 12.0)
        return procs.Proc(argv, 0, procs.RESULT_MARK + json.dumps(measured(1000.0, 0)) + "\n", 100.0)

    monkeypatch.setattr(checks_moe, "run", fake_run)
    ctx = checks.Context(quick=True, sets=[], gpus=[3], tmp=tmp_path, log=lambda _: None)
    fail = False
    assert [row.met for row in checks.CHECKS["moe"](ctx)] == ["yes", "yes", "yes", "yes"]
    runs = [(mode, "3", checks_moe.RUN_TIMEOUT_S) for mode in checks_moe.MODES]
    assert seen == [("kernel", "3", checks_moe.KERNEL_TIMEOUT_S), *runs]
    fail = True
    kernel, row = checks.CHECKS["moe"](ctx)
    assert kernel.met == "yes" and row.met == "no" and "exit 1" in row.result and "RuntimeError: boom" in row.failure


def test_the_kernel_comparison_and_the_two_runs_timeouts_fit_a_groups_limit():
    assert checks_moe.KERNEL_TIMEOUT_S + len(checks_moe.MODES) * checks_moe.RUN_TIMEOUT_S <= groups.CHECK_LIMIT_S


KERNEL_RESULT = {
    "grouped": True,
    "kernel": "host sync no",
    "max_relative_error": 0.004,
    "empty_gradient": 0.0,
    "raw_empty_gradient": 0.0,
}
SMALL = {"tokens": 64, "dim": 32, "ffn_dim": 64}


def test_the_kernel_comparison_matches_the_loop_with_the_empty_experts_gradient_exactly_0_on_this_cpu():
    found = checks_moe.kernel_comparison(torch.device("cpu"), **SMALL)
    assert found["grouped"] and found["max_relative_error"] <= checks_moe.KERNEL_TOLERANCE
    assert found["empty_gradient"] == 0 and found["raw_empty_gradient"] == 0  # the CPU kernel writes zeros
    assert checks_moe.kernel_row(found).met == "yes"


@pytest.mark.parametrize("zeroed", [True, False], ids=["blackwell-zeroing", "unzeroed"])
def test_a_kernel_that_gives_empty_experts_garbage_gradients_fails_the_row_unless_they_are_zeroed(monkeypatch, zeroed):
    nan_for_empty_groups(monkeypatch)
    found = checks_moe.kernel_comparison(torch.device("cpu"), ExpertsKernel(grouped=True, zero_empty_gradients=zeroed), **SMALL)
    assert found["raw_empty_gradient"] == float("inf")  # the row shows what the kernel alone gave
    row = checks_moe.kernel_row(found)
    assert row.met == ("yes" if zeroed else "no") and "torch's kernel alone: inf" in row.result


def test_a_gpu_without_grouped_matmuls_gets_a_not_applicable_kernel_row():
    found = checks_moe.kernel_comparison(torch.device("cuda", 0), ExpertsKernel(grouped=False), **SMALL)
    assert checks_moe.kernel_row(found).met == "n.a."
