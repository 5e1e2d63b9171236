"""python -m pretrain.export: Export a checkpoint in Hugging Face transformers' format.

The code is pretrain/hf/export.py."""

import sys

from pretrain.hf.export import main

if __name__ == "__main__":
    sys.exit(main())
