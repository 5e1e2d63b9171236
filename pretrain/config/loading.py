"""Resolving a config in layers, strictly: a preset, then a JSON file, then --max-steps, then each
--set section.key=value, every layer validated as it is applied so that an error names the layer
(the file, or the option), the key path and, for a typo, the closest valid key. Also the rules that
need the whole config (one run length, context within the model's positions, unused preset keys,
the global batch grad_accum_nums "auto" keeps), saving and loading a resolved config, and the shared
command-line options (the per-world-size batch is batch.py's). Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import re
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pretrain.config.batch import check_auto_accumulation
from pretrain.config.presets import PRESETS
from pretrain.config.schema import (
    SECTIONS,
    SHARD_SOURCES,
    CheckpointingMode,
    Config,
    ConfigError,
    DataConfig,
    describe,
    not_one_of,
)
from pretrain.run.files import atomic_write_text


# --- strict loading -------------------------------------------------------------------


def _closest(word: str, choices: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {match[0]}?" if match else f"; valid: {', '.join(sorted(choices))}"


def _coerce(key: str, expected: Any, value: Any) -> Any:
    """Return value as the declared type, or raise ConfigError naming the key."""
    origin = get_origin(expected)
    if origin is Literal:
        allowed = get_args(expected)
        if value not in allowed:
            raise ConfigError(f"{key}: {not_one_of(value, allowed)}")
        return value
    if origin in (Union, types.UnionType):
        members = get_args(expected)
        if value is None and type(None) in members:
            return None
        # The first member that takes the value (a mode's name, or the older true/false); when
        # none does, the first member's error: it names what the key is meant to hold.
        errors = []
        inners = [m for m in members if m is not type(None)]
        for inner in inners:
            try:
                return _coerce(key, inner, value)
            except ConfigError as error:
                errors.append(error)
        if inners[0] is bool and all(get_origin(m) is Literal for m in inners[1:]):
            # true, false or a name (training.float8): each is meant, so the error lists them all
            choices = [True, False, *(name for m in inners[1:] for name in get_args(m))]
            raise ConfigError(f"{key}: {not_one_of(value, choices)}")
        raise errors[0]
    if expected is bool and isinstance(value, bool):
        return value
    if expected is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if expected is float and isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise ConfigError(f"{key}: expected a finite number, got an integer of {len(str(value))} digits") from None
        if not math.isfinite(number):  # JSON's Infinity and NaN, or 1e400
            raise ConfigError(f"{key}: expected a finite number, got {value}")
        return number
    if expected is str and isinstance(value, str):
        return value
    wanted = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[expected]
    raise ConfigError(f"{key}: expected {wanted}, got {describe(value)}")


def apply_overrides(config: Config, overrides: dict[str, Any], source: str) -> Config:
    """Return config with overrides ({section: {key: value}}, as in a JSON file) applied."""
    try:
        sections: dict[str, Any] = {}
        for name, values in overrides.items():
            if name == "preset":
                continue
            if name not in SECTIONS:
                raise ConfigError(f"{name}: unknown section{_closest(name, list(SECTIONS))}")
            if not isinstance(values, dict):
                raise ConfigError(f"{name}: expected an object of keys, got {describe(values)}")
            sections[name] = _apply(getattr(config, name), values, name)
        return dataclasses.replace(config, **sections)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def _apply(current: Any, values: dict[str, Any], prefix: str) -> Any:
    """current (a section, or a group inside one such as model.moe) with values applied."""
    hints = get_type_hints(type(current))
    changes = {}
    for key, value in values.items():
        if key not in hints:
            valid = [f"{prefix}.{k}" for k in hints]
            raise ConfigError(f"{prefix}.{key}: unknown key{_closest(f'{prefix}.{key}', valid)}")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}.{key}: expected an object of keys, got {describe(value)}")
            changes[key] = _apply(getattr(current, key), value, f"{prefix}.{key}")
        else:
            changes[key] = _coerce(f"{prefix}.{key}", hints[key], value)
    return dataclasses.replace(current, **changes)


class _RepeatedKey(Exception):
    """A JSON object gave one key twice (raised by _no_repeated_keys while parsing)."""


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: the object as a dict, unless a key comes twice (json itself keeps
    the last value silently, so a file saying batch_size 4 and then 8 would train with 8)."""
    keys = [key for key, _ in pairs]
    if len(set(keys)) < len(keys):
        raise _RepeatedKey
    return dict(pairs)


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:]')
"""A JSON string, or a character that opens or closes a container or ends a key."""


