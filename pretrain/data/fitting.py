"""Where a config meets its prepared dataset: the model's vocabulary and the run's length
(and a Hub dataset's branch, pinned to the commit that was prepared).

Both depend on the data: a tokenizer's vocabulary is known once it is loaded or trained, and an
epoch's length once the tokens are counted. The launcher calls fit_to_dataset after preparing,
before it spawns anyone, so a dataset that cannot fill one step, or ids the model cannot embed,
stop the run with one line; the config it writes for the workers holds the concrete values.
Torch-free, like everything the launcher imports.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pretrain.config import Config, batch_split, with_world_size
from pretrain.data.cache import read_meta
from pretrain.data.hub_shards import pinned_paths
from pretrain.data.prepare import model_vocab_size
from pretrain.data.windows import RunLength, plan_run


def fit_to_dataset(config: Config, dataset_dir: str | Path, world_size: int) -> tuple[Config, RunLength]:
    """config with model.vocab_size and training.max_steps made concrete for this dataset and
    world size, and the run's length. A run set in epochs gets them as max_steps, and epochs 0:
    the config the workers read then sets the run length once (pretrain/config/__init__.py
    one_run_length refuses both). DataError when they do not fit; ConfigError when
    training.global_batch_size does not divide over the ranks."""
    config = with_world_size(config, world_size)
    meta = read_meta(dataset_dir)
    t = config.training
    length = plan_run(meta, config.data.context_length, *batch_split(config, world_size), world_size, t.epochs, t.max_steps)
    model = dataclasses.replace(config.model, vocab_size=model_vocab_size(config.model.vocab_size, meta))
    training = dataclasses.replace(t, max_steps=length.total_steps, epochs=0, by_epoch=t.by_epoch or t.epochs > 0)
    data = config.data
    if data.source == "hub":
        # Pin the branch to the commit prepared, so every worker finds this very dataset in the
        # cache without asking the Hub, even if the branch moves during the run.
        data = dataclasses.replace(data, hub_revision=meta["key"]["source"]["commit"])
    data = pinned_paths(data, meta["key"]["source"])  # hf:// shards: the same pin
    return dataclasses.replace(config, model=model, training=training, data=data), length
