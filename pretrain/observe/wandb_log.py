"""Weights & Biases (logging.wandb: true), an optional extra: `pip install wandb`. Nothing imports
wandb unless a config asks for it. Its own environment is honoured: WANDB_MODE=offline writes the
run under <run dir>/wandb/ for a later `wandb sync`, WANDB_API_KEY / `wandb login` authenticate,
WANDB_ENTITY chooses the team. Only rank 0 logs, the same scalars as metrics.jsonl."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pretrain import config as cfg

MISSING = "logging.wandb is true but the wandb package is not installed: pip install wandb, or set logging.wandb=false"


def is_installed() -> bool:
    """Whether `import wandb` would work, without importing it (the launcher asks before spawning)."""
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


class WandbRun:
    """One W&B run per run directory: a resumed run continues it (its id is the directory's name)."""

    def __init__(self, run_dir: Path, config: cfg.Config, logger: logging.Logger | None = None) -> None:
        try:
            import wandb  # only here: logging.wandb asked for it
        except ImportError:
            raise cfg.ConfigError(MISSING) from None

        self._run = wandb.init(
            project=config.logging.wandb_project,
            name=run_dir.name,
            id=run_dir.name,
            resume="allow",
            dir=str(run_dir),
            config=cfg.to_dict(config),
        )
        if logger is not None:
            logger.debug(f"Weights & Biases: project {config.logging.wandb_project}, run {run_dir.name}")

    def log(self, section: str, step: int, values: dict[str, Any]) -> None:
        numbers = {f"{section}/{name}": value for name, value in values.items() if value is not None}
        self._run.log(numbers, step=int(step))

    def close(self) -> None:
        self._run.finish()
