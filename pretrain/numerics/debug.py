"""Numerical safety: catch the first step whose loss or gradient norm is NaN or Inf, say
where it came from, and keep the evidence.

Always on (debug.check_finite): after each step's backward, every rank learns whether any
rank's loss or the global gradient norm is not finite (one small all-reduce, which also carries
the ranks' agreement on a stop request), and no such step writes into the weights or the
optimizer's state. Where the optimizer can be told so on the device (found_inf: torch's fused
AdamW, Muon), the update is issued masked by the all-reduced flags and the host reads them after
it (the step's only host synchronization, off the device's critical path); elsewhere the host
reads them first and steps only when they are finite. Then, by debug.on_nonfinite:

    stop   every rank says so at once, the affected ranks log a report of every parameter
           whose value or gradient holds NaN or Inf, all save checkpoint nan_grad_step_<N>
           with the state before the step (resuming it replays the step), the reporting
           rank writes every parameter and gradient to <run dir>/debug/nan_debug_step_<N>.npz,
           and every rank exits with exit_codes.NUMERICAL_FAILURE.
    skip   the update is dropped and training goes on; after max_skips_in_a_row such steps
           in a row it stops as above.

With debug.trace_nonfinite (the debug preset), hooks on every module remember the first one
whose forward output or backward gradient was not finite: where to look first.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pretrain.checkpoint.model_state import plain_name
from pretrain.distributed.parallel import has_fsdp
from pretrain.run.files import atomic_write
from pretrain.distributed.runtime import Runtime

RULE = "=" * 80
FIRST_VALUES = 5
"""How many of a bad tensor's first elements the report shows."""
PROGRESS_SECONDS = 30.0
"""How often a long tensor dump says how far it got."""


class NumericalFailure(RuntimeError):
    """Training stopped because the loss or the gradient norm was not finite."""


# --- detection ------------------------------------------------------------------------


@dataclass(frozen=True)
class NonFinite:
    """A step that was not finite, as every rank agrees on it."""

    step: int
    loss: float
    """This rank's loss (the mean over its micro-batches)."""
    grad_norm: float
    """The global gradient norm, the same on every rank."""
    affected_here: bool
    """This rank's own loss was not finite, or its hooks saw a non-finite value."""
    reporter: int
    """The lowest affected rank (rank 0 when the loss was finite everywhere): it writes the dump."""

    @property
    def kind(self) -> str:
        """NaN if any NaN is involved, else Inf."""
        return "NaN" if math.isnan(self.loss) or math.isnan(self.grad_norm) else "Inf"

    @property
    def what(self) -> str:
        """GRADIENT when the gradient norm is not finite, else LOSS (some rank's loss was not)."""
        return "GRADIENT" if not math.isfinite(self.grad_norm) else "LOSS"


@dataclass(frozen=True)
class StepAgreement:
    """What every rank agrees on after a step's backward pass, from one all-reduce."""

    nonfinite: NonFinite | None
    """None when every rank's loss and the gradient norm are finite."""
    stop_signum: int | None
    """The stop signal any rank had received when it checked (the highest number), else None."""


def agree_on_step(
    step: int,
    loss: Tensor,
    grad_norm: Tensor,
    runtime: Runtime,
    seen_by_hooks: bool = False,
    stop_signum: int | None = None,
    *,
    before_read: Callable[[Tensor], None] | None = None,
) -> StepAgreement:
    """Whether the step is finite on every rank, and whether any rank was asked to stop
    (stop_signum: this rank's pending signal). What the hooks saw only decides which ranks
    count as affected: an Inf that does not reach the loss or the gradients (a masked score,
    say) stops nothing. A collective: every rank calls it every step.

    The host synchronises once: one all-reduce of four integers and one read of them
    (.tolist()). The flags are made on the device from Python scalars passed as kernel
    arguments (torch.full, torch.where), never copied from host memory, which would block.
    before_read, if given, is called between the all-reduce and the read with found_inf (see
    found_inf: 1.0 where any rank's loss or the norm is not finite): it issues the update
    masked by it, so the device has the update queued while the host waits for the read."""
    device = loss.device
    loss_bad = ~torch.isfinite(loss)
    affected = loss_bad | seen_by_hooks
    # Under MIN: the lowest affected rank; 0 for "bad", so that any one rank's bad wins; and
    # a stop request as minus its signal number, so that any request wins (the highest signal).
    flags = torch.stack(
        [
            torch.where(affected, runtime.rank, runtime.world_size).long(),
            (~loss_bad).long(),
            torch.isfinite(grad_norm).long(),
            torch.full((), -(stop_signum or 0), dtype=torch.long, device=device),
        ]
    )
    if runtime.distributed:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if before_read is not None:
        before_read(found_inf(flags))
    first_affected, every_loss_finite, norm_finite, stop = flags.tolist()
    stop_signum = -stop or None
    if every_loss_finite and norm_finite:
        return StepAgreement(None, stop_signum)
    reporter = first_affected if first_affected < runtime.world_size else 0
    return StepAgreement(NonFinite(step, float(loss), float(grad_norm), bool(affected), reporter), stop_signum)


