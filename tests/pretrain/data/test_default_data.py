"""The small and production presets' default data: FineWeb-Edu from the Hugging Face Hub with a
real tokenizer, only the files a run needs (pretrain/data/hub.py, token_budget.py). Offline, from a Hub cache each
test builds: a few small Parquet files where FineWeb-Edu's sample/10BT files are, and a tiny
byte-level BPE where GPT-2's tokenizer.json is."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import ROOT, launcher_env, one_line_error
from support.runs import run_launcher
from pretrain import config as cfg
from pretrain.data import DataError
from pretrain.data.builtin import builtin_documents
from pretrain.data.fitting import fit_to_dataset
from pretrain.data.hub import choose_hub_files
from pretrain.data.prepare import prepare, read_meta
from pretrain.data.token_budget import files_for_tokens
from support.hub import add_snapshot

DATASET, TOKENIZER = "HuggingFaceFW/fineweb-edu", "openai-community/gpt2"
DATA_COMMIT, MODEL_COMMIT = "a" * 40, "b" * 40
FILES = [f"sample/10BT/{i:03d}_00000.parquet" for i in range(3)]
# The tiny model the end-to-end runs train instead of the preset's 153M parameters.
TINY_MODEL = [
    "--set",
    "model.n_heads=4",
    "--set",
    "model.n_kv_heads=2",
    "--set",
    "model.dim=64",
    "--set",
    "model.n_layers=2",
    "--set",
    "model.ffn_dim=128",
    "--set",
    "model.vocab_size=null",
]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A 400-id byte-level BPE with <|endoftext|>, trained once for the module."""
    from pretrain.data.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe(iter(builtin_documents()[:20]), 400, path)
    return path


