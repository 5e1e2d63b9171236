#!/usr/bin/env python3
"""Prepare and cache the dataset of a config, without training.

    python3 prepare_dataset.py [--preset NAME | --debug] [--config FILE] [--set section.key=value]
                               [--verify] [--force]

Training runs prepare the dataset themselves; this is for doing it ahead of time, checking a
cache (--verify) or rebuilding it (--force).
"""

from __future__ import annotations

import argparse
import sys

from pretrain import config as configuration
from pretrain.data import DataError
from pretrain.data.prepare import prepare, sigterm_as_exit, verify
from pretrain.runfiles import os_error_message

PROG = "prepare_dataset"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    configuration.add_arguments(parser)
    parser.add_argument("--verify", action="store_true", help="also check the sha256 of every token file")
    parser.add_argument("--force", action="store_true", help="rebuild even when a valid cache exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        data_config = configuration.from_args(args).data
        with sigterm_as_exit():
            dataset_dir = prepare(data_config, log=print, force=args.force)
        if args.verify:
            verify(dataset_dir)
            print(f"dataset: verified {dataset_dir} (every file matches its sha256 in meta.json)")
    except (configuration.ConfigError, DataError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"{PROG}: error: {os_error_message(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
