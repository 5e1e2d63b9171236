"""llm.c and nanoGPT shards of a Hub dataset (data.path=hf://datasets/OWNER/NAME/PATTERN), fetched
through the Hub cache and read there: pretrain/data/hub_shards.py, offline from a cache the tests
fill and online against a Hub simulated in this process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from support.processes import one_line_error
from support.runs import assert_one_line_error, run_debug_training, run_launcher, split_tokens
from pretrain import config as cfg
from pretrain.data import DataError
from pretrain.data.fitting import fit_to_dataset
from pretrain.data.hub import choose_hub_files, follow_checkpoint
from pretrain.data.prepare import prepare, read_meta
from support.hub import COMMIT, add_snapshot, hub_cache  # noqa: F401 (a fixture)

REPO = "kjj0/fineweb10B-gpt2"
TRAIN = [f"fineweb_train_{i:06d}.bin" for i in range(1, 5)]
VAL = "fineweb_val_000000.bin"
PATH = f"hf://datasets/{REPO}/fineweb_train_*.bin"
VAL_PATH = f"hf://datasets/{REPO}/fineweb_val_*.bin"
TOKENS = {name: np.random.default_rng(i).integers(0, 50257, size=1000).astype(np.uint16) for i, name in enumerate([*TRAIN, VAL])}


def llmc_bytes(tokens: np.ndarray) -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, len(tokens)]
    return header.tobytes() + tokens.astype("<u2").tobytes()


SHARDS = {name: llmc_bytes(tokens) for name, tokens in TOKENS.items()}


def debug_config(tmp_path: Path, *sets: str, steps: int = 5) -> cfg.Config:
    """The debug preset on the shards: 4 windows of 65 tokens a step; a 1,000-token shard holds 15.
    steps 0 keeps the preset's length."""
    return cfg.resolve(
        preset="debug",
        sets=[
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.source=llmc",
            f"data.path={PATH}",
            f"data.val_path={VAL_PATH}",
            "data.context_length=64",
            "training.batch_size=4",
            "training.grad_accum_nums=1",
            *([f"training.max_steps={steps}"] if steps else []),
            *sets,
        ],
    )


