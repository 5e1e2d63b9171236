"""The prepare_dataset.py command (pretrain/data/prepare_cli.py): prepares and caches a dataset,
says where, verifies it, refuses a bad key in one line, and cleans up when stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from support.processes import ROOT, cache_leftovers, launcher_env, wait_until
from pretrain.data import prepare as prep


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "prepare_dataset.py"), *args],
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_prepare_dataset_script_prepares_the_builtin_corpus_and_prints_the_path(tmp_path):
    cache = tmp_path / "cache"
    built = run_script("--debug", "--set", f"data.cache_dir={cache}")
    reused = run_script("--debug", "--set", f"data.cache_dir={cache}", "--verify")

    assert built.returncode == 0, built.stderr
    (path,) = [p for p in cache.iterdir() if p.is_dir()]
    assert path.name.startswith("builtin-byte-")
    assert built.stdout.startswith(f"dataset: prepared {path} (") and " train tokens, " in built.stdout
    assert reused.returncode == 0, reused.stderr
    reuse, verified = reused.stdout.splitlines()
    assert reuse.startswith(
        f"dataset: reusing {path} ({prep.read_meta(path)['tokens']['train']:,} train tokens, "
        f"{prep.read_meta(path)['tokens']['val']:,} val tokens; checked in "
    )
    assert verified == f"dataset: verified {path} (every file matches its sha256 in meta.json)"


def test_prepare_dataset_script_takes_the_launchers_cache_dir_option(tmp_path):
    built = run_script("--debug", "--cache-dir", str(tmp_path / "mine"))
    assert built.returncode == 0, built.stderr
    (path,) = (tmp_path / "mine" / "datasets").iterdir()
    assert built.stdout.startswith(f"dataset: prepared {path} (")
    empty = run_script("--debug", "--cache-dir", "")
    assert (empty.returncode, empty.stderr) == (
        2,
        "prepare_dataset: error: --cache-dir must not be empty; leave it out for the default\n",
    )


def test_prepare_dataset_script_names_the_closest_key_for_a_typo_in_one_line():
    result = run_script("--debug", "--set", "data.context_lenght=5")

    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "prepare_dataset: error: --set: data.context_lenght: unknown key; did you mean data.context_length?"
    ]


def test_prepare_dataset_script_reports_a_failed_verify_in_one_line(tmp_path):
    cache = tmp_path / "cache"
    assert run_script("--debug", "--set", f"data.cache_dir={cache}").returncode == 0
    (path,) = [p for p in cache.iterdir() if p.is_dir()]
    data = bytearray((path / "tokens.bin").read_bytes())
    data[100] ^= 0x01
    (path / "tokens.bin").write_bytes(bytes(data))

    result = run_script("--debug", "--set", f"data.cache_dir={cache}", "--verify")

    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"prepare_dataset: error: {path}: tokens.bin does not match its sha256")


TERMINATED_PREPARER = textwrap.dedent("""
    import sys, time
    from pretrain.config import DataConfig
    from pretrain.data import prepare as prep
    from pretrain.data.tokenizer import ByteTokenizer

    encode = ByteTokenizer.encode
    def slow_encode(self, text):
        time.sleep(0.05)
        return encode(self, text)
    ByteTokenizer.encode = slow_encode
    import pretrain.data.encode as encoding
    encoding.BATCH_CHARS = 1  # one document per batch: the build takes seconds
    with prep.sigterm_as_exit():
        prep.prepare(DataConfig(cache_dir=sys.argv[1]), documents=[f"document {i}" for i in range(400)])
""")


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_or_hung_up_build_removes_its_temporary_directory(tmp_path, stop_signal):
    script = tmp_path / "preparer.py"
    script.write_text(TERMINATED_PREPARER)
    cache = tmp_path / "cache"
    process = subprocess.Popen([sys.executable, str(script), str(cache)], env=launcher_env(), stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: bool(list(cache.glob(".*.tmp-*/tokens.bin"))), timeout=20), "the build never started"

    process.send_signal(stop_signal)  # a scheduler's SIGTERM; a closed terminal's SIGHUP
    _, stderr = process.communicate(timeout=20)

    assert process.returncode == 128 + stop_signal and "Traceback" not in stderr
    assert cache_leftovers(tmp_path) == []
