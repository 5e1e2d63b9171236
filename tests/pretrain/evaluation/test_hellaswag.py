"""HellaSwag: reading the public .jsonl format (pretrain/evaluation/hellaswag.py) and scoring the endings by
likelihood (pretrain/evaluation/choices.py), checked against answers worked out by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support.processes import one_line_error
from pretrain import config as cfg
from pretrain.evaluation.choices import TokenLosses, pack, score, shares
from pretrain.data.tokenizer import ByteTokenizer
from pretrain.evaluation.hellaswag import (
    Encoded,
    Example,
    HellaSwagError,
    Tally,
    choose,
    encode,
    load,
    longest_row,
    parse_hub_path,
)
from pretrain.model.transformer import ModelOutput, Transformer, project_logits
from support.hub import hub_cache  # noqa: F401 (a fixture)

LN2 = math.log(2)


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def record(ctx: str, endings: list[str], label: object) -> dict[str, object]:
    return {"ind": 0, "activity_label": "Roof shingle removal", "ctx": ctx, "endings": endings, "label": label, "split": "val"}


# --- a model whose every token's probability is known ---------------------------------------------


class Unigram(nn.Module):
    """A "language model" that ignores its input: at every position the next byte is "a" with
    probability 1/2, "b" 1/4, " " 1/8, and each of the other 254 ids (end-of-text included)
    1/2032, so these 1/8 sum to 1/8. A token's loss, in units of ln 2: "a" 1, "b" 2, " " 3."""

    def __init__(self) -> None:
        super().__init__()
        probs = torch.full((257,), 1 / 2032, dtype=torch.float64)
        probs[ord("a")], probs[ord("b")], probs[ord(" ")] = 1 / 2, 1 / 4, 1 / 8
        assert abs(float(probs.sum()) - 1) < 1e-12
        self.output = nn.Linear(1, 257, bias=False)
        self.output.weight.data = probs.log().float()[:, None]  # logits = log p

    def forward(self, tokens, head=project_logits) -> ModelOutput:
        hidden = torch.ones(*tokens.shape, 1)  # output(hidden) = log p at every position
        return ModelOutput(head(hidden, nn.Identity(), self.output), {})  # no final norm


# Every ending is read after a space, which is its first scored token (3 ln 2). By hand:
#   example 1, right ending 1:  " a" 4 (mean 4/2 = 2.0) | " aaaa" 7 (7/5 = 1.4) | " b" 5 (2.5) | " bb" 7 (2.33)
#       summed loss picks 0 (wrong), mean loss picks 1 (right)
#   example 2, right ending 1:  " b" 5 (2.5) | " a" 4 (2.0) | " bbbb" 11 (2.2) | " bb" 7 (2.33)
#       both pick 1 (right)
#   example 3, right ending 2:  " bbb" 9 (2.25) | " b" 5 (2.5) | " a" 4 (2.0) | " bb" 7 (2.33)
#       both pick 2 (right)
# So accuracy 2/3 and normalized accuracy 3/3.
HAND_EXAMPLES = [
    record("A man is sitting on a roof. he", ["a", "aaaa", "b", "bb"], 1),
    record("Then, the man", ["b", "a", "bbbb", "bb"], "1"),  # the Hub's copies spell labels as text
    record("qqq", ["bbb", "b", "a", "bb"], 2),
]
HAND_SUMS = [[4, 7, 5, 7], [5, 4, 11, 7], [9, 5, 4, 7]]  # in units of ln 2


def test_the_summed_losses_of_every_ending_match_those_worked_out_by_hand(tmp_path):
    examples = load(str(write_jsonl(tmp_path / "val.jsonl", HAND_EXAMPLES)))
    encoded = encode(examples, ByteTokenizer(), window=64)
    tokens, scored = pack(encoded, longest_row(encoded))
    with torch.no_grad():
        losses = Unigram()(tokens, head=TokenLosses(tokens)).out
    sums = (losses * scored).sum(dim=1) / LN2
    assert sums.tolist() == pytest.approx([s for row in HAND_SUMS for s in row], abs=1e-4)
    assert scored.sum(dim=1).tolist() == [1 + len(e) for example in examples for e in example.endings]


def test_scoring_the_three_example_file_gives_the_hand_computed_accuracies(tmp_path):
    examples = load(str(write_jsonl(tmp_path / "val.jsonl", HAND_EXAMPLES)))
    encoded = encode(examples, ByteTokenizer(), 64)
    tally = score(Unigram(), encoded, torch.device("cpu"), length=longest_row(encoded), batch_examples=2)
    assert tally == Tally(examples=3, correct=2, correct_norm=3)
    assert (tally.accuracy, tally.accuracy_norm) == (pytest.approx(2 / 3), 1.0)


