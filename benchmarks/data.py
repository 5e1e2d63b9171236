"""Benchmark: dataset preparation, cache hits and the loader.

Run from the repository root:

    PYTHONPATH=. python benchmarks/data.py [--large-mb 1024] [--small-mb 64] [--quick]

Measured, each in a fresh Python process so memory and imports are its own:
1. preparation throughput on a JSON Lines corpus of --small-mb MB (documents of the built-in
   corpus, shuffled, repeated): MB/s of text and tokens/s through `prepare()` with the byte
   tokenizer and with a trained 8192-token BPE tokenizer (trained beforehand; training is not
   timed), next to the raw `tokenizers` `encode_batch_fast` on the same documents held in memory.
2. peak resident memory (ru_maxrss) of a process that prepares a --large-mb MB text source
   (JSON Lines, byte tokenizer) from scratch.
3. cache-hit time: `prepare()` on an already prepared dataset, for the small and the large one
   (in-process time of the call, and the whole `prepare_dataset.py`-like process).
4. loader: TrainBatches batches/s of 8 x 1025-token windows (context 1024), one rank, no
   worker processes, from the large dataset once it is in the page cache.
Progress goes to stderr; the Markdown table goes to stdout. Temporary files are removed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGETS = {"bpe_ratio": 0.9, "peak_rss_mb": 1024, "cache_hit_s": 0.3, "batches_per_s": 20_000}

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
task, args = sys.argv[2], json.loads(sys.argv[3])
from pretrain.config import DataConfig

def config(**extra):
    return DataConfig(source="jsonl", path=args["corpus"], cache_dir=args["cache"], **extra)

if task == "prepare":
    from pretrain.data.prepare import prepare, read_meta
    started = time.perf_counter()
    path = prepare(config(**args.get("extra", {})), log=lambda line: print(line, file=sys.stderr))
    seconds = time.perf_counter() - started
    meta = read_meta(path)
    print(json.dumps({"seconds": seconds, "path": str(path),
                      "tokens": meta["tokens"]["train"] + meta["tokens"]["val"],
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
elif task == "raw_bpe":
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(args["tokenizer"])
    documents = [json.loads(line)["text"] for line in open(args["corpus"], encoding="utf-8")]
    started = time.perf_counter()
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch_fast(documents, add_special_tokens=False))
    print(json.dumps({"seconds": time.perf_counter() - started, "tokens": tokens}))
elif task == "loader":
    from pretrain.data.loader import TrainBatches
    batches = TrainBatches(args["dataset"], 1024, 8, rank=0, world_size=1, seed=0, num_workers=0)
    stream = iter(batches)
    for _ in range(1000):  # warm up: first touches of the map, allocator
        next(stream)
    started = time.perf_counter()
    for _ in range(args["batches"]):
        x, y = next(stream)
    seconds = time.perf_counter() - started
    assert x.shape == (8, 1024) and y.shape == (8, 1024)
    print(json.dumps({"batches_per_s": args["batches"] / seconds}))
"""


def child(task: str, **args) -> dict:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO), task, json.dumps(args)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if result.returncode != 0:
        sys.exit(f"benchmark step {task} failed:\n{result.stderr[-3000:]}")
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "process_seconds": time.perf_counter() - started}


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """JSON Lines of built-in documents in shuffled order until megabytes of text; its text bytes."""
    from pretrain.data.builtin import builtin_documents

    documents = builtin_documents()
    rng = random.Random(seed)
    written = 0
    with open(path, "w", encoding="utf-8") as file:
        while written < megabytes << 20:
            rng.shuffle(documents)
            for document in documents:
                file.write(json.dumps({"text": document}) + "\n")
                written += len(document.encode("utf-8"))
                if written >= megabytes << 20:
                    break
    return written


def train_bpe_tokenizer(corpus: Path, destination: Path) -> None:
    from pretrain.data.tokenizer import train_bpe

    texts = (json.loads(line)["text"] for line in open(corpus, encoding="utf-8"))
    train_bpe(texts, 8192, destination)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-mb", type=int, default=64, help="corpus for throughput (default 64)")
    parser.add_argument("--large-mb", type=int, default=1024, help="corpus for memory and the loader (default 1024)")
    parser.add_argument("--quick", action="store_true", help="16 MB and 256 MB")
    args = parser.parse_args()
    if args.quick:
        args.small_mb, args.large_mb = 16, 256
    work = Path(tempfile.mkdtemp(prefix="data-bench-"))
    try:
        rows = run(work, args.small_mb, args.large_mb)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(rows, args)