def _repeated_key(text: str) -> tuple[str, int]:
    """The dotted path of the first key an object in text (valid JSON) gives twice, and the line
    of its second occurrence."""
    frames: list[tuple[set[str], list[str]] | None] = []  # per open container: an object's keys and its current key
    last_string = ""
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token == "{":
            frames.append((set(), [""]))
        elif token == "[":
            frames.append(None)
        elif token in "}]":
            frames.pop()
        elif token == ":" and (frame := frames[-1]) is not None:
            seen, current = frame
            key = json.loads(last_string)
            current[0] = key
            if key in seen:
                path = [f[1][0] for f in frames if f is not None]
                return ".".join(path), text.count("\n", 0, match.start()) + 1
            seen.add(key)
        else:
            last_string = token
    raise ValueError("no key is repeated")


def _json_error(error: json.JSONDecodeError) -> str:
    """Why and where text is not JSON: "Expecting value at line 1 column 7". Some of json's
    reasons end in "at" ("Unterminated string starting at"), which the position completes."""
    where = f"line {error.lineno} column {error.colno}"
    return f"{error.msg} {where}" if error.msg.endswith(" at") else f"{error.msg} at {where}"


def loads_strictly(text: str, source: str) -> Any:
    """text parsed as JSON; ConfigError naming source for invalid JSON or a key given twice."""
    try:
        return json.loads(text, object_pairs_hook=_no_repeated_keys)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{source}: invalid JSON: {_json_error(error)}") from None
    except _RepeatedKey:
        path, line = _repeated_key(text)
        raise ConfigError(f"{source}: line {line}: {path} is given twice; keep one of them") from None
    except ValueError:  # Python's limit on the digits of an integer
        raise ConfigError(f"{source}: a number of more than {sys.get_int_max_str_digits()} digits") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a JSON config file into a dict, with one-line errors for the usual mistakes."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read config file ({error})") from None
    data = loads_strictly(text, str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of sections, got {describe(data)}")
    preset = data.get("preset")
    if preset is not None and not isinstance(preset, str):
        raise ConfigError(f"{path}: preset: expected a preset name, got {describe(preset)}")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"{path}: preset: unknown preset {json.dumps(preset)}{_closest(str(preset), list(PRESETS))}")
    return data


def parse_set(assignment: str) -> dict[str, Any]:
    """Turn `section.key=value` into {section: {key: value}}; value is JSON, else a string."""
    path, sep, raw = assignment.partition("=")
    if not sep or path.count(".") not in (1, 2) or not all(path.split(".")):
        raise ConfigError(f"--set {assignment}: expected section.key=value, for example training.batch_size=4")
    section, *keys = path.split(".")
    if section == "preset":
        raise ConfigError(f"--set {assignment}: the preset is not a section; use --preset NAME")
    try:
        value = json.loads(raw, object_pairs_hook=_no_repeated_keys)
    except json.JSONDecodeError:
        value = raw
    except _RepeatedKey:
        raise ConfigError(f"--set {assignment}: {path}.{_repeated_key(raw)[0]} is given twice; keep one of them") from None
    except ValueError:  # Python's limit on the digits of an integer
        raise ConfigError(f"--set {path}: a number of more than {sys.get_int_max_str_digits()} digits") from None
    for key in reversed(keys):  # model.moe.top_k=2 -> {"model": {"moe": {"top_k": 2}}}
        value = {key: value}
    return {section: value}


