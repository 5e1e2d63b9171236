"""benchmarks/step_profile.py: kernels and ops binned by kind (real kernel names from the H200 run
and typical cuBLAS and inductor names), the sweep that shares overlapping time and counts the
gaps as idle, and a real CPU profile of a few training steps."""

from __future__ import annotations

import sys

import pytest
import torch

from support.processes import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import step_profile as sp  # noqa: E402

# What torch 2.11 ran on the H200 (benchmarks/results/2026-11-25-h200.md) and typical neighbours.
CUDNN_FPROP = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_kernel0_0"
CUDNN_BPROP = "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0"
CUDNN_HELPER = "cudnn::fusion::fmha_reduce_head"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
NVJET = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN"
LOSS = "triton_red_fused__log_softmax__to_copy_nll_loss_forward_3"
ADAMW = (
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "FusedAdamMathFunctor<float, 4, ADAM_MODE::ADAMW, false>>(...)"
)
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
NORM = "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0"
ELEMENTWISE = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul>>(int, ...)"
)


@pytest.mark.parametrize(
    "name, scope, kind",
    [
        (CUDNN_FPROP, (), "attention"),
        (CUDNN_BPROP, (), "attention"),
        (CUDNN_HELPER, (), "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>(Flash_fwd_params)", (), "attention"),
        ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<>::Params)", (), "attention"),
        ("triton_red_fused__softmax_5", (), "attention"),  # the math path's softmax
        (GEMM, (), "matmuls"),
        (NVJET, (), "matmuls"),
        ("triton_tem_fused_mm_4", (), "matmuls"),  # max-autotune's matmul template
        ("triton_tem_fused__to_copy_mm_7", (), "matmuls"),  # ... with the cast before it fused in
        ("triton_red_fused__to_copy_div_gather_logsumexp_squeeze_sub_sum_unsqueeze_1", (), "cross-entropy"),  # our head
        ("triton_poi_fused__to_copy_arange_div_eq_exp_mul_sub_unsqueeze_0", (), "cross-entropy"),  # its backward
        ("aten::mm", (), "matmuls"),
        ("aten::copy_", ("aten::addmm", "aten::linear"), "matmuls"),  # an op's bookkeeping: its parent's kind
        (LOSS, (), "cross-entropy"),
        ("triton_poi_fused__log_softmax_backward_data_nll_loss_backward_7", (), "cross-entropy"),
        ("LogSoftmaxBackward0", (), "cross-entropy"),
        (ADAMW, (), "optimizer"),
        (GEMM, ("aten::mm", "Optimizer.step#Muon.step"), "optimizer"),  # Newton-Schulz: a matmul inside the step
        (NCCL, ("Optimizer.step#AdamW.step",), "communication"),
        ("gloo:all_reduce", (), "communication"),
        (NORM, (), "other compiled"),
        (ELEMENTWISE, (), "other"),
        ("Memcpy HtoD (Pinned -> Device)", (), "other"),
    ],
)
def test_each_kernel_or_op_is_binned_by_its_name_and_the_ranges_it_ran_under(name, scope, kind):
    assert sp.kind_of(name, scope) == kind


