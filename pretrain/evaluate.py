"""python -m pretrain.evaluate: Score a checkpoint or an export on a benchmark task.

The code is pretrain/evaluation/evaluate.py. Its command line (pretrain/evaluation/evaluate_args.py) is read first,
without torch, so that --help and a usage error answer at once; main is also the installed
pretrain-evaluate command."""

import sys
from collections.abc import Sequence

from pretrain.evaluation.evaluate_args import parse_args
from pretrain.run.startup_gc import imports_frozen


def main(argv: Sequence[str] | None = None) -> int:
    """Read argv (default: the command line) without torch, then run the command on it."""
    args = parse_args(sys.argv[1:] if argv is None else argv)  # exits here on --help or a usage error
    with imports_frozen():  # torch, without the collector's repeated walks over it (pretrain/run/startup_gc.py)
        from pretrain.evaluation.evaluate import run_command

    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
