"""The decisions of the GPU acceptance (scripts/gpu_check.sh) that need no GPU, held to fakes:
which CUDA kernels are flash attention's (cuDNN's included), which of NVML's processes is our
holder inside a container, the efficiency rows from efficiency.py's --json, the syncs row, the
time-to-first-step target against its floor, the compile modes' runs, the step-profile rows, the
8B shape's checkpointing, and the documented --only groups against the checks and their time
estimates."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from support.processes import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import efficiency, step_profile  # noqa: E402
from benchmarks.gpu_acceptance import (  # noqa: E402
    checks,
    checks_compile,
    checks_efficiency,
    checks_flash,
    checks_gpus,
    checks_profile,
    procs,
    workers,
    workers_profile,
)
from benchmarks.gpu_acceptance.groups import CHECK_LIMIT_S, ESTIMATED_S, GROUP_LIMIT_S, group_seconds, minutes  # noqa: E402
from pretrain import config as cfg  # noqa: E402
from pretrain.model.transformer import Transformer  # noqa: E402

# --- flash attention's kernels ---------------------------------------------------------------

FLASH_FWD = (
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>"
    "(pytorch_flash::Flash_fwd_params)"
)
FLASH_BWD = (
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, 2, 4, 2, "
    "false, false, cutlass::bfloat16_t>, true, false, false, false, false, true, false, false>(pytorch_flash::Flash_bwd_params)"
)
FLASH_BWD_DOT = (
    "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64>>(pytorch_flash::Flash_bwd_params)"
)
UNRELATED = [
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0",
    "Memcpy HtoD (Pageable -> Device)",
]
MATH = ["triton_red_fused__softmax_5", "triton_poi_fused__softmax_backward_data_7"]
EFFICIENT = [
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)",
    "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::bfloat16_t>::Params)",
]
CUDNN = [  # what torch 2.11 ran on an H200 for `small`'s block (benchmarks/results/2026-11-25-h200.md)
    "cudnn::fusion::fmha_reduce_head",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_kernel0_0",
]


def test_flash_kernels_are_told_apart_from_the_math_path_and_the_other_fused_kernels():
    found = checks_flash.attention_kernels([FLASH_FWD, FLASH_BWD, FLASH_BWD_DOT, *UNRELATED])
    assert found.flash_forward == ("pytorch_flash::flash_fwd_kernel",)
    assert found.flash_backward == (
        "pytorch_flash::flash_bwd_dot_do_o_kernel",
        "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel",
    )
    assert found.other_fused == () and found.math == () and found.flash
    assert not checks_flash.attention_kernels([FLASH_FWD, *UNRELATED]).flash  # no backward kernel
    math = checks_flash.attention_kernels([*MATH, *UNRELATED])
    assert math.math == tuple(sorted(MATH)) and not math.flash
    assert "math path (softmax): triton_poi_fused__softmax_backward_data_7" in math.describe()
    assert not checks_flash.attention_kernels([FLASH_FWD, FLASH_BWD, *MATH]).flash  # flash, yet a softmax beside it
    efficient = checks_flash.attention_kernels([*EFFICIENT, *UNRELATED])
    assert len(efficient.other_fused) == 2 and not efficient.flash_forward and not efficient.flash
    assert checks_flash.attention_kernels(UNRELATED).describe() == "no attention kernel recognised"


def test_cudnns_fused_flash_kernels_count_as_flash_and_its_helper_as_other_fused_attention():
    found = checks_flash.attention_kernels([*CUDNN, *UNRELATED])
    assert found.flash_forward == (CUDNN[2],) and found.flash_backward == (CUDNN[1],)
    assert found.other_fused == ("cudnn::fusion::fmha_reduce_head",) and found.flash
    assert not checks_flash.attention_kernels([CUDNN[2], *UNRELATED]).flash  # forward alone
    assert not checks_flash.attention_kernels([*CUDNN, *MATH]).flash  # a softmax beside them: the math path ran too


def test_a_flash_row_lists_the_kernels_and_is_met_only_with_flash_forward_and_backward():
    result = {"preset": "small", "head_dim": 64, "heads": 12, "kv_heads": 4, "batch": 16, "context": 1024, "compile_s": 41.2}
    row = checks_flash.flash_row({**result, "kernels": [FLASH_FWD, FLASH_BWD, *UNRELATED], "torch": "2.13"})
    assert row.met == "yes" and "`small` block (head_dim 64, 12/4 heads, batch 16 x 1024)" in row.check
    assert row.result.startswith("flash forward: pytorch_flash::flash_fwd_kernel; flash backward: ")
    efficient = checks_flash.flash_row({**result, "kernels": EFFICIENT, "torch": "2.13"})
    assert efficient.met == "no" and "other fused attention: fmha_cutlassB_bf16_aligned_64x64_k64_sm80" in efficient.result
    h200 = checks_flash.flash_row({**result, "kernels": [*CUDNN, *UNRELATED], "torch": "2.11.0+cu130"})
    assert h200.met == "yes" and h200.result.startswith(f"flash forward: {CUDNN[2]}; flash backward: {CUDNN[1]}")
    math_path = checks_flash.flash_row({**result, "kernels": [*MATH, *UNRELATED], "torch": "2.11.0+cu130"})
    assert math_path.met == "no" and "math path (softmax)" in math_path.result


# --- our holder among NVML's processes ---------------------------------------------------------

OWN = 4242
"""The holder's pid as this process sees it."""