def test_choose_picks_the_lowest_sum_and_the_lowest_mean_and_the_first_of_equals():
    assert choose([4.0, 7.0, 5.0, 7.0], [2, 5, 2, 3]) == (0, 1)
    assert choose([3.0, 3.0, 3.0, 3.0], [1, 1, 1, 1]) == (0, 0)


# --- the real model: batched and padded, as one row at a time ---------------------------------------


@pytest.fixture(scope="module")
def tiny_model() -> Transformer:
    config = cfg.resolve(preset="debug", sets=["model.vocab_size=257", "data.context_length=48"])
    return Transformer(config.model, max_seq_len=48, seed=3).eval()


def random_examples(count: int, seed: int) -> list[Example]:
    generator = torch.Generator().manual_seed(seed)

    def text(low: int, high: int) -> str:
        length = int(torch.randint(low, high, (), generator=generator))
        return "".join(chr(int(c)) for c in torch.randint(97, 123, (length,), generator=generator))

    return [Example(text(3, 30), tuple(text(1, 12) for _ in range(4)), n % 4) for n in range(count)]


def one_row_at_a_time(model: Transformer, example: Encoded) -> tuple[list[float], list[int]]:
    """Each ending's summed loss and token count, its row run alone, unpadded, through the logits."""
    sums, counts = [], []
    with torch.no_grad():
        for row, start in zip(example.rows, example.starts, strict=True):
            tokens = torch.tensor([row])
            logits = model(tokens).out[0, :-1].float()  # position p predicts token p + 1
            losses = F.cross_entropy(logits, tokens[0, 1:], reduction="none")
            sums.append(float(losses[start - 1 :].sum()))
            counts.append(len(row) - start)
    return sums, counts


def test_batched_padded_scoring_gives_the_answers_of_each_row_run_alone(tiny_model):
    encoded = encode(random_examples(7, seed=1), ByteTokenizer(), window=48)
    expected = Tally()
    for example in encoded:
        by_sum, by_mean = choose(*one_row_at_a_time(tiny_model, example))
        expected += Tally(1, int(by_sum == example.label), int(by_mean == example.label))
    assert 0 < expected.correct + expected.correct_norm < 14  # the labels are arbitrary: some right, some wrong
    batched = score(tiny_model, encoded, torch.device("cpu"), batch_examples=3, length=48)
    assert batched == expected


def test_a_mixture_of_experts_scores_the_same_batched_and_padded_as_row_by_row():
    """In eval mode no expert drops a token, so padding and other rows change nothing."""
    config = cfg.resolve(
        preset="debug", sets=["model.vocab_size=257", "model.moe.num_experts=4", "model.moe.capacity_factor=0.5"]
    )
    model = Transformer(config.model, max_seq_len=48, seed=5).eval()
    encoded = encode(random_examples(6, seed=6), ByteTokenizer(), window=48)
    expected = Tally()
    for example in encoded:
        by_sum, by_mean = choose(*one_row_at_a_time(model, example))
        expected += Tally(1, int(by_sum == example.label), int(by_mean == example.label))
    assert score(model, encoded, torch.device("cpu"), batch_examples=3, length=48) == expected


def test_the_ranks_shares_score_every_example_once_however_they_divide(tiny_model):
    encoded = encode(random_examples(5, seed=2), ByteTokenizer(), window=48)
    whole = score(tiny_model, encoded, torch.device("cpu"), length=40)
    parts = [score(tiny_model, encoded, torch.device("cpu"), rank=r, world_size=3, batch_examples=1, length=40) for r in range(3)]
    assert sum(parts, Tally()) == whole and whole.examples == 5


def test_every_rank_gets_as_many_batches_and_padding_is_marked():
    assert list(shares(5, 0, 2, 2)) == [[0, 2], [4, None]]
    assert list(shares(5, 1, 2, 2)) == [[1, 3], [None, None]]
    assert list(shares(3, 2, 4, 8)) == [[2, None, None, None, None, None, None, None]]
    assert list(shares(3, 3, 4, 8)) == [[None] * 8]


def test_scoring_leaves_a_training_model_in_training_mode(tiny_model):
    tiny_model.train()
    try:
        score(tiny_model, encode(random_examples(1, 4), ByteTokenizer(), 48), torch.device("cpu"), length=48)
        assert tiny_model.training
    finally:
        tiny_model.eval()


def test_a_row_longer_than_the_window_keeps_its_ending_and_the_end_of_its_context():
    [example] = encode([Example("x" * 100, ("ab", "c", "de", "fgh"), 0)], ByteTokenizer(), window=10)
    assert all(len(row) == 10 for row in example.rows[:1]) and max(map(len, example.rows)) <= 10
    for row, start, ending in zip(example.rows, example.starts, ("ab", "c", "de", "fgh"), strict=True):
        assert bytes(row[start:]).decode() == " " + ending and set(bytes(row[:start]).decode()) == {"x"}
    [long_ending] = encode([Example("ctx", ("y" * 20, "a", "b", "c"), 0)], ByteTokenizer(), window=8)
    assert long_ending.rows[0] == tuple(b"y" * 8) and long_ending.starts[0] == 1  # what fits of it is scored


