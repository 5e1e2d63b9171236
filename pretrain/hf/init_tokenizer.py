"""The --init-from checkpoint's tokenizer against the run's, once the dataset is prepared.

Weights of the right shapes trained with another tokenizer of the same size fit the model, and
every id would mean another token: the embedding's rows would belong to other tokens. So the
checkpoint's tokenizer.json (an export has one; a Hub model's is downloaded with its weights)
is compared with the tokenizer the run's dataset was made with, as id -> token
(pretrain/hf/vocabulary.py): the vocabularies only, from the files, nothing tokenized again.
Only the ids text tokenizes to must agree: the model's vocabulary and the run's end-of-text id
(the data holds it between documents). Special tokens never come out of text (the run spells
them as text), so renamed ones (Llama 3.1's <|eom_id|> where Llama 3 has a reserved token) do
not change what the data's ids mean: they are a DEBUG line at most. A difference is one line
(InitFromError, exit 2) naming both and the settings that train on the checkpoint's tokenizer;
where either side's tokenizer is not known, a warning line says the ids were not checked, and
the run goes on.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain import registry
from pretrain.config import Config
from pretrain.config.schema import SHARD_SOURCES
from pretrain.data import DataError, first_line
from pretrain.data.tokenizer import EOT_CANDIDATES, TOKENIZER_FILE, TiktokenTokenizer, huggingface_file
from pretrain.hf.init_checkpoint import HfCheckpoint, InitFromError
from pretrain.hf.vocabulary import byte_vocabulary, tiktoken_vocabulary, token_ids, tokenizer_json_ids

Log = Callable[[str], None]

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
logger = logging.getLogger(__name__)
"""A worker's DEBUG line (under the "pretrain" logger); nothing in the launcher, which sets no handler."""


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer's ids: id -> token, and which of them are special tokens (never text's)."""

    ids: dict[int, str]
    special: frozenset[int]


def vocabulary(tokens: dict[str, int], specials: dict[str, int]) -> Vocabulary:
    """The Vocabulary of a vocabulary and its special tokens, as pretrain/hf/vocabulary.py gives them."""
    return Vocabulary(token_ids(tokens, specials), frozenset(specials.values()))


def tokenizer_json_vocabulary(tokenizer_json: Any) -> Vocabulary:
    """The Vocabulary of a tokenizer.json: its added tokens marked special are the special ids (an
    added token that is not special is matched in text, like the model's vocabulary)."""
    ids = tokenizer_json_ids(tokenizer_json)  # ValueError for anything but a tokenizer.json
    added = tokenizer_json.get("added_tokens") or []
    return Vocabulary(ids, frozenset(int(token["id"]) for token in added if token.get("special") is True))


def differing_ids(theirs: Vocabulary, ours: Vocabulary, eot_id: int | None) -> tuple[list[int], list[int]]:
    """(the ids the run's data can hold that mean another token in theirs, the run's special ids
    that do), in id order. The run's data holds the ids its text tokenizes to (those of its
    tokenizer that are not special) and its end-of-text id eot_id; an id only the checkpoint's
    tokenizer has never occurs in it, and a special id of the checkpoint's is refused where the
    run's text becomes that id."""
    differ = sorted(number for number, token in ours.ids.items() if theirs.ids.get(number) != token)
    special = ours.special - {eot_id}
    return [number for number in differ if number not in special], [number for number in differ if number in special]


class Unknown(Exception):
    """A tokenizer whose vocabulary cannot be known here: the message says why, for the warning."""


def check_tokenizer(checkpoint: HfCheckpoint, config: Config, dataset_dir: Path, log: Log) -> None:
    """InitFromError in one line where checkpoint's tokenizer gives an id text tokenizes to another
    token than the run's tokenizer (that of the dataset in dataset_dir) does; a warning line to log
    where either is unknown."""
    where = f"training.init_from: {checkpoint.source}"
    try:
        theirs = _checkpoint_ids(checkpoint.directory)
        ours = _run_ids(config, dataset_dir)
    except Unknown as unknown:
        log(f"warning: {where}: {unknown}, so whether its ids mean the run's tokens is not checked")
        return
    differ, special = differing_ids(theirs, ours, _eot_id(config, ours))
    if special:
        logger.debug(f"{where}: {_count(special)}, all special tokens, which text never becomes: not refused")
    if not differ:
        return
    first = differ[0]
    raise InitFromError(
        f"{where}: its tokenizer ({TOKENIZER_FILE}, {len(theirs.ids)} ids) is not the run's ({_run_words(config)}, "
        f"{len(ours.ids)} ids): {_count(differ)} (id {first}: {_token(theirs.ids, first)} in its tokenizer, "
        f"{_token(ours.ids, first)} in the run's), so each would mean another token than its weights learned; "
        f"train on its tokenizer: {_use_theirs(checkpoint, theirs.ids)}"
    )


def _count(ids: list[int]) -> str:
    return f"{len(ids)} ids differ" if len(ids) > 1 else "1 id differs"


def _checkpoint_ids(directory: Path) -> Vocabulary:
    file = directory / TOKENIZER_FILE
    if not file.is_file():
        raise Unknown(f"it has no {TOKENIZER_FILE}")
    return _file_ids(file, f"its {TOKENIZER_FILE}")


def _run_ids(config: Config, dataset_dir: Path) -> Vocabulary:
    """id -> token of the run's tokenizer: the tokenizer.json its dataset was made with, or the
    byte tokenizer's or tiktoken encoding's own."""
    data = config.data
    if data.source in SHARD_SOURCES and data.tokenizer == "byte":
        raise Unknown(f"the run's pre-tokenized {data.source} shards do not say which tokenizer made them (data.tokenizer)")
    if (dataset_dir / TOKENIZER_FILE).is_file():
        return _file_ids(dataset_dir / TOKENIZER_FILE, "the run's dataset's tokenizer.json")
    if data.tokenizer == "byte":
        return vocabulary(*byte_vocabulary())
    try:
        if data.tokenizer == "tiktoken":
            return vocabulary(*tiktoken_vocabulary(TiktokenTokenizer(data.tokenizer_name).encoding))
        if data.tokenizer == "huggingface":  # pre-tokenized shards keep no copy of it
            return _file_ids(huggingface_file(data.tokenizer_name), f"data.tokenizer_name {data.tokenizer_name}")
    except DataError as error:
        raise Unknown(f"the run's tokenizer is not available here ({error})") from None
    if registry.TOKENIZERS[data.tokenizer].file:
        raise Unknown(f"the run's dataset ({dataset_dir}) holds no {TOKENIZER_FILE}")
    raise Unknown(f"the run's data.tokenizer {data.tokenizer} has no vocabulary known here")


def _file_ids(file: Path, what: str) -> Vocabulary:
    try:
        return tokenizer_json_vocabulary(json.loads(file.read_text(encoding="utf-8")))
    except UnicodeDecodeError:
        raise Unknown(f"{what} cannot be read (not UTF-8 text)") from None
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        raise Unknown(f"{what} cannot be read as a vocabulary ({first_line(error)})") from None


def _eot_id(config: Config, ours: Vocabulary) -> int | None:
    """The id the run's dataset puts between documents, as pretrain/data/tokenizer.py picks it:
    data.eot_token for a huggingface tokenizer, else the first of the usual names it has (the
    byte and BPE tokenizers' and tiktoken's is <|endoftext|>, the first); a special token's id first."""
    data = config.data
    names = (data.eot_token,) if data.tokenizer == "huggingface" and data.eot_token else EOT_CANDIDATES
    for name in names:
        found = sorted(number for number, token in ours.ids.items() if token == name)
        if found:
            return next((number for number in found if number in ours.special), found[0])
    return None


def _run_words(config: Config) -> str:
    """The run's tokenizer in words."""
    data = config.data
    if data.tokenizer == "bpe":
        trained_on = data.path or data.hub_repo or f"the {data.source} corpus"
        return f"the {data.bpe_vocab_size}-token BPE tokenizer trained on {trained_on}"
    if data.tokenizer_name:
        return f"data.tokenizer {data.tokenizer} {data.tokenizer_name}"
    return f"the {data.tokenizer} tokenizer"


def _token(ids: dict[int, str], number: int) -> str:
    """A token as a refusal shows it: quoted, cut to 20 characters; "none" for an id it lacks."""
    if number not in ids:
        return "none"
    token = ids[number]
    return repr(token if len(token) <= 20 else token[:20] + "...")


def _use_theirs(checkpoint: HfCheckpoint, theirs: dict[int, str]) -> str:
    """The settings that make the run's dataset with the checkpoint's tokenizer.json: its directory
    (a Hub model's id, fetched as data.tokenizer_name), its end-of-text token where
    tokenizer_config.json names one the run would not pick by itself, and its model's vocabulary
    where that has more rows than the tokenizer has ids (the model would follow the tokenizer)."""
    name = _tokenizer_name(checkpoint)
    sets = ["data.tokenizer=huggingface", f"data.tokenizer_name={name}"]
    eos = _eos_token(checkpoint.directory)
    tokens = set(theirs.values())
    picked = next((token for token in EOT_CANDIDATES if token in tokens), None)
    if eos is not None and eos in tokens and eos != picked:
        sets.append(f"data.eot_token={eos}")
    rows = checkpoint.config.get("vocab_size")
    if isinstance(rows, int) and rows != max(theirs, default=-1) + 1:
        sets.append(f"model.vocab_size={rows}")
    return " ".join(f"--set {shlex.quote(setting)}" for setting in sets)


def _tokenizer_name(checkpoint: HfCheckpoint) -> str:
    """What data.tokenizer_name gives the checkpoint's very tokenizer: a directory as it is; a Hub
    model pinned to a commit (owner/name@<commit>) by its id only where the cache's main ref is that
    commit (data.tokenizer_name reads main), else by its snapshot directory in the cache."""
    source = checkpoint.source
    if Path(source).is_absolute() or "@" not in source:
        return source
    snapshot = checkpoint.directory
    try:
        main = (snapshot.parent.parent / "refs" / "main").read_text(encoding="utf-8").strip()
    except OSError:
        main = ""
    return source.partition("@")[0] if main == snapshot.name else str(snapshot)


def _eos_token(directory: Path) -> str | None:
    """The end-of-text token tokenizer_config.json names (a string, or a dict with its content)."""
    try:
        eos = json.loads((directory / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) and eos else None
