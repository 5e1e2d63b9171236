"""Text generation from a checkpoint: the sampling loop, the command line and its errors."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch

from support.processes import launcher_env
from support.runs import assert_one_line_error, run_in_process
from pretrain import config as cfg
from pretrain.data.tokenizer import BYTE_EOT
from pretrain.checkpoint.reading import read_checkpoint
from pretrain.evaluation.generate import generate, load_model, main, next_token
from pretrain.model.transformer import Transformer
from support.evaluation import CONTEXT, saved  # noqa: F401 (saved: a fixture)


@pytest.fixture(scope="module")
def model(saved) -> Transformer:
    config, state = read_checkpoint(saved)
    return load_model(config, state, torch.device("cpu"))


def prompt_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def argmax_loop(model: Transformer, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding written out by hand: the last max_seq_len ids in, the largest logit out."""
    ids, new = list(ids), []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([ids[-model.max_seq_len :]])).out[0, -1].argmax())
            if token == BYTE_EOT:
                break
            ids.append(token)
            new.append(token)
    return new


def run_cli(argv: list[str], capsys) -> subprocess.CompletedProcess:
    return run_in_process(main, argv, capsys)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- the loop -------------------------------------------------------------------------------


def test_greedy_generation_is_deterministic_and_equals_an_argmax_loop_over_the_logits(model):
    ids = prompt_ids("def main")
    first = generate(model, ids, 20, temperature=0, top_k=50, eot_id=BYTE_EOT)
    assert first == generate(model, ids, 20, temperature=0, top_k=50, eot_id=BYTE_EOT)
    assert first == argmax_loop(model, ids, 20)
    assert len(ids) + 20 <= CONTEXT  # no cropping in this one
    assert 0 < len(first) <= 20


def test_top_k_1_draws_the_greedy_token_at_any_temperature(model):
    ids = prompt_ids("import os")
    greedy = generate(model, ids, 15, temperature=0, top_k=0, eot_id=BYTE_EOT)
    assert generate(model, ids, 15, temperature=5.0, top_k=1, eot_id=BYTE_EOT, generator=seeded(7)) == greedy


def test_the_same_seed_gives_the_same_sample_and_another_seed_a_different_one(model):
    ids = prompt_ids("The ")

    def sample(seed: int) -> list[int]:
        return generate(model, ids, 25, temperature=1.0, top_k=0, eot_id=BYTE_EOT, generator=seeded(seed))

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)  # an untrained model spreads its bets over 257 ids: collisions are rare


def test_a_prompt_and_continuation_longer_than_max_seq_len_slide_the_window(model):
    ids = prompt_ids("a prompt that is already longer than the window")
    assert len(ids) > CONTEXT
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
        model(torch.tensor([ids]))  # what an uncropped loop would do
    assert generate(model, ids, 10, temperature=0, top_k=0, eot_id=BYTE_EOT) == argmax_loop(model, ids, 10)


def test_generation_stops_at_the_end_of_text_id_and_leaves_it_out(model):
    ids = prompt_ids("class A")
    full = generate(model, ids, 12, temperature=1.0, top_k=0, eot_id=-1, generator=seeded(3))
    stop = full[5]
    assert generate(model, ids, 12, temperature=1.0, top_k=0, eot_id=stop, generator=seeded(3)) == full[: full.index(stop)]


def test_an_empty_prompt_starts_from_end_of_text(model):
    from_nothing = generate(model, [], 8, temperature=0, top_k=0, eot_id=BYTE_EOT)
    assert from_nothing == generate(model, [BYTE_EOT], 8, temperature=0, top_k=0, eot_id=BYTE_EOT)


def test_ids_beyond_the_tokenizers_vocabulary_are_never_drawn():
    torch.manual_seed(0)
    wide = Transformer(dataclasses.replace(cfg.debug().model, vocab_size=400), max_seq_len=CONTEXT)
    unrestricted = generate(wide, [1, 2, 3], 25, temperature=1.0, top_k=0, eot_id=BYTE_EOT, generator=seeded(0))
    restricted = generate(wide, [1, 2, 3], 25, temperature=1.0, top_k=0, eot_id=BYTE_EOT, generator=seeded(0), vocab_size=257)
    assert max(unrestricted) >= 257  # the check below has something to catch
    assert max(restricted) < 257


def test_top_k_draws_only_among_the_k_largest_logits():
    logits = torch.tensor([0.0, 5.0, 4.9, 4.8, -1.0, 4.7])
    generator = seeded(0)
    draws = {next_token(logits, temperature=50.0, top_k=2, generator=generator) for _ in range(200)}
    assert draws == {1, 2}
    everything = {next_token(logits, temperature=50.0, top_k=0, generator=generator) for _ in range(200)}
    assert everything == set(range(6))


