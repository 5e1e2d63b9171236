"""python -m pretrain's command line (pretrain/train.py runs it). Torch-free: --help and usage
errors answer before torch loads (pretrain/__main__.py parses first)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pretrain import config as cfg


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain",
        description="Run one training process (no supervisor). Under the launcher, or torchrun, "
        "RANK/WORLD_SIZE/MASTER_* make the processes one DDP group.",
    )
    cfg.add_arguments(parser)
    parser.add_argument("--run-dir", metavar="DIR", help="run directory (default: runs/<run-id>/)")
    return parser.parse_args(argv)
