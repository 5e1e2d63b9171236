"""python -m pretrain.export: Export a checkpoint in Hugging Face transformers' format.

The code is pretrain/hf/export.py. Its command line (pretrain/hf/export_args.py) is read first,
without torch, so that --help and a usage error answer at once; main is also the installed
pretrain-export command."""

import sys
from collections.abc import Sequence

from pretrain.hf.export_args import parse_args
from pretrain.run.startup_gc import imports_frozen


def main(argv: Sequence[str] | None = None) -> int:
    """Read argv (default: the command line) without torch, then run the command on it."""
    args = parse_args(sys.argv[1:] if argv is None else argv)  # exits here on --help or a usage error
    with imports_frozen():  # torch, without the collector's repeated walks over it (pretrain/run/startup_gc.py)
        from pretrain.hf.export import run_command

    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
