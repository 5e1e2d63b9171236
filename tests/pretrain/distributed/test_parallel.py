"""pretrain/distributed/parallel.py: DDP and FSDP2 over two real gloo ranks (tests/support/workers/parallel_worker.py),
activation checkpointing, compile and the single-process path."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.processes import ROOT, run_gloo_ranks
from pretrain import config as cfg
from pretrain.model.loss import next_token_loss
from pretrain.model.transformer import Transformer
from pretrain.distributed.parallel import clip_grad_norm, compile_enabled, gradient_sync, has_fsdp, is_fsdp, parallelize, unwrap
from pretrain.distributed.runtime import Runtime

SINGLE = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")


def tiny(**training: object) -> cfg.Config:
    base = cfg.debug()
    model = dataclasses.replace(base.model, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=61, max_seq_len=16)
    return dataclasses.replace(
        base,
        model=model,
        data=dataclasses.replace(base.data, context_length=16),
        debug=dataclasses.replace(base.debug, trace_nonfinite=False),
        training=dataclasses.replace(base.training, **({"use_amp": False, "compile": False} | training)),
    )


def fresh_model(config: cfg.Config) -> Transformer:
    torch.manual_seed(0)
    return Transformer(config.model, max_seq_len=16)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(5))
    return tokens[:, :-1], tokens[:, 1:]


# --- two ranks ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """What each of two gloo ranks saw in the DDP, FSDP2, checkpointed FSDP2 and bf16 autocast runs."""
    out = tmp_path_factory.mktemp("ranks")
    return run_gloo_ranks("parallel_worker.py", out, timeout=120)


def flat(per_step: list[list[float]]) -> list[float]:
    """[[rank 0, rank 1] of each step] -> one list."""
    return [value for step in per_step for value in step]


@pytest.mark.slow
def test_fsdp_gives_the_losses_of_ddp_on_the_first_step_and_after_an_optimizer_step(two_ranks):
    for seen in two_ranks:
        ddp, fsdp = seen["ddp"]["losses"], seen["fsdp"]["losses"]
        assert len(ddp) == 2 and ddp[0] != ddp[1]  # the step changed the weights
        assert fsdp == pytest.approx(ddp, rel=1e-5)


@pytest.mark.slow
def test_fsdp_ends_with_the_weights_of_ddp(two_ranks):
    ddp, fsdp = two_ranks[0]["ddp"]["state"], two_ranks[0]["fsdp"]["state"]
    assert fsdp.keys() == ddp.keys()
    # Adam moves each element by about lr a step whatever its gradient's size, so an element
    # whose gradient nearly cancels between the ranks moves by an amount that depends on the
    # summation order (all-reduce vs reduce-scatter): allow a thousandth of its possible travel.
    travel = 1e-2 * 2  # the worker's lr x its steps
    for name in ddp:
        assert fsdp[name] == pytest.approx(ddp[name], rel=1e-4, abs=1e-3 * travel), name


@pytest.mark.slow
@pytest.mark.parametrize("run", ["fsdp_checkpointed", "fsdp_selective_kept_gathered"])
def test_activation_checkpointing_and_blocks_kept_gathered_under_fsdp_change_nothing_but_memory(two_ranks, run):
    for seen in two_ranks:
        assert seen[run]["losses"] == pytest.approx(seen["ddp"]["losses"], rel=1e-5)
        assert flat(seen[run]["grad_norms"]) == pytest.approx(flat(seen["ddp"]["grad_norms"]), rel=1e-5)
    assert two_ranks[0][run]["keys"] == two_ranks[0]["ddp"]["keys"]


@pytest.mark.slow
def test_fsdp_reshards_blocks_after_forward_but_the_last_unless_told_to_keep_them_gathered(two_ranks):
    assert two_ranks[0]["fsdp"]["resharded_after_forward"] == [True, False]  # the last block's backward comes first
    assert two_ranks[0]["fsdp_selective_kept_gathered"]["resharded_after_forward"] == [False, False]
    # The embedding, gathered in fp32 (the largest all-gather), stays gathered with them.
    assert two_ranks[0]["fsdp"]["embedding_resharded_after_forward"] is True
    assert two_ranks[0]["fsdp_selective_kept_gathered"]["embedding_resharded_after_forward"] is False


@pytest.mark.slow
def test_clip_grad_norm_is_the_same_under_fsdp_as_under_ddp_and_on_every_rank(two_ranks):
    ddp, fsdp = two_ranks[0]["ddp"], two_ranks[0]["fsdp"]
    for ddp_norms, fsdp_norms in zip(ddp["grad_norms"], fsdp["grad_norms"], strict=True):
        assert fsdp_norms[0] == fsdp_norms[1] and ddp_norms[0] == ddp_norms[1]  # [rank 0, rank 1]
        assert fsdp_norms[0] == pytest.approx(ddp_norms[0], rel=1e-5)
        assert ddp_norms[0] > 0.5  # above max_norm: the runs above compared clipped steps
    assert fsdp["norm_is_plain"] and ddp["norm_is_plain"]  # a 0-d torch.Tensor, not a DTensor


@pytest.mark.slow
def test_ddp_ranks_keep_their_own_gradients_until_the_synced_micro_batch(two_ranks):
    ddp = two_ranks[0]["ddp"]
    for inside, after in zip(ddp["inside_no_sync"], ddp["after_sync"], strict=True):
        assert inside[0] != pytest.approx(inside[1])  # [rank 0, rank 1]: local data, local gradients
        assert after[0] == after[1]


@pytest.mark.slow
def test_fsdp_reduce_scatters_every_micro_batch_so_no_rank_keeps_a_full_gradient(two_ranks):
    # Skipping the sync would keep each parameter's unsharded gradient until the last
    # micro-batch (no sharded gradient, None, until then): 4 bytes a parameter per GPU.
    ddp, fsdp = two_ranks[0]["ddp"], two_ranks[0]["fsdp"]
    for local, synced, l1 in zip(ddp["inside_no_sync"], fsdp["inside_no_sync"], ddp["inside_no_sync_l1"], strict=True):
        # The sums cancel: their rounding is relative to the sum of the absolute values.
        assert synced[0] == synced[1] == pytest.approx(sum(local) / 2, abs=1e-6 * sum(l1))  # the mean over the ranks
    assert flat(fsdp["after_sync"]) == pytest.approx(flat(ddp["after_sync"]), rel=1e-5)


@pytest.mark.slow
def test_fsdp_under_amp_runs_blocks_in_bf16_and_keeps_fp32_master_weights_and_gradients(two_ranks):
    dtypes = two_ranks[0]["amp_dtypes"]
    assert (dtypes["forward"], dtypes["master"], dtypes["gradient"]) == ("torch.bfloat16",) + ("torch.float32",) * 2


@pytest.mark.slow
def test_fsdp_under_amp_keeps_the_residual_stream_in_bf16_as_the_model_does_under_ddp(two_ranks):
    # what both blocks' attention norms and the final norm receive
    assert two_ranks[0]["amp_dtypes"]["residual"] == ["torch.bfloat16"] * 3


@pytest.mark.slow
def test_fsdp_under_amp_computes_the_first_step_of_ddp_under_amp(two_ranks):
    for seen in two_ranks:
        ddp, fsdp = seen["ddp_amp"], seen["fsdp_amp"]
        assert ddp["losses"][0] != seen["ddp"]["losses"][0]  # autocast did run in bf16
        assert fsdp["losses"][0] == pytest.approx(ddp["losses"][0], rel=1e-7)
        assert fsdp["grad_norms"][0] == pytest.approx(ddp["grad_norms"][0], rel=1e-6)
        # Once trained, the norms' weights differ a little: FSDP gathers them as bf16, and
        # autocast leaves them fp32.
        assert fsdp["losses"][1] == pytest.approx(ddp["losses"][1], rel=1e-4)


@pytest.mark.slow
def test_wrapped_models_unwrap_to_the_transformer_with_plain_names(two_ranks):
    expected = sorted(fresh_model(tiny()).state_dict())
    for run in ("ddp", "fsdp", "fsdp_checkpointed"):
        assert two_ranks[0][run]["unwraps_to_transformer"]
        assert two_ranks[0][run]["keys"] == expected
    assert [two_ranks[0][run]["is_fsdp"] for run in ("ddp", "fsdp")] == [False, True]


@pytest.mark.slow
def test_has_fsdp_sees_a_sharded_submodule_where_is_fsdp_sees_only_the_root(two_ranks):
    assert two_ranks[0]["sharded_blocks_only"] == {"is_fsdp": False, "has_fsdp": True}
    assert [two_ranks[0][run]["has_fsdp"] for run in ("ddp", "fsdp")] == [False, True]


# --- one process ----------------------------------------------------------------------


def loss_and_grads(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    x, y = batch()
    loss = next_token_loss(model, x, y).total
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in unwrap(model).named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients_and_keeps_the_names(mode):
    config = tiny(activation_checkpointing="none")
    plain = parallelize(fresh_model(config), config, SINGLE, "ddp")
    checkpointed = parallelize(fresh_model(config), tiny(activation_checkpointing=mode), SINGLE, "ddp")
    calls = []
    # A pre-hook: the recomputation stops as soon as it has what the backward needs, before
    # feed_forward returns (non-reentrant checkpoint's early stop), so a forward hook would miss it.
    checkpointed.layers[0].feed_forward.register_forward_pre_hook(lambda *args: calls.append(1))
    loss, grads = loss_and_grads(plain)
    checkpointed_loss, checkpointed_grads = loss_and_grads(checkpointed)
    assert len(calls) == 2  # the forward, then its recomputation in the backward pass
    assert checkpointed_loss == loss
    assert checkpointed_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(checkpointed_grads[name], grads[name], rtol=1e-6, atol=1e-7)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())


def matmul_flops(model: torch.nn.Module) -> int:
    """The matmul FLOPs of one forward and backward pass (FlopCounterMode counts no attention on CPU)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        loss_and_grads(model)
    return counter.get_total_flops()


