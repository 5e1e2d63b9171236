#!/usr/bin/env python3
"""Prepare and cache the dataset of a config, without training (from a clone; installed, the
same is the `pretrain-prepare` command). Options: python3 prepare_dataset.py --help.
"""

import sys

from pretrain.data.prepare_cli import main

if __name__ == "__main__":
    sys.exit(main(prog="prepare_dataset"))