def use_offline_hub(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make home the offline Hugging Face home (HF_HOME) of this process and the launchers it starts."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these when it is imported: set them where it looks at call time too.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def hub_home(tmp_path, monkeypatch) -> Path:
    """An empty, offline Hugging Face home (HF_HOME) for this process and the launchers it starts."""
    home = tmp_path / "hf"
    (home / "hub").mkdir(parents=True)
    use_offline_hub(home, monkeypatch)
    return home


def add_fineweb(home: Path, tokenizer_file: Path) -> None:
    """Put 3 FineWeb-Edu files (different documents each) and GPT-2's tokenizer into home's Hub cache."""
    documents = builtin_documents()
    add_snapshot(
        home, "dataset", DATASET, DATA_COMMIT, {name: {"text": documents[i :: len(FILES)]} for i, name in enumerate(FILES)}
    )
    add_snapshot(home, "model", TOKENIZER, MODEL_COMMIT, {"tokenizer.json": tokenizer_file.read_bytes()})


@pytest.fixture
def fineweb(hub_home, tokenizer_file) -> Path:
    """The Hub cache holding 3 FineWeb-Edu files (different documents each) and GPT-2's tokenizer."""
    add_fineweb(hub_home, tokenizer_file)
    return hub_home


def small(tmp_path: Path, *sets: str) -> cfg.Config:
    """The small preset, with one 1,024-token sequence per step (the fixture's files are small)."""
    return cfg.resolve(
        preset="small",
        sets=[f"data.cache_dir={tmp_path / 'cache'}", "training.batch_size=1", "training.grad_accum_nums=1", *sets],
    )


def chosen(config: cfg.Config, world_size: int = 1) -> tuple[cfg.Config, list[str]]:
    lines: list[str] = []
    return choose_hub_files(config, world_size, lines.append), lines


def sized_for(files: int) -> int:
    """max_steps of small() on 1 rank (1,024 tokens per step) whose tokens the first `files` of
    the fixture's files hold by the estimate, but not the first `files - 1`."""
    sizes = [(name, (hub_file(name)).stat().st_size) for name in FILES]
    for steps in range(1, 10_000):
        if files_for_tokens(sizes, steps * 1024, 0.05) == files:
            return steps
    raise AssertionError(f"no run length needs exactly {files} file(s)")


def hub_file(name: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / "datasets--HuggingFaceFW--fineweb-edu" / "snapshots" / DATA_COMMIT / name


# --- presets ------------------------------------------------------------------------------------


def test_small_and_production_default_to_fineweb_edu_with_real_tokenizers_and_debug_stays_built_in():
    for preset, tokenizer in (("small", TOKENIZER), ("production", "NousResearch/Meta-Llama-3-8B")):
        data = cfg.resolve(preset=preset).data
        assert (data.source, data.hub_repo, data.hub_files) == ("hub", DATASET, "sample/10BT/*.parquet")
        assert (data.tokenizer, data.tokenizer_name, data.hub_max_files) == ("huggingface", tokenizer, None)
    assert cfg.resolve(preset="production").model.vocab_size == 128256  # Llama-3's ids exactly
    debug = cfg.resolve(preset="debug").data
    assert (debug.source, debug.tokenizer, debug.tokenizer_name, debug.hub_repo) == ("builtin", "byte", "", "")


# --- how many files -----------------------------------------------------------------------------


def test_a_short_run_uses_and_prepares_only_the_first_file(tmp_path, fineweb):
    config, lines = chosen(small(tmp_path, f"training.max_steps={sized_for(1)}"))

    assert config.data.hub_max_files == 1
    assert "3 file(s) match sample/10BT/*.parquet in the Hugging Face cache" in lines[0]
    assert "using the first 1 " in lines[0] and "too few" not in lines[0]
    dataset = prepare(config.data, log=lambda line: None)
    assert [name for name, _ in read_meta(dataset)["key"]["source"]["files"]] == FILES[:1]


def test_more_steps_or_more_ranks_use_more_files(tmp_path, fineweb):
    steps = sized_for(2)
    assert chosen(small(tmp_path, f"training.max_steps={steps}"))[0].data.hub_max_files == 2
    # The same steps on more ranks read that many times the tokens.
    assert chosen(small(tmp_path, f"training.max_steps={steps}"), world_size=8)[0].data.hub_max_files == 3


def test_hub_max_files_zero_uses_every_file_and_a_number_is_kept_as_given(tmp_path, fineweb):
    every, _ = chosen(small(tmp_path, "training.max_steps=1", "data.hub_max_files=0"))
    assert every.data.hub_max_files == 3
    two, lines = chosen(small(tmp_path, "training.max_steps=1", "data.hub_max_files=2"))
    assert two.data.hub_max_files == 2 and lines == []
    dataset = prepare(two.data, log=lambda line: None)
    assert [name for name, _ in read_meta(dataset)["key"]["source"]["files"]] == FILES[:2]


def test_a_run_set_in_epochs_uses_every_file(tmp_path, fineweb):
    assert chosen(small(tmp_path, "training.epochs=1"))[0].data.hub_max_files == 3


def test_a_long_run_on_the_few_files_cached_offline_says_it_repeats_its_data(tmp_path, fineweb):
    config, lines = chosen(small(tmp_path, "training.max_steps=1000"), world_size=2)

    assert config.data.hub_max_files == 3
    assert "too few for the run, which will repeat its data" in lines[0]
    assert "python3 prepare_dataset.py --preset small" in lines[0]
    fitted, length = fit_to_dataset(config, prepare(config.data, log=lambda line: None), world_size=2)
    assert length.tokens > length.train_tokens
    assert re.search(r"prepared: repeats the data ~\d+\.\d times$", length.describe())
    # The workers get the count and the commit: they find the very same files, asking nothing.
    assert (fitted.data.hub_max_files, fitted.data.hub_revision) == (3, DATA_COMMIT)
    assert chosen(fitted)[0] == fitted and chosen(fitted)[1] == []


def test_more_files_than_the_cache_holds_offline_is_one_line_with_the_fix(tmp_path, fineweb):
    config = small(tmp_path, "data.hub_max_files=5")
    with pytest.raises(DataError) as caught:
        prepare(config.data, log=lambda line: None)
    message = one_line_error(caught)
    assert "data.hub_max_files is 5, but the Hugging Face cache holds only 3 file(s)" in message
    assert f"hf download {DATASET} --repo-type dataset" in message


def test_the_file_estimate_counts_the_validation_share_and_a_margin():
    files = [("a.parquet", 1000), ("b.parquet", 1000), ("c.parquet", 1000)]  # ~300 tokens each
    assert files_for_tokens(files, 250, 0.05) == 1  # 250 / 0.95 x 1.1 = 289
    assert files_for_tokens(files, 275, 0.05) == 2  # 318: just past one file
    assert files_for_tokens(files, 10**6, 0.05) == 3  # all there are
    assert files_for_tokens([("a.txt", 1000)] * 3, 250, 0.05) == 2  # plain text: 0.25 tokens per byte


# --- online: only the files needed are downloaded ------------------------------------------------

FULL_SAMPLE = [f"sample/10BT/{i:03d}_00000.parquet" for i in range(14)]


@pytest.fixture
def online_hub(hub_home, monkeypatch, tokenizer_file):
    """The Hub, simulated in this process: FineWeb-Edu lists its 14 sample/10BT files at 2 GB each,
    and a download writes small Parquet files (or the tokenizer) into the cache. Returns the log
    of requests: ("tree", path_in_repo) and ("download", repo, allow_patterns)."""
    import httpx2
    from huggingface_hub import HfApi, constants, errors
    from huggingface_hub.hf_api import RepoFile

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    requests: list[tuple] = []

    def known(repo: str) -> None:
        if repo not in (DATASET, TOKENIZER):
            response = httpx2.Response(404, request=httpx2.Request("GET", f"https://huggingface.co/api/{repo}"))
            raise errors.RepositoryNotFoundError(f"{repo} not found", response=response)

    def repo_info(self, repo_id, *, repo_type=None, revision=None, **kwargs):
        known(repo_id)
        return type("Info", (), {"sha": DATA_COMMIT if repo_type == "dataset" else MODEL_COMMIT})()

    def list_repo_tree(self, repo_id, path_in_repo=None, *, recursive=False, revision=None, repo_type=None, **kw):
        known(repo_id)
        requests.append(("tree", path_in_repo))
        names = [*FULL_SAMPLE, "sample/10BT/README.md", "data/CC-MAIN-2024-10/000_00000.parquet"]
        return [
            RepoFile(path=name, size=2_000_000_000, oid="0", type="file") for name in names if name.startswith(f"{path_in_repo}/")
        ]

    def snapshot_download(repo_id, *, repo_type=None, revision=None, allow_patterns=None, local_files_only=False, **kw):
        if local_files_only:
            raise errors.LocalEntryNotFoundError("not cached")
        known(repo_id)
        requests.append(("download", repo_id, allow_patterns))
        if repo_type == "model":
            return str(add_snapshot(hub_home, "model", repo_id, MODEL_COMMIT, {"tokenizer.json": tokenizer_file.read_bytes()}))
        texts = builtin_documents()
        return str(
            add_snapshot(
                hub_home,
                "dataset",
                repo_id,
                DATA_COMMIT,
                {name: {"text": texts[i :: len(allow_patterns)]} for i, name in enumerate(allow_patterns)},
            )
        )

    monkeypatch.setattr(HfApi, "repo_info", repo_info)
    monkeypatch.setattr(HfApi, "list_repo_tree", list_repo_tree)
    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    # A download runs in a child process (hub_process.py), which would not see this simulation.
    from pretrain.data.hub_client import download_here

    def in_this_process(repo: str, revision: str, pattern: str | list[str], repo_type: str, log: object) -> Path:
        return download_here(repo, revision, pattern, repo_type)

    monkeypatch.setattr("pretrain.data.hub_process.download_in_child", in_this_process)
    return requests


def test_online_only_the_files_the_run_reads_are_listed_by_size_and_downloaded(tmp_path, online_hub):
    # The small preset as it is on 8 ranks: 5,000 x 16 x 1024 x 4 x 8 = 2.62B tokens, ~3.0B with
    # validation and margin, 0.6B (estimated) per 2 GB file: 6 files.
    config = cfg.resolve(preset="small", sets=[f"data.cache_dir={tmp_path / 'cache'}"])
    chosen_config, lines = chosen(config, world_size=8)

    assert chosen_config.data.hub_max_files == 6
    assert lines == [
        "dataset HuggingFaceFW/fineweb-edu: 14 file(s) match sample/10BT/*.parquet; using the first 6 "
        "(12.0 GB): the run reads 2.62B tokens, these hold ~3.60B (estimated from their size); "
        "data.hub_max_files sets the count"
    ]
    assert online_hub == [("tree", "sample/10BT")]  # listed below the pattern's directory only; nothing fetched

    dataset = prepare(chosen_config.data, log=lambda line: None)

    downloads = [r for r in online_hub if r[0] == "download"]
    assert [r for r in downloads if r[1] == DATASET] == [("download", DATASET, FULL_SAMPLE[:6])]  # exact names
    assert {r for r in downloads if r[1] != DATASET} == {("download", TOKENIZER, "tokenizer.json")}
    assert [name for name, _ in read_meta(dataset)["key"]["source"]["files"]] == FULL_SAMPLE[:6]
    # A worker's config names the count and the commit: its data comes from the cache, unasked.
    online_hub.clear()
    pinned = dataclasses.replace(chosen_config.data, hub_revision=DATA_COMMIT)
    assert prepare(pinned, log=lambda line: None) == dataset
    assert [r for r in online_hub if r[0] == "tree" or r[1] == DATASET] == []


def test_a_dataset_or_tokenizer_that_does_not_exist_is_one_line(tmp_path, hub_home, online_hub):
    with pytest.raises(DataError) as caught:
        chosen(small(tmp_path, "data.hub_repo=nobody/nothing"))
    assert "dataset nobody/nothing@main was not found" in one_line_error(caught)
    add_snapshot(hub_home, "dataset", DATASET, DATA_COMMIT, {FILES[0]: {"text": ["a text"] * 10}})
    config, _ = chosen(small(tmp_path, "data.tokenizer_name=nobody/tokenizer", "training.max_steps=1"))
    with pytest.raises(DataError) as caught:
        prepare(config.data, log=lambda line: None)
    assert "model nobody/tokenizer@main was not found" in one_line_error(caught)


# --- offline without the files ------------------------------------------------------------------


def test_offline_without_the_dataset_says_how_to_fetch_it_and_how_to_use_local_files(tmp_path, hub_home):
    with pytest.raises(DataError) as caught:
        chosen(small(tmp_path), world_size=8)
    message = one_line_error(caught)
    assert f"dataset {DATASET} (sample/10BT/*.parquet) is not in the Hugging Face cache" in message
    assert "`python3 prepare_dataset.py --preset small --world-size 8`" in message
    assert f"`hf download {DATASET} --repo-type dataset --include 'sample/10BT/*.parquet'`" in message
    assert "--set data.source=parquet --set data.path=DIR" in message and "HF_HUB_OFFLINE" in message


def test_offline_without_the_tokenizer_says_how_to_fetch_it_or_use_a_local_file(tmp_path, hub_home):
    add_snapshot(hub_home, "dataset", DATASET, DATA_COMMIT, {FILES[0]: {"text": ["some text"] * 10}})
    config, _ = chosen(small(tmp_path, "training.max_steps=1"))
    with pytest.raises(DataError) as caught:
        prepare(config.data, log=lambda line: None)
    message = one_line_error(caught)
    assert f"tokenizer {TOKENIZER} is not in the Hugging Face cache" in message
    assert f"`hf download {TOKENIZER} tokenizer.json`" in message and "data.tokenizer_name" in message


def test_the_launcher_offline_without_the_dataset_stops_with_one_line_before_any_worker(tmp_path, hub_home):
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps({"gpus": [{}] * 8}))
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--run-dir", str(tmp_path / "run")],
        cwd=ROOT,
        env=launcher_env(LAUNCHER_SCRIPTED_GPUS=str(machine)),
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("launcher: error: dataset ")
    assert "prepare_dataset.py --preset production --world-size 8" in result.stderr
    assert "fewer than one optimizer step" not in result.stderr
    assert not (tmp_path / "run").exists() and "GPU0:" not in result.stdout


# --- prepare_dataset.py and the whole path ------------------------------------------------------


def test_prepare_dataset_prepares_what_a_one_rank_launch_would_and_says_it_assumed_one_rank(tmp_path, fineweb):
    import prepare_dataset

    lines: list[str] = []
    args = [
        "--preset",
        "small",
        "--set",
        f"data.cache_dir={tmp_path / 'cache'}",
        "--max-steps",
        str(sized_for(1)),
        "--set",
        "training.batch_size=1",
        "--set",
        "training.grad_accum_nums=1",
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("builtins.print", lambda *a, **k: lines.append(" ".join(map(str, a))))
        assert prepare_dataset.main(args) == 0

    assert any("sizing the download for 1 rank" in line and "--world-size N" in line for line in lines)
    config, _ = chosen(small(tmp_path, f"training.max_steps={sized_for(1)}"))
    assert any(str(prepare(config.data, log=lambda line: None)) in line for line in lines)  # the same dataset


def train_small(tmp_path: Path, *options: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    """The small preset with a tiny model on 2 CPU workers through the launcher, 4,096 tokens a
    step, into tmp_path/run, with the data cache tmp_path/cache unless another is given."""
    return run_launcher(
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--preset",
        "small",
        "--run-dir",
        str(tmp_path / "run"),
        *TINY_MODEL,
        "--set",
        "training.batch_size=2",
        "--set",
        "training.grad_accum_nums=1",
        "--set",
        "training.warmup_steps=1",
        "--set",
        "training.use_amp=false",
        "--set",
        "logging.log_interval=1",
        "--set",
        f"data.cache_dir={cache or tmp_path / 'cache'}",
        *options,
        timeout=300,
    )


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, tokenizer_file) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """The small preset trained for 3 steps on its default data (the fixture's offline Hub cache)
    once for the module: (its directory, holding run/ and cache/; its Hugging Face home; the
    launcher's result). The tests below read it, or resume copies of its run directory."""
    base = tmp_path_factory.mktemp("small-run")
    (base / "hf" / "hub").mkdir(parents=True)
    add_fineweb(base / "hf", tokenizer_file)
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_offline_hub(base / "hf", monkeypatch)
        return base, base / "hf", train_small(base, "--max-steps", "3")


@pytest.fixture
def resumable(small_run, tmp_path, monkeypatch) -> Path:
    """A copy of small_run's run directory as tmp_path/run, small_run's Hub home as this test's;
    returns small_run's data cache, which a run resuming the copy shares."""
    base, home, result = small_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    use_offline_hub(home, monkeypatch)
    shutil.copytree(base / "run", tmp_path / "run")
    return base / "cache"


@pytest.mark.slow
def test_the_small_preset_trains_on_its_default_data_through_the_launcher(small_run):
    base, _, result = small_run

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "launcher: dataset HuggingFaceFW/fineweb-edu: 3 file(s) match" in result.stdout
    losses = [float(m) for m in re.findall(r"^CPU0:INFO \| \[CPU 0\] Step \[\d/3\] \| Loss: (\d+\.\d+)", result.stdout, re.M)]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    resolved = json.loads((base / "run" / "config.json").read_text())["data"]
    assert (resolved["source"], resolved["tokenizer_name"]) == ("hub", TOKENIZER)
    assert resolved["hub_max_files"] == 1 and resolved["hub_revision"] == DATA_COMMIT


@pytest.mark.slow
def test_a_resumed_run_reads_the_hub_files_of_its_checkpoint_even_when_it_is_longer(tmp_path, resumable):
    longer = -(-sized_for(3) // 4)  # steps of 4,096 tokens that, started afresh, would take 3 files
    result = train_small(tmp_path, "--max-steps", str(longer), "--resume", "auto", cache=resumable)

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "using the first 1 " not in result.stdout  # nothing chosen anew: the checkpoint's file
    assert f"Step [{longer - 1}/{longer}]" in result.stdout
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())["data"]
    assert resolved["hub_max_files"] == 1 and resolved["hub_revision"] == DATA_COMMIT


@pytest.mark.slow
def test_resuming_on_other_hub_files_than_the_checkpoints_is_refused(tmp_path, resumable):
    result = train_small(tmp_path, "--max-steps", "3", "--resume", "auto", "--set", "data.hub_max_files=2", cache=resumable)

    assert result.returncode == 2, result.stdout[-3000:]
    assert (
        "was trained on other Hub data: data.hub_max_files is 1 there, 2 here; resume with "
        "--set data.hub_max_files=1 or start fresh" in result.stdout
    )