def resolve(
    preset: str | None = None,
    config_file: Path | None = None,
    max_steps: int | None = None,
    sets: Sequence[str] = (),
    *,
    saved: bool = False,
) -> Config:
    """Build a config: preset (explicit, else the file's "preset", else production), then
    the file, then --max-steps, then each --set in order. saved: config_file was written by
    save() (see one_run_length)."""
    file_data = read_config_file(config_file) if config_file is not None else {}
    name = preset or file_data.get("preset") or "production"
    if name not in PRESETS:
        raise ConfigError(f"--preset {name}: unknown preset{_closest(name, list(PRESETS))}")
    config = PRESETS[name]()
    user_data_keys = set(file_data["data"]) if isinstance(file_data.get("data"), dict) else set()
    run_length_set_by: dict[str, str] = {}
    if config_file is not None:
        config = apply_overrides(config, file_data, str(config_file))
        run_length_set_by |= run_length_keys(file_data, str(config_file))
    if max_steps is not None:
        config = apply_overrides(config, {"training": {"max_steps": max_steps}}, "--max-steps")
        run_length_set_by["max_steps"] = "--max-steps"
    # Every --set at once, later ones winning: a check between two keys (training.float8 needs
    # training.use_amp) sees both, whichever order they were given in.
    merged: dict[str, Any] = {}
    for assignment in sets:
        overrides = parse_set(assignment)
        user_data_keys |= set(overrides.get("data", {}))
        merged = _merged(merged, overrides)
        run_length_set_by |= run_length_keys(overrides, "--set")
    if merged:
        config = apply_overrides(config, merged, "--set")
    if not saved:
        config = one_run_length(config, run_length_set_by)
    config = drop_unused_preset_keys(config, PRESETS[name]().data, user_data_keys)
    config.data.check_complete()
    check_context(config)
    check_auto_accumulation(config)
    return config


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """base with overrides laid over it, key by key into nested objects (a --set of a group's key
    after one of the whole group changes that key only)."""
    out = dict(base)
    for key, value in overrides.items():
        both_objects = isinstance(out.get(key), dict) and isinstance(value, dict)
        out[key] = _merged(out[key], value) if both_objects else value
    return out


def run_length_keys(overrides: dict[str, Any], layer: str) -> dict[str, str]:
    """{key: layer} for training.epochs and training.max_steps, where overrides set them."""
    training = overrides.get("training")
    return {key: layer for key in ("epochs", "max_steps") if isinstance(training, dict) and key in training}


def one_run_length(config: Config, set_by: dict[str, str]) -> Config:
    """training.epochs (when above 0) sets the run length instead of training.max_steps, so
    the user's layers (a file, --max-steps, --set; set_by names the last to set each) may set
    only one of them: both is an error, never a silent choice. Where only one is the user's,
    it wins over the preset's other. A config written by save() is exempt: its max_steps is
    the one fit_to_dataset derived from its epochs (newer runs save epochs as 0)."""
    t = config.training
    if t.epochs == 0:
        return config
    if "epochs" in set_by and "max_steps" in set_by:
        raise ConfigError(
            f"training.epochs={t.epochs} ({set_by['epochs']}) and training.max_steps={t.max_steps} "
            f"({set_by['max_steps']}) both set the run length; keep one of them"
        )
    if "max_steps" in set_by:  # the preset's epochs under the user's max_steps
        return dataclasses.replace(config, training=dataclasses.replace(t, epochs=0))
    return config


HUB_KEYS = ("hub_repo", "hub_revision", "hub_files", "hub_max_files")
TOKENIZER_KEYS = ("tokenizer_name", "eot_token")


def drop_unused_preset_keys(config: Config, preset: DataConfig, user_keys: set[str]) -> Config:
    """config with the data keys that came from the preset, and that the user's choice of source
    or tokenizer makes meaningless, back at their neutral defaults: `--preset small --set
    data.source=jsonl` must not fail on the preset's data.hub_repo, nor `--set data.tokenizer=byte`
    on its data.tokenizer_name; with pre-tokenized shards its tokenizer goes too. A key the user
    set (file or --set) is kept, so check_complete still refuses it when it would be ignored."""
    data, neutral = config.data, DataConfig()
    unused: list[str] = []
    if data.source != "hub":
        unused += HUB_KEYS
    if data.source in SHARD_SOURCES and "tokenizer" not in user_keys:
        # Shards are tokenized already; "byte" is what says nothing names their tokenizer.
        data = dataclasses.replace(data, tokenizer=neutral.tokenizer)
    if data.tokenizer != preset.tokenizer:  # another tokenizer: the preset's name is not its name
        unused += TOKENIZER_KEYS
    changes = {
        key: getattr(neutral, key) for key in unused if key not in user_keys and getattr(data, key) == getattr(preset, key)
    }
    return dataclasses.replace(config, data=dataclasses.replace(data, **changes))