def chosen(config: cfg.Config, world_size: int = 1) -> tuple[cfg.Config, list[str]]:
    lines: list[str] = []
    return choose_hub_files(config, world_size, lines.append), lines


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The names of the shard files read (their headers: every read of a shard starts there)."""
    from pretrain.data import shards

    names: list[str] = []

    def recording(path: Path) -> shards.Shard:
        names.append(path.name)
        return shards.token_file(path)

    monkeypatch.setattr("pretrain.data.hub_shards.token_file", recording)
    monkeypatch.setattr("pretrain.data.shard_files.token_file", recording)
    return names


def test_offline_a_run_reads_only_the_cached_shards_it_needs_in_place(tmp_path, hub_cache, opened):
    snapshot = hub_cache(REPO, {**SHARDS, "README.md": "a card"})
    config, lines = chosen(debug_config(tmp_path, steps=5))  # 20 windows: two shards of 15

    assert config.data.hub_max_files == 2
    assert lines == [
        f"dataset {REPO}: 4 shard(s) match fineweb_train_*.bin in the Hugging Face cache (the Hub cannot be reached); "
        "using the first 2 of 4 (6.0 kB): the run reads 1,280 tokens, these hold 2,000; data.hub_max_files sets the count"
    ]
    dataset = prepare(config.data, log=lambda line: None)

    assert sorted(p.name for p in dataset.iterdir()) == ["meta.json"]  # no copy, no tokenization
    meta = read_meta(dataset)
    assert sorted(meta["files"]) == [str(snapshot / name) for name in (*TRAIN[:2], VAL)]
    assert split_tokens(dataset, "train").tolist() == np.concatenate([TOKENS[TRAIN[0]], TOKENS[TRAIN[1]]]).tolist()
    assert split_tokens(dataset, "val").tolist() == TOKENS[VAL].tolist()
    assert set(opened) == {TRAIN[0], TRAIN[1], VAL}  # never the shards the run does not read
    # The workers get the path at the commit prepared, and find the very same dataset.
    fitted, _ = fit_to_dataset(config, dataset, world_size=1)
    assert fitted.data.path == f"hf://datasets/{REPO}@{COMMIT}/fineweb_train_*.bin"
    assert fitted.data.val_path == f"hf://datasets/{REPO}@{COMMIT}/fineweb_val_*.bin"
    assert prepare(fitted.data, log=lambda line: None) == dataset


def test_more_steps_or_ranks_read_more_shards_and_a_run_set_in_epochs_all(tmp_path, hub_cache):
    hub_cache(REPO, SHARDS)

    assert chosen(debug_config(tmp_path, steps=3))[0].data.hub_max_files == 1
    assert chosen(debug_config(tmp_path, steps=3), world_size=2)[0].data.hub_max_files == 2
    assert chosen(debug_config(tmp_path, steps=12))[0].data.hub_max_files == 4
    long, lines = chosen(debug_config(tmp_path, steps=100))
    assert long.data.hub_max_files == 4 and lines[0].endswith("too few for the run, which will repeat its data")
    epochs, _ = chosen(debug_config(tmp_path, "training.epochs=1", steps=0))
    assert epochs.data.hub_max_files == 4


def test_without_val_path_the_validation_tail_counts_in_the_shards_needed(tmp_path, hub_cache):
    hub_cache(REPO, SHARDS)
    # 14 windows of 65 tokens: a 1,000-token shard holds them, but not once 5% of it validates.
    assert chosen(debug_config(tmp_path, "training.batch_size=7", steps=2))[0].data.hub_max_files == 1
    assert chosen(debug_config(tmp_path, "training.batch_size=7", "data.val_path=", steps=2))[0].data.hub_max_files == 2


def test_a_shard_missing_from_the_cache_offline_is_one_line_naming_it_and_hf_hub_offline(tmp_path, hub_cache):
    hub_cache(REPO, {name: SHARDS[name] for name in TRAIN})  # no validation shard

    result = run_launcher(
        "--device", "cpu", "--debug", "--max-steps", "2",
        "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.source=llmc",
        "--set", f"data.path={PATH}", "--set", f"data.val_path={VAL_PATH}",
    )  # fmt: skip

    assert_one_line_error(
        result,
        f"data.val_path fineweb_val_*.bin of dataset {REPO}@{COMMIT[:12]} is not in the Hugging Face cache",
        "HF_HUB_OFFLINE=1",
        "hf download kjj0/fineweb10B-gpt2 --repo-type dataset --include 'fineweb_val_*.bin'",
        prefix="launcher: error: ",
        quiet_stdout=False,
    )


def test_a_dataset_not_in_the_cache_offline_is_one_line_with_the_fix(tmp_path, hub_cache):
    with pytest.raises(DataError) as caught:
        chosen(debug_config(tmp_path))
    message = one_line_error(caught)
    assert f"dataset {REPO} (fineweb_train_*.bin) is not in the Hugging Face cache" in message and "HF_HUB_OFFLINE" in message


def test_nanogpt_bins_on_the_hub_are_read_in_place_too(tmp_path, hub_cache):
    ids = np.arange(3000, dtype="<u2")
    hub_cache("someone/owt", {"train.bin": ids[:2000].tobytes(), "val.bin": ids[2000:].tobytes()})
    data = cfg.DataConfig(
        cache_dir=str(tmp_path / "cache"),
        source="nanogpt",
        path="hf://datasets/someone/owt/train.bin",
        val_path="hf://datasets/someone/owt/val.bin",
    )

    dataset = prepare(data, log=lambda line: None)

    assert split_tokens(dataset, "train").tolist() == list(range(2000))
    assert split_tokens(dataset, "val").tolist() == list(range(2000, 3000))


@pytest.mark.parametrize(
    "path,fragment",
    [
        ("hf://models/owner/name/x.bin", "is not a Hugging Face dataset path"),
        ("hf://datasets/owner/name", "names no files"),
    ],
)
def test_an_hf_path_that_names_no_dataset_files_is_one_line(tmp_path, hub_cache, path, fragment):
    with pytest.raises(DataError) as caught:
        prepare(cfg.DataConfig(cache_dir=str(tmp_path / "cache"), source="llmc", path=path), log=lambda line: None)
    assert fragment in one_line_error(caught) and "hf://datasets/OWNER/NAME/PATTERN" in str(caught.value)


def test_hf_paths_are_for_llmc_and_nanogpt_shards_only():
    with pytest.raises(cfg.ConfigError) as caught:
        cfg.DataConfig(source="megatron", path="hf://datasets/o/n/x").check_complete()
    assert "hf:// paths are for llmc and nanogpt shards" in str(caught.value)
    cfg.DataConfig(source="llmc", path="hf://datasets/o/n/x", hub_max_files=2).check_complete()  # the count applies


def test_a_resume_reads_the_shards_and_commit_its_checkpoint_was_trained_on(tmp_path):
    saved = debug_config(tmp_path, "data.hub_max_files=3")
    saved = dataclasses.replace(
        saved, data=dataclasses.replace(saved.data, path=f"hf://datasets/{REPO}@{COMMIT}/fineweb_train_*.bin")
    )
    checkpoint = tmp_path / "step_10"
    checkpoint.mkdir()
    cfg.save(saved, checkpoint / "config.json")

    current = debug_config(tmp_path, f"training.resume={checkpoint}", steps=50)
    followed = follow_checkpoint(current).data

    assert followed.hub_max_files == 3 and followed.path == saved.data.path


# --- a directory of the dataset, as a local directory ----------------------------------------------

NG = "owner/ng"
NANOGPT_IDS = np.arange(3000, dtype="<u2")
NANOGPT_DIR = {
    "data/train.bin": NANOGPT_IDS[:2000].tobytes(),
    "data/val.bin": NANOGPT_IDS[2000:].tobytes(),
    "README.md": "a card",
}
LLMC_DIR = {**{f"shards/{name}": data for name, data in SHARDS.items()}, "README.md": "a card"}


def splits(data: cfg.DataConfig) -> tuple[list[int], list[int]]:
    dataset = prepare(data, log=lambda line: None)
    return split_tokens(dataset, "train").tolist(), split_tokens(dataset, "val").tolist()


@pytest.mark.parametrize(
    "source,files,folder",
    [("nanogpt", NANOGPT_DIR, "data"), ("nanogpt", NANOGPT_DIR, "data/"), ("llmc", LLMC_DIR, "shards")],
)
def test_an_hf_directory_reads_what_the_same_local_directory_reads(tmp_path, hub_cache, source, files, folder):
    hub_cache(NG, files)
    local = tmp_path / "local"
    for name, content in files.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    on_hub = cfg.DataConfig(cache_dir=str(tmp_path / "cache"), source=source, path=f"hf://datasets/{NG}/{folder}")

    train, val = splits(on_hub)

    assert (train, val) == splits(dataclasses.replace(on_hub, path=str(local / folder)))
    if source == "nanogpt":  # train.bin trains, val.bin beside it validates
        assert (train, val) == (list(range(2000)), list(range(2000, 3000)))
    else:  # every shard, in name order, the validation share their tail
        assert train + val == np.concatenate([TOKENS[name] for name in sorted(TOKENS)]).tolist() and val


def test_an_hf_nanogpt_directory_is_sized_pinned_and_found_again_by_the_workers(tmp_path, hub_cache):
    hub_cache(NG, NANOGPT_DIR)
    # 29 windows of 65 tokens: train.bin's 2,000 hold them all, as val.bin validates (none are its tail).
    run = debug_config(
        tmp_path, "data.source=nanogpt", f"data.path=hf://datasets/{NG}/data", "data.val_path=", "training.batch_size=29", steps=1
    )

    config, lines = chosen(run)

    assert config.data.hub_max_files == 1
    assert lines == [
        f"dataset {NG}: nanoGPT's data/train.bin (data/val.bin validates) in the Hugging Face cache (the Hub cannot be "
        "reached); using the first 1 of 1 (4.0 kB): the run reads 1,856 tokens, these hold 2,000; "
        "data.hub_max_files sets the count"
    ]
    dataset = prepare(config.data, log=lambda line: None)
    fitted, _ = fit_to_dataset(config, dataset, world_size=1)
    assert fitted.data.path == f"hf://datasets/{NG}@{COMMIT}/data" and fitted.data.val_path == ""
    assert prepare(fitted.data, log=lambda line: None) == dataset


def test_an_hf_path_naming_nothing_in_the_cache_offline_says_so_with_the_download_that_fetches_it(tmp_path, hub_cache):
    hub_cache(NG, NANOGPT_DIR)

    with pytest.raises(DataError) as caught:
        prepare(cfg.DataConfig(cache_dir=str(tmp_path / "cache"), source="nanogpt", path=f"hf://datasets/{NG}/other"), log=print)

    message = one_line_error(caught)
    assert message.startswith(
        f"data.path: the file or directory 'other' of dataset {NG}@{COMMIT[:12]} is not in the Hugging Face cache"
    )
    assert f"`hf download {NG} --repo-type dataset --include 'other/*'`" in message


# --- online: a Hub simulated in this process ---------------------------------------------------------


@pytest.fixture
def hub_files() -> dict[str, bytes]:
    """The files of the simulated Hub's dataset (the shards at its root unless a test changes them)."""
    return dict(SHARDS)


