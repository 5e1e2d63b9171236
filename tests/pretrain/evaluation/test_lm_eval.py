"""A run's export in the Hugging Face tools, as a user runs them (issue 29): lm-eval, offline, on a
local task in HellaSwag form gets pretrain.evaluation.evaluate's acc (and, from the same log-likelihoods, its
own acc_norm by characters and acc_bytes by bytes, where ours divides by tokens); transformers'
AutoModelForCausalLM and AutoTokenizer greedy-continue a prompt with pretrain.evaluation.generate's text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain import config as cfg
from pretrain.evaluation import hellaswag
from pretrain.evaluation.choices import TokenLosses, pack
from pretrain.evaluation.evaluate import main as evaluate_main
from pretrain.hf.export import main as export_main
from pretrain.checkpoint.reading import find_checkpoint, find_tokenizer_file, open_tokenizer, read_checkpoint
from pretrain.evaluation.generate import load_model
from pretrain.evaluation.generate import main as generate_main
from pretrain.distributed.runtime import Runtime, setup_logging
from pretrain.train import train

pytestmark = pytest.mark.slow  # a real (if short) training run, and lm-eval in a subprocess: about 15 s

# HellaSwag's form (ctx, four endings, label), some endings not ASCII: characters, bytes and
# tokens then count differently, which is what tells the normalized accuracies apart (the last
# example's answer by characters, by bytes and by the sum are three different endings, for the
# model trained here). The labels are arbitrary: what is checked is that both sides agree.
EXAMPLES = [
    (
        "A man is sitting on a roof. He",
        ["is using wrap to wrap a pair of skis.", "starts pulling up roofing.", "rips tiles off.", "holds a cube."],
        3,
    ),
    (
        "The list is sorted in place, and",
        ["the function returns None.", "it prints a new list.", "café au lait is served.", "keys are compared."],
        3,
    ),
    (
        "Python's documentation says that",
        ["a tuple is immutable.", "über alles, das Wetter.", "def main(): return 0", "the loop never ends."],
        0,
    ),
    ("To open a file, call", ["open() with its name.", "the fire department.", "ñandú y pingüino", "a function named read"], 0),
    ("The dictionary maps", ["keys to values.", "streets of a city to their names.", "日本語のテキスト", "nothing"], 3),
    ("An exception is raised when", ["an error occurs.", "the sun rises.", "it rains — naïvely.", "you sleep"], 0),
    ("The for statement iterates over", ["the items of a sequence.", "hills and valleys.", "ça va", "a"], 3),
    ("Strings are", ["sequences of characters.", "made of cheese.", "très bien", "the end of the story"], 3),
    ("Strings are", ["ça", "zz", "Q", "Z"], 1),
]
TASK = "local_hellaswag"
# The task lm-eval runs: the file as it is, context then " " + each ending (lm-eval's default
# target_delimiter), the metrics of its hellaswag task and acc_bytes.
TASK_YAML = """\
task: local_hellaswag
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: multiple_choice
validation_split: validation
doc_to_text: "{{{{ctx}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "{{{{endings}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
  - metric: acc_bytes
    aggregation: mean
    higher_is_better: true
"""
PROMPT = "The list, naïvely:"


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> Path:
    """The run directory of a tiny BPE model trained a few steps in fp32, as a run leaves it:
    checkpoints/ and export/."""
    root = tmp_path_factory.mktemp("lm_eval")
    config = cfg.resolve(
        preset="debug",
        max_steps=40,
        sets=[
            f"data.cache_dir={root / 'cache'}",
            "data.tokenizer=bpe",
            "data.bpe_vocab_size=300",
            "training.batch_size=4",
            "training.use_amp=false",  # fp32 throughout, so that lm-eval's float32 run computes the same numbers
        ],
    )
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")
    train(config, runtime, str(root / "run"), setup_logging("CPU 0", "WARNING"))  # a worker's whole run, export included
    return root / "run"


def our_loglikelihoods(run_dir: Path, data: Path) -> tuple[np.ndarray, np.ndarray]:
    """(each ending's log-likelihood, each ending's token count), (examples, 4), as pretrain.evaluation.evaluate
    scores them (pretrain/evaluation/hellaswag.py, pretrain/evaluation/choices.py)."""
    checkpoint_dir = find_checkpoint(run_dir)
    config, state = read_checkpoint(checkpoint_dir)
    encoded = hellaswag.encode(
        hellaswag.load(str(data)), open_tokenizer(config, find_tokenizer_file(config, checkpoint_dir)), cfg.max_seq_len(config)
    )
    tokens, scored = pack(encoded, hellaswag.longest_row(encoded))
    with torch.no_grad():
        losses = load_model(config, state, torch.device("cpu"))(tokens, head=TokenLosses(tokens)).out  # (rows, T - 1)
    sums = -(losses * scored).sum(dim=1).view(len(encoded), hellaswag.ENDINGS).double().numpy()
    return sums, scored.sum(dim=1).view(len(encoded), hellaswag.ENDINGS).numpy()


def lm_eval(export_dir: Path, data: Path, tmp_path: Path) -> tuple[dict[str, float], np.ndarray]:
    """(lm-eval's metrics, each ending's log-likelihood (examples, 4)) from the command a user runs,
    offline."""
    tasks, out = tmp_path / "tasks", tmp_path / "lm_eval_out"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(data=data))
    offline = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
    }
    # The package in this Python, as `lm_eval ...` would run it.
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={export_dir},dtype=float32"]
    command += ["--tasks", TASK, "--include_path", str(tasks), "--device", "cpu", "--output_path", str(out), "--log_samples"]
    done = subprocess.run(command, env=os.environ | offline, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][TASK]
    samples = sorted(
        (json.loads(line) for line in next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()),
        key=lambda s: s["doc_id"],
    )
    lls = np.array([[float(ll) for ll, _greedy in sample["filtered_resps"]] for sample in samples])
    return {name.removesuffix(",none"): value for name, value in results.items() if name.endswith(",none")}, lls


def accuracy(scores: np.ndarray) -> float:
    """The share of examples whose highest-scoring ending is the label (the first of equals, as both sides take it)."""
    labels = np.array([label for *_, label in EXAMPLES])
    return float((scores.argmax(axis=1) == labels).mean())


def test_lm_eval_offline_on_a_local_hellaswag_task_gets_pretrain_evaluates_accuracy(bpe_run, tmp_path):
    data = tmp_path / "hellaswag_local.jsonl"
    data.write_text(
        "".join(json.dumps({"ctx": c, "endings": e, "label": label}, ensure_ascii=False) + "\n" for c, e, label in EXAMPLES)
    )
    assert evaluate_main(["--checkpoint", str(bpe_run), "--data", str(data), "--output", str(tmp_path / "ours.json")]) == 0
    ours = json.loads((tmp_path / "ours.json").read_text())
    # The run's export is bfloat16: export the checkpoint again in the dtype it was scored in.
    assert export_main(["--checkpoint", str(bpe_run), "--output", str(tmp_path / "export"), "--dtype", "float32"]) == 0
    metrics, theirs = lm_eval(tmp_path / "export", data, tmp_path)
    ours_ll, token_counts = our_loglikelihoods(bpe_run, data)

    # The same model, tokens and positions: every ending's log-likelihood agrees, so acc does.
    np.testing.assert_allclose(theirs, ours_ll, rtol=1e-5, atol=1e-4)
    assert metrics["acc"] == ours["accuracy"] == accuracy(ours_ll)
    # The normalized accuracies differ in what divides the log-likelihood: lm-eval's acc_norm
    # by the ending's characters, its acc_bytes by its UTF-8 bytes (both without the space before
    # it); ours by the ending's tokens (with that space), build-nanogpt's acc_norm.
    characters = np.array([[len(e) for e in endings] for _, endings, _ in EXAMPLES])
    utf8_bytes = np.array([[len(e.encode()) for e in endings] for _, endings, _ in EXAMPLES])
    assert metrics["acc_norm"] == accuracy(ours_ll / characters)
    assert metrics["acc_bytes"] == accuracy(ours_ll / utf8_bytes)
    assert ours["accuracy_norm"] == accuracy(theirs / token_counts)
    assert (characters != utf8_bytes).any() and (characters != token_counts).any()  # the data tells them apart


def test_transformers_greedy_continues_a_prompt_as_pretrain_generate_does(bpe_run, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    argv = ["--checkpoint", str(bpe_run), "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "24", "--device", "cpu"]
    assert generate_main(argv) == 0
    ours = capsys.readouterr().out.removesuffix("\n")

    export_dir = bpe_run / "export"
    tokenizer = AutoTokenizer.from_pretrained(str(export_dir))
    # The run's bfloat16 weights computed in fp32; generate runs the fp32 checkpoint.
    model = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=torch.float32).eval()
    prompt_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    generated = model.generate(prompt_ids, max_new_tokens=24, do_sample=False)[0, prompt_ids.shape[1] :]
    theirs = PROMPT + tokenizer.decode(generated, skip_special_tokens=True)
    assert len(ours) > len(PROMPT) and theirs == ours
