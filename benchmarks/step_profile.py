"""Where a training step's time goes: a few steps under torch.profiler, their device time binned by kind.

profile_steps() runs N steps (after the caller's warm-up) inside one profiled window that starts
and ends with a device synchronization, and split() bins what ran by kind:

- matmuls: cuBLAS/CUTLASS GEMMs (gemm, xmma, nvjet, cutlass), inductor's matmul templates, aten::mm/addmm/bmm
- attention: fused attention (PyTorch's flash, the memory-efficient cutlass fmha, cuDNN's SDPA
  kernels such as cudnn_generated_fort_native_sdpa_sm90_flash_*) and a math path's softmax
- cross-entropy: log-softmax and NLL kernels (the compiled loss head's fused ones carry those names)
- optimizer: fused/foreach AdamW (multi_tensor_apply), gradient clipping's norms, and everything
  launched inside an optimizer's step (Muon's Newton-Schulz matmuls included)
- communication: NCCL and gloo
- other compiled: inductor's other Triton kernels (norms, rotary, SwiGLU, casts)
- other: what is left (eager elementwise kernels, copies, memsets)
- idle: the window's wall time that no kernel covers (the GPU waiting on the host)

On CUDA the events are the GPU kernels (and copies); on CPU, each CPU op's own time (its
interval less its children's), so the same table says where a CPU step's time goes and the
whole path runs without a GPU. Where events overlap (kernels on two streams: communication
beside compute), each instant is shared equally among the events running then, so the kinds
and idle add up to the window exactly and the shares to 100%; the overlap is reported apart.

split() and kind_of() are pure functions of (name, start, duration, scope) events, tested with
synthetic kernel names (tests/benchmarks/test_step_profile.py)."""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

KINDS = ("matmuls", "attention", "cross-entropy", "optimizer", "communication", "other compiled", "other", "idle")
"""The table's rows, in order."""
WINDOW = "step_profile: profiled steps"
"""The record_function range around the profiled steps: its interval is the window."""
OPTIMIZER_SCOPE = "Optimizer.step#"
"""torch.optim.Optimizer's own profiler range around step() (every optimizer subclass has it)."""
TOP = 3
"""Names listed per kind, the longest first."""
NAME_CHARS = 120
"""Names are cut here (cuBLAS's and cuDNN's run to about 110 characters without their templates)."""

_COMMUNICATION = ("nccl", "gloo", "c10d::", "all_reduce", "allreduce", "reduce_scatter", "all_gather", "allgather")
_CROSS_ENTROPY = ("log_softmax", "logsoftmax", "nll_loss", "nllloss", "cross_entropy", "crossentropy", "logsumexp")
_CROSS_ENTROPY_BACKWARD = re.compile(r"arange.*_eq_exp")
"""pretrain/model/loss.py's compiled head: its forward kernel's name has logsumexp, its backward's
(softmax minus the one-hot, the one-hot as column index == target) arange, eq and exp, e.g.
cpp/triton_poi_fused__to_copy_arange_div_eq_exp_mul_sub_unsqueeze_0 (read off inductor's output
code for the head on CPU, torch 2.13)."""
_ATTENTION = ("flash", "fmha", "sdpa", "attention", "scaled_dot_product")
_OPTIMIZER = ("adam", "multi_tensor_apply", "_foreach_", "newton_schulz", "zeropower", "muon")
_MATMUL = re.compile(r"gemm|xmma|cublas|cutlass|nvjet|splitkreduce|triton_tem_|aten::(?:mm|addmm|bmm|matmul|linear|baddbmm)\b")


@dataclass(frozen=True)
class Event:
    """One thing that ran: a GPU kernel, or a slice of a CPU op's own time."""

    name: str
    start_us: float
    duration_us: float
    scope: tuple[str, ...] = ()
    """The CPU ranges it ran under (for a kernel: those of the op that launched it), innermost first."""