def test_selective_checkpointing_recomputes_no_matmul_and_full_every_one_but_w2():
    flops = {}
    for mode in ("none", "selective", "full"):
        config = tiny(activation_checkpointing=mode)
        flops[mode] = matmul_flops(parallelize(fresh_model(config), config, SINGLE, "ddp"))
    # full: each block's forward again but w2's (ffn_dim -> dim), which no backward needs the output of
    tokens, m = 2 * 16, tiny().model
    block = 2 * (2 * m.dim * m.dim + 2 * m.dim * (m.n_kv_heads * m.dim // m.n_heads) + 2 * m.dim * m.ffn_dim)
    assert flops["selective"] == flops["none"]
    assert flops["full"] - flops["none"] == m.n_layers * tokens * block


def test_selective_checkpointing_compiled_recomputes_no_matmul_and_gives_the_losses_and_gradients_of_eager():
    # The blocks compiled with their checkpoint and policy traced in, through dynamo and AOT
    # autograd's partitioner (which is what meets the policy), the graphs run as they are
    # instead of through inductor's slow code generation; the backward graph is kept to count
    # its matmuls.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    backward_matmuls = []

    def backward(graph: torch.fx.GraphModule, inputs: list) -> object:
        backward_matmuls.append(sum(node.target == torch.ops.aten.mm.default for node in graph.graph.nodes))
        return make_boxed_func(graph.forward)

    config = tiny(activation_checkpointing="selective")
    eager = parallelize(fresh_model(config), config, SINGLE, "ddp")
    compiled = parallelize(fresh_model(config), config, SINGLE, "ddp")
    for block in compiled.layers:
        block.compile(
            backend=aot_autograd(fw_compiler=lambda graph, inputs: make_boxed_func(graph.forward), bw_compiler=backward)
        )
    loss, grads = loss_and_grads(eager)
    compiled_loss, compiled_grads = loss_and_grads(compiled)
    assert backward_matmuls == [2 * 4] * 2  # per block: two per nn.Linear (wqkv, wo, w13, w2), none recomputed (full: 11)
    assert compiled_loss == pytest.approx(loss, rel=1e-6)
    for name in grads:
        torch.testing.assert_close(compiled_grads[name], grads[name], rtol=1e-5, atol=1e-6)


def test_a_checkpointed_block_recomputes_nothing_in_evaluation():
    config = tiny(activation_checkpointing=True)
    model = parallelize(fresh_model(config), config, SINGLE, "ddp")
    calls = []
    model.layers[0].feed_forward.register_forward_pre_hook(lambda *args: calls.append(1))
    with torch.no_grad():
        model(batch()[0])
    assert len(calls) == 1


def test_compile_is_applied_to_each_block_in_place_without_renaming_parameters():
    config = tiny(compile=True)
    names = list(fresh_model(config).state_dict())
    model = parallelize(fresh_model(config), config, SINGLE, "ddp")
    assert all(block._compiled_call_impl is not None for block in model.layers)
    assert model._compiled_call_impl is None  # the blocks, not the whole model
    assert list(model.state_dict()) == names


def test_compile_defaults_to_cuda_only_and_an_explicit_choice_wins():
    assert compile_enabled(tiny(compile=None), torch.device("cuda", 0))
    assert not compile_enabled(tiny(compile=None), torch.device("cpu"))
    assert compile_enabled(tiny(compile=True), torch.device("cpu"))
    assert not compile_enabled(tiny(compile=False), torch.device("cuda", 0))


@pytest.mark.parametrize("mode", ["single", "ddp", "fsdp"])
def test_a_single_process_trains_the_model_itself_whatever_the_mode(mode):
    config = tiny()
    model = fresh_model(config)
    assert parallelize(model, config, SINGLE, mode) is model
    assert unwrap(model) is model and not is_fsdp(model) and not has_fsdp(model)


def test_gradient_sync_off_in_a_single_process_still_accumulates_gradients():
    model = fresh_model(tiny())
    _, once = loss_and_grads(model)
    with gradient_sync(model, False):
        _, twice = loss_and_grads(model)
    for name in once:
        torch.testing.assert_close(twice[name], 2 * once[name])


def test_an_unknown_mode_or_single_on_several_ranks_is_refused():
    with pytest.raises(ValueError, match="mode must be single, ddp or fsdp"):
        parallelize(fresh_model(tiny()), tiny(), SINGLE, "auto")
    two = dataclasses.replace(SINGLE, world_size=2)
    with pytest.raises(ValueError, match="mode single is for one process, but there are 2 ranks"):
        parallelize(fresh_model(tiny()), tiny(), two, "single")


def global_norm(model: torch.nn.Module) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))


