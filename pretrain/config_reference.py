"""python -m pretrain.config_reference: Write (or --check) docs/config.md from the config's docstrings.

The code is pretrain/config/reference.py."""

import sys

from pretrain.config.reference import main

if __name__ == "__main__":
    sys.exit(main())