@pytest.fixture
def online_hub(hub_cache, hub_files, monkeypatch):
    """The Hub lists hub_files at their sizes (those under the folder asked for) and a download
    writes the files asked for into the cache. Returns the requests: ("tree", folder) and
    ("download", [names])."""
    from huggingface_hub import HfApi, constants, errors
    from huggingface_hub.hf_api import RepoFile

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    requests: list[tuple] = []

    def repo_info(self, repo_id, *, repo_type=None, revision=None, **kwargs):
        return type("Info", (), {"sha": COMMIT})()

    def list_repo_tree(self, repo_id, path_in_repo=None, *, recursive=False, revision=None, repo_type=None, **kw):
        requests.append(("tree", path_in_repo))
        under = f"{path_in_repo}/" if path_in_repo else ""
        return [
            RepoFile(path=name, size=len(data), oid="0", type="file")
            for name, data in hub_files.items()
            if name.startswith(under)
        ]

    def snapshot_download(repo_id, *, repo_type=None, revision=None, allow_patterns=None, local_files_only=False, **kw):
        if local_files_only:
            raise errors.LocalEntryNotFoundError("not cached")
        requests.append(("download", list(allow_patterns)))
        return str(hub_cache(repo_id, {name: hub_files[name] for name in allow_patterns}))

    monkeypatch.setattr(HfApi, "repo_info", repo_info)
    monkeypatch.setattr(HfApi, "list_repo_tree", list_repo_tree)
    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    from pretrain.data.hub_client import download_here

    def in_this_process(repo: str, revision: str, pattern: str | list[str], repo_type: str, log: object) -> Path:
        return download_here(repo, revision, pattern, repo_type)  # the child would not see this simulation

    monkeypatch.setattr("pretrain.data.hub_process.download_in_child", in_this_process)
    return requests


