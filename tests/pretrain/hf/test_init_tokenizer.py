"""The --init-from checkpoint's tokenizer against the run's (pretrain/hf/init_tokenizer.py): weights
trained with another tokenizer of the same size are refused once the dataset is prepared, with the
settings that train on the checkpoint's tokenizer instead."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shlex
from pathlib import Path

import pytest

from support.runs import assert_one_line_error, data_config, prepared
from pretrain import config as cfg
from pretrain.hf.init_checkpoint import HfCheckpoint, InitFromError, find_checkpoint
from pretrain.hf import init_tokenizer
from pretrain.hf.init_tokenizer import check_tokenizer
from pretrain.hf.tokenizer_files import write_tokenizer_files
from test_init_from import DEBUG, run_launcher_with, write_checkpoint, model_cache  # noqa: F401 (a fixture)

VOCAB = 300


def corpus(path: Path, words: list[str], seed: int) -> Path:
    rng = random.Random(seed)
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(60)) for _ in range(60)) + "\n")
    return path


@pytest.fixture
def texts(tmp_path) -> tuple[Path, Path]:
    """A.txt and B.txt: texts of other words, on which two BPE tokenizers of one size learn other merges."""
    a = corpus(tmp_path / "A.txt", ["apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "peach"], 1)
    b = corpus(tmp_path / "B.txt", ["zebra", "quokka", "walrus", "yak", "vulture", "jaguar", "koala", "ibex"], 2)
    return a, b


def export_trained_on(text: Path, out: Path, cache: Path) -> Path:
    """An export's directory as a run with a BPE tokenizer trained on text writes it: the weights
    (random, of the debug model's shapes) and the tokenizer files (pretrain/hf/tokenizer_files.py)."""
    dataset = prepared(data_config(cache, source="text", path=str(text), tokenizer="bpe", bpe_vocab_size=VOCAB))
    write_checkpoint(out, dataclasses.replace(DEBUG, vocab_size=VOCAB))
    run = cfg.resolve(preset="debug", sets=["data.tokenizer=bpe", f"data.bpe_vocab_size={VOCAB}"])
    assert write_tokenizer_files(run, dataset / "tokenizer.json", out, max_seq_len=16).written
    return out


def run_on(tmp_path: Path, export: Path, *sets: str):
    """The launcher, one step from export's weights, with these --set options."""
    options = ["--max-steps", "1", "--set", "data.context_length=16", "--set", "training.batch_size=2"]
    for setting in sets:
        options += ["--set", setting]
    return run_launcher_with(tmp_path, str(export), *options)


def test_an_export_of_another_tokenizer_of_the_same_size_is_refused_naming_both_and_how_to_use_its(tmp_path, texts):
    a, b = texts
    export = export_trained_on(a, tmp_path / "exportA", tmp_path / "made")

    result = run_on(tmp_path, export, "data.source=text", f"data.path={b}", "data.tokenizer=bpe", f"data.bpe_vocab_size={VOCAB}")

    fix = f"--set data.tokenizer=huggingface --set data.tokenizer_name={export} --set model.vocab_size={VOCAB}"
    assert_one_line_error(
        result,
        f"training.init_from: {export}: its tokenizer (tokenizer.json, ",
        f"is not the run's (the {VOCAB}-token BPE tokenizer trained on {b}, ",
        "ids differ (id 257: ",
        f"train on its tokenizer: {fix}",
        prefix="launcher: error:",
        quiet_stdout=False,
    )
    assert not (tmp_path / "run" / "logs").exists()  # refused before any worker started

    # The settings it names train on the export's tokenizer: the same ids, the run goes on.
    again = run_on(tmp_path, export, "data.source=text", f"data.path={b}", *shlex.split(fix)[1::2])
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr
    assert f"Weights from {export} (Llama)" in again.stdout


def test_a_checkpoint_without_tokenizer_files_is_said_in_a_warning_and_the_run_goes_on(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ckpt", DEBUG)

    result = run_on(tmp_path, checkpoint, "data.max_samples=50")

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    warning = f"launcher: warning: training.init_from: {checkpoint}: it has no tokenizer.json, so whether its ids"
    said = [line for line in result.stdout.splitlines() if "tokenizer.json" in line and "DEBUG" not in line]
    assert said == [f"{warning} mean the run's tokens is not checked"]


def test_a_hub_models_tokenizer_is_compared_and_its_id_named_in_the_fix(tmp_path, texts, model_cache):  # noqa: F811
    a, b = texts
    model_cache("owner/tiny", export_trained_on(a, tmp_path / "exportA", tmp_path / "made"))
    checkpoint = find_checkpoint("owner/tiny", log=print)
    run = cfg.resolve(
        preset="debug", sets=["data.source=text", f"data.path={b}", "data.tokenizer=bpe", f"data.bpe_vocab_size={VOCAB}"]
    )
    dataset = prepared(data_config(tmp_path, source="text", path=str(b), tokenizer="bpe", bpe_vocab_size=VOCAB))

    with pytest.raises(InitFromError) as excinfo:
        check_tokenizer(checkpoint, run, dataset, log=pytest.fail)

    assert "\n" not in str(excinfo.value)
    assert "--set data.tokenizer=huggingface --set data.tokenizer_name=owner/tiny --set" in str(excinfo.value)


# --- special tokens: renamed ones do not change what text's ids mean ------------------------------


def llama_like(renamed: dict[int, str] = {}) -> dict:  # noqa: B006 (read only)
    """A tokenizer.json as Llama 3's is made, in small: a byte-level BPE vocabulary (0-5), then
    special added tokens, end-of-text and reserved ones (6-9); renamed gives ids other tokens."""
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>"]
    vocab = {renamed.get(number, token): number for token, number in vocab.items()}
    added = [
        {"id": number, "content": renamed.get(number, token), "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": True}
        for number, token in enumerate(specials, start=len(vocab))
    ]
    return {"version": "1.0", "added_tokens": added, "model": {"type": "BPE", "vocab": vocab, "merges": ["a b", "ab c"]}}


def check(tmp_path: Path, theirs: dict, ours: dict, *sets: str) -> list[str]:
    """check_tokenizer of a checkpoint with tokenizer.json theirs, for a run on ours (a huggingface
    tokenizer, its dataset's copy): the DEBUG lines it logged; a warning fails the test."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "tokenizer.json").write_text(json.dumps(theirs))
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "tokenizer.json").write_text(json.dumps(ours))
    checkpoint = HfCheckpoint(source=str(tmp_path / "ckpt"), directory=tmp_path / "ckpt", config={}, tensors={})
    run = cfg.resolve(preset="debug", sets=["data.tokenizer=huggingface", f"data.tokenizer_name={tmp_path / 'dataset'}", *sets])
    # A handler of its own, not caplog's on the root: a worker's setup_logging, run in this process
    # by another test, stops "pretrain" lines from propagating there.
    lines: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    level = init_tokenizer.logger.level
    init_tokenizer.logger.addHandler(handler)
    init_tokenizer.logger.setLevel(logging.DEBUG)
    try:
        check_tokenizer(checkpoint, run, tmp_path / "dataset", log=pytest.fail)
    finally:
        init_tokenizer.logger.removeHandler(handler)
        init_tokenizer.logger.setLevel(level)
    return lines


def test_llama_3_1_weights_whose_tokenizer_renames_reserved_special_tokens_are_accepted_for_a_llama_3_run(tmp_path):
    llama_3_1 = llama_like({8: "<|eom_id|>", 9: "<|python_tag|>"})

    lines = check(tmp_path, llama_3_1, llama_like())

    said = "2 ids differ, all special tokens, which text never becomes: not refused"
    assert lines == [f"training.init_from: {tmp_path / 'ckpt'}: {said}"]


def test_a_checkpoint_whose_ordinary_vocabulary_differs_by_one_token_is_still_refused_though_its_specials_agree(tmp_path):
    with pytest.raises(InitFromError) as excinfo:
        check(tmp_path, llama_like({4: "ca"}), llama_like())

    assert "): 1 id differs (id 4: 'ca' in its tokenizer, 'bc' in the run's), so each would mean" in str(excinfo.value)


@pytest.mark.parametrize(
    ("eot", "sets"),
    [(7, []), (8, ["data.eot_token=<|reserved_special_token_0|>"])],
    ids=["the usual name", "data.eot_token"],
)
def test_a_checkpoint_whose_token_at_the_runs_end_of_text_id_differs_is_refused_though_it_is_special(tmp_path, eot, sets):
    with pytest.raises(InitFromError) as excinfo:
        check(tmp_path, llama_like({eot: "<|eot_id|>"}), llama_like(), *sets)

    assert f"): 1 id differs (id {eot}: '<|eot_id|>' in its tokenizer, " in str(excinfo.value)


def test_a_special_token_of_the_checkpoints_at_an_id_the_runs_text_becomes_is_refused(tmp_path):
    theirs = llama_like({4: "<pad>"})
    theirs["added_tokens"].append({"id": 4, "content": "<pad>", "special": True})

    with pytest.raises(InitFromError) as excinfo:
        check(tmp_path, theirs, llama_like())

    assert "): 1 id differs (id 4: '<pad>' in its tokenizer, 'bc' in the run's)" in str(excinfo.value)


def test_ids_only_the_checkpoints_tokenizer_has_are_never_in_the_runs_data_and_are_not_refused(tmp_path):
    theirs = llama_like()
    theirs["added_tokens"].append({"id": 10, "content": "  ", "special": False})  # extra vocabulary, as CodeLlama's

    assert check(tmp_path, theirs, llama_like()) == []


@pytest.mark.parametrize("main_is_pinned", [True, False], ids=["main is that commit", "main moved on"])
def test_the_fix_for_a_hub_model_pinned_to_a_commit_names_what_gives_that_commits_tokenizer(tmp_path, main_is_pinned):
    repo = tmp_path / "hub" / "models--owner--tiny"
    snapshot = repo / "snapshots" / ("1" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_text(json.dumps(llama_like({4: "ca"})))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name if main_is_pinned else "2" * 40)
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "tokenizer.json").write_text(json.dumps(llama_like()))
    checkpoint = HfCheckpoint(source=f"owner/tiny@{snapshot.name}", directory=snapshot, config={}, tensors={})
    run = cfg.resolve(preset="debug", sets=["data.tokenizer=huggingface", f"data.tokenizer_name={tmp_path / 'dataset'}"])

    with pytest.raises(InitFromError) as excinfo:
        check_tokenizer(checkpoint, run, tmp_path / "dataset", log=pytest.fail)

    # data.tokenizer_name reads the main ref: the id only while main is the pinned commit, else its snapshot
    name = "owner/tiny" if main_is_pinned else shlex.quote(str(snapshot))
    assert f"--set data.tokenizer=huggingface --set data.tokenizer_name={name}" in str(excinfo.value)