@pytest.mark.parametrize("max_norm", [0.0, float("inf")])
def test_clip_grad_norm_with_no_limit_returns_the_norm_and_leaves_the_gradients(max_norm):
    model = fresh_model(tiny())
    _, grads = loss_and_grads(model)
    before = global_norm(model)
    assert float(clip_grad_norm(model, max_norm)) == pytest.approx(before, rel=1e-6)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name])


def test_clip_grad_norm_scales_the_gradients_to_max_norm_and_returns_the_norm_before():
    model = fresh_model(tiny())
    loss_and_grads(model)
    before = global_norm(model)
    norm = clip_grad_norm(model, before / 4)
    assert norm.dim() == 0 and float(norm) == pytest.approx(before, rel=1e-6)
    assert global_norm(model) == pytest.approx(before / 4, rel=1e-4)


def test_clip_grad_norm_without_gradients_is_zero():
    assert float(clip_grad_norm(fresh_model(tiny()), 1.0)) == 0.0


# --- meta-device initialisation and CPU offload -----------------------------------------


@pytest.mark.slow
def test_models_built_on_the_meta_device_train_exactly_as_models_built_whole(two_ranks):
    for seen in two_ranks:
        for mode in ("fsdp", "ddp"):
            assert seen[f"{mode}_meta"]["losses"] == seen[mode]["losses"]  # bit for bit: the same weights
            assert seen[f"{mode}_meta"]["grad_norms"] == seen[mode]["grad_norms"]
    assert two_ranks[0]["fsdp_meta"]["state"] == two_ranks[0]["fsdp"]["state"]


