"""python -m pretrain.evaluate: Score a checkpoint or an export on a benchmark task.

The code is pretrain/evaluation/evaluate.py."""

import sys

from pretrain.evaluation.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
