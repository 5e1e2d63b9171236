"""Worker scripts of tests/pretrain/checkpoint/test_async_checkpoint.py.

python tests/support/workers/async_checkpoint_worker.py OUT: one of two gloo ranks (support.processes.run_gloo_ranks), the
parallelism in OUT/parallelism: fit 4 steps saving every 2 with asynchronous checkpoints, again
synchronously, then resume the asynchronous step_2 and fit the rest; writes the losses.

With OUT/marker present instead (DDP): rank 1's write of step_2 is held (test hook) until
OUT/release exists; rank 0 reports what its checkpoint directory holds meanwhile, then releases.

python tests/support/workers/async_checkpoint_worker.py --held MODE HANDSHAKES ARGS...: `python -m pretrain ARGS`
in which the background write of step_4 is held by a test hook (pretrain/checkpoint/async_save.py
_test_hook) after it wrote HANDSHAKES/holding: kill (held for ever, for a SIGKILL), fail (its
model.pt made a directory, so the write fails) or term (held until HANDSHAKES/release exists;
HANDSHAKES/waiting is written when the training thread starts waiting for it).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for support.*

HELD = "step_4.tmp"
HANDSHAKE_S = 60
"""The longest a handshake is waited for: a failure then fails instead of hanging."""


def await_path(path: Path) -> None:
    waited = threading.Event()
    for _ in range(int(HANDSHAKE_S / 0.02)):
        if path.exists():
            return
        waited.wait(0.02)
    raise TimeoutError(f"{path} never appeared")


def marker_rank(out: Path) -> None:
    """Rank 0 renames step_2.tmp only once rank 1's marker is there (the DDP single-file format:
    rank 0 writes the tensors, rank 1 only its random generators)."""
    from concurrent.futures import TimeoutError as NotYet

    from support.checkpointing import resolved
    from support.gloo_rank import report_as_gloo_rank
    from pretrain.build import build
    from pretrain.checkpoint import async_save
    from pretrain.checkpoint.files import is_complete
    from pretrain.distributed.runtime import Runtime, setup_logging

    sets = ("training.parallelism=ddp", "training.async_checkpoint=true")

    def measure(runtime: Runtime) -> dict:
        config, dataset = resolved(out / "cache", *sets, world_size=2)
        trainer = build(config, runtime, dataset, out / "run_marker", setup_logging(runtime.label, "WARNING"))
        if runtime.rank == 1:
            async_save._test_hook = lambda tmp: await_path(out / "release")
        writer = trainer.checkpoints
        final = writer.save(2, writer.tiers["durable"])
        seen: dict = {}
        if runtime.rank == 0:
            tmp = final.with_name("step_2.tmp")
            await_path(tmp / ".written_rank0")  # this rank's part is on disk
            job = writer._pending
            assert job is not None and job.done is not None
            try:  # a rename would follow at once (the thread polls every 20 ms)
                job.done.result(timeout=1.0)
                seen["done_before_release"] = True
            except NotYet:
                seen["done_before_release"] = False
            seen["final_while_held"] = final.exists()
            seen["tmp_while_held"] = sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else None
            (out / "release").touch()
        writer.wait()
        seen["complete"] = is_complete(final, world_size=2)
        return seen

    config, _ = resolved(out / "cache", *sets, world_size=2)
    report_as_gloo_rank(config, measure)


def gloo_rank(out: Path) -> None:
    from support.checkpointing import resolved
    from support.gloo_rank import report_as_gloo_rank
    from pretrain.build import build
    from pretrain.checkpoint import save_restore
    from pretrain.distributed.runtime import Runtime, setup_logging
    from pretrain.train import fit

    parallelism = (out / "parallelism").read_text().strip()
    cache = out / "cache"
    sets = (
        f"training.parallelism={parallelism}",
        "training.max_steps=4",
        "training.checkpoint_interval=2",
        "logging.log_interval=1",
    )

    def measure(runtime: Runtime) -> dict:
        log = setup_logging(runtime.label, "WARNING")
        seen: dict = {}
        for mode in ("true", "false"):
            config, dataset = resolved(cache, *sets, f"training.async_checkpoint={mode}", world_size=2)
            trainer = build(config, runtime, dataset, out / f"run_{mode}", log)
            fit(trainer)
            seen[mode] = {
                "losses": trainer.losses,
                "completed": trainer.checkpoints.completed,
                "own_group": trainer.checkpoints.group is not None,
                "mode": trainer.mode,
            }
        config, dataset = resolved(cache, *sets, "training.async_checkpoint=true", world_size=2)
        resumed = build(config, runtime, dataset, out / "resumed", log)
        resumed.start_step = save_restore.restore(resumed, out / "run_true" / "checkpoints" / "step_2")
        fit(resumed)
        seen["resumed"] = resumed.losses
        return seen

    config, _ = resolved(cache, *sets, world_size=2)
    report_as_gloo_rank(config, measure)


def held(mode: str, handshakes: Path, argv: list[str]) -> None:
    from pretrain.checkpoint import async_save
    from pretrain.distributed.runtime import exit_process
    from pretrain.train import main

    def hook(tmp: Path) -> None:
        if tmp.name != HELD:
            return
        if mode == "fail":
            (tmp / "model.pt").mkdir()  # what a read-only directory is to anyone but root: unwritable
        (handshakes / "holding").touch()
        if mode == "kill":
            threading.Event().wait(HANDSHAKE_S)  # the test kills the process meanwhile
        if mode == "term":
            await_path(handshakes / "release")

    async_save._test_hook = hook
    if mode == "term":
        complete = async_save.CheckpointWriter._complete_pending  # what save and wait wait in

        def complete_pending(self: async_save.CheckpointWriter) -> async_save._Save | None:
            if self._pending is not None and self._pending.tmp.name == HELD:
                (handshakes / "waiting").touch()
            return complete(self)

        async_save.CheckpointWriter._complete_pending = complete_pending  # type: ignore[method-assign]
    exit_process(main(argv))


if __name__ == "__main__":
    if sys.argv[1] == "--held":
        held(sys.argv[2], Path(sys.argv[3]), sys.argv[4:])
    elif (Path(sys.argv[1]) / "marker").exists():
        marker_rank(Path(sys.argv[1]))
    else:
        gloo_rank(Path(sys.argv[1]))
