"""One rank of tests/pretrain/observe/test_stragglers.py's two-rank run (gloo, CPU, FSDP2): the tiny model's
forward and loss timed as train_step times them, with the straggler watch that watch_for builds
for the sharded model, over an even phase and then a phase in which rank 1's first block is
slow in its own forward (a sleep in a forward hook: compute between two all-gathers, not the
PRETRAIN_FAULTS sleep, which train_step times in an interval of its own). Writes to
<out>/rank<r>.json: the straggler lines rank 0 logged (with the step after which each came),
this rank's per-step figures, and its per-step forward wall time, all-gathers included.

Run as: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/workers/stragglers_worker.py OUT
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from support.gloo_rank import fsdp_on_cpu, report_as_gloo_rank
from pretrain import config as cfg
from pretrain.distributed.parallel import parallelize, unwrap
from pretrain.distributed.runtime import Runtime
from pretrain.model.loss import next_token_loss
from pretrain.model.transformer import Transformer
from pretrain.observe.stragglers import HostTimer, watch_for

CONTEXT, BATCH, VOCAB = 16, 2, 61
WINDOW, EVEN_STEPS, SLOW_STEPS = 4, 8, 8
SLOW_S = 0.3
THRESHOLD = 1.8  # tests/pretrain/observe/test_stragglers.py says why


def config() -> cfg.Config:
    base = cfg.debug()
    model = dataclasses.replace(base.model, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB, max_seq_len=CONTEXT)
    tiny = fsdp_on_cpu(base, model, CONTEXT, seed=7)
    return dataclasses.replace(
        tiny, logging=dataclasses.replace(tiny.logging, straggler_window=WINDOW, straggler_threshold=THRESHOLD)
    )


def measure(runtime: Runtime) -> dict:
    setup = config()
    model = parallelize(Transformer(setup.model, CONTEXT, seed=setup.training.seed), setup, runtime, "fsdp")
    watch = watch_for(setup, runtime, model)
    assert watch is not None and isinstance(watch.timer, HostTimer) and watch.warning is None
    figures: list[float] = []
    drain = watch.timer.drain

    def recorded() -> list[float]:  # each step's figure, as the watch drains them
        drained = drain()
        figures.extend(drained)
        return drained

    watch.timer.drain = recorded  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(runtime.rank)
    lines: list[tuple[int, str]] = []
    forward_s: list[float] = []
    for step in range(EVEN_STEPS + SLOW_STEPS):
        if step == EVEN_STEPS and runtime.rank == 1:
            unwrap(model).layers[0].register_forward_hook(lambda *_: time.sleep(SLOW_S))
        tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=generator)
        watch.timer.new_step()
        started = time.perf_counter()
        watch.timer.begin()
        loss = next_token_loss(model, tokens[:, :-1], tokens[:, 1:])
        watch.timer.end()
        forward_s.append(time.perf_counter() - started)
        loss.total.backward()
        model.zero_grad(set_to_none=True)
        dist.all_reduce(loss.total.detach())  # the step's agreement, as train_step has one
        logged: list[str] = []
        watch.at_logging_step(runtime, logged.append)
        lines.extend((step, line) for line in logged)
    return {"lines": lines, "figures": figures, "forward_s": forward_s}


if __name__ == "__main__":
    report_as_gloo_rank(config(), measure)
