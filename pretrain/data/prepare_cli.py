"""Prepare and cache the dataset of a config, without training: the `pretrain-prepare` command
(`python3 prepare_dataset.py` in a clone).

    pretrain-prepare [--preset NAME | --debug] [--config FILE] [--set section.key=value]
                     [--world-size N] [--cache-dir DIR] [--verify] [--force]

Training runs prepare the dataset themselves; this is for doing it ahead of time (on a machine
with network, for one without: a Hub dataset's files and tokenizer land in the Hugging Face
cache), checking a cache (--verify) or rebuilding it (--force). A Hub dataset's file count
(data.hub_max_files null) is sized for --world-size ranks, 1 unless given. Datasets go under the
cache root (--cache-dir, as the launcher's; else $PRETRAIN_CACHE_DIR, else ./cache).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pretrain import config as configuration
from pretrain.run.command_name import command_name
from pretrain.data.hub import choose_hub_files
from pretrain.data.prepare import prepare, sigterm_as_exit, verify
from pretrain.run.refusal import Refusal
from pretrain.run.files import CACHE_DIR_VAR, os_error_message

CONSOLE_COMMAND = "pretrain-prepare"  # pyproject.toml [project.scripts]


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Prepare and cache the dataset of a config, without training.")
    configuration.add_arguments(parser)
    parser.add_argument(
        "--world-size", type=int, metavar="N", help="ranks (GPUs) the run will have, to size a Hub download (default: 1)"
    )
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help=f"prepared datasets (default: ${CACHE_DIR_VAR}, else ./cache)",
    )
    parser.add_argument("--verify", action="store_true", help="also check the sha256 of every token file")
    parser.add_argument("--force", action="store_true", help="rebuild even when a valid cache exists")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """prog: the name usage and errors start with (prepare_dataset for the script in a clone; by
    default the name this command was invoked by)."""
    prog = prog or command_name("pretrain.data.prepare_cli", CONSOLE_COMMAND)
    args = build_parser(prog).parse_args(argv)
    try:
        if args.cache_dir is not None:
            if not args.cache_dir:
                raise configuration.ConfigError("--cache-dir must not be empty; leave it out for the default")
            os.environ[CACHE_DIR_VAR] = str(Path(args.cache_dir).expanduser().resolve())  # read where datasets go
        config = configuration.from_args(args)
        if args.world_size is not None and args.world_size < 1:
            raise configuration.ConfigError(f"--world-size must be at least 1 (got {args.world_size})")
        sized = config.data.source == "hub" or config.data.path.startswith("hf://")  # a Hub dataset's files, or shards
        if sized and config.data.hub_max_files is None and args.world_size is None:
            print(
                "dataset: sizing the download for 1 rank; a run on N GPUs reads N times as many tokens: "
                "pass --world-size N (or set data.hub_max_files)"
            )
        config = choose_hub_files(config, args.world_size or 1, print)
        with sigterm_as_exit():
            dataset_dir = prepare(config.data, log=print, force=args.force)
        if args.verify:
            verify(dataset_dir)
            print(f"dataset: verified {dataset_dir} (every file matches its sha256 in meta.json)")
    except Refusal as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return error.exit_code
    except OSError as error:
        print(f"{prog}: error: {os_error_message(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