def test_the_holder_is_found_under_its_own_pid_in_one_pid_namespace():
    found = checks_gpus.find_holder({77: 500}, {77: 500, OWN: 1536}, OWN, used_rise_mib=1536)
    assert (found.pid, found.ok) == (OWN, True) and "one pid namespace" in found.how


@pytest.mark.parametrize("memory", [1536, None])
def test_in_a_container_the_one_new_process_on_the_gpu_is_the_holder_under_its_host_pid(memory):
    found = checks_gpus.find_holder({77: 500}, {77: 500, 90123: memory}, OWN, used_rise_mib=1536)
    assert (found.pid, found.ok) == (90123, True)
    assert found.how == f"NVML lists our holder (pid {OWN} here) as host pid 90123: another pid namespace, a container"


def test_a_new_process_that_holds_less_than_the_holder_allocated_is_not_accepted():
    found = checks_gpus.find_holder({}, {90123: 300}, OWN, used_rise_mib=1536)
    assert (found.pid, found.ok) == (90123, False) and "300 MiB, below the 1024 MiB it holds" in found.how


def test_of_several_new_processes_only_one_holding_the_gigabyte_is_taken_and_two_are_ambiguous():
    assert checks_gpus.find_holder({}, {90123: 1536, 90200: 200}, OWN, 1736).pid == 90123
    both = checks_gpus.find_holder({}, {90123: 1536, 90200: 1600}, OWN, 3136)
    assert (both.pid, both.ok) == (None, False) and both.how.startswith("2 processes appeared")


def test_our_pid_listed_before_the_holder_started_is_another_namespaces_process():
    found = checks_gpus.find_holder({OWN: 700}, {OWN: 700, 90123: 1536}, OWN, 1536)
    assert found.pid == 90123 and found.ok


@pytest.mark.parametrize("rise, ok", [(1536, True), (100, False), (None, False)])
def test_where_nvml_lists_no_process_the_gpus_used_memory_must_rise_by_what_the_holder_holds(rise, ok):
    found = checks_gpus.find_holder({}, {}, OWN, used_rise_mib=rise)
    assert (found.pid, found.ok) == (None, ok) and "NVML lists no process on the GPU" in found.how


def test_processes_listed_but_none_new_is_a_failure():
    found = checks_gpus.find_holder({77: 500}, {77: 500}, OWN, used_rise_mib=1536)
    assert (found.pid, found.ok) == (None, False) and "none new" in found.how


def test_nvidia_smis_process_rows_are_read_by_gpu_and_pid_with_memory_where_reported():
    rows = [["GPU-a", "123", "1536"], ["GPU-b", "456", "[N/A]"], ["No running processes found"]]
    apps = checks_gpus.compute_apps(rows)
    assert apps == {("GPU-a", 123): 1536, ("GPU-b", 456): None}
    assert checks_gpus.on_gpu(apps, "GPU-b") == {456: None}


