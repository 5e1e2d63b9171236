"""python -m pretrain.export's command line (pretrain/hf/export.py runs it). Torch-free: --help and
usage errors answer before torch loads (pretrain/export.py parses first)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from pretrain.checkpoint.arguments import checkpoint_command_parser
from pretrain.hf.safetensors_shards import DTYPES, parse_size

DEFAULT_DTYPE = "bfloat16"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = checkpoint_command_parser(
        "export",
        "Export a checkpoint's model as safetensors, with a config.json and its tokenizer.json, for use outside training.",
    )
    parser.add_argument(
        "--output", type=Path, metavar="DIR", help="where to write (default: <run dir>/export, or <checkpoint>/export)"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=DEFAULT_DTYPE, help=f"the weights' dtype (default {DEFAULT_DTYPE})"
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="the largest weights file (such as 5GB, 200MB); a bigger model is split into several (default 5GB)",
    )
    args = parser.parse_args(argv)
    try:
        args.max_shard_bytes = parse_size(args.max_shard_size)
    except ValueError as error:
        parser.error(f"--max-shard-size: {error}")
    return args