def check_context(config: Config) -> None:
    """The training sequences must fit the model's positions."""
    limit = config.model.max_seq_len
    if limit is not None and config.data.context_length > limit:
        raise ConfigError(
            f"data.context_length {config.data.context_length} is longer than the model supports "
            f"(model.max_seq_len {limit}); lower data.context_length or raise model.max_seq_len"
        )


def activation_checkpointing(config: Config) -> CheckpointingMode:
    """What the blocks recompute: training.activation_checkpointing, except under
    debug.trace_nonfinite, whose hooks must see every module run once ("none"). "auto" is made
    concrete by the launcher's plan (pretrain/plan/parallelism.py); before it, "none", the plan's
    first choice."""
    chosen = config.training.activation_checkpointing
    if isinstance(chosen, bool):  # TrainingConfig has made it a name already; this tells the type checker
        chosen = "full" if chosen else "none"
    if config.debug.trace_nonfinite or chosen == "auto":
        return "none"
    return chosen


def loss_chunk_tokens(config: Config) -> int:
    """Tokens per loss chunk (0: one piece): training.loss_chunk_tokens, which the launcher's plan
    makes concrete when it is null (pretrain/plan/parallelism.py); before it, 0, the plan's first choice."""
    return config.training.loss_chunk_tokens or 0


def max_seq_len(config: Config) -> int:
    """The sequence length the model is built for."""
    return config.model.max_seq_len or config.data.context_length


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def save(config: Config, path: Path) -> None:
    """Write the resolved config as JSON, atomically; loading it back gives the same config."""
    atomic_write_text(path, json.dumps(to_dict(config), indent=2) + "\n")


def load(path: Path) -> Config:
    """Load a resolved config written by save() (or any complete config file)."""
    return resolve(config_file=path, saved=True)


# --- command line ---------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The config options shared by the launcher and pretrain_main.py."""
    group = parser.add_argument_group("config")
    group.add_argument("--preset", choices=sorted(PRESETS), help="base preset (default: production)")
    group.add_argument("--debug", action="store_true", help="same as --preset debug")
    group.add_argument("--config", type=Path, metavar="FILE.json", help="JSON file overriding the preset")
    group.add_argument("--max-steps", type=int, metavar="N", help="override training.max_steps")
    group.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key (value as JSON, else a string); repeatable",
    )
    group.add_argument(
        "--resume",
        metavar="auto|PATH",
        help="continue from a checkpoint: auto (the latest one) or a checkpoint or run directory; "
        "same as --set training.resume=...",
    )
    group.add_argument(
        "--init-from",
        metavar="PATH_OR_HUB_ID",
        help="start from a Hugging Face Llama or Mixtral checkpoint: a directory or a Hub model id "
        "(owner/name[@revision]); same as --set training.init_from=...",
    )
    group.add_argument(
        "--local-checkpoint-dir",
        metavar="DIR",
        help="where the frequent local checkpoints go (training.local_checkpoint_interval; default "
        "/dev/shm/pretrain-<user>/<run id>-<hash>/); same as --set training.local_checkpoint_dir=...",
    )


def from_args(args: argparse.Namespace) -> Config:
    if args.debug and args.preset not in (None, "debug"):
        raise ConfigError(f"--debug conflicts with --preset {args.preset}; use one of them")
    sets = list(args.sets)
    if getattr(args, "resume", None):
        if not args.resume.strip():
            raise ConfigError("--resume: expected auto or a checkpoint path")
        sets.append(f"training.resume={json.dumps(args.resume)}")
    if getattr(args, "init_from", None) is not None:
        if not args.init_from.strip():
            raise ConfigError("--init-from: expected a checkpoint directory or a Hub model id (owner/name)")
        sets.append(f"training.init_from={json.dumps(args.init_from)}")
    if getattr(args, "local_checkpoint_dir", None) is not None:
        if not args.local_checkpoint_dir.strip():
            raise ConfigError("--local-checkpoint-dir: expected a directory")
        sets.append(f"training.local_checkpoint_dir={json.dumps(args.local_checkpoint_dir)}")
    return resolve(preset="debug" if args.debug else args.preset, config_file=args.config, max_steps=args.max_steps, sets=sets)