def test_the_split_shares_overlapping_time_counts_gaps_as_idle_and_adds_up_to_the_step():
    events = [
        sp.Event(GEMM, 0, 10),
        sp.Event(NCCL, 5, 4),  # beside the matmul: 4 us shared two ways
        sp.Event(CUDNN_FPROP, 12, 3),
        sp.Event(CUDNN_HELPER, 15, 1),
        sp.Event(LOSS, 16, 2),
        sp.Event(ADAMW, 20, 2),
        sp.Event(NORM, 22, 1),
        sp.Event(ELEMENTWISE, 23, 1),
        sp.Event(GEMM, 28, 10),  # runs past the window: clipped to 2 us
        sp.Event(GEMM, -5, 3),  # before the window: left out
    ]
    window, steps = (0.0, 30.0), 2
    result = sp.split(events, window, steps)
    per_step_ms = 1 / (1000 * steps)  # one microsecond of the window, in ms per step
    busy = {"matmuls": 10 - 4 / 2 + 2, "communication": 4 / 2, "attention": 3 + 1, "cross-entropy": 2}
    busy |= {"optimizer": 2, "other compiled": 1, "other": 1}
    covered = [(0, 10), (12, 18), (20, 24), (28, 30)]
    idle = 30 - sum(b - a for a, b in covered)
    for kind, us in {**busy, "idle": idle}.items():
        assert result.ms[kind] == pytest.approx(us * per_step_ms), kind
    assert list(result.ms) == list(sp.KINDS)
    assert result.step_ms == pytest.approx(30 * per_step_ms)
    assert sum(result.ms.values()) == pytest.approx(result.step_ms)
    assert sum(result.shares.values()) == pytest.approx(100)
    assert result.overlap_ms == pytest.approx(4 * per_step_ms)
    assert result.top["attention"][0][0] == CUDNN_FPROP  # the longest first, names shortened
    assert result.top["optimizer"][0][0] == "at::native::multi_tensor_apply_kernel"


def test_a_window_with_nothing_in_it_is_all_idle():
    result = sp.split([], (100.0, 400.0), 3)
    assert result.ms["idle"] == pytest.approx(result.step_ms) and result.shares["idle"] == pytest.approx(100)


def test_a_split_survives_its_json_form():
    result = sp.split([sp.Event(GEMM, 0, 10), sp.Event(LOSS, 12, 2)], (0.0, 20.0), 1)
    result.device = "cuda"
    again = sp.Split.from_dict(result.as_dict())
    assert again == result and again.shares == result.shares


def test_profiling_cpu_training_steps_gives_a_table_whose_shares_add_up_to_100_percent():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 300))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randint(0, 300, (32,))

    def step(_: int) -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)
    result = sp.profile_steps(step, range(1, 4), torch.device("cpu"))
    assert result.steps == 3 and result.device == "cpu"
    for kind in ("matmuls", "cross-entropy", "optimizer"):
        assert result.ms[kind] > 0, (kind, result.ms)
    assert result.ms["communication"] == 0 and result.ms["attention"] == 0
    assert sum(result.ms.values()) == pytest.approx(result.step_ms)
    table = sp.format_table(result)
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
    assert [cells[0].strip() for cells in rows] == [*sp.KINDS, "step"]
    printed = [float(cells[2].strip().rstrip("%")) for cells in rows[:-1]]
    assert abs(sum(printed) - 100) <= 0.05 * len(printed)  # each share is rounded to 0.1%


def test_on_a_gpu_the_ranges_copied_onto_the_device_timeline_are_not_binned_as_kernels():
    """The profiler copies record_function ranges onto the GPU's timeline (user annotations): they
    span kernels and the gaps between them, so binned they would turn idle time into "other"."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, start, end, device, *, annotation=False, linked=0, ident=0):
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(
            name=name, time_range=span, device_type=device, is_user_annotation=annotation,
            linked_correlation_id=linked, id=ident, cpu_parent=None, is_async=False, cpu_children=[],
        )  # fmt: skip

    events = [
        event(sp.WINDOW, 0.0, 100.0, DeviceType.CPU, annotation=True),
        event("aten::mm", 1.0, 2.0, DeviceType.CPU, ident=7),
        event(sp.WINDOW, 0.0, 100.0, DeviceType.CUDA, annotation=True),
        event("Optimizer.step#AdamW.step", 50.0, 90.0, DeviceType.CUDA, annotation=True),
        event("sm90_xmma_gemm_bf16bf16_bf16f32", 10.0, 30.0, DeviceType.CUDA, linked=7),
    ]
    binned, window = sp.trace_events(events, "cuda")
    assert window == (0.0, 100.0)
    assert [(e.name, e.scope) for e in binned] == [("sm90_xmma_gemm_bf16bf16_bf16f32", ("aten::mm",))]
