"""Benchmark: the time of Muon's orthogonalization (pretrain/optim/muon.py) of one update matrix.

Run from the repository root:

    PYTHONPATH=. python benchmarks/newton_schulz.py [--sizes 768x768,4096x4096] [--device cpu|cuda]
        [--dtype bfloat16] [--function newton_schulz|svd] [--steps 5] [--repeats N] [--warmup N]

The function is looked up by name in pretrain/registry.py ORTHOGONALIZERS, as training.muon_orthogonalize
does, and called as Muon calls it: (update, steps). Each size gets one random normal matrix of
--dtype (newton_schulz casts it to bfloat16 and computes in bfloat16 whatever it is given; svd
computes in float32 and ignores --steps). After --warmup calls, --repeats calls are timed one by
one: on CUDA between two CUDA events after a synchronize (so a call's time includes launching its
kernels, as in an optimizer step), on the CPU with time.perf_counter; the table gives the median
and the fastest.

TFLOP/s counts the matrix multiplications of newton_schulz only: it iterates on an (m, n) matrix
with m <= n (it transposes a tall one), and one iteration is gram = X X^T (2 m^2 n), gram @ gram
(2 m^3) and (b gram + c gram @ gram) @ X (2 m^2 n), so steps x (4 m^2 n + 2 m^3) in all (6 n^3 per
iteration for a square n x n; the norm and the elementwise terms are left out). It is n.a. for svd.
Progress goes to stderr; the machine line and the Markdown table to stdout. Bad input is one line
on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and Path(sys.path[0]).resolve() == REPO / "benchmarks":
    sys.path[0] = str(REPO)  # run as a script: import pretrain from the repository root

from pretrain.registry import ORTHOGONALIZERS  # noqa: E402  (imports no torch: bad input fails fast)

PROG = "newton_schulz.py"
SIZE = re.compile(r"^([1-9]\d*)x([1-9]\d*)$")
DTYPES = ("bfloat16", "float16", "float32")


class UsageError(Exception):
    """Bad input: one line, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise UsageError(f"{message}; see --help")


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """ "768x768,768x3072" -> [(768, 768), (768, 3072)]."""
    sizes = []
    for item in text.split(","):
        match = SIZE.match(item.strip().lower())
        if match is None:
            raise UsageError(f"--sizes: {item.strip()!r} is not ROWSxCOLS with positive whole numbers, e.g. 768x3072")
        sizes.append((int(match[1]), int(match[2])))
    return sizes


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", default="768x768,4096x4096", help="ROWSxCOLS[,ROWSxCOLS] (default 768x768,4096x4096)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is there, else cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="of the input matrix (default bfloat16)")
    parser.add_argument("--function", default="newton_schulz", help=f"in ORTHOGONALIZERS: {', '.join(ORTHOGONALIZERS)}")
    parser.add_argument("--steps", type=int, default=5, help="Newton-Schulz iterations (default 5, Muon's)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per size (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2; at least 1 is made)")
    args = parser.parse_args(argv)
    args.sizes = parse_sizes(args.sizes)
    if args.function not in ORTHOGONALIZERS:
        raise UsageError(f"--function: unknown {args.function!r}; choose from {', '.join(ORTHOGONALIZERS)}")
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name}: must be at least 1")
    if args.warmup < 0:
        raise UsageError("--warmup: must be 0 or more")  # 0 still makes one untimed call
    return args


def flops(rows: int, cols: int, steps: int) -> int:
    """The matmul FLOPs of newton_schulz's iterations on a rows x cols matrix (see the docstring)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def timer(device: Any) -> Callable[[Callable[[], object]], float]:
    """A function that calls fn once and returns its time in milliseconds, on this device."""
    import torch

    if device.type == "cuda":

        def on_gpu(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))

        return on_gpu

    def on_cpu(fn: Callable[[], object]) -> float:
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1000

    return on_cpu


def machine_line(device: Any) -> str:
    import torch

    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, torch {torch.__version__} (CUDA {torch.version.cuda})"
    else:
        where = f"{os.cpu_count()} CPUs ({torch.get_num_threads()} threads), {platform.platform()}, torch {torch.__version__}"
    return f"Machine: {where}"


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA GPU here; use --device cpu")
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    from pretrain import registry

    orthogonalize = registry.load(ORTHOGONALIZERS[args.function])
    dtype = getattr(torch, args.dtype)
    time_ms = timer(device)
    generator = torch.Generator(device=device).manual_seed(0)
    rows = []
    for m, n in args.sizes:
        about = f"{max(args.warmup, 1)} warm-up, {args.repeats} timed calls"
        print(f"{args.function} {m}x{n} on {device}: {about}", file=sys.stderr, flush=True)
        matrix = torch.randn(m, n, device=device, generator=generator).to(dtype)
        call = functools.partial(orthogonalize, matrix, args.steps)
        out = call()  # the first warm-up call; its result's dtype goes in the table
        for _ in range(args.warmup - 1):
            call()
        times = [time_ms(call) for _ in range(args.repeats)]
        median = statistics.median(times)
        rate = f"{flops(m, n, args.steps) / (median / 1000) / 1e12:.2f}" if args.function == "newton_schulz" else "n.a."
        rows.append((f"{m}x{n}", f"{args.dtype} -> {str(out.dtype).removeprefix('torch.')}", median, min(times), rate))
    print(machine_line(device))
    print(
        f"Function: {args.function} ({ORTHOGONALIZERS[args.function]}), steps {args.steps}"
        + (" (unused)" if args.function == "svd" else "")
        + f"; {args.repeats} timed calls after {max(args.warmup, 1)} warm-up calls"
    )
    print()
    print("| size | dtype (in -> out) | device | median ms | min ms | TFLOP/s (median) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for size, dtype_text, median, fastest, rate in rows:
        print(f"| {size} | {dtype_text} | {device.type} | {median:.3f} | {fastest:.3f} | {rate} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
