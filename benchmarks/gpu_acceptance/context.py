"""What every GPU check shares: a row of the table (Row), what a check is given (Context), and
the data options of the runs that train a preset."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Without --set data.*: the built-in corpus and the byte tokenizer, so that nothing needs the
# network (the GPU machine may have none). The presets keep their vocabularies (byte ids are
# valid rows of any of them), so the models, and their throughput, are the presets' own.
OFFLINE_DATA = ("data.source=builtin", "data.hub_repo=", "data.tokenizer=byte", "data.tokenizer_name=", "data.max_samples=0")
SMALL_FALLBACK_VOCAB = 50304
"""The small preset's vocabulary on the offline fallback when the preset has none of its own."""


@dataclass
class Row:
    check: str
    result: str
    target: str
    met: str
    """yes, no or n.a."""
    key: str = ""
    """The --only name of the check that made it."""
    failure: str = ""
    """The last lines of the output of what failed (shown under the table)."""


@dataclass
class Context:
    quick: bool
    sets: list[str]
    """--set options for the data of the small and production-shaped runs."""
    gpus: list[int]
    """NVML indices of the whole GPUs."""
    tmp: Path
    log: Callable[[str], None] = print
    data_note: str = ""

    @property
    def data_sets(self) -> list[str]:
        return self.sets if any(s.startswith("data.") for s in self.sets) else [*OFFLINE_DATA, *self.sets]

    @property
    def small_sets(self) -> list[str]:
        """data_sets, and on the byte fallback the vocabulary of GPT-2's tokenizer (padded to
        64) when the preset's follows the tokenizer: 257 rows would leave out most of the output
        projection's work and make the throughput and MFU those of another model."""
        from pretrain import config as cfg

        sets = self.data_sets
        if sets is not self.sets and cfg.resolve(preset="small", sets=sets).model.vocab_size is None:
            sets = [*sets, f"model.vocab_size={SMALL_FALLBACK_VOCAB}"]
        return sets

    def run_dir(self, name: str) -> str:
        return str(self.tmp / name)


def sets_args(sets: Sequence[str]) -> list[str]:
    return [item for assignment in sets for item in ("--set", assignment)]