def test_a_tiny_temperature_is_greedy_rather_than_nan():
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert next_token(logits, temperature=1e-30, top_k=0, generator=seeded(0)) == 1


# --- the command line -----------------------------------------------------------------------


@pytest.mark.slow
def test_the_command_prints_the_prompt_followed_by_generated_text(saved):
    run_dir = saved.parent.parent  # a run directory means its latest checkpoint
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pretrain.generate",
            "--checkpoint",
            str(run_dir),
            "--prompt",
            "Return the",
            "--max-tokens",
            "12",
            "--seed",
            "5",
            "--device",
            "cpu",
        ],
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout.removesuffix("\n")
    assert text.startswith("Return the") and len(text) > len("Return the")


def test_the_same_seed_prints_the_same_text(saved, capsys):
    argv = ["--checkpoint", str(saved), "--prompt", "x = ", "--max-tokens", "10", "--temperature", "1", "--seed", "9"]
    first, second = run_cli(argv, capsys), run_cli(argv, capsys)
    assert first.returncode == 0 and (first.stdout, first.stderr) == (second.stdout, second.stderr)


def test_an_empty_prompt_is_fine(saved, capsys):
    result = run_cli(["--checkpoint", str(saved), "--prompt", "", "--max-tokens", "5", "--seed", "1"], capsys)
    assert result.returncode == 0 and result.stderr == "" and result.stdout.endswith("\n")


REFUSAL = {"prefix": "generate: error: "}  # and nothing on stdout


@pytest.mark.parametrize(
    "option, value, fragment",
    [
        ("--max-tokens", "0", "--max-tokens must be at least 1"),
        ("--temperature", "-0.5", "--temperature must be 0"),
        ("--temperature", "nan", "--temperature must be 0"),
        ("--top-k", "-1", "--top-k must be 0"),
        ("--max-tokens", "ten", "invalid int value"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(saved, capsys, option, value, fragment):
    result = run_cli(["--checkpoint", str(saved), "--prompt", "a", option, value], capsys)
    assert_one_line_error(result, fragment, **REFUSAL)


def test_a_missing_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    result = run_cli(["--checkpoint", str(tmp_path / "nowhere"), "--prompt", "a"], capsys)
    assert_one_line_error(result, "no such directory", **REFUSAL)


def test_an_unfinished_save_is_refused(saved, tmp_path, capsys):
    unfinished = shutil.copytree(saved, tmp_path / "step_9.tmp")
    assert_one_line_error(run_cli(["--checkpoint", str(unfinished), "--prompt", "a"], capsys), "unfinished", **REFUSAL)


def test_a_checkpoint_without_its_weights_is_incomplete(saved, tmp_path, capsys):
    broken = shutil.copytree(saved, tmp_path / "step_1")
    (broken / "model.pt").unlink()
    assert_one_line_error(run_cli(["--checkpoint", str(broken), "--prompt", "a"], capsys), "incomplete", "model.pt", **REFUSAL)


def test_weights_that_do_not_fit_the_config_are_one_line(saved, tmp_path, capsys):
    edited = shutil.copytree(saved, tmp_path / "step_1")
    config = json.loads((edited / "config.json").read_text())
    config["model"]["n_layers"] = 3
    (edited / "config.json").write_text(json.dumps(config))
    result = run_cli(["--checkpoint", str(edited), "--prompt", "a"], capsys)
    assert_one_line_error(result, "do not fit", "6 missing (layers.2.", **REFUSAL)


def test_a_bpe_tokenizer_that_is_nowhere_to_be_found_says_how_to_get_it(saved, tmp_path, capsys):
    edited = shutil.copytree(saved, tmp_path / "step_1")
    config = json.loads((edited / "config.json").read_text())
    config["data"] |= {"tokenizer": "bpe", "cache_dir": str(tmp_path / "empty-cache")}
    (edited / "config.json").write_text(json.dumps(config))
    result = run_cli(["--checkpoint", str(edited), "--prompt", "a"], capsys)
    assert_one_line_error(result, "tokenizer (bpe", "prepare_dataset.py", **REFUSAL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_line(saved, capsys):
    result = run_cli(["--checkpoint", str(saved), "--prompt", "a", "--device", "cuda"], capsys)
    assert_one_line_error(result, "no CUDA GPU", "--device cpu", **REFUSAL)