def fake_gpus_check(monkeypatch, table_out: str):
    """check_gpus on a faked container: our holder is pid OWN here, host pid 987654 in NVML."""
    apps_reads = iter([[["GPU-a", "555", "700"]], [["GPU-a", "555", "700"], ["GPU-a", "987654", "1536"]]])
    used_reads = iter([["700"]])

    def smi_query(*fields, what="gpu", index=None):
        if what == "compute-apps":
            return next(apps_reads)
        if fields == ("memory.used",):
            return [next(used_reads)]
        return [["0", "GPU-a", "81559", "2236"]]

    nvml = [
        {
            "index": 0,
            "uuid": "GPU-a",
            "mig": False,
            "memory_total": 81559 * 2**20,
            "processes": [(555, 700 * 2**20), (987654, 1536 * 2**20)],
        }
    ]
    table = procs.Proc(["python", "-m", "launcher", "gpus"], 0, table_out, 1.0)
    monkeypatch.setattr(checks_gpus, "smi_query", smi_query)
    monkeypatch.setattr(checks_gpus, "start_holder", lambda index: types.SimpleNamespace(pid=OWN, stdin=io.StringIO()))
    monkeypatch.setattr(checks_gpus, "kill_group", lambda proc: None)
    monkeypatch.setattr(checks_gpus, "worker", lambda name, timeout: nvml)
    monkeypatch.setattr(checks_gpus, "launcher", lambda *args, timeout: table)


def test_the_gpus_check_passes_in_a_container_when_the_table_shows_the_holders_host_pid(monkeypatch, tmp_path):
    ctx = checks.Context(quick=True, sets=[], gpus=[0], tmp=tmp_path, log=lambda _: None)
    fake_gpus_check(monkeypatch, "GPU  name\n0    H100  987654 (1.5 GiB)\n")
    (row,) = checks.CHECKS["gpus"](ctx)
    assert row.met == "yes" and "host pid 987654: another pid namespace" in row.result
    fake_gpus_check(monkeypatch, "GPU  name\n0    H100  555 (0.7 GiB)\n")
    (row,) = checks.CHECKS["gpus"](ctx)
    assert row.met == "no" and "the table does not show our holder (pid 987654 in NVML)" in row.result


# --- the efficiency rows ------------------------------------------------------------------------


def efficiency_json(features: str, **values) -> dict:
    """A row as efficiency.py's --json writes it (every key of efficiency.KEYS)."""
    row = {key: None for key in efficiency.KEYS} | {"preset": "small", "features": features, "ranks": 1}
    row |= {"activation_checkpointing": "auto", "executed_over_model_flops": 1.012}
    return {"rows": [row | {"graph_breaks": 0, "recompiles": 0, "host_syncs_per_step": 1} | values]}


def test_an_efficiency_row_is_met_with_no_graph_break_no_recompile_and_one_host_sync():
    row = checks_efficiency.efficiency_row("moe", efficiency_json("moe"), "1 GPU")
    assert (
        row.met == "yes"
        and row.check == "graph breaks, recompiles, host syncs: `small`, mixture of experts (4 experts, top-2), 1 GPU"
    )
    assert (
        row.result == "0 graph breaks, 0 recompiles, 1 host syncs per step; checkpointing auto; executed 1.012 x the model FLOPs"
    )
    for bad in ({"graph_breaks": 2}, {"recompiles": 1}, {"host_syncs_per_step": 4}):
        assert checks_efficiency.efficiency_row("moe", efficiency_json("moe", **bad), "1 GPU").met == "no", bad


def test_an_efficiency_row_that_was_not_measured_or_is_missing_fails():
    unmeasured = checks_efficiency.efficiency_row("muon", efficiency_json("muon", graph_breaks=None), "1 GPU")
    assert unmeasured.met == "no" and unmeasured.result.startswith("FAILED: not measured")
    for data in (None, efficiency_json("dense")):
        missing = checks_efficiency.efficiency_row("muon", data, "1 GPU")
        assert missing.met == "no" and missing.result == "FAILED: no row in efficiency.py's --json"


