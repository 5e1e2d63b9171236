"""Float8 training (training.float8; pretrain/plan/float8.py, pretrain/distributed/float8.py): the
config and its refusals, which Linears convert and when, selective checkpointing's saved ops, the
memory plan, FSDP2's float8 all-gathers, and the debug preset trained end to end through torchao's
emulation (CPU: no float8 tensor cores), against a bf16 run on the same batches."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import io
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from support.processes import ROOT, launcher_env, run_gloo_ranks
from support.runs import assert_one_line_error, run_debug_training, run_in_process, run_launcher
from launcher.gpus.nvml import Gpu
from launcher.gpus.placement import Placement
from launcher.prepare import prepare_training
from launcher.supervise.printer import Printer
from pretrain import config as cfg
from pretrain.config import ModelConfig, MoEConfig
from pretrain.distributed import float8, parallel
from pretrain.distributed.runtime import Runtime
from pretrain.model.transformer import Transformer
from pretrain.observe.metrics import read_metrics
from pretrain.plan import float8 as plan
from pretrain.plan import gpu_memory
from pretrain.train import main as train_main

# Found, not imported: every test process collects this file, and torchao's import costs a second of CPU.
if importlib.util.find_spec("torchao") is None:  # requirements-dev.txt installs it; pip install ".[float8]"
    pytest.skip("torchao is not installed", allow_module_level=True)
if _problem := plan.torchao_version_problem():  # torchao 0.18 on torch 2.9/2.10: import torchao may fail
    pytest.skip(f"the installed torchao does not run on this torch ({_problem})", allow_module_level=True)

SEQ = 16
AMP_ON = ["--set", "training.use_amp=true"]


def float8_config(model: ModelConfig | None = None, float8_mode: bool | str = "emulate", **training) -> cfg.Config:
    base = cfg.debug()
    changes = {"use_amp": True, "float8": float8_mode, "compile": False, **training}
    return dataclasses.replace(
        base,
        model=model or dataclasses.replace(base.model, vocab_size=257),
        training=dataclasses.replace(base.training, **changes),
    )


def converted(model: nn.Module) -> list[str]:
    return sorted(name for name, module in model.named_modules() if float8.is_float8(module))


# --- the config ---------------------------------------------------------------------------


def test_training_float8_takes_true_false_and_emulate_and_refuses_anything_else():
    for value in (False, True, "emulate"):
        assert cfg.TrainingConfig(use_amp=True, float8=value).float8 == value
    assert cfg.TrainingConfig().float8 is False  # opt-in
    for value in ("yes", 1, 0, None):
        with pytest.raises(cfg.ConfigError, match=r'training.float8: .* is not one of true, false, "emulate"'):
            cfg.TrainingConfig(use_amp=True, float8=value)


def test_float8_without_bf16_autocast_is_refused_in_one_line(capsys):
    result = run_in_process(train_main, ["--preset", "debug", "--set", "training.float8=emulate"], capsys)
    assert_one_line_error(result, "training.float8", "needs training.use_amp=true", prefix="pretrain: error: ")


def gpu(name: str, capability: tuple[int, int] | None) -> Gpu:
    return Gpu("0", 0, "GPU-0", name, "0", 80 << 30, 0, 0.0, (), compute_capability=capability)


def launch(tmp_path, gpus: tuple[Gpu, ...], *sets: str) -> tuple[cfg.Config, str]:
    """prepare_training for the debug preset with bf16 autocast on gpus: the config and what it printed."""
    config = cfg.resolve(preset="debug", sets=[f"data.cache_dir={tmp_path / 'cache'}", "training.use_amp=true", *sets])
    out = io.StringIO()
    return prepare_training(config, Placement("cuda", len(gpus), gpus=gpus), Printer(out, None)), out.getvalue()


# --- refusals where it cannot run ------------------------------------------------------------


def test_float8_true_on_a_cpu_is_refused_in_one_line_that_points_to_emulation(capsys):
    result = run_in_process(train_main, ["--preset", "debug", *AMP_ON, "--set", "training.float8=true"], capsys)
    assert_one_line_error(
        result, "training.float8: true needs a CUDA GPU", 'training.float8="emulate"', prefix="pretrain: error: "
    )


def test_float8_without_torchao_is_refused_in_one_line_naming_the_extra_to_install(capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a))
    result = run_in_process(train_main, ["--preset", "debug", *AMP_ON, "--set", "training.float8=emulate"], capsys)
    assert_one_line_error(result, "needs torchao, which is not installed", 'pip install ".[float8]"', prefix="pretrain: error: ")
    with pytest.raises(cfg.ConfigError, match="not installed"):
        plan.check_launch(float8_config(), "cuda")  # the launcher's own check, before any worker
    plan.check_launch(float8_config(float8_mode=False), "cpu")  # off: nothing to check


def test_float8_on_a_gpu_below_compute_capability_8_9_is_refused_naming_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(cfg.ConfigError) as refused:
        float8.check_device(float8_config(float8_mode=True), torch.device("cuda", 0))
    assert "NVIDIA A100-SXM4-80GB has 8.0" in str(refused.value) and "8.9+" in str(refused.value)
    assert "\n" not in str(refused.value)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    float8.check_device(float8_config(float8_mode=True), torch.device("cuda", 0))  # Hopper: runs


@pytest.mark.parametrize(
    ("name", "arch", "capability", "runs"),
    [
        ("AMD Instinct MI300X", "gfx942:sramecc+:xnack-", (9, 4), True),
        ("AMD Instinct MI355X", "gfx950:sramecc+:xnack-", (9, 5), True),
        ("AMD Instinct MI250X", "gfx90a:sramecc+:xnack-", (9, 0), False),  # 9.0 >= 8.9, yet no float8
        ("AMD Radeon RX 7900 XTX", "gfx1100", (11, 0), False),
    ],
    ids=["mi300x", "mi355x", "mi250x", "rdna3"],
)
def test_float8_on_rocm_is_judged_by_the_gpus_architecture_not_its_reported_capability(monkeypatch, name, arch, capability, runs):
    monkeypatch.setattr(torch.version, "hip", "7.0.51831")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(gcnArchName=arch))
    if runs:
        float8.check_device(float8_config(float8_mode=True), torch.device("cuda", 0))
        return
    with pytest.raises(cfg.ConfigError) as refused:
        float8.check_device(float8_config(float8_mode=True), torch.device("cuda", 0))
    message = str(refused.value)
    assert f"{name} is {arch.split(':')[0]}" in message and "gfx942" in message and "training.float8=false" in message
    assert "\n" not in message


def installed(monkeypatch, **versions: str | None) -> None:
    """Make the packages' metadata say these versions (None: no metadata)."""

    def version(name: str) -> str:
        if versions.get(name) is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]  # type: ignore[return-value]

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_a_torchao_too_new_for_the_installed_torch_is_refused_naming_a_release_that_fits(monkeypatch):
    installed(monkeypatch, torchao="0.18.0", torch="2.10.0+cu128")
    assert 'pip install "torchao>=0.14.1,<0.18"' in (plan.torchao_version_problem() or "")
    with pytest.raises(cfg.ConfigError, match="torchao 0.18.0 needs torch 2.11"):
        plan.check_launch(float8_config(), "cpu")  # the launcher's check, from metadata: no torch
    assert 'pip install "torchao>=0.14.1,<0.18"' in plan.install_hint()  # what a torch 2.10 user is told to install
    installed(monkeypatch, torchao="0.17.0", torch="2.9.1")
    assert plan.torchao_version_problem() is None
    installed(monkeypatch, torchao="0.18.0", torch="2.13.0")
    assert plan.torchao_version_problem() is None and plan.install_hint() == plan.INSTALL


