"""benchmarks/efficiency.py's counters: each must see what it is there to see (a sync, a graph
break, a recompile, a collective's bytes, Muon's matrices), and nothing else, on tiny shapes."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from support.checkpointing import make_trainer
from support.processes import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import efficiency, efficiency_counters as counters, efficiency_worker as worker  # noqa: E402
from benchmarks import efficiency_forward as forward_counters  # noqa: E402
from pretrain import config as cfg  # noqa: E402
from pretrain.model import transformer as model_module  # noqa: E402
from pretrain.optim import muon  # noqa: E402
from pretrain.optim.muon import newton_schulz  # noqa: E402
from pretrain.distributed.runtime import Runtime  # noqa: E402

TINY_MODEL = ["model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64", "debug.trace_nonfinite=false"]


def syncs_of(function, on_host=lambda tensor: False) -> counters.DispatchCounter:
    counter = counters.DispatchCounter(on_host)
    with counters.counting_syncs(counter):
        function()
    return counter


def test_the_flop_formula_of_newton_schulz_is_what_flop_counter_mode_counts():
    for shape in [(8, 24), (24, 8), (3, 16, 16)]:
        with FlopCounterMode(display=False) as flops:
            newton_schulz(torch.randn(shape), 5)
        assert counters.newton_schulz_flops(shape, 5) == flops.get_total_flops()


def test_the_sync_counter_catches_scalar_reads_data_dependent_shapes_and_tolist():
    x = torch.randn(16)
    cases = {
        "item": lambda: x.sum().item(),
        "float": lambda: float(x.max()),
        "if on a tensor": lambda: bool(x.sum() > 0),
        "tolist": lambda: x[:4].tolist(),
        "boolean mask": lambda: x[x > 0],
        "nonzero": lambda: torch.nonzero(x),
        "unique": lambda: torch.unique(x),
        "repeat_interleave by a tensor": lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3])),
    }
    for name, case in cases.items():
        assert syncs_of(case).sync_count >= 1, name


def test_the_sync_counter_leaves_out_device_work_host_tensors_and_the_cpu_only_checks_of_one_hot():
    x = torch.randn(16, 16)
    step = torch.tensor(3.0)  # as torch AdamW's step counter: in host memory on a GPU too
    counter = syncs_of(
        lambda: (
            (x @ x).softmax(-1).topk(2),
            torch.where(x > 0, x, 0),
            torch.nn.functional.one_hot(torch.tensor([0, 2]), 4),
            step.item(),
            torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3]), output_size=6),
        ),
        on_host=lambda tensor: tensor is step,
    )
    assert counter.sync_count == 0, counter.syncs
    assert syncs_of(lambda: torch.nn.functional.one_hot(torch.tensor([0, 2]))).sync_count == 1  # sized by max()


def test_torch_adamw_step_counters_are_host_tensors_and_their_reads_no_sync():
    weight = torch.nn.Parameter(torch.randn(4, 4))
    optimizer = torch.optim.AdamW([weight], foreach=False)  # its per-tensor loop reads step.item()
    weight.grad = torch.ones(4, 4)
    optimizer.step()  # creates the state
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")
    assert syncs_of(optimizer.step, worker.on_host_of(runtime, optimizer)).sync_count == 0
    assert syncs_of(optimizer.step).sync_count >= 1  # the same reads, were the counter on the device


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_collective_counter_sees_ddp_reducer_and_python_collectives_with_their_payloads(one_rank_group):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4, bias=False))
    counter = syncs_of(lambda: (model(torch.randn(2, 8)).sum().backward(), dist.all_reduce(torch.zeros(5))))
    assert counter.collective_bytes == {"all_reduce": 4 * 32 + 4 * 5}  # DDP's bucket (fp32 gradients), then ours
    gathered = torch.zeros(6)
    counter = syncs_of(lambda: dist.all_gather_into_tensor(gathered, torch.ones(6)))
    assert counter.collective_bytes == {"all_gather": 4 * 6}


def test_compile_events_count_graph_breaks_and_recompiles_after_the_first_train_and_eval_compiles():
    def clean(x):
        return (x * 2).relu().sum()

    def breaking(x):
        return x[x > 0].sum()

    torch._dynamo.reset()
    with counters.CompileEvents() as events:
        compiled = torch.compile(clean, backend="eager", dynamic=False)
        compiled(torch.randn(4, requires_grad=True))
        compiled(torch.randn(4, requires_grad=True))
        events.phase = "eval"
        with torch.no_grad():
            compiled(torch.randn(4))  # a compile of its own, expected
        events.phase = "train"
        compiled(torch.randn(4, requires_grad=True))
        assert (events.recompiles, events.graph_breaks) == (0, 0)
        compiled(torch.randn(5, requires_grad=True))  # a new size: a recompile
        assert events.recompiles == 1
        torch.compile(breaking, backend="eager")(torch.randn(4))
    assert events.graph_breaks >= 1


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One prepared built-in corpus for the module's trainers."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def debug_trainer(corpus, tmp_path):
    def make(*sets: str):
        return make_trainer(corpus, tmp_path / "run", *TINY_MODEL, "debug.check_finite=true", *sets)

    return make


def test_a_debug_step_has_one_host_sync_the_finite_check_and_muon_orthogonalizes_every_matrix_on_one_rank(debug_trainer):
    counts = worker.eager_counts(debug_trainer("training.optimizer=muon"))
    assert counts["syncs_per_step"] == [1, 1], counts["sync_sites"]
    assert list(counts["sync_sites"]) == [next(iter(counts["sync_sites"]))] and "debug.py" in next(iter(counts["sync_sites"]))
    assert counts["orthogonalize_share"] == pytest.approx(1.0)
    assert counts["collective_bytes_per_step"] == {}
    assert counts["collective_bytes_by_link_per_step"] == {"inter_node": {}, "intra_node": {}}
    assert counts["syncs_before_optimizer_step"] in (0, 1)  # where it sits against the optimizer's step is known


def test_an_item_call_in_the_model_shows_as_a_host_sync_and_a_graph_break(debug_trainer, monkeypatch):
    forward = model_module.Attention.forward

    def reading(self, x, cos, sin):
        if float(x.abs().max()) < 0:  # a scalar read: a sync on CUDA, a graph break under compile
            x = x * 2
        return forward(self, x, cos, sin)

    monkeypatch.setattr(model_module.Attention, "forward", reading)
    counts = worker.eager_counts(debug_trainer())
    assert min(counts["syncs_per_step"]) >= 1 + 2  # the finite check and one per layer
    torch._dynamo.reset()
    with worker.compile_backend("eager"):
        compiled = worker.compile_counts(debug_trainer("training.compile=true"))
    assert compiled["graph_breaks"] >= 1


def test_a_compiled_debug_model_has_no_graph_break_and_no_recompile(debug_trainer):
    torch._dynamo.reset()
    with worker.compile_backend("eager"):
        compiled = worker.compile_counts(debug_trainer("training.compile=true"))
    assert (compiled["graph_breaks"], compiled["recompiles"]) == (0, 0), compiled


def test_checkpointing_modes_map_to_the_bool_of_older_trees_and_are_marked_missing_there():
    assert efficiency.checkpointing_setting("full", takes_modes=False) == "true"
    assert efficiency.checkpointing_setting("none", takes_modes=False) == "false"
    assert efficiency.checkpointing_setting("selective", takes_modes=False) is None
    assert efficiency.checkpointing_setting("auto", takes_modes=True) == '"auto"'


def test_the_minimum_traffic_is_one_gradient_all_reduce_for_ddp_and_one_gather_and_reduce_scatter_for_fsdp():
    count = {"true_tokens_per_step": 1000, "parameters": 100, "gather_bytes": 260}
    row = efficiency.Row("small", "dense", 2, "none")
    assert efficiency.minimum_bytes(count | {"plan": {"parallelism": "ddp"}}, row) == {"all_reduce": (400 + 32) / 1000}
    fsdp = efficiency.minimum_bytes(count | {"plan": {"parallelism": "fsdp"}}, row)
    assert fsdp == {"all_gather": 0.26, "reduce_scatter": 0.4, "all_reduce": 0.032}
    assert efficiency.minimum_bytes(count | {"plan": {}}, efficiency.Row("small", "dense", 1, "none")) == {}


def test_the_saved_bytes_counter_counts_a_storage_once_and_the_per_token_slope_leaves_weights_out():
    weight = torch.nn.Parameter(torch.randn(8, 8))

    def forward_at(rows: int) -> torch.Tensor:
        x = torch.randn(rows, 4, 8, requires_grad=True)
        h = (x @ weight).to(torch.bfloat16)  # matmul keeps x (fp32) and the weight
        return (h * h).sum()  # keeps h (bf16) once, though it is both operands

    _, saved = forward_counters.saved_bytes(lambda: forward_at(2))
    assert saved == {"float32": 2 * 4 * 8 * 4 + 8 * 8 * 4, "bfloat16": 2 * 4 * 8 * 2}
    per_token = forward_counters.activation_bytes_per_token(forward_at, tokens_per_row=4)
    assert per_token == {"float32": 8 * 4, "bfloat16": 8 * 2}  # the weight's 256 bytes cancel


def test_the_matmul_counter_counts_every_projection_of_one_block_once():
    config = cfg.resolve(preset="debug", sets=[*TINY_MODEL[:-1], "model.vocab_size=64"]).model
    block = model_module.TransformerBlock(config)
    projections = sum(isinstance(m, torch.nn.Linear) for m in block.modules())  # each runs once per forward
    assert worker.matmuls_per_block(config, context=8, use_amp=False) == projections
    assert worker.matmuls_per_block(config, context=8, use_amp=True) == projections


def test_a_bf16_model_keeps_little_fp32_for_backward_and_compiled_runs_only_the_embedding_uncompiled(debug_trainer):
    eager = worker.forward_counts(debug_trainer("training.use_amp=true"), compiled=False)
    assert 0 < eager["activation_fp32_bytes_per_token"] <= 0.15 * eager["activation_bytes_per_token"], eager
    torch._dynamo.reset()
    with worker.compile_backend("aot_eager"):
        compiled = worker.forward_counts(debug_trainer("training.use_amp=true", "training.compile=true"), compiled=True)
    assert compiled["activation_fp32_bytes_per_token"] <= 0.15 * compiled["activation_bytes_per_token"], compiled
    uncompiled = compiled["uncompiled_forward_ops"]
    assert uncompiled == {"embedding in model/transformer.py forward": 1, "to in model/transformer.py forward": 1}


def test_a_compiled_muon_row_compiles_newton_schulz_on_the_cpu_and_counts_no_recompile(debug_trainer):
    """Under the worker's compile_backend Muon's Newton-Schulz is compiled on a CPU as on CUDA, so
    the row's recompiles include its (the debug model's wide and tall matrices: none)."""
    torch._dynamo.reset()
    with worker.compile_backend("aot_eager"):
        trainer = debug_trainer("training.optimizer=muon", "training.compile=true")
        assert trainer.optimizer.orthogonalize is not newton_schulz  # compiled, not the eager function
        counts = worker.compile_counts(trainer)
    assert counts["recompiles"] == 0 and counts["graph_breaks"] == 0, counts
    assert muon.COMPILED_ON == ("cuda",)  # as it was outside


def test_moe_plus_muon_sets_both_features_runs_when_named_and_quick_compiles_every_muon_row():
    assert efficiency.FEATURES["moe+muon"] == efficiency.FEATURES["moe"] + efficiency.FEATURES["muon"]
    assert "moe+muon" not in efficiency.parse_args([]).features
    assert efficiency.parse_args(["--features", "moe+muon"]).features == ["moe+muon"]
    muon_rows = {row: compiled for row, compiled in efficiency.QUICK.items() if "muon" in row[1]}
    assert {row[1] for row in muon_rows} == {"muon", "moe+muon"} and all(muon_rows.values()), muon_rows


def per_group_products(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> None:
    """What aten._grouped_mm(a, b, offs) computes, one group's matmul at a time."""
    ends = offs.tolist() if offs is not None else []
    starts = [0, *ends[:-1]]
    if a.dim() == 3 and b.dim() == 3:
        a @ b
    elif a.dim() == 2 and b.dim() == 3:  # rows ragged
        for g, (start, end) in enumerate(zip(starts, ends, strict=True)):
            a[start:end] @ b[g]
    elif a.dim() == 3:  # columns ragged
        for g, (start, end) in enumerate(zip(starts, ends, strict=True)):
            a[g] @ b[:, start:end]
    else:  # the contraction ragged: the weight gradient's form
        for start, end in zip(starts, ends, strict=True):
            a[:, start:end] @ b[start:end]


