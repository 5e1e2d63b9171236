"""The forward-pass counters of benchmarks/efficiency.py: what one forward pass keeps for the
backward pass (bytes per token, by dtype, weights left out), how many matmul kernels one block runs,
and which ops run outside every compiled region. benchmarks/efficiency_counters.py counts the step."""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


# --- what the forward keeps for the backward pass ---------------------------------------------------


def saved_bytes(forward: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """forward()'s result, and the bytes autograd kept for the backward pass while it ran, by dtype
    name ("bfloat16", "float32", ...): every tensor a pack hook (saved_tensors_hooks) is handed, each
    storage counted once (a tensor that several ops save, or views of one buffer, once). A compiled
    region's saves are what AOTAutograd's partitioner chose (its CompiledFunction saves them
    through the same hooks). Weights (and autocast's bf16 copies of them) are counted too:
    activation_bytes_per_token takes them out."""
    storages: dict[int, tuple[str, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        dtype = str(tensor.dtype).removeprefix("torch.")
        try:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr() or id(tensor)] = (dtype, storage.nbytes())
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
            storages[id(tensor)] = (dtype, tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = forward()
    by_dtype: Counter[str] = Counter()
    for dtype, nbytes in storages.values():
        by_dtype[dtype] += nbytes
    return result, dict(by_dtype)


def activation_bytes_per_token(
    forward_at: Callable[[int], Any],
    tokens_per_row: int,
    rows: tuple[int, int] = (2, 3),
    then: Callable[[Any], Any] = lambda result: None,
) -> dict[str, float]:
    """What one token's forward keeps for the backward pass, by dtype name, weights excluded:
    saved_bytes of forward_at(rows) (a micro-batch of that many rows of tokens_per_row tokens;
    then(its result) runs after, outside the count: a backward pass, say) at two batch sizes, the
    difference over the tokens added. Weights, their casts and tables sized by the context (the
    rotary ones) are the same at both sizes and cancel; whatever grows with the tokens is an
    activation."""
    counts: list[dict[str, int]] = []
    for n in rows:
        result, counted = saved_bytes(functools.partial(forward_at, n))
        then(result)
        del result
        counts.append(counted)
    low, high = counts
    tokens = (rows[1] - rows[0]) * tokens_per_row
    return {dtype: (high.get(dtype, 0) - low.get(dtype, 0)) / tokens for dtype in sorted(set(low) | set(high))}


MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)
"""What matmuls_in counts: the matmul kernels (a Linear on a 3-D input runs as one mm)."""


class MatmulCounter(TorchDispatchMode):
    """The matmul kernels (MATMULS, and grouped ones) run while active and `counting` is true."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.counting = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting and (func in MATMULS or func.__name__.startswith("_grouped_mm")):
            self.count += 1
        return func(*args, **(kwargs or {}))


def matmuls_in(module: torch.nn.Module, run: Callable[[], Any]) -> int:
    """The matmul kernels module's forward runs (once) while run() runs, whatever else runs around it."""
    counter = MatmulCounter()

    def start(*_: Any) -> None:
        counter.counting = True

    def stop(*_: Any) -> None:
        counter.counting = False

    hooks = [module.register_forward_pre_hook(start), module.register_forward_hook(stop)]
    try:
        with counter, torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return counter.count


# --- what runs outside the compiled regions ---------------------------------------------------

NO_WORK = {
    "as_strided", "view", "_unsafe_view", "_reshape_alias", "alias", "detach", "lift_fresh", "to", "contiguous",
    "expand", "t", "transpose", "permute", "slice", "select", "squeeze", "unsqueeze", "flatten", "unflatten",
    "reshape", "narrow", "view_as", "unbind", "split", "chunk", "resolve_conj", "resolve_neg",
}  # fmt: skip
"""aten ops that, when nothing below them runs, only make a view or return their input: no kernel."""


def uncompiled_ops(run: Callable[[], Any]) -> Counter[str]:
    """The aten ops run() runs outside every compiled region that do work (launch a kernel on a
    GPU), as "op in file function" (the innermost project function; "op in torch.distributed" for
    DDP's and FSDP2's own hooks) -> count. From torch.profiler's CPU events: an op counts when no
    ancestor of it is an op or a compiled region (dynamo's "Torch-Compiled Region", AOTAutograd's
    CompiledFunction) and it or an op below it is not in NO_WORK."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        run()
    found: Counter[str] = Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        above = list(_ancestors(event))
        if any(a.name.startswith("aten::") or "Compiled" in a.name for a in above):
            continue
        if not _does_work(event):
            continue
        frames = [a.name for a in above]  # python frames read "path/file.py(first line): function"
        if any("torch/distributed/" in frame for frame in frames):
            site = "in torch.distributed"
        else:
            project = next((f for f in frames if re.match(r"(.*/)?pretrain/", f)), None)
            if project is None:  # no Python frame above it (FSDP2's copies from autograd's C++ hooks)
                site = "outside project code"
            else:
                site = "in " + re.sub(r"\(\d+\): ", " ", re.sub(r"^(.*/)?pretrain/", "", project))
        found[f"{event.name.removeprefix('aten::')} {site}"] += 1
    return found


def _ancestors(event: Any) -> Iterator[Any]:
    while event.cpu_parent is not None:
        event = event.cpu_parent
        yield event


def _does_work(event: Any) -> bool:
    ops = [child for child in event.cpu_children if child.name.startswith("aten::")]
    if not ops:
        return event.name.removeprefix("aten::") not in NO_WORK
    return any(_does_work(child) for child in ops)