def test_a_package_without_metadata_leaves_the_version_check_to_the_import(monkeypatch):
    installed(monkeypatch, torchao=None, torch="2.10.0")  # e.g. a source checkout on PYTHONPATH
    assert plan.torchao_version_problem() is None
    installed(monkeypatch, torchao="0.18.0", torch=None)  # a torch built from source: the worker passes its own
    assert plan.torchao_version_problem() is None
    assert "needs torch 2.11+" in (plan.torchao_version_problem("2.10.0") or "")
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    with pytest.raises(cfg.ConfigError, match="needs torch 2.11"):  # the worker's backstop
        float8.check_device(float8_config(), torch.device("cpu"))


def test_the_launcher_refuses_float8_on_a_gpu_below_8_9_in_one_line_naming_it(tmp_path):
    gpus = (gpu("NVIDIA H100 80GB HBM3", (9, 0)), gpu("NVIDIA A100-SXM4-80GB", (8, 0)))
    with pytest.raises(cfg.ConfigError) as refused:
        launch(tmp_path, gpus, "training.float8=true")
    assert "NVIDIA A100-SXM4-80GB has 8.0" in str(refused.value) and "8.9+" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "cache").exists()  # before the data
    with pytest.raises(cfg.ConfigError, match="true needs a CUDA GPU"):
        plan.check_launch(float8_config(float8_mode=True), "cpu")
    # emulation runs on any GPU; a capability NVML could not read is left to the worker
    plan.check_launch(float8_config(), "cuda", [("NVIDIA A100-SXM4-80GB", (8, 0))])
    plan.check_launch(float8_config(float8_mode=True), "cuda", [("NVIDIA H200", (9, 0)), ("MIG", None)])


