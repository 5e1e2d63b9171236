"""HellaSwag, the build-nanogpt way: which of four endings continues a context, by likelihood.

The public file (rowanz/hellaswag's hellaswag_val.jsonl, or a copy on the Hugging Face Hub) holds
one JSON object per line; what is read of each:

    {"ctx": "A man is sitting on a roof. he",
     "endings": ["is using wrap to wrap a pair of skis.", "...", "...", "..."],
     "label": 3}

(the Hub's copies spell the label as a string, "3"; both are read). Every other field is ignored.

The model reads the context followed by each ending (with a space between them, as the endings
were written to follow the context). An ending's loss is the cross-entropy of its tokens, each
predicted from everything before it; the context's own tokens are not scored. Two answers per
example:
- accuracy: the ending with the lowest summed loss, the most likely ending as a whole;
- normalized accuracy: the lowest mean loss per token (build-nanogpt's acc_norm), which does not
  hold a long ending's length against it. Random guessing scores 0.25 on both.

This module reads and tokenizes (no torch, so the launcher checks a file before any worker
starts); pretrain/evaluation/choices.py scores the rows with a model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pretrain.data import DataError
from pretrain.data.hub_process import hub_snapshot
from pretrain.data.tokenizer import Tokenizer
from pretrain.run.refusal import Refusal

ENDINGS = 4
FIELDS = "ctx (the text), endings (4 texts) and label (0-3)"
HUB_PREFIX = "hf://datasets/"
HUB_FORM = "hf://datasets/OWNER/NAME[@REVISION]/PATH.jsonl"


class HellaSwagError(Refusal):
    """A HellaSwag file that cannot be used, or that is not there; the message is one line."""


@dataclass(frozen=True)
class Example:
    context: str
    endings: tuple[str, ...]
    """ENDINGS texts, each meant to follow the context after a space."""
    label: int
    """The index of the right ending."""


@dataclass(frozen=True)
class Encoded:
    """An example as token rows: the context's tokens, then one ending's, cut to the model's window."""

    rows: tuple[tuple[int, ...], ...]
    """One row per ending: the tokens the model reads."""
    starts: tuple[int, ...]
    """Each row's first scored position: row[start:] are its ending's tokens, each predicted from
    the tokens before it. At least 1, so every scored token has something before it."""
    label: int


# --- where the file is ------------------------------------------------------------------------


def locate(data: str) -> Path:
    """The local file data names: a path, or a file of a Hub dataset (HUB_FORM), downloaded into
    the Hugging Face cache, or found there when offline (HF_HUB_OFFLINE=1), by the data's own Hub
    client (its one-line errors for what is gated, missing or not cached)."""
    if not data.startswith(HUB_PREFIX):
        path = Path(data).expanduser()
        if not path.is_file():
            raise HellaSwagError(f"{data}: no such file; give a HellaSwag .jsonl file or {HUB_FORM}")
        return path
    repo, revision, filename = parse_hub_path(data)
    try:
        path = hub_snapshot(repo, revision, filename) / filename
    except DataError as error:
        raise HellaSwagError(str(error)) from None
    if not path.is_file():
        raise HellaSwagError(f"dataset {repo}@{revision} has no file {filename}")
    return path


def parse_hub_path(data: str) -> tuple[str, str, str]:
    """(repo, revision, file in the repo) of hf://datasets/OWNER/NAME[@REVISION]/PATH."""
    match = re.fullmatch(r"([^/@\s]+)/([^/@\s]+)(?:@([^/\s]+))?/(\S+)", data.removeprefix(HUB_PREFIX))
    if match is None:
        raise HellaSwagError(f"{data}: not a Hub file; expected {HUB_FORM}")
    owner, name, revision, filename = match.groups()
    return f"{owner}/{name}", revision or "main", filename


# --- reading -----------------------------------------------------------------------------------


def read_examples(path: Path, limit: int = 0) -> list[Example]:
    """The examples of a HellaSwag .jsonl file, in file order; the first limit of them when
    limit > 0. HellaSwagError names the first line that is not an example, and why."""
    examples: list[Example] = []
    for number, line in numbered_lines(path):
        if limit and len(examples) == limit:
            break
        examples.append(parse_example(line, f"{path}: line {number}"))
    if not examples:
        raise HellaSwagError(f"{path} holds no examples; expected one JSON object per line with {FIELDS}")
    return examples


def numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The file's non-blank lines, numbered from 1."""
    try:
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, start=1):
                if line.strip():
                    yield number, line
    except UnicodeDecodeError:
        raise HellaSwagError(f"{path} is not UTF-8 text; expected HellaSwag's .jsonl file") from None


