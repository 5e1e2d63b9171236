"""Score a checkpoint (or an export, as pretrain/evaluation/generate.py reads one) on a benchmark task:

    python -m pretrain.evaluate --checkpoint runs/<id>/checkpoints/step_1000 --task hellaswag \\
        --data hellaswag_val.jsonl [--max-examples N] [--batch-examples 8] [--device auto|cpu|cuda]
        [--output result.json]

prints one line, `HellaSwag | step 1000 | 10042 examples | Accuracy: 0.2950 (2963/10042) | ...`.
--data is a local .jsonl file or a file of a Hub dataset, hf://datasets/OWNER/NAME[@REVISION]/PATH
(read from the Hugging Face cache when offline). --output also writes the result as JSON. The
same scoring runs during training with evaluation.data set (pretrain/evaluation/hellaswag.py says how).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretrain import config as cfg
from pretrain.evaluation import hellaswag
from pretrain.evaluation.choices import score
from pretrain.checkpoint.reading import (
    find_checkpoint,
    find_tokenizer_file,
    open_tokenizer,
    read_checkpoint,
)
from pretrain.evaluation.generate import check_vocabulary, load_model, pick_device
from pretrain.evaluation.evaluate_args import parse_args
from pretrain.evaluation.hellaswag import Tally
from pretrain.run.refusal import Refusal
from pretrain.run.files import atomic_write_text, os_error_message


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The result of scoring; the cheap checks (the device, the checkpoint, the examples) come
    before the model is built."""
    device = pick_device(args.device)
    checkpoint_dir = find_checkpoint(args.checkpoint)
    config, state = read_checkpoint(checkpoint_dir)
    examples = hellaswag.load(args.data, args.max_examples)
    tokenizer = open_tokenizer(config, find_tokenizer_file(config, checkpoint_dir))
    check_vocabulary(tokenizer, config)
    window = cfg.max_seq_len(config)
    encoded = hellaswag.encode(examples, tokenizer, window)
    model = load_model(config, state, device)
    del state  # the model holds its own copy
    amp = config.training.use_amp  # as the run trained and scored it: bfloat16 autocast, also on a CPU
    tally = score(
        model,
        encoded,
        device,
        batch_examples=args.batch_examples,
        length=hellaswag.longest_row(encoded),
        amp=amp,
    )
    return result(args.task, checkpoint_dir, tally)


def result(task: str, checkpoint_dir: Path, tally: Tally) -> dict[str, Any]:
    step = checkpoint_dir.name.removeprefix("step_")
    return {
        "task": task,
        "checkpoint": str(checkpoint_dir),
        "step": int(step) if step.isdigit() else None,
        "examples": tally.examples,
        "correct": tally.correct,
        "correct_norm": tally.correct_norm,
        "accuracy": tally.accuracy,
        "accuracy_norm": tally.accuracy_norm,
    }


def describe(result: dict[str, Any]) -> str:
    tally = Tally(result["examples"], result["correct"], result["correct_norm"])
    where = f"checkpoint step_{result['step']}" if result["step"] is not None else result["checkpoint"]
    return f"HellaSwag | {where} | {tally.describe()}"


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(parse_args(sys.argv[1:] if argv is None else argv))


def run_command(args: argparse.Namespace) -> int:
    """The command on arguments already read (parse_args): its output, or one error line and its exit code."""
    try:
        scored = run(args)
        if args.output is not None:
            atomic_write_text(args.output, json.dumps(scored, indent=2) + "\n")
    except Refusal as error:
        print(f"evaluate: error: {error}", file=sys.stderr)
        return error.exit_code
    except OSError as error:
        print(f"evaluate: error: {os_error_message(error)}", file=sys.stderr)
        return 2
    print(describe(scored))
    return 0


if __name__ == "__main__":
    sys.exit(main())