@pytest.mark.slow  # prepares the debug data set: a few seconds
def test_the_launcher_warns_once_that_uncompiled_float8_is_usually_slower_than_bf16(tmp_path):
    _, printed = launch(tmp_path, (gpu("NVIDIA H100 80GB HBM3", (9, 0)),), "training.float8=true", "training.compile=false")
    warnings = [line for line in printed.splitlines() if "training.float8 is true but training.compile is off" in line]
    assert len(warnings) == 1 and "slower than bf16" in warnings[0]
    assert plan.uncompiled_line(float8_config(float8_mode=True), compiled=True) is None
    assert plan.uncompiled_line(float8_config(float8_mode="emulate"), compiled=False) is None  # emulation: no speed to lose


@pytest.mark.slow  # one launcher process: about 5 s
def test_the_launcher_refuses_float8_true_on_a_cpu_before_any_worker_starts(tmp_path):
    result = run_launcher(
        "--debug", "--device", "cpu", "--run-dir", str(tmp_path / "r"), *AMP_ON, "--set", "training.float8=true"
    )
    assert_one_line_error(result, "training.float8: true needs a CUDA GPU", prefix="launcher: error: ", quiet_stdout=False)
    assert not (tmp_path / "r" / "logs").exists()  # no worker started


@pytest.mark.slow  # one launcher process: about 5 s
def test_the_launcher_reads_the_gpus_capability_through_nvml_and_refuses_an_a100_once(tmp_path, scripted_gpus):
    scripted_gpus([{"name": "NVIDIA A100-SXM4-80GB", "compute_capability": [8, 0]}])
    result = run_launcher(
        "--debug", "--device", "cuda", "--run-dir", str(tmp_path / "r"), *AMP_ON, "--set", "training.float8=true"
    )
    assert_one_line_error(result, "NVIDIA A100-SXM4-80GB has 8.0", "8.9+", prefix="launcher: error: ", quiet_stdout=False)
    assert not (tmp_path / "r").exists()  # no worker, no run directory


# --- what converts, and when ---------------------------------------------------------------


