"""Config: presets, strict loading, one-line errors, round trip."""

from __future__ import annotations

import dataclasses
import typing
import json
from pathlib import Path

import pytest

from pretrain import config as cfg
from pretrain.config import reference
from pretrain.config.loading import loads_strictly
from pretrain.config.schema import MAX_STEPS

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.json"))


def write(tmp_path: Path, data: object, name: str = "c.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def error_of(**kwargs) -> str:
    with pytest.raises(cfg.ConfigError) as caught:
        cfg.resolve(**kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_every_file_in_configs_loads_on_every_preset():
    assert {p.name for p in CONFIGS} >= {"debug.json", "production.json", "single_gpu.json", "config_stable.json"}
    for path in CONFIGS:
        for preset in cfg.PRESETS:
            assert isinstance(cfg.resolve(preset=preset, config_file=path), cfg.Config)


@pytest.mark.parametrize("name", ["debug", "production"])
def test_the_preset_files_write_out_their_presets(name):
    assert cfg.resolve(config_file=CONFIG_DIR / f"{name}.json") == cfg.PRESETS[name]()


def test_debug_preset_is_two_small_layers_for_ten_steps_with_debug_logging():
    c = cfg.debug()
    assert (c.model.n_layers, c.training.max_steps, c.logging.level) == (2, 10, "DEBUG")
    assert c.model.dim < 512


def test_production_preset_has_llama_3_8b_shape():
    m = cfg.production().model
    assert (m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.vocab_size) == (32, 4096, 32, 8, 128256)
    assert cfg.production().training.max_steps == 10000


def test_single_gpu_file_sets_cuda_device_zero_batch_four_accumulation_eight():
    c = cfg.resolve(config_file=CONFIG_DIR / "single_gpu.json")
    assert (c.system.device, c.system.device_id, c.training.batch_size, c.training.grad_accum_nums) == ("cuda", 0, 4, 8)


def test_stable_config_is_more_conservative_than_every_preset():
    for preset in cfg.PRESETS:
        base = cfg.PRESETS[preset]()
        stable = cfg.resolve(preset=preset, config_file=CONFIG_DIR / "config_stable.json")
        assert stable.training.learning_rate < base.training.learning_rate
        assert stable.model.init_std < base.model.init_std
        assert stable.training.max_grad_norm < base.training.max_grad_norm
        assert stable.training.use_amp is False


def test_config_file_chooses_its_preset_and_the_command_line_preset_wins(tmp_path):
    path = write(tmp_path, {"preset": "debug", "training": {"batch_size": 3}})
    assert cfg.resolve(config_file=path).model.n_layers == 2
    assert cfg.resolve(preset="production", config_file=path).model.n_layers == 32
    assert cfg.resolve(preset="production", config_file=path).training.batch_size == 3


def test_layers_apply_in_order_preset_file_max_steps_set(tmp_path):
    path = write(tmp_path, {"training": {"max_steps": 50, "batch_size": 2}})
    c = cfg.resolve(preset="debug", config_file=path, max_steps=7, sets=["training.max_steps=9"])
    assert (c.training.max_steps, c.training.batch_size) == (9, 2)


def test_set_parses_json_values_and_falls_back_to_strings():
    c = cfg.resolve(
        preset="debug",
        sets=["training.use_amp=true", "system.device=cpu", "training.learning_rate=1e-4", "system.device_id=null"],
    )
    assert c.training.use_amp is True and c.system.device == "cpu"
    assert c.training.learning_rate == 1e-4 and c.system.device_id is None


def test_integer_is_accepted_where_a_float_is_expected():
    c = cfg.resolve(preset="debug", sets=["training.learning_rate=1"])
    assert c.training.learning_rate == 1.0 and isinstance(c.training.learning_rate, float)


def test_unknown_key_names_the_file_the_key_and_the_closest_key(tmp_path):
    path = write(tmp_path, {"training": {"batchsize": 8}})
    assert error_of(config_file=path) == f"{path}: training.batchsize: unknown key; did you mean training.batch_size?"


def test_unknown_section_suggests_the_closest_section(tmp_path):
    path = write(tmp_path, {"trainig": {"batch_size": 8}})
    assert "trainig: unknown section; did you mean training?" in error_of(config_file=path)


def test_wrong_types_are_errors_that_say_what_was_expected():
    assert error_of(sets=['training.batch_size="8"']) == '--set: training.batch_size: expected an integer, got "8" (a string)'
    assert "expected true or false, got 1" in error_of(sets=["training.use_amp=1"])
    assert "expected an integer, got 2.5" in error_of(sets=["training.batch_size=2.5"])
    assert 'system.device: "gpu" (a string) is not one of "auto", "cpu", "cuda"' in error_of(sets=["system.device=gpu"])


def test_impossible_values_are_errors_naming_the_key():
    assert "training.batch_size: must be at least 1 (got 0)" in error_of(sets=["training.batch_size=0"])
    assert "model.n_heads: 4 is not divisible by model.n_kv_heads (3)" in error_of(preset="debug", sets=["model.n_kv_heads=3"])
    assert "model.vocab_size: must be at least 2 or null (got 1)" in error_of(sets=["model.vocab_size=1"])
    assert "training.learning_rate: must be positive" in error_of(sets=["training.learning_rate=0"])


def test_the_evaluation_section_refuses_an_unknown_task_and_impossible_counts():
    assert 'evaluation.task: "mmlu" (a string) is not one of "hellaswag"' in error_of(sets=["evaluation.task=mmlu"])
    assert "evaluation.interval: must not be negative (got -1)" in error_of(sets=["evaluation.interval=-1"])
    assert "evaluation.max_examples: must not be negative (got -5)" in error_of(sets=["evaluation.max_examples=-5"])
    assert "evaluation.batch_examples: must be at least 1 (got 0)" in error_of(sets=["evaluation.batch_examples=0"])
    assert cfg.resolve(preset="debug").evaluation.data == ""  # nothing is scored unless asked


@pytest.mark.parametrize(
    "value, mode",
    [("true", "full"), ("false", "none"), ("none", "none"), ("selective", "selective"), ("full", "full"), ("auto", "auto")],
)
def test_activation_checkpointing_takes_four_modes_and_the_older_true_and_false(value, mode):
    assert cfg.resolve(sets=[f"training.activation_checkpointing={value}"]).training.activation_checkpointing == mode


def test_activation_checkpointing_from_a_file_or_the_dataclass_is_normalised_and_saved_by_name(tmp_path):
    from_file = cfg.resolve(config_file=write(tmp_path, {"training": {"activation_checkpointing": True}}))
    assert from_file.training.activation_checkpointing == "full"
    assert cfg.TrainingConfig(activation_checkpointing=False).activation_checkpointing == "none"
    assert cfg.production().training.activation_checkpointing == "auto"  # the launcher's plan decides
    cfg.save(from_file, tmp_path / "saved.json")
    assert json.loads((tmp_path / "saved.json").read_text())["training"]["activation_checkpointing"] == "full"
    assert cfg.load(tmp_path / "saved.json") == from_file


def test_an_unknown_activation_checkpointing_mode_is_one_line_listing_the_four():
    four = '"none", "selective", "full", "auto"'
    assert error_of(sets=["training.activation_checkpointing=sometimes"]) == (
        f'--set: training.activation_checkpointing: "sometimes" (a string) is not one of {four}'
    )
    assert 'did you mean "selective"?' in error_of(sets=["training.activation_checkpointing=selectiv"])
    assert f"2 (an integer) is not one of {four}" in error_of(sets=["training.activation_checkpointing=2"])
    with pytest.raises(cfg.ConfigError, match=f"is not one of {four} \\(true and false mean full and none\\)"):
        cfg.TrainingConfig(activation_checkpointing="most")  # type: ignore[arg-type]


def test_the_launcher_refuses_an_unknown_activation_checkpointing_mode_before_any_worker_starts(tmp_path):
    from support.runs import assert_one_line_error, run_launcher

    result = run_launcher("--debug", "--run-dir", str(tmp_path / "r"), "--set", "training.activation_checkpointing=sometimes")
    assert_one_line_error(
        result, 'training.activation_checkpointing: "sometimes" (a string) is not one of', prefix="launcher: error: "
    )
    assert not (tmp_path / "r").exists()


def test_the_loss_chunk_and_resharding_are_left_to_the_plan_unless_set():
    t = cfg.production().training
    assert (t.loss_chunk_tokens, t.reshard_after_forward) == (None, None)
    t = cfg.resolve(sets=["training.loss_chunk_tokens=512", "training.reshard_after_forward=false"]).training
    assert (t.loss_chunk_tokens, t.reshard_after_forward) == (512, False)
    assert cfg.resolve(sets=["training.loss_chunk_tokens=null"]).training.loss_chunk_tokens is None
    assert "training.loss_chunk_tokens: must not be negative (got -1)" in error_of(sets=["training.loss_chunk_tokens=-1"])


def test_file_problems_are_one_line_errors(tmp_path):
    assert error_of(config_file=tmp_path / "missing.json").endswith("config file not found")
    bad = tmp_path / "bad.json"
    bad.write_text('{"training": {"batch_size": 4,}}')
    message = error_of(config_file=bad)
    assert message.startswith(f"{bad}: invalid JSON: ") and message.endswith(" at line 1 column 31")
    assert "expected a JSON object" in error_of(config_file=write(tmp_path, [1, 2]))
    assert 'unknown preset "debg"; did you mean debug?' in error_of(config_file=write(tmp_path, {"preset": "debg"}))


def test_invalid_json_whose_reason_ends_in_at_says_where_without_at_at(tmp_path):
    unterminated = tmp_path / "unterminated.json"
    unterminated.write_text('{"training": {"resume": "auto')
    message = error_of(config_file=unterminated)
    assert message == f"{unterminated}: invalid JSON: Unterminated string starting at line 1 column 25"


def test_a_key_given_twice_in_a_config_file_is_refused_naming_the_file_the_key_and_the_line(tmp_path):
    path = tmp_path / "twice.json"
    path.write_text('{"training": {"batch_size": 4, "batch_size": 8}}')
    assert error_of(config_file=path) == f"{path}: line 1: training.batch_size is given twice; keep one of them"
    path.write_text('{\n  "model": {"moe": {"top_k": 1}},\n  "training": {"batch_size": 4},\n  "model": {}\n}\n')
    assert error_of(config_file=path) == f"{path}: line 4: model is given twice; keep one of them"
    path.write_text('{"model": {"moe": {"top_k": 1, "num_experts": 2, "top_k": 2}}}')
    assert error_of(config_file=path) == f"{path}: line 1: model.moe.top_k is given twice; keep one of them"


def test_a_key_given_twice_in_one_set_value_is_refused():
    message = error_of(sets=['model.moe={"top_k": 1, "top_k": 2}'])
    assert message == '--set model.moe={"top_k": 1, "top_k": 2}: model.moe.top_k is given twice; keep one of them'


def test_the_same_key_in_separate_objects_or_inside_a_string_is_not_a_repeat():
    text = '{"a": {"k": 1}, "b": {"k": "\\"k\\": {"}, "c": [{"k": 1}, {"k": 2}]}'
    assert loads_strictly(text, "x") == json.loads(text)


def test_a_huge_max_steps_is_refused_alike_from_the_option_a_file_and_set(tmp_path):
    huge = 10**22
    problem = f"training.max_steps: must be at most {MAX_STEPS} (got {huge}); use a value up to {MAX_STEPS}"
    path = write(tmp_path, {"training": {"max_steps": huge}})
    assert error_of(max_steps=huge) == f"--max-steps: {problem}"
    assert error_of(config_file=path) == f"{path}: {problem}"
    assert error_of(sets=[f"training.max_steps={huge}"]) == f"--set: {problem}"
    assert cfg.resolve(max_steps=MAX_STEPS).training.max_steps == MAX_STEPS


def test_an_integer_too_long_for_python_to_read_is_one_line_from_a_file_or_set(tmp_path):
    digits = "1" + "0" * 5000
    path = tmp_path / "huge.json"
    path.write_text(f'{{"training": {{"max_steps": {digits}}}}}')
    assert error_of(config_file=path) == f"{path}: a number of more than 4300 digits"
    assert error_of(sets=[f"training.max_steps={digits}"]) == "--set training.max_steps: a number of more than 4300 digits"


def integer_keys() -> list[tuple[str, str]]:
    """(section path, key) of every integer field of every section, groups such as model.moe included."""
    found = []

    def walk(prefix: str, cls: type) -> None:
        for name, hint in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(hint):
                walk(f"{prefix}.{name}", hint)
            elif hint in (int, int | None):
                found.append((prefix, name))

    for section, cls in cfg.SECTIONS.items():
        walk(section, cls)
    return found


@pytest.mark.parametrize("prefix, key", integer_keys())
def test_every_integer_key_refuses_a_huge_value_and_documents_its_bound(prefix, key):
    huge = 10**22
    message = error_of(preset="debug", sets=[f"{prefix}.{key}={huge}"])
    assert f"{prefix}.{key}: must " in message and str(huge) in message
    section, _, group = prefix.partition(".")  # model.moe, model.rope_scaling: a group's own class
    cls = typing.get_type_hints(cfg.SECTIONS[section])[group] if group else cfg.SECTIONS[section]
    bound = cls.AT_MOST.get(key)  # the seed has a check of its own: [0, 2**63)
    assert (str(bound) if bound is not None else "2^63") in cfg.field_docs(cls)[key]


def test_set_without_a_section_or_value_explains_the_syntax():
    assert "expected section.key=value" in error_of(sets=["batch_size=4"])
    assert "expected section.key=value" in error_of(sets=["training.batch_size"])


def test_saved_config_loads_back_identical(tmp_path):
    original = cfg.resolve(preset="debug", sets=["training.batch_size=3", "system.device_id=1"])
    cfg.save(original, tmp_path / "config.json")
    assert cfg.load(tmp_path / "config.json") == original
    assert not [p for p in tmp_path.iterdir() if p.name != "config.json"]  # no temp file left


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.debug().training.batch_size = 3  # type: ignore[misc]


def test_every_field_has_a_one_line_docstring():
    for section, cls in cfg.SECTIONS.items():
        docs = cfg.field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{section}.{f.name} has no docstring"


def test_reference_table_lists_every_key_the_users_know():
    table = cfg.reference_table()
    for key in [
        "training.batch_size",
        "training.grad_accum_nums",
        "training.num_workers",
        "training.learning_rate",
        "training.max_steps",
        "training.max_grad_norm",
        "training.use_amp",
        "model.init_std",
        "data.context_length",
        "system.device",
        "system.device_id",
        "logging.log_interval",
    ]:
        assert f"| `{key}` |" in table


def test_docs_config_md_is_what_the_generator_makes_from_the_code():
    on_disk = reference.REFERENCE.read_text(encoding="utf-8")
    assert on_disk == reference.render(), (
        f"docs/config.md is stale (a config field or its docstring changed): run {reference.COMMAND}"
    )


def test_the_config_reference_lists_every_key_with_its_docstring_in_each_preset_column():
    page = reference.render()

    def check(prefix: str, cls: type) -> None:
        for f in dataclasses.fields(cls):
            kind = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(kind):  # a group of keys inside a section: model.moe.top_k
                check(f"{prefix}.{f.name}", kind)
                continue
            row = next(line for line in page.splitlines() if line.startswith(f"| `{prefix}.{f.name}` |"))
            assert row.count(" | ") == len(reference.PRESETS) + 1
            assert row.endswith(f" {cfg.field_docs(cls)[f.name].replace('|', chr(92) + '|')} |")

    for section, cls in cfg.SECTIONS.items():
        check(section, cls)
    assert "| `model.moe.top_k` |" in page


def test_the_check_mode_fails_on_a_stale_page_naming_the_command_and_passes_on_a_fresh_one(tmp_path, capsys):
    page = tmp_path / "config.md"
    page.write_text(reference.render().replace("Number of transformer blocks.", "Blocks."))
    assert reference.main(["--check", str(page)]) == 1
    assert reference.COMMAND in capsys.readouterr().err
    page.write_text(reference.render())
    assert reference.main(["--check", str(page)]) == 0


def test_infinite_or_nan_numbers_are_refused():
    assert "training.learning_rate: expected a finite number, got inf" in error_of(sets=["training.learning_rate=1e400"])
    assert error_of(sets=[f"training.learning_rate={10**400}"]) == (
        "--set: training.learning_rate: expected a finite number, got an integer of 401 digits"
    )
    assert "expected a finite number, got nan" in error_of(sets=["model.init_std=NaN"])


@pytest.mark.parametrize("seconds", ["0", "-1", "86401"])
def test_a_collective_timeout_out_of_range_is_refused_with_a_range_that_holds_its_own_bounds(seconds):
    # "between 0 and 86400" refused 0, which it seemed to allow
    assert error_of(sets=[f"system.collective_timeout={seconds}"]) == (
        f"--set: system.collective_timeout: must be more than 0 seconds and at most 86400, a day (got {seconds})"
    )


def test_a_seed_beyond_64_bits_is_refused():
    assert "training.seed: must be in [0, 2**63)" in error_of(sets=[f"training.seed={2**64}"])


def test_preset_must_be_a_name_and_is_not_a_section(tmp_path):
    assert 'preset: expected a preset name, got ["debug"] (a list)' in error_of(
        config_file=write(tmp_path, {"preset": ["debug"]})
    )
    assert "the preset is not a section; use --preset NAME" in error_of(sets=["preset.foo=1"])


def test_the_debug_preset_leaves_the_vocabulary_to_the_tokenizer_and_production_fixes_llama_3s():
    assert cfg.debug().model.vocab_size is None
    assert cfg.production().model.vocab_size == 128256
    assert cfg.resolve(sets=["model.vocab_size=null"]).model.vocab_size is None


def test_each_data_source_demands_the_keys_it_cannot_work_without():
    assert 'data.path: source "jsonl" needs data.path' in error_of(preset="debug", sets=["data.source=jsonl"])
    assert 'data.path: source "megatron" needs data.path' in error_of(preset="debug", sets=["data.source=megatron"])
    assert 'data.hub_repo: source "hub" needs data.hub_repo=owner/name' in error_of(preset="debug", sets=["data.source=hub"])
    assert "data.hub_repo: expected owner/name (got 'nameonly')" in error_of(preset="debug", sets=["data.hub_repo=nameonly"])
    assert 'data.tokenizer_name: tokenizer "tiktoken" needs an encoding such as gpt2' in error_of(
        preset="debug", sets=["data.tokenizer=tiktoken"]
    )
    assert "data.max_samples: applies to text sources" in error_of(
        preset="debug", sets=["data.source=llmc", "data.path=x.bin", "data.max_samples=5"]
    )
    assert "data.bpe_vocab_size: must be at least 258" in error_of(preset="debug", sets=["data.bpe_vocab_size=100"])
    assert "data.max_samples: must not be negative" in error_of(preset="debug", sets=["data.max_samples=-1"])
    assert "training.epochs: must not be negative" in error_of(preset="debug", sets=["training.epochs=-1"])
    assert 'data.source: "csv" (a string) is not one of' in error_of(preset="debug", sets=["data.source=csv"])


def test_keys_the_chosen_source_or_tokenizer_would_ignore_are_errors_not_silence():
    assert 'data.path: source "builtin" reads no local files; set data.source to text' in error_of(
        preset="debug", sets=["data.path=corpus.jsonl"]
    )
    assert 'data.val_path: source "hub" reads no local files' in error_of(
        preset="debug", sets=["data.source=hub", "data.hub_repo=a/b", "data.val_path=v.jsonl"]
    )
    assert 'data.hub_repo: is set but data.source is "builtin"; set data.source=hub' in error_of(
        preset="debug", sets=["data.hub_repo=a/b"]
    )
    assert 'data.tokenizer_name: is set but data.tokenizer is "byte"' in error_of(
        preset="debug", sets=["data.tokenizer_name=gpt2"]
    )
    assert "data.tokenizer_name: 'a/b' is not a tiktoken encoding name" in error_of(
        preset="debug", sets=["data.tokenizer=tiktoken", "data.tokenizer_name=a/b"]
    )


def test_a_source_chosen_in_a_file_may_get_its_path_from_a_set(tmp_path):
    file = write(tmp_path, {"data": {"source": "parquet"}})
    assert cfg.resolve(config_file=file, sets=["data.path=x.parquet"]).data.path == "x.parquet"
    assert 'data.path: source "parquet" needs data.path' in error_of(config_file=file)


def test_a_complete_data_source_config_resolves():
    config = cfg.resolve(
        preset="debug",
        sets=[
            "data.source=jsonl",
            "data.path=data/*.jsonl",
            "data.text_field=body",
            "data.tokenizer=bpe",
            "data.bpe_vocab_size=4096",
            "training.epochs=2",
        ],
    )
    assert (config.data.source, config.data.path, config.data.text_field) == ("jsonl", "data/*.jsonl", "body")
    assert (config.data.tokenizer, config.data.bpe_vocab_size, config.training.epochs) == ("bpe", 4096, 2)


def test_the_small_preset_is_gpt2_small_sized_with_gpt2s_vocabulary_at_context_1024():
    import torch  # noqa: F401  (the model needs it; the config module does not)
    from pretrain.model.transformer import Transformer

    c = cfg.small()
    with torch.device("meta"):
        params = Transformer(c.model, max_seq_len=cfg.max_seq_len(c)).num_params()
    # GPT-2 small's 124M ties the output projection to the embedding; here it is separate (+39M).
    assert 145e6 < params < 160e6 and c.data.context_length == 1024
    assert c.model.vocab_size % 64 == 0 and 0 <= c.model.vocab_size - 50257 < 64  # GPT-2's ids, rounded up


def test_a_global_batch_size_sets_the_accumulation_for_the_number_of_ranks():
    c = cfg.resolve(preset="debug", sets=["training.batch_size=4", "training.global_batch_size=32"])
    assert cfg.with_world_size(c, 2).training.grad_accum_nums == 4
    assert cfg.with_world_size(c, 8).training.grad_accum_nums == 1
    unset = cfg.resolve(preset="debug")
    assert cfg.with_world_size(unset, 4) == unset  # 0: batch_size x grad_accum_nums per rank, as configured


def test_a_global_batch_size_that_does_not_divide_names_the_nearest_that_do():
    c = cfg.resolve(preset="debug", sets=["training.batch_size=4", "training.global_batch_size=32"])
    with pytest.raises(cfg.ConfigError) as caught:
        cfg.with_world_size(c, 3)
    assert str(caught.value) == (
        "training.global_batch_size 32 is not a multiple of training.batch_size 4 x 3 "
        "rank(s) = 12; use 24 or 36, or change batch_size"
    )


def test_a_context_longer_than_the_models_positions_is_refused():
    message = error_of(preset="small", sets=["data.context_length=2048"])
    assert message == (
        "data.context_length 2048 is longer than the model supports (model.max_seq_len 1024); "
        "lower data.context_length or raise model.max_seq_len"
    )
    assert cfg.resolve(preset="debug", sets=["data.context_length=4096"]).model.max_seq_len is None  # follows it


def test_resume_on_the_command_line_is_the_training_resume_key():
    import argparse

    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    assert cfg.from_args(parser.parse_args(["--debug", "--resume", "auto"])).training.resume == "auto"
    with pytest.raises(cfg.ConfigError, match="--resume: expected auto or a checkpoint path"):
        cfg.from_args(parser.parse_args(["--debug", "--resume", " "]))


def test_preset_data_keys_that_the_users_source_or_tokenizer_makes_meaningless_are_dropped(tmp_path):
    local = cfg.resolve(preset="small", sets=["data.source=jsonl", "data.path=x.jsonl"]).data
    assert (local.source, local.path, local.hub_repo, local.hub_files) == ("jsonl", "x.jsonl", "", "*.parquet")
    assert (local.tokenizer, local.tokenizer_name) == ("huggingface", "openai-community/gpt2")  # still relevant
    byte = cfg.resolve(preset="production", sets=["data.tokenizer=byte"]).data
    assert (byte.tokenizer, byte.tokenizer_name, byte.hub_repo) == ("byte", "", "HuggingFaceFW/fineweb-edu")
    shards = cfg.resolve(preset="production", sets=["data.source=llmc", "data.path=x.bin"]).data
    assert (shards.tokenizer, shards.tokenizer_name) == ("byte", "")  # shards are tokenized already
    from_file = cfg.resolve(config_file=write(tmp_path, {"preset": "small", "data": {"source": "builtin"}})).data
    assert (from_file.source, from_file.hub_repo) == ("builtin", "")
    # Another tokenizer needs its own name: the preset's GPT-2 repo is no tiktoken encoding.
    assert 'tokenizer "tiktoken" needs an encoding' in error_of(preset="small", sets=["data.tokenizer=tiktoken"])


def test_data_keys_the_user_set_are_still_errors_when_the_source_or_tokenizer_ignores_them(tmp_path):
    assert 'data.hub_repo: is set but data.source is "jsonl"' in error_of(
        preset="small", sets=["data.source=jsonl", "data.path=x.jsonl", "data.hub_repo=HuggingFaceFW/fineweb-edu"]
    )
    assert 'data.hub_max_files: is set but data.source is "jsonl"' in error_of(
        preset="small", sets=["data.hub_max_files=2", "data.source=jsonl", "data.path=x.jsonl"]
    )
    assert 'data.tokenizer_name: is set but data.tokenizer is "byte"' in error_of(
        config_file=write(tmp_path, {"data": {"tokenizer": "byte", "tokenizer_name": "openai-community/gpt2"}}), preset="small"
    )
    assert "data.hub_max_files: must not be negative" in error_of(preset="small", sets=["data.hub_max_files=-1"])


def test_a_saved_config_loads_back_unchanged_whatever_its_preset_would_drop(tmp_path):
    config = cfg.resolve(preset="small", sets=["data.source=jsonl", "data.path=x.jsonl", "data.hub_max_files=null"])
    cfg.save(config, tmp_path / "config.json")
    assert cfg.load(tmp_path / "config.json") == config