def test_the_efficiency_command_is_one_efficiency_py_accepts_for_one_compiled_cuda_row(tmp_path):
    argv = checks_efficiency.efficiency_argv("muon", tmp_path / "e.json", 79.647)
    assert argv[1] == "benchmarks/efficiency.py" and (ROOT / argv[1]).exists()
    args = efficiency.parse_args(argv[2:])
    assert (args.device, args.presets, args.features, args.ranks, args.checkpointing) == (
        "cuda",
        ["small"],
        ["muon"],
        ["1"],
        ["auto"],
    )
    assert (args.compile, args.json, args.no_markdown, args.plan_gpu_gib) == ("all", tmp_path / "e.json", True, 79.647)
    assert [r.features for r in efficiency.rows_of(args)] == ["muon"]


def test_the_efficiency_check_runs_one_process_per_model_on_the_chosen_gpu_and_keeps_a_failures_output(monkeypatch, tmp_path):
    seen = []

    def fake_run(argv, timeout, env):
        features = argv[argv.index("--features") + 1]
        seen.append((features, env["CUDA_VISIBLE_DEVICES"], timeout))
        if features == "muon":
            return procs.Proc(argv, 1, "Traceback ...\nRuntimeError: boom\n", 12.0)
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(efficiency_json(features)))
        return procs.Proc(argv, 0, "", 100.0)

    monkeypatch.setattr(checks_efficiency, "run", fake_run)
    monkeypatch.setattr(checks_efficiency, "smi_query", lambda *fields, index=None: [["81559"]])
    ctx = checks.Context(quick=False, sets=[], gpus=[3], tmp=tmp_path, log=lambda _: None)
    rows = checks.CHECKS["efficiency"](ctx)
    assert sorted(seen) == [(f, "3", checks_efficiency.TIMEOUT_S) for f in ("dense", "moe", "moe+muon", "muon")]
    assert [r.met for r in rows] == ["yes", "yes", "no", "yes"] and not rows[0].failure
    assert "mixture of experts with Muon" in rows[3].check
    assert rows[2].result.endswith("efficiency.py exit 1 after 12 s") and "RuntimeError: boom" in rows[2].failure


# --- the syncs row ---------------------------------------------------------------------------


def test_a_syncs_row_needs_at_most_one_sync_and_a_compiled_model():
    r = {
        "max_syncs": 1,
        "mean_syncs": 1.0,
        "steps": 6,
        "compiled": True,
        "shape": "batch 16 x 1024",
        "profiler_syncs": 1.0,
        "pageable_h2d": 0.0,
    }
    assert checks.syncs_row(r, "1 process").met == "yes"
    assert checks.syncs_row({**r, "max_syncs": 2, "where": "loss.py:80"}, "1 process").met == "no"
    eager = checks.syncs_row({**r, "compiled": False}, "1 process")
    assert eager.met == "no" and "NOT compiled" in eager.check


# --- time to first step, compile modes, where the time goes, the 8B shape's row -----------------------


@pytest.mark.parametrize("floor, cold", [(8.0, 20.0), (5.0, 36.0)])
def test_a_warm_launch_may_spend_a_quarter_of_the_cold_compile_beyond_the_uncompiled_floor(floor, cold):
    limit = floor + (cold - floor) / 4
    at_limit = checks_compile.compile_cache_row(checks_compile.FirstStep(floor, cold, limit))
    assert at_limit.met == "yes" and at_limit.target == "warm <= floor + 25% of (cold - floor)"
    assert f"floor (training.compile=false) {floor:.1f} s; cold {cold:.1f} s; warm {limit:.1f} s" in at_limit.result
    assert "warm spends 25% of the cold compile" in at_limit.result
    over = checks_compile.compile_cache_row(checks_compile.FirstStep(floor, cold, limit + 0.2))
    assert over.met == "no"
    # Half the first launch was the old target: a slow floor made it unreachable, a fast one too easy.
    assert checks_compile.compile_cache_row(checks_compile.FirstStep(floor, cold, cold / 2)).met == (
        "yes" if cold / 2 <= limit else "no"
    )


def test_a_cold_launch_no_slower_than_the_floor_fails_the_compile_cache_row():
    row = checks_compile.compile_cache_row(checks_compile.FirstStep(10.0, 9.0, 9.5))
    assert row.met == "no" and "cold no slower than the floor" in row.result


