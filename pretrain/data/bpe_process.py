"""Training the BPE tokenizer in a child process, so that a stop signal ends it at once.

The `tokenizers` library trains in Rust and does not come back to Python until it is done, and
Python runs a signal handler only between two bytecodes of its main thread: Ctrl-C or SIGTERM
during a training was acted on when the training ended (6 s on a 20 MB corpus, hours on a large
one), and a second one changed nothing. Here the texts still come from this process (the
source, its formats and registered extensions, are read where they always were) and go to a
child through a pipe, length-prefixed so that each text reaches the trainer as it was; the
child trains and writes tokenizer.json. This process only ever waits in a system call that a
signal interrupts (a write to the pipe, waiting for the child), so its handler runs at once; on
the way out (KeyboardInterrupt, SystemExit, any error) the child is SIGKILLed and reaped
(child_process.py, shared with the Hub's downloads), and the caller removes the half-built
directory (pretrain/data/prepare.py).

Standard library only in this process: the launcher prepares data and must start fast.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pretrain.data import DataError, first_line
from pretrain.data.child_process import child_args, child_code, ended_on_the_way_out, how_it_failed, start_child

FRAME_HEADER = 8
"""Bytes of the little-endian length that precedes each text on the pipe."""
EXIT_CANNOT_WRITE = 3
"""The child's exit code when tokenizer.json cannot be written (its stderr says why)."""
_CHILD = child_code("pretrain.data.bpe_process")


def train_in_child(texts: Iterator[str], vocab_size: int, end_of_text: str, destination: Path) -> None:
    """Train a byte-level BPE of vocab_size (end_of_text its one special token) on texts in a
    child process; write its tokenizer.json to destination. DataError when the child fails (with
    its last line); a stop signal while it trains is acted on here at once."""
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: a chatty child never blocks on it
        child = start_child(
            _CHILD,
            [str(vocab_size), end_of_text, str(destination)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=errors,
        )
        with ended_on_the_way_out(child):  # stopped (a signal, an error reading the source): killed now
            assert child.stdin is not None
            _send(texts, child.stdin)
            returncode = child.wait()
        errors.seek(0)
        said = errors.read().decode("utf-8", errors="replace").strip().splitlines()
    if returncode == 0:
        return
    how = how_it_failed(returncode)  # a stop signal that ended the child is this process's too: raised here
    if returncode == EXIT_CANNOT_WRITE:
        raise DataError(f"cannot write {destination}: {said[-1] if said else 'unknown error'}")
    detail = f": {said[-1]}" if said else ("; out of memory?" if returncode == -signal.SIGKILL else "")
    raise DataError(f"training the BPE tokenizer {how}{detail}")


def _send(texts: Iterator[str], pipe: IO[bytes]) -> None:
    """Each text as its length and its UTF-8 bytes, then end of file. A child that ended early
    (an error) closes the pipe: the rest is not sent, and its exit code tells why."""
    try:
        for text in texts:
            data = text.encode("utf-8")
            pipe.write(len(data).to_bytes(FRAME_HEADER, "little"))
            pipe.write(data)
        pipe.close()
    except BrokenPipeError:
        pass


# --- the child --------------------------------------------------------------------------------


def child_main() -> None:
    """The child: argv vocab_size, end-of-text token, destination (then the parent's pid); texts on stdin
    (see _send)."""
    # The parent decides what a stop signal means, and kills this process: a Ctrl-C that the
    # terminal sends here too ends it quietly (no KeyboardInterrupt traceback). SIGTERM and
    # SIGHUP are already as exec left them: fatal, or ignored as the parent's were (nohup).
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    vocab_size, end_of_text, destination = child_args()
    tokenizer = _train(_received(sys.stdin.buffer), int(vocab_size), end_of_text)
    try:
        tokenizer.save(destination)
    except Exception as error:  # a plain Exception: "No space left on device (os error 28)"
        print(first_line(error), file=sys.stderr)
        sys.exit(EXIT_CANNOT_WRITE)


def _received(pipe: IO[bytes]) -> Iterator[str]:
    while header := pipe.read(FRAME_HEADER):
        yield pipe.read(int.from_bytes(header, "little")).decode("utf-8")


def _train(texts: Iterator[str], vocab_size: int, end_of_text: str) -> Any:  # a tokenizers.Tokenizer
    """Byte-level BPE (GPT-2 style pre-tokenization, no unknown tokens). Streams: the trainer
    keeps word counts, not text."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[end_of_text],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
