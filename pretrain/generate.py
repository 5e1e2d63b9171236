"""python -m pretrain.generate: Sample text from a checkpoint or an export.

The code is pretrain/evaluation/generate.py."""

import sys

from pretrain.evaluation.generate import main

if __name__ == "__main__":
    sys.exit(main())