def name_kind(name: str) -> str | None:
    """The kind a name alone says, or None (names are matched lowercase, most specific kind first)."""
    low = name.lower()
    if any(word in low for word in _COMMUNICATION):
        return "communication"
    if any(word in low for word in _CROSS_ENTROPY) or _CROSS_ENTROPY_BACKWARD.search(low):
        return "cross-entropy"
    # Attention before matmuls: cutlass's fmha kernels are attention; a bare softmax (not log-softmax)
    # in a transformer step is attention's math path.
    if any(word in low for word in _ATTENTION) or "softmax" in low:
        return "attention"
    if any(word in low for word in _OPTIMIZER):
        return "optimizer"
    if _MATMUL.search(low):
        return "matmuls"
    if low.startswith("triton_") or "triton" in low:
        return "other compiled"
    return None


def kind_of(name: str, scope: Sequence[str] = ()) -> str:
    """An event's kind: communication by its name; anything under an optimizer's step is the
    optimizer's; else its own name's kind, else that of the innermost range around it with one
    (a CPU op's bookkeeping under aten::addmm is the matmul's), else other."""
    own = name_kind(name)
    if own == "communication":
        return own
    if any(s.startswith(OPTIMIZER_SCOPE) for s in scope):
        return "optimizer"
    if own is not None:
        return own
    for outer in scope:
        if outer == WINDOW:
            break
        if (found := name_kind(outer)) is not None and found != "communication":
            return found
    return "other"


@dataclass
class Split:
    """A window of steps, its time by kind: per step, in milliseconds."""

    steps: int
    step_ms: float
    """The window's wall time per step."""
    ms: dict[str, float]
    """Per kind (every one of KINDS, idle included); they add up to step_ms."""
    overlap_ms: float = 0.0
    """Per step: time where two or more events ran at once (counted once in ms, shared among them)."""
    top: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    """Per kind: its longest names (short_name) with their ms per step (overlap not shared out)."""
    device: str = ""

    @property
    def shares(self) -> dict[str, float]:
        """Per kind, percent of the step (they add up to 100)."""
        return {kind: 100 * ms / self.step_ms if self.step_ms > 0 else 0.0 for kind, ms in self.ms.items()}

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "step_ms": self.step_ms,
            "ms": self.ms,
            "shares": self.shares,
            "overlap_ms": self.overlap_ms,
            "top": {kind: [[name, ms] for name, ms in names] for kind, names in self.top.items()},
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Split:
        top = {kind: [(str(n), float(ms)) for n, ms in names] for kind, names in data.get("top", {}).items()}
        return cls(data["steps"], data["step_ms"], dict(data["ms"]), data.get("overlap_ms", 0.0), top, data.get("device", ""))


def split(events: Iterable[Event], window: tuple[float, float], steps: int, kind: Callable[..., str] = kind_of) -> Split:
    """Bin events clipped to window (start, end in microseconds) by kind, per step. A sweep over the
    events' start and end points: each stretch between two of them goes, in equal parts, to the
    events running through it, or to idle when none is."""
    begin, end = window
    clipped = []
    for e in events:
        a, b = max(e.start_us, begin), min(e.start_us + e.duration_us, end)
        if b > a:
            clipped.append((a, b, kind(e.name, e.scope), short_name(e.name)))
    total: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    by_name: dict[tuple[str, str], float] = {}
    points = sorted({begin, end, *(a for a, _, _, _ in clipped), *(b for _, b, _, _ in clipped)})
    clipped.sort()
    running: list[tuple[float, int]] = []  # (end, index) of the events under way: a heap by end
    overlap, nxt = 0.0, 0
    for left, right in zip(points, points[1:], strict=False):
        while nxt < len(clipped) and clipped[nxt][0] <= left:
            heapq.heappush(running, (clipped[nxt][1], nxt))
            nxt += 1
        while running and running[0][0] <= left:
            heapq.heappop(running)
        width = right - left
        if not running:
            total["idle"] += width
            continue
        if len(running) > 1:
            overlap += width
        for _, index in running:
            total[clipped[index][2]] += width / len(running)
    for a, b, k, name in clipped:
        by_name[(k, name)] = by_name.get((k, name), 0.0) + (b - a)
    per = 1000.0 * max(steps, 1)  # microseconds in a window -> milliseconds per step
    top: dict[str, list[tuple[str, float]]] = {}
    for (k, name), us in sorted(by_name.items(), key=lambda item: -item[1]):
        if len(top.setdefault(k, [])) < TOP:
            top[k].append((name, us / per))
    return Split(steps, (end - begin) / per, {k: v / per for k, v in total.items()}, overlap / per, top)


