"""The benchmark task during training (evaluation.data): read and tokenized once when the run
starts, scored every evaluation.interval steps (from step 0) and after the last step, by every
rank (each its share of the examples, pretrain/evaluation/choices.py), summed over the ranks and logged by
rank 0: a line in the log, a "hellaswag" record in metrics.jsonl, and the plot's accuracy panel.
A score logged at step N is that of the weights after N steps, those checkpoint step_N holds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pretrain import config as cfg
from pretrain.evaluation import hellaswag
from pretrain.checkpoint.save_restore import CheckpointError
from pretrain.evaluation.choices import score
from pretrain.config import Config
from pretrain.data import DataError
from pretrain.evaluation.hellaswag import HellaSwagError, Tally, TaskExamples
from pretrain.distributed.runtime import Runtime

if TYPE_CHECKING:
    from pretrain.build import Trainer


def load_task(config: Config, tokenizer_file: Path | None) -> TaskExamples | None:
    """The examples of evaluation.data in the run's tokens (None: no benchmark); DataError when the
    file or the tokenizer cannot be had (the launcher has checked the file before the workers)."""
    from pretrain.checkpoint.reading import open_tokenizer  # only a run with a benchmark needs it

    e = config.evaluation
    if not e.data:
        return None
    try:
        examples = hellaswag.load(e.data, e.max_examples)
        tokenizer = open_tokenizer(config, tokenizer_file)
    except (HellaSwagError, CheckpointError) as error:
        raise DataError(f"evaluation.data: {error}") from None
    encoded = hellaswag.encode(examples, tokenizer, cfg.max_seq_len(config))
    return TaskExamples(encoded, hellaswag.longest_row(encoded))


def is_due(config: Config, steps_done: int) -> bool:
    """Whether the task is scored on the way with the weights after steps_done steps: every
    evaluation.interval steps, from step 0 (before training; fit scores it after the last step too)."""
    interval = config.evaluation.interval
    return bool(config.evaluation.data and interval and steps_done % interval == 0)


def summed(tally: Tally, runtime: Runtime) -> Tally:
    """The tallies of all ranks added up (each rank scored its own examples)."""
    if not runtime.distributed:
        return tally
    counts = torch.tensor([tally.examples, tally.correct, tally.correct_norm], dtype=torch.int64, device=runtime.device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return Tally(*(int(n) for n in counts.tolist()))


def log_task(trainer: Trainer, steps_done: int) -> Tally | None:
    """Score the task with the weights after steps_done steps (those checkpoint step_<steps_done>
    holds), on every rank; rank 0 logs the result at that step."""
    task, config, runtime = trainer.task, trainer.config, trainer.runtime
    if task is None:
        return None
    tally = summed(
        score(
            trainer.model,
            task.encoded,
            runtime.device,
            rank=runtime.rank,
            world_size=runtime.world_size,
            batch_examples=config.evaluation.batch_examples,
            length=task.length,
            amp=config.training.use_amp,
        ),
        runtime,
    )
    trainer.log.info(f"HellaSwag | Step [{steps_done}/{config.training.max_steps}] | {tally.describe()}")
    trainer.metrics.log_task(config.evaluation.task, steps_done, tally)
    return tally