@pytest.mark.slow
def test_fsdp_with_cpu_offload_keeps_the_parameters_in_host_memory_and_trains_as_fsdp(two_ranks):
    # On CPU ranks the "device" is the CPU too: what this shows is that the offloaded path trains
    # the same numbers; that on a GPU the shards stay in host memory is an acceptance row (docs/gpu-acceptance.md).
    for seen in two_ranks:
        offload, fsdp = seen["fsdp_offload"], seen["fsdp"]
        assert offload["is_fsdp"] and offload["parameter_devices"] == ["cpu"]
        assert offload["losses"] == pytest.approx(fsdp["losses"], rel=1e-6)
        assert flat(offload["grad_norms"]) == pytest.approx(flat(fsdp["grad_norms"]), rel=1e-6)
    for name, values in two_ranks[0]["fsdp_offload"]["state"].items():
        assert values == pytest.approx(two_ranks[0]["fsdp"]["state"][name], rel=1e-5, abs=1e-7), name


@pytest.mark.slow
def test_one_process_with_cpu_offload_is_sharded_over_a_group_of_its_own(tmp_path):
    probe = (
        "import torch, torch.distributed as dist\n"
        "from pretrain import config as cfg\n"
        "from pretrain.model.loss import next_token_loss\n"
        "from pretrain.model.transformer import Transformer\n"
        "from pretrain.distributed.parallel import grad_norm, is_fsdp, parallelize\n"
        "from pretrain.distributed.runtime import Runtime, shutdown\n"
        "import dataclasses, sys\n"
        f"sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(ROOT / 'tests')!r}]\n"
        "from test_parallel import tiny, batch\n"
        "config = tiny(cpu_offload=True)\n"
        "runtime = Runtime(rank=0, world_size=1, device=torch.device('cpu'), label='CPU 0')\n"
        "with torch.device('meta'):\n"
        "    model = Transformer(config.model, max_seq_len=16)\n"
        "model = parallelize(model, config, runtime, 'fsdp')\n"
        "x, y = batch()\n"
        "loss = next_token_loss(model, x, y).total; loss.backward()\n"
        "eager = Transformer(config.model, max_seq_len=16, seed=config.training.seed)\n"
        "assert is_fsdp(model) and dist.get_world_size() == 1\n"
        "eager_loss = float(next_token_loss(eager, x, y).total)\n"
        "assert float(loss) == eager_loss, (float(loss), eager_loss)\n"
        "print(float(grad_norm(model)) > 0)\n"
        "shutdown(runtime, peers_alive=True)\n"
        "assert not dist.is_initialized()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The last line: gloo in torch 2.8 and 2.9 prints "[Gloo] Rank 0 is connected to 0 peer ranks..." first.
    assert result.stdout.strip().splitlines()[-1] == "True"


def test_offload_is_refused_outside_fsdp():
    with pytest.raises(ValueError, match="training.cpu_offload needs mode fsdp"):
        parallelize(fresh_model(tiny(cpu_offload=True)), tiny(cpu_offload=True), SINGLE, "ddp")


def test_a_model_built_on_the_meta_device_is_materialised_for_one_process_with_the_seeds_weights():
    config = tiny()
    with torch.device("meta"):
        model = Transformer(config.model, max_seq_len=16)
    model = parallelize(model, config, SINGLE, "single")
    whole = Transformer(config.model, max_seq_len=16, seed=config.training.seed)
    for (name, p), q in zip(model.state_dict().items(), whole.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(model.rope_sin, whole.rope_sin)
    assert loss_and_grads(model)[0] == loss_and_grads(whole)[0]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture
def pretrain_log():
    """What the trainer's logger says (it does not propagate to the root logger once set up)."""
    handler, logger = _Lines(), logging.getLogger("pretrain")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def on_path(*found: str):
    """shutil.which that finds exactly these programs."""
    return lambda name, *args, **kwargs: f"/usr/bin/{name}" if name in found else None


@pytest.mark.parametrize("chosen", [None, True])
def test_compile_on_cuda_without_a_c_compiler_is_turned_off_with_one_warning_line(monkeypatch, pretrain_log, chosen):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr("shutil.which", on_path("cc", "g++", "c++"))  # no gcc or clang: what Triton looks for
    assert not compile_enabled(tiny(compile=chosen), torch.device("cuda", 0))
    assert len(pretrain_log) == 1 and pretrain_log[0].startswith("WARNING training.compile is off: ")
    assert "a C compiler (gcc or clang on PATH, or CC)" in pretrain_log[0]


@pytest.mark.parametrize("found, env", [(("gcc",), {}), (("clang",), {}), ((), {"CC": "/opt/cc"})])
def test_compile_on_cuda_stays_on_with_gcc_clang_or_cc_set(monkeypatch, pretrain_log, found, env):
    monkeypatch.delenv("CC", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("shutil.which", on_path(*found))
    assert compile_enabled(tiny(compile=None), torch.device("cuda", 0))
    assert pretrain_log == []


def test_compile_on_cpu_needs_the_cxx_compiler_inductor_uses(monkeypatch, pretrain_log):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", on_path("gcc", "clang"))
    assert not compile_enabled(tiny(compile=True), torch.device("cpu"))
    assert len(pretrain_log) == 1 and "a C++ compiler (g++ on PATH, or CXX)" in pretrain_log[0]
    monkeypatch.setattr("shutil.which", on_path("g++"))
    assert compile_enabled(tiny(compile=True), torch.device("cpu"))
    assert not compile_enabled(tiny(compile=None), torch.device("cpu"))  # off by default: nothing to warn about
    assert len(pretrain_log) == 1


def test_a_model_built_without_a_compiler_trains_uncompiled(monkeypatch, pretrain_log):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", on_path())
    config = tiny(compile=True)
    model = parallelize(fresh_model(config), config, SINGLE, "single")
    assert all(block._compiled_call_impl is None for block in model.layers)
    inputs, targets = batch()
    model(inputs).out.float().mean().backward()  # no first compile, so nothing raises for the missing compiler
    assert len(pretrain_log) == 1