def test_the_compile_cache_check_launches_the_floor_uncompiled_then_cold_and_warm_on_one_cache(monkeypatch, tmp_path):
    launches = []

    def fake_launcher(*args, timeout, env, first_match):
        sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
        launches.append((sets, env["TORCHINDUCTOR_CACHE_DIR"], timeout))
        return procs.Proc(list(args), 0, "", 1.0, first_match_s=[6.0, 30.0, 11.0][len(launches) - 1])

    monkeypatch.setattr(checks_compile, "run", lambda argv, timeout: procs.Proc(argv, 0, "", 1.0))
    monkeypatch.setattr(checks_compile, "launcher", fake_launcher)
    ctx = checks.Context(quick=True, sets=[], gpus=[0], tmp=tmp_path, log=lambda _: None)
    (row,) = checks.CHECKS["compile-cache"](ctx)
    compiled = [cfg.resolve(preset="small", sets=sets).training.compile for sets, _, _ in launches]
    assert compiled == [False, True, True] and len({cache for _, cache, _ in launches}) == 1
    assert 60 + sum(timeout for _, _, timeout in launches) <= CHECK_LIMIT_S  # with the data's preparation
    assert row.met == "yes" and row.result.startswith("floor (training.compile=false) 6.0 s; cold 30.0 s; warm 11.0 s")


def small_run_result(mode: str, **values) -> dict:
    """A result of the small-run worker (workers_profile.worker_small_run)."""
    result = {"compile_mode": mode, "compiled": True, "shape": "batch 16 x 1024, 4 micro-batches", "checkpointing": "none"}
    result |= {"first_step_s": 40.0, "warmup_extra_s": 45.0, "step_s": 0.13, "tokens_per_s": 504123.0, "mfu": 0.41}
    return result | {"loss": 9.5, "peak_gib": 8.7, "profile": None, "torch": "2.11.0+cu130"} | values


@pytest.mark.parametrize(
    "key, modes, shared",
    [
        ("compile-modes", ["default", "reduce-overhead"], False),
        ("compile-autotune", ["max-autotune-no-cudagraphs", "max-autotune"], True),
    ],
)
def test_each_compile_mode_runs_small_with_its_training_compile_mode_and_a_cache_of_its_own(
    monkeypatch, tmp_path, key, modes, shared
):
    calls = []

    def fake_worker(name, timeout, *args, env):
        calls.append((name, timeout, args, env["TORCHINDUCTOR_CACHE_DIR"]))
        return small_run_result(args[3])

    monkeypatch.setattr(checks_compile, "worker", fake_worker)
    ctx = checks.Context(quick=False, sets=[], gpus=[2], tmp=tmp_path, log=lambda _: None)
    rows = checks.CHECKS[key](ctx)
    assert [args[3] for _, _, args, _ in calls] == modes and {name for name, *_ in calls} == {"small-run"}
    for (_, _, (steps, profile, data_sets, mode), _), row in zip(calls, rows, strict=True):
        config = cfg.resolve(preset="small", sets=workers_profile.small_run_sets(json.loads(data_sets), 3, mode))
        t = config.training
        assert (t.compile, t.compile_mode, t.use_amp, config.debug.trace_nonfinite) == (True, mode, True, False)
        assert (config.data.source, config.system.device, steps, profile) == ("builtin", "cuda", "20", "0")
        assert f"training.compile_mode={mode}" in row.check and row.met == "n.a."
        assert row.result.startswith("504,123 tokens/s, MFU 41.0%, 130 ms per step; compile: first step 40 s")
    assert len({cache for *_, cache in calls}) == (1 if shared else len(modes))
    assert ("autotuning cached by" in rows[1].result) == shared
    assert sum(timeout for _, timeout, _, _ in calls) <= CHECK_LIMIT_S


def test_a_compile_mode_the_run_did_not_use_or_an_uncompiled_run_is_not_accepted():
    assert checks_compile.compile_mode_row("max-autotune", small_run_result("default")).met == "no"
    assert checks_compile.compile_mode_row("default", small_run_result("default", compiled=False)).met == "no"


