"""Plot a run's metrics: python -m pretrain.plot RUN_DIR [--output PATH]

One PNG, panels on a shared step axis: loss (train, and validation points), gradient norm,
learning rate, and, for a run that scored HellaSwag (evaluation.data), its accuracy. Every point
at step N is of the weights after N steps, those checkpoint step_N holds (docs/training.md, Steps).
matplotlib is optional for training, so it is imported only here, and only when a plot is drawn.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretrain.run.command_name import command_name
from pretrain.observe.metrics import read_metrics
from pretrain.run.refusal import Refusal
from pretrain.run.files import atomic_write, os_error_message


class PlotError(Refusal):
    """A problem the user can fix; the message is one line."""


def latest_by_step(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The records of one kind, one per step, in step order. A resumed run re-logs the
    steps after its checkpoint, so when a step repeats, the later record wins."""
    by_step = {record["step"]: record for record in records if record.get("kind") == kind and isinstance(record.get("step"), int)}
    return [by_step[step] for step in sorted(by_step)]


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a number for key (null marks NaN/Inf)."""
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    return [step for step, _ in points], [value for _, value in points]


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir}: no such run directory")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir} has no metrics.jsonl: it is written by rank 0 during training")
    try:
        records = read_metrics(path)
    except ValueError as error:
        raise PlotError(str(error)) from None
    if not any(record.get("kind") == "train" for record in records):
        raise PlotError(f"{path} has no train records yet: the first is written after step 0")
    return records


def _import_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError("matplotlib is not installed; pip install matplotlib") from None
    return Figure, FigureCanvasAgg


def plot_metrics(records: list[dict[str, Any]], output: Path, title: str = "") -> Path:
    """Draw the train and validation records into a PNG at output, atomically."""
    train, val = latest_by_step(records, "train"), latest_by_step(records, "val")
    task = latest_by_step(records, "hellaswag")
    if not train:
        raise PlotError("no train records to plot")
    Figure, FigureCanvasAgg = _import_matplotlib()
    # The Agg canvas draws without a display, and a bare Figure leaves pyplot's global state alone.
    figure = Figure(figsize=(9, 12 if task else 9), layout="constrained")
    FigureCanvasAgg(figure)
    loss_ax, norm_ax, lr_ax, *task_ax = figure.subplots(4 if task else 3, 1, sharex=True)
    loss_ax.plot(*series(train, "loss"), label="train", linewidth=1.2)
    if val:
        loss_ax.plot(*series(val, "val_loss"), "o-", label="validation", markersize=4)
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    norm_ax.plot(*series(train, "grad_norm"), color="tab:green", linewidth=1.2)
    norm_ax.set_ylabel("gradient norm")
    lr_ax.plot(*series(train, "lr"), color="tab:purple", linewidth=1.2)
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    for ax in task_ax:
        ax.plot(*series(task, "accuracy_norm"), "o-", label="normalized (mean loss per token)", markersize=4)
        ax.plot(*series(task, "accuracy"), "s--", label="by summed loss", markersize=3, alpha=0.7)
        ax.axhline(0.25, color="grey", linestyle=":", linewidth=1, label="chance (0.25)")
        ax.set_ylabel("HellaSwag accuracy")
        ax.legend()
    (task_ax or [lr_ax])[0].set_xlabel("step N: the weights after N steps (checkpoint step_N)")
    for ax in (loss_ax, norm_ax, lr_ax, *task_ax):
        ax.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    # Through a temporary file and a rename: a viewer never sees half a PNG.
    atomic_write(output, lambda tmp: figure.savefig(tmp, format="png", dpi=110))
    return output


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=command_name("pretrain.plot", "pretrain-plot"),
        description="Plot loss, gradient norm, learning rate and HellaSwag accuracy of a run.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory (holds metrics.jsonl)")
    parser.add_argument("--output", type=Path, metavar="PATH", help="the PNG to write (default: RUN_DIR/metrics.png)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    output = args.output or args.run_dir / "metrics.png"
    try:
        records = load_records(args.run_dir)
        plot_metrics(records, output, title=args.run_dir.resolve().name)
    except Refusal as error:
        print(f"plot: error: {error}", file=sys.stderr)
        return error.exit_code
    except OSError as error:  # an unreadable metrics file, an unwritable output directory
        print(f"plot: error: {os_error_message(error)}", file=sys.stderr)
        return 2
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