# --- reading ---------------------------------------------------------------------------------------


def test_the_public_format_is_read_with_its_extra_fields_blank_lines_and_text_labels(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text(json.dumps(HAND_EXAMPLES[0]) + "\n\n" + json.dumps(HAND_EXAMPLES[1]) + "\n")
    assert load(str(path)) == [
        Example("A man is sitting on a roof. he", ("a", "aaaa", "b", "bb"), 1),
        Example("Then, the man", ("b", "a", "bbbb", "bb"), 1),
    ]
    assert len(load(str(path), limit=1)) == 1


@pytest.mark.parametrize(
    ("line", "fragments"),
    [
        ('{"ctx": "a", "label": 0}', ["line 2", "has no endings", "ctx (the text), endings (4 texts) and label"]),
        ('{"ctx": "a", "endings": ["b", "c", "d", "e"]}', ["line 2", "has no label", "test split has no labels"]),
        ('{"context": "a", "endings": [], "answer": 0}', ["line 2 has no ctx, label;"]),
        ('{"ctx": "a", "endings": ["b", "c", "d"], "label": 0}', ["line 2", "endings must be a list of 4 texts"]),
        ('{"ctx": "a", "endings": ["b", "c", "d", 5], "label": 0}', ["endings must be a list of 4 texts"]),
        ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 4}', ["label must be an ending's index, 0 to 3 (got 4)"]),
        ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": "two"}', ["label must be", '(got "two")']),
        ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": true}', ["label must be"]),
        ('{"ctx": "", "endings": ["b", "c", "d", "e"], "label": 0}', ["ctx must be a non-empty text"]),
        ('{"ctx": "a", "endings": ', ["line 2 is not JSON"]),
        ('["a", "b"]', ["line 2 is not a JSON object"]),
    ],
)
def test_a_file_with_the_wrong_fields_is_a_one_line_error_naming_the_line(tmp_path, line, fragments):
    path = tmp_path / "val.jsonl"
    path.write_text(json.dumps(HAND_EXAMPLES[0]) + "\n" + line + "\n")
    with pytest.raises(HellaSwagError) as error:
        load(str(path))
    message = one_line_error(error)
    assert message.startswith(str(path))
    for fragment in fragments:
        assert fragment in message


def test_an_empty_missing_or_binary_file_is_a_one_line_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    for name, fragment in [("empty.jsonl", "holds no examples"), ("absent.jsonl", "no such file"), ("binary.jsonl", "not UTF-8")]:
        with pytest.raises(HellaSwagError) as error:
            load(str(tmp_path / name))
        assert fragment in one_line_error(error)


# --- the Hugging Face Hub --------------------------------------------------------------------------


def test_a_hub_file_is_read_from_the_hub_cache_offline(hub_cache):
    hub_cache("someone/hellaswag", {"data/val.jsonl": "".join(json.dumps(r) + "\n" for r in HAND_EXAMPLES)})
    assert len(load("hf://datasets/someone/hellaswag/data/val.jsonl")) == 3
    assert len(load("hf://datasets/someone/hellaswag@main/data/val.jsonl", limit=2)) == 2


def test_a_hub_file_missing_from_the_cache_offline_says_how_to_get_it(hub_cache):
    with pytest.raises(HellaSwagError) as error:
        load("hf://datasets/someone/absent/val.jsonl")
    message = one_line_error(error)
    assert "not in the Hugging Face cache" in message and "hf download someone/absent" in message


def test_a_hub_dataset_without_the_file_named_says_so(hub_cache):
    hub_cache("someone/hellaswag", {"data/val.jsonl": json.dumps(HAND_EXAMPLES[0]) + "\n"})
    with pytest.raises(HellaSwagError) as error:
        load("hf://datasets/someone/hellaswag/data/test.jsonl")
    assert one_line_error(error).startswith("dataset someone/hellaswag@main")


def test_hub_paths_name_a_repository_an_optional_revision_and_a_file():
    assert parse_hub_path("hf://datasets/a/b/x/val.jsonl") == ("a/b", "main", "x/val.jsonl")
    assert parse_hub_path("hf://datasets/a/b@v1.0/val.jsonl") == ("a/b", "v1.0", "val.jsonl")
    for bad in ("hf://datasets/a/val.jsonl", "hf://datasets/a/b", "hf://datasets/a/b@/f.jsonl"):
        with pytest.raises(HellaSwagError) as error:
            parse_hub_path(bad)
        assert "hf://datasets/OWNER/NAME[@REVISION]/PATH.jsonl" in one_line_error(error)
