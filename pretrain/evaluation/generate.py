"""Sample text from a checkpoint (or an export: --checkpoint runs/<id>/export, or a Hugging Face Llama
or Mixtral directory; pretrain/hf/exported.py), with the tokenizer the model was trained with.

    python -m pretrain.generate --checkpoint runs/<id>/checkpoints/step_1000 --prompt "The module"
        [--max-tokens 100] [--temperature 0.8] [--top-k 50] [--seed N] [--device auto|cpu|cuda]

prints the prompt followed by the continuation. Temperature 0 is greedy (the most likely token
every time); otherwise each token is drawn from softmax(logits / temperature) over the top-k
tokens (top-k 0: all of them). Generation stops after max-tokens tokens or at end-of-text.
The same --seed gives the same text on the same machine; without it every run differs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

from pretrain import config as cfg
from pretrain.config import Config
from pretrain.data.tokenizer import Tokenizer
from pretrain.checkpoint.reading import (
    find_checkpoint,
    find_tokenizer_file,
    open_tokenizer,
    read_checkpoint,
)
from pretrain.evaluation.generate_args import parse_args
from pretrain.model.transformer import Transformer
from pretrain.run.refusal import Refusal
from pretrain.run.files import os_error_message


class GenerateError(Refusal):
    """A problem with the request (the device, the tokenizer) the user can fix; one line."""


# --- sampling ---------------------------------------------------------------------------------


def next_token(logits: Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> int:
    """Pick the next id from the last position's logits (vocab,), float32 on the CPU."""
    if temperature == 0:
        return int(logits.argmax())
    ids = None
    if 0 < top_k < logits.numel():
        logits, ids = torch.topk(logits, top_k)  # sorted, largest first
    # Subtracting the maximum first keeps a tiny temperature from overflowing to inf (then NaN).
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    choice = int(torch.multinomial(probs, 1, generator=generator))
    return int(ids[choice]) if ids is not None else choice


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float,
    top_k: int,
    eot_id: int,
    generator: torch.Generator | None = None,
    *,
    vocab_size: int | None = None,
) -> list[int]:
    """The ids the model continues prompt_ids with: max_tokens of them, fewer when it ends the
    text (the end-of-text id itself is not returned). An empty prompt starts a new text (from
    end-of-text). Only the last max_seq_len ids are shown to the model: a sliding window.
    vocab_size, when smaller than the model's, keeps ids the tokenizer cannot decode from being
    drawn (a model's vocabulary may be rounded up beyond its tokenizer's)."""
    if max_tokens < 1 or temperature < 0 or top_k < 0:
        raise ValueError(f"need max_tokens >= 1, temperature >= 0, top_k >= 0 (got {max_tokens}, {temperature}, {top_k})")
    device = next(model.parameters()).device
    ids = list(prompt_ids) or [eot_id]
    new: list[int] = []
    for _ in range(max_tokens):
        # No KV cache: every token runs the model over the whole window again. At the sizes this
        # is for (a look at samples during or after a run) that costs little, and it uses exactly
        # the forward pass that was trained.
        window = torch.tensor(ids[-model.max_seq_len :], dtype=torch.long, device=device)[None]  # (1, T)
        logits = model(window).out[0, -1, :vocab_size].float().cpu()  # the last position's (vocab,)
        token = next_token(logits, temperature, top_k, generator)
        if token == eot_id:
            break
        ids.append(token)
        new.append(token)
    return new


# --- loading ----------------------------------------------------------------------------------


def pick_device(name: str) -> torch.device:
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise GenerateError("--device cuda: no CUDA GPU is visible here; use --device cpu")
    return torch.device("cuda", 0)


def load_model(config: Config, state: dict[str, Tensor], device: torch.device) -> Transformer:
    """The model of config with state's weights on device, in eval mode."""
    with device:  # initialised where it will run: much faster on a GPU than on the CPU
        model = Transformer(config.model, max_seq_len=cfg.max_seq_len(config))
    model.load_state_dict(state)  # strict; read_checkpoint has already checked names and shapes
    return model.eval()


def check_vocabulary(tokenizer: Tokenizer, config: Config) -> None:
    """A tokenizer with more ids than the model embeds is not the one it was trained with."""
    if config.model.vocab_size is not None and tokenizer.vocab_size > config.model.vocab_size:
        raise GenerateError(
            f"the tokenizer found ({tokenizer.name}) has {tokenizer.vocab_size} ids but the model "
            f"embeds only {config.model.vocab_size}: it is not the tokenizer the model was trained "
            "with"
        )


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return [int(i) for i in tokenizer.encode_batch([text])[0]] if text else []


def make_generator(seed: int | None) -> torch.Generator:
    """Seeded: reproducible. Unseeded: from the OS (torch's default generator would start from the
    same fixed seed in every process, so every run would print the same text)."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


# --- command line -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> str:
    """The prompt and its continuation. The cheap checks come before the model is built."""
    device = pick_device(args.device)
    checkpoint_dir = find_checkpoint(args.checkpoint)
    config, state = read_checkpoint(checkpoint_dir)
    tokenizer = open_tokenizer(config, find_tokenizer_file(config, checkpoint_dir))
    check_vocabulary(tokenizer, config)
    model = load_model(config, state, device)
    del state  # the model holds its own copy
    amp = device.type == "cuda" and config.training.use_amp
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        new_ids = generate(
            model,
            encode(tokenizer, args.prompt),
            args.max_tokens,
            args.temperature,
            args.top_k,
            tokenizer.eot_id,
            make_generator(args.seed),
            vocab_size=tokenizer.vocab_size,
        )
    return args.prompt + tokenizer.decode(new_ids)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(parse_args(sys.argv[1:] if argv is None else argv))


def run_command(args: argparse.Namespace) -> int:
    """The command on arguments already read (parse_args): its output, or one error line and its exit code."""
    try:
        text = run(args)
    except Refusal as error:
        print(f"generate: error: {error}", file=sys.stderr)
        return error.exit_code
    except OSError as error:
        print(f"generate: error: {os_error_message(error)}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