def short_name(name: str) -> str:
    """'void pytorch_flash::flash_fwd_kernel<Traits<...>>(Params)' -> 'pytorch_flash::flash_fwd_kernel'."""
    text = re.sub(r"^void\s+", "", name.strip()).replace("(anonymous namespace)::", "")
    return (re.split(r"[<(]", text, maxsplit=1)[0].strip() or text)[:NAME_CHARS]


# --- reading a torch.profiler trace -----------------------------------------------------------------


def scope_of(event: Any) -> tuple[str, ...]:
    """The names of event and its CPU parents, innermost first."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return tuple(names)


def trace_events(profiler_events: Sequence[Any], device_type: str) -> tuple[list[Event], tuple[float, float]]:
    """The events to bin from a torch.profiler EventList, and the window (the WINDOW range's interval).

    cuda: the device's kernels, copies and memsets, each scoped by the CPU op that launched it
    (found by its correlation id). cpu: each CPU op's own intervals, its children's cut out."""
    import torch

    ranges = [e for e in profiler_events if e.name == WINDOW]
    if not ranges:
        raise ValueError(f"no {WINDOW!r} range in the trace")
    window = (ranges[0].time_range.start, ranges[0].time_range.end)
    cpu = torch.autograd.DeviceType.CPU
    if device_type == "cuda":
        launchers = {e.id: e for e in profiler_events if e.device_type == cpu and getattr(e, "linked_correlation_id", 0) == 0}
        events = []
        for e in profiler_events:
            # Not the GPU's copies of record_function ranges (the window's, Optimizer.step's): they
            # span kernels and the gaps between them, which would then bin as "other", not idle.
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation and e.name != WINDOW:
                op = launchers.get(getattr(e, "linked_correlation_id", 0))
                events.append(Event(e.name, e.time_range.start, e.time_range.elapsed_us(), scope_of(op)))
        return events, window
    events = []
    for e in profiler_events:
        if e.device_type != cpu or e.is_async or e.name == WINDOW:
            continue
        start, end = e.time_range.start, e.time_range.end
        children = sorted((c.time_range.start, c.time_range.end) for c in e.cpu_children)
        parents = scope_of(e.cpu_parent)
        for child_start, child_end in children:  # the op's own time: the gaps between its children
            if child_start > start:
                events.append(Event(e.name, start, child_start - start, parents))
            start = max(start, child_end)
        if end > start:
            events.append(Event(e.name, start, end - start, parents))
    return events, window


def profile_steps(run_step: Callable[[int], Any], steps: Sequence[int], device: Any) -> Split:
    """Run run_step(step) for each of steps under torch.profiler (CPU ops, and CUDA kernels on a
    GPU) inside one WINDOW range that starts and ends synchronized, and split its time."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as profiler:
        with record_function(WINDOW):
            for step in steps:
                run_step(step)
            if cuda:
                torch.cuda.synchronize(device)
    events, window = trace_events(profiler.events(), device.type)
    result = split(events, window, len(steps))
    result.device = "cuda" if cuda else "cpu"
    return result


# --- the table --------------------------------------------------------------------------------------


def table_rows(result: Split) -> list[list[str]]:
    """Rows of kind, ms per step, share, longest names (the Markdown table of format_table)."""
    shares = result.shares
    return [
        [
            kind,
            f"{result.ms[kind]:.2f}",
            f"{shares[kind]:.1f}%",
            ", ".join(f"{name} {ms:.2f}" for name, ms in result.top.get(kind, [])),
        ]
        for kind in KINDS
    ]


HEADER = ["kind", "ms per step", "share", "longest (ms per step)"]


def format_table(result: Split) -> str:
    """The split as a Markdown table, a total row last."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
    lines.append(f"| step | {result.step_ms:.2f} | 100.0% | {result.steps} step(s) profiled |")
    return "\n".join(lines)


def describe(result: Split) -> str:
    """One line: what the table's rows measure, and the overlap."""
    what = "GPU kernels and copies" if result.device == "cuda" else "CPU ops' own time"
    return (
        f"{result.steps} step(s) under torch.profiler, one synchronized window, {what}; idle: no "
        f"{'kernel' if result.device == 'cuda' else 'op'} running; overlapping events share their time equally "
        f"({result.overlap_ms:.2f} ms per step overlapped)"
    )
