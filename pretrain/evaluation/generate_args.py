"""python -m pretrain.generate's command line (pretrain/evaluation/generate.py runs it). Torch-free:
--help and usage errors answer before torch loads (pretrain/generate.py parses first)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from pretrain.checkpoint.arguments import add_device_argument, checkpoint_command_parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = checkpoint_command_parser("generate", "Print a prompt and the text a checkpoint's model continues it with.")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue (may be empty)")
    parser.add_argument("--max-tokens", type=int, default=100, metavar="N", help="tokens to generate (default 100)")
    parser.add_argument(
        "--temperature", type=float, default=0.8, metavar="T", help="0 is greedy; higher is more random (default 0.8)"
    )
    parser.add_argument(
        "--top-k", type=int, default=50, metavar="K", help="draw from the K most likely tokens only; 0 from all (default 50)"
    )
    parser.add_argument("--seed", type=int, metavar="N", help="make the sample reproducible")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature must be 0 (greedy) or positive (got {args.temperature})")
    if args.top_k < 0:
        parser.error(f"--top-k must be 0 (no limit) or positive (got {args.top_k})")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        parser.error(f"--seed must be in [0, 2**63) (got {args.seed})")
    return args
