"""What a training step whose loss or gradient norm is NaN or Inf on some rank does, once every
rank has agreed on it (pretrain/numerics/debug.py finds and reports; this decides): drop the update and go
on (debug.on_nonfinite=skip, within debug.max_skips_in_a_row), or stop every rank with the
evidence written: the report, a checkpoint of the state before the step, the tensor dump."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pretrain.checkpoint import save_restore
from pretrain.numerics import debug
from pretrain.numerics.debug import NonFinite, NumericalFailure

if TYPE_CHECKING:
    from pretrain.build import Trainer


def skip_or_stop(trainer: Trainer, event: NonFinite, position: dict[str, int]) -> None:
    """Drop the step's update (on_nonfinite=skip, within max_skips_in_a_row), else stop."""
    d = trainer.config.debug
    if d.on_nonfinite == "skip" and trainer.skips_in_a_row < d.max_skips_in_a_row:
        trainer.skips_in_a_row += 1
        trainer.skipped_steps += 1
        trainer.optimizer.zero_grad(set_to_none=True)
        first = trainer.tracer.first if trainer.tracer is not None else None
        trainer.log.warning(
            f"Step {event.step}: loss {event.loss:.4f}, gradient norm {event.grad_norm:.4f}: update skipped "
            f"({trainer.skips_in_a_row} in a row, {trainer.skipped_steps} in all; debug.max_skips_in_a_row "
            f"is {d.max_skips_in_a_row})" + (f"; first non-finite: {first}" if first else "")
        )
        return
    stop_for_nonfinite(trainer, event, position)


def stop_for_nonfinite(trainer: Trainer, event: NonFinite, position: dict[str, int]) -> None:
    """Every rank, in this order (the most useful evidence first): say so at once; report the
    tensors (the affected ranks); save checkpoint nan_grad_step_<N> with the state before the
    step; write the tensor dump (the reporting rank); raise NumericalFailure."""
    runtime, log, d = trainer.runtime, trainer.log, trainer.config.debug
    what = "gradient norm" if event.what == "GRADIENT" else "loss"
    log.error(
        f"Step {event.step}: {event.kind} {what} (loss here {event.loss:.4f}, gradient norm "
        f"{event.grad_norm:.4f}); no update made; writing the report, a checkpoint"
        + (" and a tensor dump" if d.dump_tensors else "")
    )
    findings = debug.inspect_all(trainer.model)
    reports = event.affected_here or runtime.rank == event.reporter
    if reports:
        first = trainer.tracer.first if trainer.tracer is not None else None
        log.error(debug.report(event, runtime.label, findings, first, tracing=trainer.tracer is not None))
    else:
        log.error(f"Step {event.step}: this rank's loss is finite; rank {event.reporter} reports the tensors")
    trainer.loader.load_state_dict(position)  # so that resuming the checkpoint replays this step
    path = save_restore.save(trainer, event.step, trainer.run_dir, name=f"nan_grad_step_{event.step}")
    log.info(f"Checkpoint with the state before step {event.step}: {path} (resuming it replays the step)")
    dump_path = trainer.run_dir / "debug" / f"nan_debug_step_{event.step}.npz"
    dumped = d.dump_tensors and debug.write_dump(trainer.model, dump_path, runtime, event.reporter, log)
    if dumped:
        log.info(f"Tensor dump: {dump_path} (numpy.load(path, allow_pickle=False); docs/numerics.md: NaN and Inf)")
    raise NumericalFailure(
        f"step {event.step}: {event.kind} {what}; stopped ("
        + ("the report above names the tensors" if reports else f"rank {event.reporter}'s report names the tensors")
        + f"; checkpoint {path}"
        + (f"; dump {dump_path}" if dumped else "")
        + "); docs/numerics.md (Troubleshooting) and configs/config_stable.json say what to change"
    )
