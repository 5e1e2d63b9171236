"""The command-line pieces the commands that read a checkpoint share (generate, evaluate, export):
the parser whose usage errors are one line, --checkpoint and --device. Standard library only, so
that their --help and usage errors answer before torch loads."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

from pretrain.run.command_name import command_name


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2), like every other error here."""

    def __init__(self, *args: Any, error_prefix: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.error_prefix = error_prefix

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.error_prefix}: error: {message} (see --help)\n")


def checkpoint_command_parser(command: str, description: str) -> OneLineParser:
    """The parser of `python -m pretrain.<command>` (installed as pretrain-<command>): one-line
    usage errors prefixed with command, and --checkpoint PATH, as every command that reads a
    checkpoint takes it (pretrain/checkpoint/reading.py find_checkpoint)."""
    parser = OneLineParser(
        prog=command_name(f"pretrain.{command}", f"pretrain-{command}"), error_prefix=command, description=description
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        metavar="PATH",
        help="a checkpoint directory (<run dir>/checkpoints/step_<N>), a run directory for its latest checkpoint, "
        "or an export (<run dir>/export, or a Hugging Face Llama or Mixtral directory)",
    )
    return parser


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """--device auto|cpu|cuda, which pick_device reads."""
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: the first CUDA GPU when there is one, else the CPU",
    )