def test_online_only_the_shards_the_run_reads_are_downloaded_and_workers_ask_nothing(tmp_path, online_hub):
    config, lines = chosen(debug_config(tmp_path, steps=5))

    assert config.data.hub_max_files == 2 and "4 shard(s) match fineweb_train_*.bin; using the first 2 of 4" in lines[-1]
    # The first shard comes first: its header says how wide the tokens are, so how many the others hold.
    assert [r for r in online_hub if r[0] == "download"] == [("download", [TRAIN[0]])]
    dataset = prepare(config.data, log=lambda line: None)
    assert [r for r in online_hub if r[0] == "download"] == [
        ("download", [TRAIN[0]]),
        ("download", TRAIN[:2]),  # exact names: what is cached already is not fetched again
        ("download", [VAL]),
    ]

    online_hub.clear()
    worker, _ = fit_to_dataset(config, dataset, world_size=1)
    assert prepare(worker.data, log=lambda line: None) == dataset
    assert online_hub == []  # the path is at the commit, and the cache holds the shards


def test_a_debug_run_trains_on_hub_shards_from_the_cache_through_the_launcher(tmp_path, hub_cache):
    hub_cache(REPO, SHARDS)

    result = run_debug_training(
        tmp_path,
        ["-m", "launcher", "--device", "cpu", "--nproc", "1"],
        tmp_path / "run",
        "--max-steps", "3",
        "--set", "data.source=llmc", "--set", f"data.path={PATH}", "--set", f"data.val_path={VAL_PATH}",
    )  # fmt: skip

    output = result.stdout + result.stderr
    assert "using the first 1 of 4" in output and "(1,000 train tokens, 1,000 val tokens)" in output
    assert f'"path": "hf://datasets/{REPO}@{COMMIT}/fineweb_train_*.bin"' in (tmp_path / "run" / "config.json").read_text()


def test_a_commit_the_user_pins_is_sized_from_the_hubs_listing_not_from_what_is_cached(tmp_path, hub_cache, online_hub):
    hub_cache(REPO, {TRAIN[0]: SHARDS[TRAIN[0]]})
    pinned = debug_config(tmp_path, f"data.path=hf://datasets/{REPO}@{COMMIT}/fineweb_train_*.bin", steps=5)

    config, lines = chosen(pinned)

    assert config.data.hub_max_files == 2 and "4 shard(s) match fineweb_train_*.bin; using the first 2 of 4" in lines[-1]


def test_online_an_hf_directory_is_listed_and_only_its_files_the_run_reads_are_fetched(tmp_path, online_hub, hub_files):
    hub_files.clear()
    hub_files.update({**NANOGPT_DIR, "other/train.bin": b"\0\0" * 100})
    data = cfg.DataConfig(cache_dir=str(tmp_path / "cache"), source="nanogpt", path=f"hf://datasets/{NG}/data")

    assert splits(data) == (list(range(2000)), list(range(2000, 3000)))
    assert [r for r in online_hub if r[0] == "download"] == [("download", ["data/train.bin"]), ("download", ["data/val.bin"])]


def test_online_an_hf_path_the_dataset_lacks_is_one_line_saying_it_has_no_such_file_or_directory(tmp_path, online_hub):
    with pytest.raises(DataError) as caught:
        prepare(cfg.DataConfig(cache_dir=str(tmp_path / "cache"), source="llmc", path=f"hf://datasets/{REPO}/data"), log=print)

    assert one_line_error(caught).startswith(
        f"data.path: dataset {REPO}@{COMMIT[:12]} has no file or directory 'data' holding .bin shards"
    )
