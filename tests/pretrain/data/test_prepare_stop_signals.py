"""A stop signal while the BPE tokenizer trains (Rust code that never returns to Python until it
is done) is acted on at once: the launcher, prepare_dataset.py and a training process started
alone each print one line, keep nothing half-written, leave no process behind and exit 128 +
the signal (pretrain/data/bpe_process.py trains in a child process that they kill)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest

from support.processes import ROOT, alive, cache_leftovers, launcher_env, stop_as_a_user_would, wait_until
from pretrain.data.sources import text_pieces
from pretrain.data.tokenizer import train_bpe

MIN_TRAINING_SECONDS = 1.5
"""The corpus is made large enough that training the BPE tokenizer on it takes at least this long
here, so that a stop acted on only when the training ends is told from one acted on at once."""
VOCAB = 8192


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, float, float]:
    """The corpus file, and how long training the BPE tokenizer on it takes here: its wall-clock
    seconds and the CPU seconds of the child that trains (its threads together), measured once
    through the same child process and pieces the preparation uses. Random letters and spaces:
    almost every word is new, so 1 MB takes 1 to 3 s on 2 shared cores, and is written in
    milliseconds; it doubles until training takes MIN_TRAINING_SECONDS."""
    directory = tmp_path_factory.mktemp("corpus")
    table = bytes(b"abcdefghijklmnopqrstuvwxyz  "[i % 28] for i in range(256))
    path = directory / "corpus.txt"
    for size in (1 << 20, 2 << 20, 4 << 20, 8 << 20):
        path.write_bytes(random.Random(0).randbytes(size).translate(table))
        started, before = time.monotonic(), os.times()
        train_bpe((piece.text for piece in text_pieces(path, "")), VOCAB, directory / "tokenizer.json")  # as prepare reads it
        seconds, after = time.monotonic() - started, os.times()
        if seconds >= MIN_TRAINING_SECONDS:
            child_cpu = (after.children_user + after.children_system) - (before.children_user + before.children_system)
            return str(path), seconds, child_cpu
    raise AssertionError(f"BPE training on {size} bytes took only {seconds:.2f} s")


def bpe_trainer(proc: subprocess.Popen) -> psutil.Process | None:
    """The child process that trains the BPE tokenizer (pretrain/data/bpe_process.py), if it runs."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(proc.pid).children(recursive=True):
            if any("pretrain.data.bpe_process" in part for part in child.cmdline()):
                return child
    return None


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def command(entry: str, corpus: str, tmp_path) -> list[str]:
    data = ["--set", "data.source=text", "--set", f"data.path={corpus}", "--set", "data.tokenizer=bpe"]
    data += ["--set", f"data.bpe_vocab_size={VOCAB}", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    run = ["--run-dir", str(tmp_path / "run")]
    return {
        "launcher": [sys.executable, "-m", "launcher", "--debug", "--device", "cpu", *run, *data],
        "prepare_dataset.py": [sys.executable, "prepare_dataset.py", "--debug", *data],
        "python -m pretrain": [sys.executable, "-m", "pretrain", "--debug", "--set", "system.device=cpu", *run, *data],
    }[entry]


@pytest.mark.slow
@pytest.mark.parametrize(
    "entry, stop_signal",
    [
        ("launcher", signal.SIGINT),
        ("launcher", signal.SIGTERM),
        ("prepare_dataset.py", signal.SIGINT),
        ("python -m pretrain", signal.SIGTERM),
    ],
)
def test_a_stop_signal_during_bpe_training_is_acted_on_at_once(processes, tmp_path, corpus, entry, stop_signal):
    path, training_seconds, training_cpu = corpus
    proc = processes(
        command(entry, path, tmp_path),
        cwd=ROOT,
        env=launcher_env(PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    while f"training a {VOCAB}-token BPE tokenizer on text" not in (line := proc.stdout.readline()):
        assert line, "".join(seen)
        seen.append(line)
    # A handshake, not a delay: wait until the trainer has done a quarter of its work (its CPU
    # seconds, which load does not change as it changes wall-clock time), so that the signal
    # comes while it trains whatever else runs here. A signal acted on only when training ends
    # would let it write tokenizer.json, which the last assertion looks for.
    assert wait_until(lambda: bpe_trainer(proc) is not None, timeout=60), "the BPE trainer never started"
    trainer = bpe_trainer(proc)
    assert trainer is not None
    assert wait_until(lambda: cpu_seconds(trainer) >= training_cpu / 4, timeout=60), "the BPE trainer never got a quarter through"
    assert trainer.is_running() and trainer.status() != psutil.STATUS_ZOMBIE, "the BPE trainer ended before the signal"
    code, took, out, job = stop_as_a_user_would(proc, stop_signal, timeout=training_seconds + 30)  # SIGINT: the trainer too

    assert code == 128 + stop_signal, out
    assert took < training_seconds / 2, f"stopped {took:.2f} s after {stop_signal.name}; training takes {training_seconds:.2f} s"
    interrupted = [line for line in out.splitlines() if "preparation interrupted by" in line]
    assert len(interrupted) == 1 and interrupted[0].endswith(
        f"dataset: preparation interrupted by {stop_signal.name}; nothing half-written is kept (its temporary files are removed)"
    ), out
    assert "Traceback" not in out
    assert cache_leftovers(tmp_path) == [] and not list((tmp_path / "cache").rglob("tokenizer.json"))
    assert wait_until(lambda: not any(alive(p.pid) for p in job), timeout=5), job