def test_the_step_profile_rows_give_the_step_and_each_kind_with_its_longest_kernels():
    events = [step_profile.Event(CUDNN[2], 0, 30), step_profile.Event(UNRELATED[0], 30, 50), step_profile.Event(MATH[0], 85, 5)]
    split = step_profile.split(events, (0.0, 100.0), 1)
    split.device = "cuda"
    first, *kinds = checks_profile.profile_rows(small_run_result("default", profile=split.as_dict()))
    assert [r.check.rsplit(": ", 1)[1] for r in kinds] == list(step_profile.KINDS)
    assert first.met == "yes" and "batch 16 x 1024, 4 micro-batches, checkpointing none" in first.check
    assert first.result.startswith("0.1 ms per step: matmuls 50.0%, attention 35.0%") and "idle 15.0%" in first.result
    attention = kinds[step_profile.KINDS.index("attention")]
    assert attention.met == "n.a." and attention.result.startswith(
        f"{(30 + 5) / 1000:.2f} ms per step (35.0%); longest: {CUDNN[2]}"
    )
    cpu = dataclasses.replace(split, device="cpu")
    assert checks_profile.profile_rows(small_run_result("default", profile=cpu.as_dict()))[0].met == "no"  # not a GPU's


def test_the_8b_shape_row_names_the_checkpointing_the_runs_had_not_the_one_asked_for(monkeypatch, tmp_path):
    shape = {"params": 1.92e9, "mode": "single", "step_s": 0.28, "tokens": 16384, "tokens_per_s": 58411.0, "mfu": 0.59}
    shape |= {"peak_gib": 39.1, "peak_flops": 989e12, "layer_flops_per_step": 2.0e15, "estimate_gib": 54.5}
    shape |= {"estimate_parts": "weights 9.8 GiB", "run_allocated_gib": 39.1, "run_reserved_gib": 39.5}
    monkeypatch.setattr(
        checks, "worker", lambda name, timeout, layers, *rest: shape | {"checkpointing": "none", "step_s": 0.1 * int(layers)}
    )
    ctx = checks.Context(quick=True, sets=[], gpus=[0], tmp=tmp_path, log=lambda _: None)
    row, _estimate = checks.CHECKS["production-shape"](ctx)
    assert row.check.endswith("activation checkpointing none (as planned)")
    monkeypatch.setattr(
        checks, "worker", lambda name, timeout, layers, *rest: shape | {"checkpointing": "full" if layers == "4" else "none"}
    )
    assert "activation checkpointing full / none" in checks.CHECKS["production-shape"](ctx)[0].check


def test_the_poisoned_weight_of_the_nan_check_is_a_weight_of_the_debug_model():
    config = cfg.resolve(preset="debug", sets=[*workers.TINY, "model.vocab_size=257"])  # the byte tokenizer's ids
    with torch.device("meta"):
        model = Transformer(config.model, max_seq_len=cfg.max_seq_len(config))
    assert workers.POISONED in dict(model.named_parameters())


# --- the documented groups -------------------------------------------------------------------

GROUP_LINE = re.compile(r"^bash scripts/gpu_check\.sh --only (?P<checks>\S+)\s+#.*?~(?P<minutes>[\d.]+) min\s*$", re.M)


def test_the_documented_groups_name_every_check_once_and_each_fits_its_estimated_time():
    text = (ROOT / "docs" / "gpu-acceptance.md").read_text()
    groups = [(m["checks"].split(","), float(m["minutes"])) for m in GROUP_LINE.finditer(text)]
    named = [name for checks, _ in groups for name in checks]
    assert sorted(named) == sorted(checks.CHECKS), "each check in exactly one documented group"
    assert sorted(ESTIMATED_S) == sorted(checks.CHECKS)
    for names, stated in groups:
        seconds = group_seconds(names)
        assert seconds <= GROUP_LIMIT_S, (names, seconds)
        assert stated == minutes(seconds), (names, stated, minutes(seconds))


def test_every_check_has_a_row_in_the_documented_table_of_checks():
    text = (ROOT / "docs" / "gpu-acceptance.md").read_text()
    table = text.split("## The checks", 1)[1].split("## How it runs", 1)[0]
    first_cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    documented = [name for cell in first_cells for name in re.findall(r"`([a-z0-9-]+)`", cell)]
    assert sorted(documented) == sorted(checks.CHECKS)
