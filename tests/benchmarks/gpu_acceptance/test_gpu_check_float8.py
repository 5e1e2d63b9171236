"""The GPU acceptance's float8 rows (benchmarks/gpu_acceptance/checks_float8.py): which runs it
accepts (faster, losses tracking bf16, float8 Linears only in the float8 run), the not-applicable
row where float8 cannot run, and the bf16 then float8 runs on the chosen GPU. Float8 training itself
is tests/pretrain/plan/test_float8.py."""

from __future__ import annotations

import json

import pytest
import torch

from pretrain.plan import float8 as plan

pytest.importorskip("torchao")  # requirements-dev.txt installs it; pip install ".[float8]"
if _problem := plan.torchao_version_problem():  # torchao 0.18 on torch 2.9/2.10: import torchao may fail
    pytest.skip(f"the installed torchao does not run on this torch ({_problem})", allow_module_level=True)


def acceptance_run(losses: list[float], tokens_per_s: float, peak_gib: float, float8_linears: int = 0) -> dict:
    return {
        "losses": losses,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * 1e9 / 989e12,
        "peak_gib": peak_gib,
        "estimate_gib": peak_gib + 5,
        "checkpointing": "none",
        "float8_linears": float8_linears,
    }


def test_the_float8_acceptance_accepts_a_faster_run_whose_losses_track_bf16():
    from benchmarks.gpu_acceptance import checks_float8

    bf16 = acceptance_run([11.0 - 0.1 * s for s in range(50)], 20_000, 60.0)
    fp8 = acceptance_run([loss * 1.002 for loss in bf16["losses"]], 24_000, 57.5, float8_linears=16)
    *speed, parity = checks_float8.speed_rows(bf16, fp8) + [checks_float8.parity_row(bf16, fp8)]
    assert "1.20x tokens/s; peak memory -2.5 GiB" in speed[2].result and speed[2].met == "yes"
    assert "(16 Linears in float8)" in speed[2].check
    assert "MFU (bf16 peak)" in speed[1].check and "24,000 tokens/s" in speed[1].result
    assert parity.met == "yes" and "last 10 steps: largest gap 0.20%, mean 0.20%" in parity.result


def test_the_float8_acceptance_judges_the_losses_after_the_warm_up_spikes_and_shows_the_gap_during_them():
    """As on the H200 (2026-11-29): 31% apart at step 12 while both runs spiked, within 1% from step 41."""
    from benchmarks.gpu_acceptance import checks_float8

    bf16 = acceptance_run([11.0 - 0.1 * s for s in range(50)], 20_000, 60.0)
    spiking = [loss * (0.69 if step == 11 else 1.005) for step, loss in enumerate(bf16["losses"])]
    parity = checks_float8.parity_row(bf16, acceptance_run(spiking, 24_000, 57.5, 16))
    assert parity.met == "yes", parity.result
    assert "largest gap of any step 31.00% (step 12)" in parity.result
    late = spiking[:45] + [bf16["losses"][45] * 1.06] + bf16["losses"][46:]  # one late step 6% off, the mean 0.85%
    assert checks_float8.parity_row(bf16, acceptance_run(late, 24_000, 57.5, 16)).met == "no"


def test_a_float8_run_whose_loss_drifts_or_that_is_slower_is_not_accepted():
    from benchmarks.gpu_acceptance import checks_float8

    bf16 = acceptance_run([11.0 - 0.1 * s for s in range(50)], 20_000, 60.0)
    drifting = acceptance_run(bf16["losses"][:40] + [loss * 1.02 for loss in bf16["losses"][40:]], 19_000, 60.0)
    assert checks_float8.parity_row(bf16, drifting).met == "no"  # 2% over the last 10 steps
    assert checks_float8.speed_rows(bf16, drifting)[2].met == "no"
    broken = acceptance_run([*bf16["losses"][:-1], float("nan")], 24_000, 60.0)
    assert checks_float8.parity_row(bf16, broken).result.startswith("FAILED")


def test_a_faster_float8_run_is_not_accepted_unless_only_its_model_ran_float8_linears():
    from benchmarks.gpu_acceptance import checks_float8

    bf16 = acceptance_run([11.0, 10.0], 20_000, 60.0)
    for plain, fast in (
        (bf16, acceptance_run([11.0, 10.0], 24_000, 60.0)),
        (acceptance_run([11.0, 10.0], 20_000, 60.0, 16), acceptance_run([11.0, 10.0], 24_000, 60.0, 16)),
    ):
        speedup = checks_float8.speed_rows(plain, fast)[2]
        assert speedup.met == "no" and f"float8 run had {fast['float8_linears']} Float8Linears" in speedup.result


def test_where_float8_cannot_run_the_check_says_why_not_applicable_without_a_bf16_run(monkeypatch, tmp_path):
    from benchmarks.gpu_acceptance import checks, checks_float8, procs

    # the run itself: float8's checks come first, before the data and the model
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    import pretrain.data.prepare

    monkeypatch.setattr(pretrain.data.prepare, "prepare", lambda *a, **k: pytest.fail("prepared the data"))
    refused = checks_float8.measure("bf16", 2, [])
    assert "NVIDIA A100-SXM4-80GB has 8.0" in refused["refused"]
    # the check: the first run's refusal is the rows, n.a., and no second run
    argvs = []

    def fake_run(argv, timeout, env):
        argvs.append(argv)
        return procs.Proc(argv, 0, procs.RESULT_MARK + json.dumps(refused) + "\n", 5.0)

    monkeypatch.setattr(checks_float8, "run", fake_run)
    rows = checks.CHECKS["float8"](checks.Context(quick=True, sets=[], gpus=[0], tmp=tmp_path, log=lambda _: None))
    assert len(argvs) == 1 and [row.met for row in rows] == ["n.a."]
    assert rows[0].result == f"not run: {refused['refused']}"


def test_the_float8_check_trains_bf16_then_float8_on_the_chosen_gpu_in_processes_of_their_own(monkeypatch, tmp_path):
    from benchmarks.gpu_acceptance import checks, checks_float8, procs

    seen = []

    def fake_run(argv, timeout, env):
        mode = argv[argv.index("benchmarks.gpu_acceptance.checks_float8") + 1]
        seen.append((mode, env["CUDA_VISIBLE_DEVICES"], argv[argv.index(mode) + 1]))
        result = acceptance_run([11.0, 10.0], 20_000 if mode == "bf16" else 25_000, 60.0, 0 if mode == "bf16" else 16)
        return procs.Proc(argv, 0, "noise\n" + procs.RESULT_MARK + json.dumps(result) + "\n", 100.0)

    monkeypatch.setattr(checks_float8, "run", fake_run)
    ctx = checks.Context(quick=True, sets=[], gpus=[3], tmp=tmp_path, log=lambda _: None)
    rows = checks.CHECKS["float8"](ctx)
    assert seen == [("bf16", "3", "50"), ("float8", "3", "50")]  # --quick too: past the warm-up's loss spikes
    assert [row.met for row in rows] == ["n.a.", "n.a.", "yes", "yes"]