def test_the_head_embedding_router_and_layers_not_multiples_of_16_stay_plain_linear():
    dense = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=72, vocab_size=257, max_seq_len=SEQ)
    model = Transformer(dense, SEQ, seed=0)
    float8.convert(model, float8_config(dense), fsdp=False)
    # ffn_dim 72: w13 (64 -> 144) converts, w2 (72 -> 64) does not; the head (64 -> 257) never does.
    assert converted(model) == [
        f"layers.{i}.{name}" for i in (0, 1) for name in ("attention.wo", "attention.wqkv", "feed_forward.w13")
    ]
    assert type(model.output) is nn.Linear and type(model.layers[0].feed_forward.w2) is nn.Linear
    assert type(model.tok_embed) is nn.Embedding
    moe = dataclasses.replace(dense, ffn_dim=64, moe=MoEConfig(num_experts=16, top_k=2))
    model = Transformer(moe, SEQ, seed=0)
    float8.convert(model, float8_config(moe), fsdp=False)
    assert type(model.layers[0].feed_forward.router) is nn.Linear  # 64 -> 16: a multiple, but routing stays bf16
    assert converted(model) == [f"layers.{i}.attention.{name}" for i in (0, 1) for name in ("wo", "wqkv")]  # experts: 3-D weights


def test_float8_linears_keep_parameter_names_and_dtypes_so_state_dicts_load_either_way():
    config = float8_config()
    plain = Transformer(config.model, SEQ, seed=0)
    converted_model = Transformer(config.model, SEQ, seed=1)
    float8.convert(converted_model, config, fsdp=False)
    assert converted(converted_model)
    theirs, ours = plain.state_dict(), converted_model.state_dict()
    assert {k: (v.dtype, v.shape, type(v)) for k, v in theirs.items()} == {
        k: (v.dtype, v.shape, type(v)) for k, v in ours.items()
    }
    converted_model.load_state_dict(theirs, strict=True)  # a bf16 run's checkpoint, into float8
    plain.load_state_dict(converted_model.state_dict(), strict=True)  # and back
    assert all(torch.equal(theirs[k], v) for k, v in converted_model.state_dict().items())


def test_float8_conversion_comes_before_checkpointing_compile_and_fsdp(monkeypatch):
    config = float8_config(activation_checkpointing="selective", compile=True, parallelism="fsdp", cpu_offload=False)
    seen: list[tuple[str, bool]] = []
    plain_checkpointing, converts = parallel.checkpoint_activations, float8.convert

    def checkpointing(block, mode):
        seen.append(("checkpointing", float8.is_float8(block.attention.wqkv)))
        plain_checkpointing(block, mode)

    def compile_block(self, **kwargs):
        seen.append(("compile", float8.is_float8(self.attention.wqkv)))

    def shard(model, *args, **kwargs):
        seen.append(("fsdp", float8.is_float8(model.layers[0].attention.wqkv)))
        return model

    def convert(model, config, fsdp):
        seen.append(("convert with float8 all-gathers" if fsdp else "convert", False))
        return converts(model, config, fsdp=False)  # the all-gather wrapper needs the real FSDP2

    monkeypatch.setattr(parallel, "checkpoint_activations", checkpointing)
    monkeypatch.setattr(parallel, "compile_enabled", lambda config, device: True)
    monkeypatch.setattr(type(Transformer(config.model, SEQ).layers[0]), "compile", compile_block)
    monkeypatch.setattr(parallel, "shard", shard)
    monkeypatch.setattr(parallel, "device_mesh", lambda runtime: None)
    monkeypatch.setattr(float8, "convert", convert)
    with torch.device("meta"):
        model = Transformer(config.model, SEQ)
    runtime = Runtime(rank=0, world_size=2, device=torch.device("cpu"), label="CPU 0")
    parallel.parallelize(model, config, runtime, "fsdp")
    assert seen[0] == ("convert with float8 all-gathers", False)
    assert [step for step, _ in seen[1:]] == ["checkpointing"] * 2 + ["compile"] * 2 + ["fsdp"]
    assert all(was_float8 for _, was_float8 in seen[1:])


