"""What the evaluation and export tests share: a checkpoint of the debug model, trained once per
module, and multiple-choice examples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain import config as cfg
from pretrain.build import build
from pretrain.checkpoint import save_restore as checkpoint
from pretrain.data.fitting import fit_to_dataset
from pretrain.data.prepare import prepare
from pretrain.distributed.runtime import Runtime, setup_logging


CONTEXT = 32


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A real checkpoint of a tiny byte-level model (debug preset, context 32)."""
    root = tmp_path_factory.mktemp("generate")
    config = cfg.resolve(
        preset="debug", sets=[f"data.cache_dir={root / 'cache'}", "training.batch_size=2", f"data.context_length={CONTEXT}"]
    )
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")
    dataset = prepare(config.data, log=lambda _: None)
    config, _ = fit_to_dataset(config, dataset, world_size=1)
    trainer = build(config, runtime, dataset, root / "run", setup_logging("CPU 0", "WARNING"))
    return checkpoint.save(trainer, 1, root / "run")


EXAMPLES = [
    {"ctx": "The module", "endings": ["imports the package.", "zzqx vvk.", "def def def", "the the the"], "label": 0},
    {"ctx": "To install Python,", "endings": ["run the installer.", "qqq", "xx yy zz", "]]]]"], "label": 0},
    {"ctx": "A list is", "endings": ["kwkwkw", "a sequence of items.", "}}}", "0000"], "label": 1},
    {"ctx": "The function returns", "endings": ["!!!", "zz", "None.", "@@@@"], "label": 2},
    {"ctx": "import", "endings": ["os", "%%%", "~~", "^^^"], "label": 0},
]


def write_examples(path: Path, examples: list[dict] = EXAMPLES) -> Path:
    path.write_text("".join(json.dumps(example) + "\n" for example in examples))
    return path
