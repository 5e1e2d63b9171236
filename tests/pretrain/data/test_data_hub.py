"""Hugging Face Hub datasets, offline from a Hub cache the tests fill: pretrain/data/sources.py."""

from __future__ import annotations

import json

import pytest

from support.processes import cache_leftovers, one_line_error
from pretrain.data import DataError
from pretrain.data.prepare import prepare, read_meta
from support.runs import data_config, prepared
from test_data_sources import TEXTS, documents_of
from support.hub import COMMIT, hub_cache  # noqa: F401 (hub_cache: a fixture)

# --- Hugging Face Hub (offline, from a pre-populated Hub cache) ----------------------------------


def test_hub_reads_the_matching_files_of_a_cached_snapshot_and_keys_on_its_commit(tmp_path, hub_cache):
    hub_cache(
        "owner/name",
        {
            "data/train-00000.parquet": {"text": TEXTS[:2]},
            "data/train-00001.parquet": {"text": TEXTS[2:]},
            "extra/other.parquet": {"text": ["not matched"]},
            "README.md": "# a dataset card\n",
        },
    )

    dataset = prepared(data_config(tmp_path, source="hub", hub_repo="owner/name", hub_files="data/train-*.parquet"))

    assert documents_of(dataset) == TEXTS
    key = read_meta(dataset)["key"]["source"]
    assert key["source"] == "hub" and key["hub_repo"] == "owner/name" and key["commit"] == COMMIT
    assert [name for name, _ in key["files"]] == ["data/train-00000.parquet", "data/train-00001.parquet"]
    assert dataset.name.startswith("hub-owner-name-byte-")


def test_hub_reads_jsonl_files_and_a_new_commit_is_a_new_dataset(tmp_path, hub_cache):
    hub_cache("owner/name", {"data/part.jsonl": json.dumps({"text": "old"}) + "\n"})
    cfg = data_config(tmp_path, source="hub", hub_repo="owner/name", hub_files="*.jsonl")
    old = prepared(cfg)

    new_commit = "f" * 40
    hub_cache("owner/name", {"data/part.jsonl": json.dumps({"text": "new"}) + "\n"}, commit=new_commit)
    new = prepared(cfg)

    assert documents_of(old) == ["old"] and documents_of(new) == ["new"]
    assert old != new and read_meta(new)["key"]["source"]["commit"] == new_commit


def test_a_hub_repo_missing_from_the_cache_offline_says_how_to_get_it(tmp_path, hub_cache):
    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="hub", hub_repo="owner/absent"))

    message = one_line_error(excinfo)
    assert "owner/absent" in message and "offline" in message
    assert "HF_HUB_OFFLINE" in message and "hf download owner/absent" in message
    assert cache_leftovers(tmp_path) == []


def test_the_offline_hint_for_a_dataset_at_a_revision_fetches_that_revision(tmp_path, hub_cache):
    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="hub", hub_repo="owner/absent", hub_revision="v1", hub_files="data/*.parquet"))

    message = one_line_error(excinfo)
    assert "dataset owner/absent@v1 (data/*.parquet) is not in the Hugging Face cache" in message
    assert "`hf download owner/absent --repo-type dataset --revision v1 --include 'data/*.parquet'`" in message


@pytest.mark.parametrize(
    "path, command",
    [
        ("hf://datasets/a/b@v1/data", "`hf download a/b --repo-type dataset --revision v1 --include 'data/*'`"),
        ("hf://datasets/a/b@refs%2Fpr%2F3/x.bin", "`hf download a/b --repo-type dataset --revision refs/pr/3 --include x.bin`"),
        ("hf://datasets/a/b/data", "`hf download a/b --repo-type dataset --include 'data/*'`"),
        # quoted for a shell as a whole: the pasted command fetches this pattern and runs nothing else
        ("hf://datasets/a/b@v1/it's $(id).bin", """--revision v1 --include 'it'"'"'s $(id).bin'`"""),
    ],
)
def test_the_offline_hint_for_hub_shards_keeps_the_paths_revision_and_quotes_every_word(hub_cache, path, command):
    from pretrain.data.hub_shards import hub_shards

    with pytest.raises(DataError) as excinfo:
        hub_shards(path, 1, "data.path")

    message = one_line_error(excinfo)
    assert command in message
    assert (" (data) is" in message) == path.endswith("/data") and ("@v1 (" in message) == ("@v1/" in path)


def test_hub_files_matching_nothing_is_an_error_naming_the_setting(tmp_path, hub_cache):
    hub_cache("owner/name", {"data/train.parquet": {"text": ["x"]}, "README.md": "card"})

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="hub", hub_repo="owner/name", hub_files="*.jsonl"))

    message = one_line_error(excinfo)
    assert "data.hub_files" in message and "*.jsonl" in message and "owner/name" in message
    assert cache_leftovers(tmp_path) == []


def test_hub_files_matching_several_formats_is_an_error(tmp_path, hub_cache):
    hub_cache("owner/name", {"a.parquet": {"text": ["x"]}, "b.jsonl": json.dumps({"text": "y"}) + "\n"})

    with pytest.raises(DataError) as excinfo:
        prepared(data_config(tmp_path, source="hub", hub_repo="owner/name", hub_files="*"))

    assert "several formats" in one_line_error(excinfo)


def test_workers_get_the_hub_branch_pinned_to_the_commit_the_launcher_prepared(tmp_path, hub_cache):
    from pretrain import config as cfg
    from pretrain.data.fitting import fit_to_dataset

    hub_cache("owner/name", {"data/train.jsonl": "".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 20)})
    config = cfg.resolve(
        preset="debug",
        sets=[
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.source=hub",
            "data.hub_repo=owner/name",
            "data.hub_files=*.jsonl",
            "data.context_length=8",
            "training.batch_size=1",
        ],
    )
    dataset = prepare(config.data, log=lambda line: None)

    fitted, _ = fit_to_dataset(config, dataset, world_size=1)

    assert config.data.hub_revision == "main" and fitted.data.hub_revision == COMMIT
    assert prepare(fitted.data, log=lambda line: None) == dataset  # a worker finds the same dataset