def test_scales_are_precomputed_under_fsdp_but_not_under_cpu_offload_where_the_copy_to_the_gpu_drops_them():
    model = Transformer(float8_config().model, SEQ, seed=0)
    assert float8.scale_precompute(model, float8_config(cpu_offload=False), fsdp=True) is not None
    assert float8.scale_precompute(model, float8_config(cpu_offload=True), fsdp=True) is None
    assert float8.scale_precompute(model, float8_config(), fsdp=False) is None  # no all-gather to precompute for


def test_selective_checkpointing_keeps_the_float8_matmuls_and_their_scales_amax():
    kept = parallel.selective_saved_ops()
    assert torch.ops.aten._scaled_mm.default in kept  # else every float8 matmul runs again in the backward
    assert torch.ops.aten.max.default in kept


def test_the_conversion_the_plan_counts_is_the_one_torchao_makes():
    for model_config in (
        cfg.production().model,
        ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=72, vocab_size=257),
        ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=257, moe=MoEConfig(4, 2)),
    ):
        model_config = dataclasses.replace(model_config, n_layers=1, vocab_size=257)
        with torch.device("meta"):
            model = Transformer(model_config, SEQ)
        float8.convert(model, float8_config(model_config), fsdp=False)
        counted = sum(module.weight.numel() for module in model.modules() if float8.is_float8(module))
        assert plan.converted_block_parameters(model_config) == counted


def test_the_memory_plan_counts_float8_weights_at_one_byte_where_bf16_took_two():
    production = cfg.production()
    off = dataclasses.replace(production, model=dataclasses.replace(production.model, vocab_size=128256))
    on = dataclasses.replace(off, training=dataclasses.replace(off.training, float8=True))
    per_block = plan.converted_block_parameters(off.model)
    assert per_block > 0
    fsdp_off, fsdp_on = gpu_memory.estimate(off, 8, "fsdp"), gpu_memory.estimate(on, 8, "fsdp")
    # FSDP2 gathers the converted weights of the blocks in flight in float8: half their bf16 bytes.
    assert fsdp_off.weights - fsdp_on.weights == gpu_memory.gathered_blocks(off) * per_block * (gpu_memory.BF16 - plan.FLOAT8)
    ddp_off, ddp_on = gpu_memory.estimate(off, 8, "ddp"), gpu_memory.estimate(on, 8, "ddp")
    # DDP: each converted weight's cast for the matmul is float8, where autocast's copy was bf16.
    assert ddp_off.weights - ddp_on.weights == off.model.n_layers * per_block * (gpu_memory.BF16 - plan.FLOAT8)
    for changed in ("gradients", "optimizer", "activations", "logits"):
        assert getattr(fsdp_off, changed) == getattr(fsdp_on, changed), changed


# --- FSDP2 on two gloo ranks ---------------------------------------------------------------