def found_inf(flags: Tensor) -> Tensor:
    """From agree_on_step's all-reduced flags, on the device and unread: 1.0 when some rank's
    loss or the gradient norm is not finite, else 0.0. A 0-d float32 tensor, as torch's fused
    optimizers take it (optimizer.found_inf, the way GradScaler tells them to skip a step)."""
    return (1 - flags[1] * flags[2]).float()


def check_step(step: int, loss: Tensor, grad_norm: Tensor, runtime: Runtime, seen_by_hooks: bool = False) -> NonFinite | None:
    """agree_on_step without a stop request: None when every rank's loss and the gradient
    norm are finite, else what every rank agrees happened. A collective."""
    return agree_on_step(step, loss, grad_norm, runtime, seen_by_hooks).nonfinite


# --- where it started (debug mode) ----------------------------------------------------


def _not_finite(value: object) -> bool:
    if isinstance(value, Tensor):
        # detach: a check recorded by autograd would be saved for the backward, and inside a
        # checkpointed region (the chunked loss) the recomputation would then not match.
        return value.is_floating_point() and not bool(torch.isfinite(value.detach()).all())
    if isinstance(value, (tuple, list)):
        return any(_not_finite(item) for item in value)
    if isinstance(value, dict):  # a block's auxiliary losses, by name
        return any(_not_finite(item) for item in value.values())
    return False


class FirstNonFinite:
    """Forward hooks, backward hooks and gradient hooks on every module and parameter that
    remember the first place, in execution order, a NaN or Inf appeared:
    "layers.1.feed_forward.w13, forward output", "layers.0.attention, gradient of its input",
    "norm.weight, gradient". Inner modules finish before the modules around them, so the
    first one named is the innermost. Each hook synchronises with the device: debug only."""

    def __init__(self, model: nn.Module) -> None:
        self.first: str | None = None
        self._handles = []
        for name, module in model.named_modules():
            name = plain_name(name) or "model"
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
            if module is not model and not isinstance(module, nn.Embedding):  # their inputs are token ids
                self._handles.append(module.register_full_backward_hook(self._backward_hook(name)))
        for name, param in model.named_parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(self._gradient_hook(plain_name(name))))

    def reset(self) -> None:
        self.first = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _note(self, where: str, value: object) -> None:
        if self.first is None and _not_finite(value):
            self.first = where

    def _forward_hook(self, name: str):
        return lambda _module, _args, output: self._note(f"{name}, forward output", output)

    def _backward_hook(self, name: str):
        return lambda _module, grad_input, _grad_output: self._note(f"{name}, gradient of its input", grad_input)

    def _gradient_hook(self, name: str):
        return lambda grad: self._note(f"{name}, gradient", grad)


# --- the report and the dump ----------------------------------------------------------


def _whole(tensor: Tensor | None) -> Tensor | None:
    """The full tensor, detached, where it is (under FSDP a collective)."""
    if tensor is None:
        return None
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def named_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor, Tensor | None]]:
    """(plain name, whole value, whole gradient or None) of every parameter, one at a time.
    Under FSDP every rank must iterate to the end: each tensor is gathered from all."""
    for name, param in model.named_parameters():
        value = _whole(param)
        assert value is not None  # a parameter, never None
        yield plain_name(name), value, _whole(param.grad)


def bad_count(tensor: Tensor) -> str | None:
    """'3 NaN, 1 Inf of 4096' for a tensor holding NaN or Inf, else None."""
    nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    if not nan and not inf:
        return None
    parts = ([f"{nan} NaN"] if nan else []) + ([f"{inf} Inf"] if inf else [])
    return f"{', '.join(parts)} of {tensor.numel()}"


def first_values(tensor: Tensor) -> str:
    values = tensor.flatten()[:FIRST_VALUES].tolist()
    return "[" + ", ".join(f"{v:.4g}" for v in values) + (", ...]" if tensor.numel() > FIRST_VALUES else "]")


@dataclass
class TensorFindings:
    """What the report lists: every parameter with NaN or Inf in its gradient or value."""

    lines: list[str]
    bad_gradients: list[str]
    affected: list[str]


def inspect(name: str, value: Tensor, grad: Tensor | None, findings: TensorFindings) -> None:
    """Add the parameter to the findings if its value or gradient is not finite."""
    shape = tuple(value.shape)
    for label, tensor in (("gradient", grad), ("value", value)):
        if tensor is None or (count := bad_count(tensor)) is None:
            continue
        findings.lines.append(f"  {name} {shape} {label}: {count}; first values {first_values(tensor)}")
        if label == "gradient":
            findings.bad_gradients.append(name)
        if name not in findings.affected:
            findings.affected.append(name)