def run(work: Path, small_mb: int, large_mb: int) -> list[tuple[str, str, str, str]]:
    small, large = work / "small.jsonl", work / "large.jsonl"
    log(f"writing a {small_mb} MB and a {large_mb} MB JSON Lines corpus ...")
    small_bytes, large_bytes = write_corpus(small, small_mb), write_corpus(large, large_mb, seed=1)
    tokenizer = work / "tokenizer.json"
    log("training an 8192-token BPE tokenizer on the small corpus (not timed) ...")
    train_bpe_tokenizer(small, tokenizer)
    rows = []

    log("preparing the small corpus: byte tokenizer ...")
    byte = child("prepare", corpus=str(small), cache=str(work / "c-byte"))
    log("preparing the small corpus: BPE tokenizer ...")
    bpe = child(
        "prepare",
        corpus=str(small),
        cache=str(work / "c-bpe"),
        extra={"tokenizer": "huggingface", "tokenizer_name": str(tokenizer)},
    )
    log("raw tokenizers encode_batch_fast on the same documents ...")
    raw = child("raw_bpe", corpus=str(small), tokenizer=str(tokenizer))
    mb = small_bytes / 2**20

    def speed(run: dict, mb_digits: int, tokens_digits: int) -> str:
        return f"{mb / run['seconds']:.{mb_digits}f} MB/s, {run['tokens'] / run['seconds'] / 1e6:.{tokens_digits}f} M tokens/s"

    rows.append(("prepare, byte tokenizer", speed(byte, 0, 1), "", ""))
    rows.append(("prepare, BPE 8192 (ours)", speed(bpe, 1, 2), "", ""))
    rows.append(("raw encode_batch_fast, same BPE", speed(raw, 1, 2), "", ""))
    ratio = raw["seconds"] / bpe["seconds"]
    rows.append(
        (
            "ours / raw (BPE throughput)",
            f"{ratio:.2f}x",
            f">= {TARGETS['bpe_ratio']}x",
            "yes" if ratio >= TARGETS["bpe_ratio"] else "no",
        )
    )

    log(f"preparing the {large_mb} MB corpus from scratch (peak memory) ...")
    big = child("prepare", corpus=str(large), cache=str(work / "c-large"))
    rows.append(
        (
            f"prepare {large_bytes / 2**20:.0f} MB, byte tokenizer",
            f"{big['seconds']:.1f} s ({large_bytes / 2**20 / big['seconds']:.0f} MB/s)",
            "",
            "",
        )
    )
    rows.append(
        (
            f"peak RSS preparing {large_bytes / 2**20:.0f} MB",
            f"{big['peak_rss_mb']:.0f} MB",
            f"< {TARGETS['peak_rss_mb']} MB",
            "yes" if big["peak_rss_mb"] < TARGETS["peak_rss_mb"] else "no",
        )
    )

    log("cache hits ...")
    for corpus, cache, tokens in ((small, "c-byte", byte["tokens"]), (large, "c-large", big["tokens"])):
        hits = [child("prepare", corpus=str(corpus), cache=str(work / cache)) for _ in range(5)]
        worst = max(hit["seconds"] for hit in hits)
        process = max(hit["process_seconds"] for hit in hits)
        rows.append(
            (
                f"cache hit, {tokens / 1e6:,.0f} M-token dataset (max of 5)",
                f"{worst * 1000:.1f} ms (whole process {process * 1000:.0f} ms)",
                f"< {TARGETS['cache_hit_s'] * 1000:.0f} ms",
                "yes" if worst < TARGETS["cache_hit_s"] else "no",
            )
        )

    log("loader ...")
    subprocess.run(["cat", str(next(Path(big["path"]).glob("tokens.bin")))], stdout=subprocess.DEVNULL, check=True)
    loader = child("loader", dataset=big["path"], batches=50_000)
    rows.append(
        (
            "loader, 8 x 1025 windows, page cache",
            f"{loader['batches_per_s']:,.0f} batches/s",
            f">= {TARGETS['batches_per_s']:,}",
            "yes" if loader["batches_per_s"] >= TARGETS["batches_per_s"] else "no",
        )
    )
    return rows


def print_table(rows: list[tuple[str, str, str, str]], args: argparse.Namespace) -> None:
    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("numpy", "tokenizers", "torch"))
    print(f"Machine: {os.cpu_count()} CPUs, {platform.platform()}; Python {platform.python_version()}; {versions}")
    print(f"Corpora: {args.small_mb} MB and {args.large_mb} MB of JSON Lines (built-in documents, shuffled)\n")
    print("| measurement | result | target | met? |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
