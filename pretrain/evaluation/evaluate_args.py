"""python -m pretrain.evaluate's command line (pretrain/evaluation/evaluate.py runs it). Torch-free:
--help and usage errors answer before torch loads (pretrain/evaluate.py parses first)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from pretrain.checkpoint.arguments import add_device_argument, checkpoint_command_parser
from pretrain.evaluation import hellaswag

TASKS = ("hellaswag",)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = checkpoint_command_parser("evaluate", "Score a checkpoint's model on a benchmark task (HellaSwag).")
    parser.add_argument("--task", choices=TASKS, default="hellaswag", help="the task (default hellaswag)")
    parser.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help=f"the task's examples: a .jsonl file, or a Hub dataset's file ({hellaswag.HUB_FORM})",
    )
    parser.add_argument("--max-examples", type=int, default=0, metavar="N", help="score the first N examples only (default: all)")
    parser.add_argument(
        "--batch-examples", type=int, default=8, metavar="N", help="examples per forward pass (default 8; 4 rows each)"
    )
    add_device_argument(parser)
    parser.add_argument("--output", type=Path, metavar="FILE", help="also write the result to FILE as JSON")
    args = parser.parse_args(argv)
    if args.max_examples < 0:
        parser.error(f"--max-examples must be 0 (all) or positive (got {args.max_examples})")
    if args.batch_examples < 1:
        parser.error(f"--batch-examples must be at least 1 (got {args.batch_examples})")
    return args