def report(event: NonFinite, label: str, findings: TensorFindings, first: str | None, tracing: bool) -> str:
    """The banner and the tables the affected rank logs."""
    lines = [
        RULE,
        f"{event.kind} {event.what} DETECTED [{label}]",
        RULE,
        f"Step: {event.step}",
        f"Loss: {event.loss:.4f}",
        f"Gradient Norm: {event.grad_norm:.4f}",
        "PROBLEMATIC TENSORS (name, shape, where: bad elements of all; first values):",
    ]
    why = (
        "this rank's loss was not"
        if not math.isfinite(event.loss)
        else "the loss of another rank was not"
        if math.isfinite(event.grad_norm)
        else "only their norm overflowed"
    )
    lines += findings.lines or [f"  none: every parameter and gradient is finite ({why})"]
    lines += [f"Total layers with NaN gradients: {len(findings.bad_gradients)}", f"Affected layers: {findings.affected}"]
    if tracing:
        lines.append(f"first non-finite: {first or 'not seen by the hooks on this rank'}")
    else:
        lines.append(
            "first non-finite: set debug.trace_nonfinite=true (on in --debug) to name the first "
            "module, for example by resuming from the nan_grad_step checkpoint"
        )
    lines.append(RULE)
    return "\n".join(lines)


class NpzWriter:
    """A .npz written one array at a time (np.savez needs them all in memory at once):
    np.load(path, allow_pickle=False) reads it."""

    def __init__(self, path: Path) -> None:
        self._zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def add(self, key: str, tensor: Tensor) -> None:
        with self._zip.open(f"{key}.npy", "w", force_zip64=True) as entry:
            np.lib.format.write_array(entry, tensor.float().cpu().numpy(), allow_pickle=False)

    def close(self) -> None:
        self._zip.close()


def dump_size(model: nn.Module) -> int:
    """Bytes of a dump: every parameter and its gradient in float32."""
    return sum(2 * 4 * p.numel() for p in model.parameters())


def inspect_all(model: nn.Module) -> TensorFindings:
    """Every parameter whose value or gradient is not finite (under FSDP a collective)."""
    findings = TensorFindings([], [], [])
    for name, value, grad in named_tensors(model):
        inspect(name, value, grad, findings)
    return findings


def room_for_dump(model: nn.Module, directory: Path) -> tuple[bool, int]:
    """(whether the dump fits in 90% of the free space where it goes, its size in bytes);
    OSError when the directory cannot be made."""
    size = dump_size(model)
    directory.mkdir(parents=True, exist_ok=True)
    return size <= 0.9 * shutil.disk_usage(directory).free, size


def write_dump(model: nn.Module, path: Path, runtime: Runtime, reporter: int, log: logging.Logger) -> bool:
    """The reporting rank writes param/<name> and grad/<name> of every parameter to path, one
    tensor at a time; whether it did. Every rank calls it: under FSDP each tensor is gathered
    from all of them, so every rank goes through every tensor whatever happens on the
    reporter (no room, a write error), and then all wait for the reporter to finish, so that
    none exits (and has the launcher stop the rest) while the dump is being written."""
    writes = runtime.rank == reporter
    if writes:
        try:
            fits, size = room_for_dump(model, path.parent)
        except OSError as error:
            fits, size = False, dump_size(model)
            log.warning(f"Tensor dump skipped: {error.strerror or error}: {error.filename}")
        else:
            if not fits:
                log.warning(
                    f"Tensor dump skipped: it needs {size / 2**30:.1f} GiB, more than the disk has free under {path.parent}"
                )
        writes = fits
    written, gathered = False, False

    def write(tmp: Path) -> None:
        nonlocal gathered
        gathered = True
        _write_all(model, tmp, log)

    if writes:
        try:
            atomic_write(path, write)
            written = True
        except OSError as error:
            log.warning(f"Tensor dump {path} not written: {error.strerror or error}")
    if not gathered and has_fsdp(model):  # no file to write to, or not the reporter
        for _ in named_tensors(model):  # take part in the gathers
            pass
    if runtime.distributed:
        dist.barrier()
    return written


def _write_all(model: nn.Module, tmp: Path, log: logging.Logger) -> None:
    """Every tensor into tmp; after a write error, the rest are still gathered (FSDP peers
    wait for them), then the error is raised."""
    names = sum(1 for _ in model.parameters())
    writer, error, last_news = NpzWriter(tmp), None, time.monotonic()
    for done, (name, value, grad) in enumerate(named_tensors(model), start=1):
        try:
            if error is None:
                writer.add(f"param/{name}", value)
                if grad is not None:
                    writer.add(f"grad/{name}", grad)
        except OSError as failed:
            error = failed
        if time.monotonic() - last_news > PROGRESS_SECONDS:  # a line now and then for the hang watchdog
            log.info(f"Tensor dump: {done} of {names} parameters written")
            last_news = time.monotonic()
    writer.close()
    if error is not None:
        raise error
