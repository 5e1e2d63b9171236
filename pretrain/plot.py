"""python -m pretrain.plot: Plot a run's metrics.

The code is pretrain/observe/plot.py."""

import sys

from pretrain.observe.plot import main

if __name__ == "__main__":
    sys.exit(main())
