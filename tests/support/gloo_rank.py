"""One rank of support.processes.run_gloo_ranks: what each worker script (tests/support/workers/) does around
its own measurements, in one place, and the CPU FSDP config they share."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from pretrain.config import Config, ModelConfig
from pretrain.distributed.runtime import Runtime, exit_process, init_runtime, shutdown


def report_as_gloo_rank(config: Config, measure: Callable[[Runtime], object]) -> NoReturn:
    """Join the process group of config, write what measure(runtime) returns to
    <argv[1]>/rank<r>.json, leave the group with the others, and end as a training process does
    (exit_process: interpreter finalization can abort a gloo rank that succeeded)."""
    out = Path(sys.argv[1])
    runtime = init_runtime(config)
    (out / f"rank{runtime.rank}.json").write_text(json.dumps(measure(runtime)))
    shutdown(runtime, peers_alive=True)
    exit_process(0)


def fsdp_on_cpu(base: Config, model: ModelConfig, context: int, seed: int) -> Config:
    """base with model, as the gloo workers run it: FSDP over CPU ranks in fp32, uncompiled, no
    activation checkpointing or offload, windows of context tokens."""
    training = dataclasses.replace(
        base.training,
        use_amp=False,
        compile=False,
        activation_checkpointing=False,
        seed=seed,
        parallelism="fsdp",
        cpu_offload=False,
    )
    return dataclasses.replace(
        base,
        model=model,
        training=training,
        data=dataclasses.replace(base.data, context_length=context),
        system=dataclasses.replace(base.system, device="cpu"),
    )