@pytest.mark.slow  # two gloo ranks: about 10 s
def test_fsdp_all_gathers_float8_precomputes_scales_and_checkpoints_plain_weights_on_two_ranks(tmp_path):
    ranks = run_gloo_ranks("float8_worker.py", tmp_path, timeout=300)
    for rank in ranks:
        assert rank["weight_wrapper"] == "WeightWithDynamicFloat8CastTensor"  # all-gathered already cast to float8
        assert rank["scale_precomputed"]  # precompute_float8_dynamic_scale_for_fsdp ran after the optimizer step
        assert len(rank["float8_linears"]) == 8 and "output" not in rank["float8_linears"]
        assert rank["state_dtypes"] == ["torch.float32"] and "layers.0.attention.wqkv.weight" in rank["state_keys"]
        assert all(loss == loss and loss < 6 for loss in rank["losses"])  # finite, about ln(257) = 5.55 at the start
    for rank in ranks:  # the trainer's sharded checkpoint, read back into a model without float8
        assert rank["plain_model_loads_checkpoint"] and rank["plain_optimizer_state"] == ["Tensor"]
        assert not rank["checkpoint_names_torchao"]  # plain tensors: a run without torchao reads it
    exported = Path(ranks[0]["export"])
    from safetensors import safe_open

    with safe_open(str(next(exported.glob("*.safetensors"))), "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}


# --- the debug preset, end to end --------------------------------------------------------------


STEPS = 6
RELATIVE_GAP = 0.01
"""How far an emulated float8 run's loss may be from a bf16 run's on the same batches, at every
step: measured at most 0.07% over the debug preset's first 6 steps (5.586 vs 5.585 at step 0,
4.635 vs 4.638 at step 2), which float8's e4m3 rounding (3 mantissa bits, per-tensor scales)
explains; 1% leaves room for other CPUs' kernels while a broken cast or scale (a wrong scale
flushes values to zero or saturates them) moves the loss by far more."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The debug preset trained STEPS steps in bf16 autocast, and again with emulated float8
    (same seed, so the same batches and initial weights), through the real entry point."""
    tmp = tmp_path_factory.mktemp("float8")
    done = {}
    for name, value in (("bf16", "false"), ("float8", "emulate")):
        result = run_debug_training(
            tmp, ["pretrain_main.py"], tmp / name, "--max-steps", str(STEPS), *AMP_ON, "--set", f"training.float8={value}"
        )
        (tmp / f"{name}.out").write_text(result.stdout + result.stderr)
        done[name] = tmp / name
    return done


def losses(run_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(run_dir / "metrics.jsonl") if record["kind"] == "train"]


@pytest.mark.slow  # two debug runs: about 20 s
def test_emulated_float8_trains_the_debug_preset_with_losses_within_1_percent_of_bf16(runs):
    bf16, fp8 = losses(runs["bf16"]), losses(runs["float8"])
    assert len(bf16) == len(fp8) == STEPS
    assert fp8[-1] < fp8[0] - 1  # it learns
    assert fp8 != bf16  # float8's rounding shows: the matmuls did run through the casts
    assert max(abs(a - b) / b for a, b in zip(fp8, bf16, strict=True)) < RELATIVE_GAP
    line = (runs["float8"].parent / "float8.out").read_text()
    assert "Float8: emulated float8 (no speed-up) matmuls in 8 Linears" in line and "MFU is counted against the bf16 peak" in line
    assert "Float8:" not in (runs["bf16"].parent / "bf16.out").read_text()


@pytest.mark.slow
def test_a_float8_run_exports_bf16_weights_that_transformers_loads(runs):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    export = runs["float8"] / "export"
    with safe_open(str(next(export.glob("*.safetensors"))), "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
    theirs = AutoModelForCausalLM.from_pretrained(export)
    assert isinstance(theirs.model.layers[0].mlp.down_proj, nn.Linear)


@pytest.mark.slow  # one more debug run: about 10 s
def test_a_float8_checkpoint_resumes_in_a_bf16_run(runs, tmp_path):
    checkpoint = runs["float8"] / "checkpoints" / f"step_{STEPS}"
    config = json.loads((runs["float8"] / "config.json").read_text())
    assert config["training"]["float8"] == "emulate"
    result = subprocess.run(
        [sys.executable, "pretrain_main.py", "--config", str(runs["float8"] / "config.json"), "--run-dir", str(tmp_path / "r")]
        + ["--set", "training.float8=false", "--set", f"training.resume={checkpoint}", "--max-steps", str(STEPS + 2)],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resumed from {checkpoint} at step {STEPS}" in result.stdout + result.stderr
    resumed = losses(tmp_path / "r")
    assert len(resumed) == 2 and abs(resumed[0] - losses(runs["float8"])[-1]) < 0.5
