"""python -m pretrain.export: Export a checkpoint in Hugging Face transformers' format.

The code is pretrain/hf/export.py. Its command line (pretrain/hf/export_args.py) is read first,
without torch, so that --help and a usage error answer at once; main is also the installed
pretrain-export command."""

import sys

from pretrain.hf.export_args import parse_args


def main() -> int:
    parse_args(sys.argv[1:])  # exits here on --help or a usage error
    from pretrain.hf.export import main as export

    return export()


if __name__ == "__main__":
    sys.exit(main())