def parse_example(line: str, where: str) -> Example:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise HellaSwagError(f"{where} is not JSON ({error.msg}); expected one object with {FIELDS}") from None
    if not isinstance(record, dict):
        raise HellaSwagError(f"{where} is not a JSON object; expected one with {FIELDS}")
    missing = [name for name in ("ctx", "endings", "label") if name not in record]
    if missing:
        hint = "; the public test split has no labels: use the validation file" if missing == ["label"] else ""
        raise HellaSwagError(f"{where} has no {', '.join(missing)}; a HellaSwag example has {FIELDS}{hint}")
    context, endings, label = record["ctx"], record["endings"], record["label"]
    if not isinstance(context, str) or not context.strip():
        raise HellaSwagError(f"{where}: ctx must be a non-empty text (got {json.dumps(context)[:60]})")
    if not (isinstance(endings, list) and len(endings) == ENDINGS and all(isinstance(e, str) for e in endings)):
        raise HellaSwagError(f"{where}: endings must be a list of {ENDINGS} texts (got {json.dumps(endings)[:60]})")
    if isinstance(label, str) and label.strip().isdigit():  # the Hub's copies: "3"
        label = int(label)
    if not (isinstance(label, int) and not isinstance(label, bool) and 0 <= label < ENDINGS):
        raise HellaSwagError(f"{where}: label must be an ending's index, 0 to {ENDINGS - 1} (got {json.dumps(label)[:60]})")
    return Example(context, tuple(endings), label)


def load(data: str, limit: int = 0) -> list[Example]:
    """The examples data names (a path or a Hub file), as read_examples reads them. A file that
    cannot be read is a HellaSwagError too."""
    path = locate(data)
    try:
        return read_examples(path, limit)
    except OSError as error:
        raise HellaSwagError(f"{path}: cannot read it ({error.strerror or error})") from None


def checked_data(data: str, limit: int = 0) -> str:
    """data as the workers should get it (a local path made absolute, so that a resume from
    another directory finds it; a Hub file as it is, now in the cache), after reading every
    example it names: the launcher's check, before any worker starts. DataError when it is not
    a usable HellaSwag file."""
    try:
        load(data, limit)
    except HellaSwagError as error:
        raise DataError(f"evaluation.data: {error}") from None
    return data if data.startswith(HUB_PREFIX) else str(Path(data).expanduser().resolve())


# --- tokens -----------------------------------------------------------------------------------


def encode(examples: list[Example], tokenizer: Tokenizer, window: int) -> list[Encoded]:
    """Each example's rows, at most window tokens each. A row longer than the window loses its
    first tokens (the start of the context: the ending is what is scored)."""
    texts = [text for example in examples for text in (example.context, *(" " + e for e in example.endings))]
    ids = [[int(i) for i in row] for row in tokenizer.encode_batch(texts)]
    encoded = []
    for n, example in enumerate(examples):
        context, *endings = ids[n * (ENDINGS + 1) : (n + 1) * (ENDINGS + 1)]
        rows, starts = [], []
        for ending in endings:
            row = context + ending
            cut = max(0, len(row) - window)
            rows.append(tuple(row[cut:]))
            starts.append(max(1, len(context) - cut))
        encoded.append(Encoded(tuple(rows), tuple(starts), example.label))
    return encoded


def longest_row(encoded: list[Encoded]) -> int:
    return max(len(row) for example in encoded for row in example.rows)


@dataclass(frozen=True)
class TaskExamples:
    """A file's examples as a run scores them, again and again (pretrain/evaluation/task_eval.py)."""

    encoded: list[Encoded]
    length: int
    """Every batch's row length: the longest row, so that every batch has one shape."""


# --- answers ----------------------------------------------------------------------------------


def choose(loss_sums: list[float], token_counts: list[int]) -> tuple[int, int]:
    """(the ending with the lowest summed loss, the one with the lowest mean loss per token);
    the first of equals."""
    means = [total / max(1, count) for total, count in zip(loss_sums, token_counts, strict=True)]
    return min(range(len(loss_sums)), key=loss_sums.__getitem__), min(range(len(means)), key=means.__getitem__)


@dataclass(frozen=True)
class Tally:
    examples: int = 0
    correct: int = 0
    """Right by the summed loss."""
    correct_norm: int = 0
    """Right by the mean loss per token."""

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.examples + other.examples, self.correct + other.correct, self.correct_norm + other.correct_norm)

    @property
    def accuracy(self) -> float:
        return self.correct / self.examples if self.examples else 0.0

    @property
    def accuracy_norm(self) -> float:
        return self.correct_norm / self.examples if self.examples else 0.0

    def describe(self) -> str:
        return (
            f"{self.examples} examples | Accuracy: {self.accuracy:.4f} ({self.correct}/{self.examples}) | "
            f"Normalized: {self.accuracy_norm:.4f} ({self.correct_norm}/{self.examples})"
        )
