"""The batch a step trains on: training.global_batch_size shared over the ranks
(with_world_size), and training.grad_accum_nums "auto", the micro-batch the plan chooses
(pretrain/plan/parallelism.py) from the choices here, each keeping the global batch. Nothing here
imports torch."""

from __future__ import annotations

import dataclasses
import math

from pretrain.config.checks import MAX_SIZE
from pretrain.config.schema import Config, ConfigError, TrainingConfig


def check_auto_accumulation(config: Config) -> None:
    """training.grad_accum_nums "auto" keeps a global batch, so training.global_batch_size must
    say it (checked once every layer is applied: a file may set one and a --set the other)."""
    t = config.training
    if t.grad_accum_nums == "auto" and t.global_batch_size == 0:
        example = t.batch_size * 8
        raise ConfigError(
            'training.grad_accum_nums "auto" keeps training.global_batch_size, which is 0; set it to the '
            f"sequences per optimizer step over all ranks (e.g. training.global_batch_size={example}), "
            "or give grad_accum_nums a number"
        )


def per_rank_batch(config: Config, world_size: int) -> int:
    """Sequences per optimizer step on each rank under training.grad_accum_nums "auto": the global
    batch's equal share. ConfigError, one line, when there is no such share: no global batch, or
    one that world_size ranks cannot split evenly."""
    check_auto_accumulation(config)
    batch = config.training.global_batch_size
    if batch % world_size:
        lower = batch // world_size * world_size
        options = " or ".join(str(n) for n in (lower, lower + world_size) if n > 0)
        raise ConfigError(
            f'training.global_batch_size {batch} does not split over {world_size} rank(s), as training.grad_accum_nums "auto" '
            f"needs (each rank takes an equal share); use {options}"
        )
    return batch // world_size


def micro_batch_choices(config: Config, world_size: int) -> list[int]:
    """The micro-batches (training.batch_size) a config leaves open on world_size ranks, largest
    first: under training.grad_accum_nums "auto" every divisor of the per-rank batch (each keeps
    the global batch with a whole number of micro-batches), else the configured one alone."""
    if config.training.grad_accum_nums != "auto":
        return [config.training.batch_size]
    share = per_rank_batch(config, world_size)
    small = [d for d in range(1, math.isqrt(share) + 1) if share % d == 0]  # the divisors up to sqrt(share)
    divisors = sorted({*small, *(share // d for d in small)}, reverse=True)
    # Both numbers the config will hold stay within their bounds (checks.MAX_SIZE).
    return [b for b in divisors if b <= MAX_SIZE and share // b <= MAX_SIZE]


def with_micro_batch(config: Config, world_size: int, batch_size: int) -> Config:
    """config with training.batch_size set to batch_size (one of micro_batch_choices) and
    grad_accum_nums the micro-batches that keep the global batch: "auto" made concrete."""
    accum = per_rank_batch(config, world_size) // batch_size
    return dataclasses.replace(
        config, training=dataclasses.replace(config.training, batch_size=batch_size, grad_accum_nums=accum)
    )


def without_gpu_memory(config: Config, world_size: int) -> Config:
    """training.grad_accum_nums "auto" made concrete where there is no GPU memory to fill (CPU
    workers, and the provisional split before the plan): the largest micro-batch that divides
    the per-rank batch and is at most training.batch_size. Any other config as it is."""
    if config.training.grad_accum_nums != "auto":
        return config
    fitting = [b for b in micro_batch_choices(config, world_size) if b <= config.training.batch_size]
    return with_micro_batch(config, world_size, fitting[0])  # 1 always divides


def batch_split(config: Config, world_size: int) -> tuple[int, int]:
    """(micro-batch, micro-batches per step) on each rank as the run will train them, or, before
    the plan makes grad_accum_nums "auto" concrete, its CPU choice (without_gpu_memory): the same
    global batch either way, so the run's length does not depend on it."""
    t = with_world_size(without_gpu_memory(config, world_size), world_size).training
    assert isinstance(t.grad_accum_nums, int)  # without_gpu_memory made "auto" a number
    return t.batch_size, t.grad_accum_nums


def grad_accum_nums(config: Config | TrainingConfig) -> int:
    """training.grad_accum_nums of a config (or its training section) the plan has made concrete
    (pretrain/plan/parallelism.py); ValueError for "auto": a caller that needs the number before
    the plan uses batch_split."""
    accum = (config.training if isinstance(config, Config) else config).grad_accum_nums
    if accum == "auto":
        raise ValueError('training.grad_accum_nums is still "auto": read it after the plan (plan_parallelism) decides it')
    return accum


def with_world_size(config: Config, world_size: int) -> Config:
    """config with grad_accum_nums derived from training.global_batch_size for world_size ranks
    (unchanged when global_batch_size is 0). ConfigError when it does not divide. Under
    grad_accum_nums "auto" the plan derives both; here only the per-rank share is checked."""
    t = config.training
    if t.grad_accum_nums == "auto":
        per_rank_batch(config, world_size)
        return config
    if t.global_batch_size == 0:
        return config
    per_step = t.batch_size * world_size
    if t.global_batch_size % per_step:
        lower = t.global_batch_size // per_step * per_step
        options = " or ".join(str(n) for n in (lower, lower + per_step) if n > 0)
        raise ConfigError(
            f"training.global_batch_size {t.global_batch_size} is not a multiple of training.batch_size "
            f"{t.batch_size} x {world_size} rank(s) = {per_step}; use {options}, or change batch_size"
        )
    training = dataclasses.replace(t, grad_accum_nums=t.global_batch_size // per_step)
    return dataclasses.replace(config, training=training)