@pytest.mark.parametrize("form", ["2d-3d", "3d-2d", "2d-2d", "3d-3d"])
def test_the_flop_formula_of_grouped_mm_counts_each_operand_form_as_its_groups_matmuls(form):
    bf16, offs = torch.bfloat16, torch.tensor([3, 5, 8], dtype=torch.int32)
    a, b, offs = {
        "2d-3d": (torch.randn(8, 16, dtype=bf16), torch.randn(3, 16, 24, dtype=bf16), offs),
        "3d-2d": (torch.randn(3, 8, 16, dtype=bf16), torch.randn(16, 8, dtype=bf16), offs),
        "2d-2d": (torch.randn(24, 8, dtype=bf16), torch.randn(8, 24, dtype=bf16), offs),
        "3d-3d": (torch.randn(3, 8, 16, dtype=bf16), torch.randn(3, 16, 24, dtype=bf16), None),
    }[form]
    with FlopCounterMode(display=False, custom_mapping=counters.FLOP_FORMULAS) as grouped:
        torch.nn.functional.grouped_mm(a, b, offs=offs)
    with FlopCounterMode(display=False) as looped:
        per_group_products(a, b, offs)
    assert grouped.get_total_flops() == looped.get_total_flops() > 0


@pytest.mark.parametrize("use_amp", [True, False], ids=["bf16-grouped", "fp32-fallback"])
def test_on_meta_a_dropless_mixture_of_experts_counts_the_matmuls_a_gpu_runs_under_use_amp(use_amp):
    from pretrain.model.moe import MixtureOfExperts

    model = dataclasses.replace(cfg.debug().model, dim=64, ffn_dim=128, vocab_size=64, moe=cfg.MoEConfig(num_experts=4, top_k=2))
    tokens = 2 * 32
    with worker.on_meta(use_amp), torch.device("meta"):
        block = MixtureOfExperts(model)
        with FlopCounterMode(display=False, custom_mapping=counters.FLOP_FORMULAS) as flops:
            out, aux = block(torch.randn(2, 32, 64, requires_grad=True))
            (out.sum() + aux["moe_load_balance"]).backward()
    router = 3 * 2 * tokens * 64 * 4  # forward, and the input's and weight's gradients
    experts = 3 * 2 * tokens * 3 * 64 * 128  # one token through one expert: three matmuls, each three times
    rows = 2 if use_amp else 4 * (tokens + 1) / tokens  # top_k rows a token; the fallback: every expert's, + overflow
    assert flops.get_total_flops() == router + experts * rows


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_a_dropless_moe_step_executes_the_flops_its_plan_counts_with_checkpointing_and_nothing_more(tmp_path, checkpointing):
    sets = [
        "data.tokenizer=byte",
        f"data.cache_dir={tmp_path}",
        "system.device=cpu",
        f"training.activation_checkpointing={checkpointing}",
        "training.use_amp=true",  # bf16: the grouped matmuls a GPU runs (fp32 takes the every-token fallback)
        "model.moe.num_experts=4",
        "model.moe.top_k=2",
        *TINY_MODEL,
    ]
    job = {"name": "t", "preset": "debug", "ranks": 1, "true_sets": sets, "run_sets": sets, "plan_gpu_bytes": 80 * 2**30}
    count = worker.count(job)
    outcome = efficiency.combine(efficiency.Row("debug", "moe", 1, checkpointing), count, [])
    assert (count["planned_recompute_share"] > 0.2) == (checkpointing == "full")
    assert outcome.values["executed_over_planned_flops"] == pytest.approx(1.0, abs=0.02)
    assert outcome.values["executed_over_model_flops"] == pytest.approx(1 + count["planned_recompute_share"], abs=0.02)
