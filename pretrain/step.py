"""One optimizer step (train_step) and what it needs: the autocast context, clipping and the
update (apply_update), PRETRAIN_FAULTS' slowed ranks (slow_down), and the logging step's means of
the auxiliary losses (aux_means). pretrain/train.py's fit runs it; what a step with NaN or Inf does
is pretrain/numerics/nonfinite.py; the optimizer and the loss are pretrain/optim/optimizers.py and
pretrain/model/loss.py."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pretrain import config as cfg
from pretrain.build import Trainer
from pretrain.distributed import parallel
from pretrain.model.loss import next_token_loss
from pretrain.numerics import debug, nonfinite
from pretrain.optim import optimizers
from pretrain.optim.schedule import lr_at


def autocast(trainer: Trainer):
    return torch.autocast(trainer.runtime.device.type, dtype=torch.bfloat16, enabled=trainer.config.training.use_amp)


def train_step(trainer: Trainer, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step over grad_accum_nums micro-batches: (local loss, grad norm, lr).
    A step whose loss or gradient norm is not finite on any rank updates nothing: it is
    skipped or stops the run (debug.on_nonfinite; see pretrain/numerics/debug.py)."""
    t, device = trainer.config.training, trainer.runtime.device
    lr = lr_at(step, t)
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr
    position = trainer.loader.state_dict()  # where this step's batches start
    if trainer.tracer is not None:
        trainer.tracer.reset()
    loss_sum = torch.zeros((), device=device)  # the cross-entropy; auxiliary losses only train
    aux_sums: dict[str, torch.Tensor] = {}
    count_sums: dict[str, torch.Tensor] = {}  # summed over micro-batches: a mixture of experts' dropped assignments
    # This rank's compute, for the straggler line: each micro-batch's forward and loss, where DDP
    # runs no collective; under FSDP its all-gathers are left out by hooks in FSDP's pre-forward
    # (pretrain/observe/stragglers.py). Timed outside the compiled blocks.
    timer = trainer.stragglers.timer if trainer.stragglers is not None else None
    if timer is not None:
        timer.new_step()
    if trainer.faults is not None:  # PRETRAIN_FAULTS (a testing aid); None in an ordinary run
        slow_down(trainer, step)
    accum = cfg.grad_accum_nums(trainer.config)  # a number once planned (build's parallel_mode)
    for micro in range(accum):
        x, y = (tensor.to(device, non_blocking=True) for tensor in next(trainer.batches))
        # Under DDP only the last micro-batch all-reduces gradients; FSDP reduce-scatters on every
        # micro-batch, so no rank holds a whole model's gradients, and HSDP too, within each node,
        # all-reducing the shards across nodes on the last only (see parallel.gradient_sync).
        with parallel.gradient_sync(trainer.model, enabled=micro == accum - 1):
            if timer is not None:
                timer.begin()
            with autocast(trainer):
                loss = next_token_loss(trainer.model, x, y, cfg.loss_chunk_tokens(trainer.config))
            if timer is not None:
                timer.end()
            (loss.total / accum).backward()
        loss_sum += loss.cross_entropy.detach() / accum
        for name, value in loss.aux_losses.items():
            aux_sums[name] = aux_sums.get(name, 0) + value.detach().float() / accum
        for name, value in loss.counts.items():
            count_sums[name] = count_sums.get(name, 0) + value
    trainer.aux_losses = aux_sums
    trainer.counts = count_sums
    grad_norm = parallel.grad_norm(trainer.model)
    if trainer.config.debug.check_finite:
        seen = trainer.tracer is not None and trainer.tracer.first is not None
        # The step's one host synchronization, which also settles whether the ranks stop after
        # it. Where the optimizer takes a device flag, the update is issued first, masked by the
        # all-reduced flags (update), so the device works through it while the host waits.
        masked = optimizers.takes_found_inf(trainer.optimizer, device)
        states = len(trainer.optimizer.state)
        update = (lambda found_inf: apply_update(trainer, grad_norm, found_inf)) if masked else None
        agreement = debug.agree_on_step(step, loss_sum, grad_norm, trainer.runtime, seen, trainer.stop.signum, before_read=update)
        trainer.stop.settle(agreement.stop_signum)
        if agreement.nonfinite is not None:
            if masked:  # nothing was updated; a first step's new state goes too
                optimizers.forget_state_since(trainer.optimizer, states)
            nonfinite.skip_or_stop(trainer, agreement.nonfinite, position)
            return loss_sum, grad_norm, lr
        if not masked:
            apply_update(trainer, grad_norm)
    else:
        apply_update(trainer, grad_norm)
    if trainer.float8_scales is not None:  # FSDP2's float8 all-gathers: the next step's weight scales, in one op
        trainer.float8_scales(trainer.model)
    trainer.skips_in_a_row = 0
    trainer.optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, lr


def apply_update(trainer: Trainer, grad_norm: torch.Tensor, found_inf: torch.Tensor | None = None) -> None:
    """Clip the gradients and step the optimizer. found_inf (a 0-d float32 device tensor, unread):
    where it is 1.0 the step changes no weight or optimizer state (optimizers.step_unless), and
    clipping scales the gradients by exactly 1 (a norm of 0 for it), so what a report and a tensor
    dump of the step read is the backward's gradients, never ones scaled by a NaN or Inf norm."""
    max_norm = trainer.config.training.max_grad_norm
    if found_inf is None:
        parallel.clip_gradients(trainer.model, max_norm, grad_norm)
        trainer.optimizer.step()
        return
    parallel.clip_gradients(trainer.model, max_norm, torch.where(found_inf > 0, 0.0, grad_norm))
    optimizers.step_unless(trainer.optimizer, found_inf)


def slow_down(trainer: Trainer, step: int) -> None:
    """PRETRAIN_FAULTS' sleep=S from its step on: this rank sleeps S seconds inside the interval
    its compute is timed by, so it looks like a slow GPU (on one, the GPU first finishes its queue
    and then idles through the sleep)."""
    assert trainer.faults is not None
    seconds = trainer.faults.sleep_seconds(step)
    if not seconds:
        return
    timer = trainer.stragglers.timer if trainer.stragglers is not None else None
    if trainer.runtime.device.type == "cuda":
        torch.cuda.synchronize(trainer.runtime.device)
    if timer is not None:
        timer.begin()
    time.sleep(seconds)
    if timer is not None:
        timer.end()


def aux_means(trainer: Trainer) -> tuple[dict[str, float], dict[str, int]]:
    """The last step's auxiliary losses (one per MoE layer), each the mean over ranks, and its counts
    (each MoE layer's dropped assignments), each the sum over ranks and micro-batches: one
    all-reduce of them stacked (float64, exact for any count), not one per layer, read at the
    logging step's one read."""
    names, counted = sorted(trainer.aux_losses), sorted(trainer.counts)
    if not names and not counted:
        return {}, {}
    stacked = torch.stack([trainer.aux_losses[n].double() for n in names] + [trainer.counts[n].double() for n in counted])
    if trainer.runtime.distributed:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    values = stacked.tolist()
    world = trainer.runtime.world_size if trainer.runtime.distributed else 1
    losses = {name: value / world for name, value in zip(names, values[: len(names)], strict=True)}
    return losses, {name: round(value) for name, value in zip(counted, values[len(names) :], strict=True)}
