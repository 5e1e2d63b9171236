"""training.compile_mode: torch.compile's mode, checked against the modes torch has, and passed
to every torch.compile of the run (pretrain/distributed/parallel.py: the blocks, and the loss head
through the model's compile_mode)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from support.processes import ROOT, launcher_env, one_line_error
from pretrain import config as cfg
from pretrain.config import ConfigError
from pretrain.distributed import parallel
from pretrain.distributed.runtime import Runtime
from pretrain.model.transformer import Transformer

ONE_CPU = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")


def test_the_modes_offered_are_modes_torch_compile_has():
    import torch._inductor

    assert set(cfg.COMPILE_MODES) <= set(torch._inductor.list_mode_options())


def test_an_unknown_compile_mode_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError) as error:
        cfg.resolve("debug", sets=["training.compile_mode=max-autotune-no-cudagraph"])
    assert one_line_error(error) == (
        '--set: training.compile_mode: "max-autotune-no-cudagraph" (a string) is not one of "default", "reduce-overhead", '
        '"max-autotune", "max-autotune-no-cudagraphs"; did you mean "max-autotune-no-cudagraphs"?'
    )


def test_an_unknown_compile_mode_exits_2_from_pretrain_main_without_a_traceback():
    result = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_main.py"), "--debug", "--set", "training.compile_mode=bogus"],
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('pretrain: error: --set: training.compile_mode: "bogus"')
    for mode in cfg.COMPILE_MODES:
        assert f'"{mode}"' in lines[0]


def compiled_with(mode: str, monkeypatch) -> tuple[list[dict], Transformer]:
    """The keyword arguments of every block's compile() when parallelize compiles debug's model in
    mode, and the model (compile recorded, not run: the spy replaces nn.Module.compile)."""
    calls: list[dict] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *args, **kwargs: calls.append(kwargs))
    base = cfg.debug()
    config = cfg.apply_overrides(
        base,
        {"model": {"vocab_size": 61}, "training": {"compile": True, "compile_mode": mode}, "debug": {"trace_nonfinite": False}},
        "test",
    )
    model = Transformer(config.model, max_seq_len=32, seed=0)
    parallel.parallelize(model, config, ONE_CPU, "single")
    return calls, model


@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"])
def test_the_mode_reaches_every_blocks_torch_compile_and_the_loss_head(mode, monkeypatch):
    calls, model = compiled_with(mode, monkeypatch)
    assert calls == [{"mode": mode}] * len(model.layers)
    assert model.compile_loss_head and model.compile_mode == mode


def test_the_default_mode_leaves_torch_its_own_default(monkeypatch):
    calls, model = compiled_with("default", monkeypatch)
    assert calls == [{"mode": None}] * len(model.layers)
    assert model.compile_mode is None
