"""Asynchronous checkpoints (pretrain/checkpoint/async_save.py): staged, written in the background,
complete only once every rank's files are there, and a resume that sees no difference. The plan's
host memory for them is tests/pretrain/plan/test_checkpoint_memory.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from support.checkpointing import make_trainer, resolved
from support.processes import ROOT, launcher_env, run_gloo_ranks
from pretrain import train as train_module
from pretrain.checkpoint import async_save, save_restore
from pretrain.checkpoint.files import CheckpointError, is_complete, latest
from pretrain.checkpoint.staging import ALIGN, KeptBuffers
from pretrain.observe.metrics import read_metrics
from pretrain.plan.checkpoint_memory import staged_bytes
from pretrain.distributed.peer_loss import PeerFailed
from pretrain.distributed.runtime import Runtime, setup_logging
from pretrain.run.exit_codes import BAD_INPUT, by_signal
from pretrain.train import fit

WORKER = ROOT / "tests" / "support" / "workers" / "async_checkpoint_worker.py"
SIX_STEPS = ("training.max_steps=6", "training.checkpoint_interval=2", "training.keep_checkpoints=3", "logging.log_interval=1")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def hook(monkeypatch):
    """Install a test hook in the writing thread (async_save._test_hook) for the test's length."""

    def install(function) -> None:
        monkeypatch.setattr(async_save, "_test_hook", function)

    return install


def saved_tensors(path: Path) -> dict:
    return {name: save_restore.load_tensors(path, name) for name in ("model.pt", "optimizer.pt", "rng_rank0.pt")}


def assert_same(first, second) -> None:
    if isinstance(first, dict):
        assert first.keys() == second.keys()
        for key in first:
            assert_same(first[key], second[key])
    elif isinstance(first, list | tuple):
        assert len(first) == len(second)
        for a, b in zip(first, second, strict=True):
            assert_same(a, b)
    elif isinstance(first, torch.Tensor):
        assert torch.equal(first, second)
    else:
        assert first == second


HANDSHAKE_S = 60
"""The longest a test waits for a handshake: a failure then fails instead of hanging."""


def timed(writer) -> list[float]:
    """The seconds the calling threads spend in writer's save, poll and wait, in all (the first
    item of the list returned, updated as they run; a call inside another counted once)."""
    spent, depth = [0.0], threading.local()

    def timing(method):
        def call(*args, **kwargs):
            outer = not getattr(depth, "inside", False)
            depth.inside, began = True, time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if outer:
                    depth.inside = False
                    spent[0] += time.perf_counter() - began

        return call

    for name in ("save", "poll", "wait"):
        setattr(writer, name, timing(getattr(writer, name)))
    return spent


def assert_stall_adds_up(writer, records: list[dict], blocked: float) -> None:
    """The writer's stall is its saves' recorded stalls (each rounded to 1 ms) and its unrecorded
    part, and no more than the training thread was blocked in its calls."""
    assert writer.stall_seconds == pytest.approx(
        sum(r["stall_s"] for r in records) + writer.unrecorded_seconds, abs=1e-3 * len(records)
    )
    assert writer.stall_seconds <= blocked + 1e-6


# --- one process ----------------------------------------------------------------------


def test_an_async_checkpoint_written_while_training_goes_on_holds_its_staged_step_and_resumes_to_the_sync_losses(
    cache, tmp_path, hook, monkeypatch
):
    synchronous = make_trainer(cache, tmp_path / "sync", *SIX_STEPS, "training.async_checkpoint=false")
    fit(synchronous)
    assert not synchronous.checkpoints.asynchronous

    # step_2's write is held until two more steps have changed the weights and Adam's moments in place.
    two_more_steps = threading.Event()
    held_while = []

    def hold(tmp: Path) -> None:
        if tmp.name == "step_2.tmp":
            assert two_more_steps.wait(HANDSHAKE_S), "training never reached step 3"
            held_while.append(tmp.is_dir() and not (tmp.parent / "step_2").exists())

    hook(hold)
    real_step = train_module.train_step

    def step_and_signal(trainer, step):
        result = real_step(trainer, step)
        if step == 3:
            two_more_steps.set()
        return result

    monkeypatch.setattr(train_module, "train_step", step_and_signal)
    asynchronous = make_trainer(cache, tmp_path / "async", *SIX_STEPS, "training.async_checkpoint=true")
    blocked = timed(asynchronous.checkpoints)
    fit(asynchronous)
    monkeypatch.setattr(train_module, "train_step", real_step)

    assert asynchronous.checkpoints.asynchronous and held_while == [True]
    assert asynchronous.losses == synchronous.losses
    assert asynchronous.checkpoints.completed == [(2, "durable"), (4, "durable"), (6, "durable")]
    sync_dir, async_dir = synchronous.run_dir / "checkpoints", asynchronous.run_dir / "checkpoints"
    # What the background wrote after steps 3 and 4 is step 2's state, bit for bit: weights,
    # moments, random generators, and the data and schedule positions.
    assert_same(saved_tensors(sync_dir / "step_2"), saved_tensors(async_dir / "step_2"))
    assert save_restore.read_state(sync_dir / "step_2") == save_restore.read_state(async_dir / "step_2")
    assert sorted(p.name for p in async_dir.iterdir()) == sorted(p.name for p in sync_dir.iterdir())
    assert not any(p.name.startswith(".written") for p in (async_dir / "step_2").iterdir())

    resumed = make_trainer(cache, tmp_path / "resumed", *SIX_STEPS, "training.async_checkpoint=true")
    resumed.start_step = save_restore.restore(resumed, async_dir / "step_2")
    fit(resumed)
    assert resumed.losses == synchronous.losses[2:]

    records = [r["checkpoint"] for r in read_metrics(asynchronous.run_dir / "metrics.jsonl") if r.get("kind") == "checkpoint"]
    assert [(r["step"], r["tier"], r["async"], r["path"]) for r in records] == [
        (steps, "durable", True, str(async_dir / f"step_{steps}")) for steps in (2, 4, 6)
    ]
    assert_stall_adds_up(asynchronous.checkpoints, records, blocked[0])


def test_a_second_save_waits_for_the_one_in_flight_and_the_wait_counts_as_stall_once(cache, tmp_path, hook, monkeypatch):
    trainer = make_trainer(cache, tmp_path / "run", "training.async_checkpoint=true")
    writer, tier = trainer.checkpoints, trainer.checkpoints.tiers["durable"]
    release, waiting = threading.Event(), threading.Event()
    hook(lambda tmp: release.wait(HANDSHAKE_S) if tmp.name == "step_1.tmp" else None)
    complete = writer._complete_pending

    def complete_pending():
        if writer._pending is not None:
            waiting.set()
        return complete()

    monkeypatch.setattr(writer, "_complete_pending", complete_pending)
    blocked = timed(writer)
    writer.save(1, tier)
    first_blocked = blocked[0]  # what the first save's stall can be at most
    waiting.clear()
    second = threading.Thread(target=writer.save, args=(2, tier), daemon=True)
    second.start()
    assert waiting.wait(HANDSHAKE_S)
    held_from = time.perf_counter()
    checkpoints = trainer.run_dir / "checkpoints"
    assert (checkpoints / "step_1.tmp").is_dir() and not (checkpoints / "step_2.tmp").exists()  # not begun
    # The second save is held (the write of step_1 not released) over twice the first's stall, so
    # that the two stalls are told apart however fast the machine (on a loaded one they came within 1 ms).
    threading.Event().wait(2 * first_blocked + 0.05)
    release.set()
    second.join(HANDSHAKE_S)
    held = time.perf_counter() - held_from
    writer.wait()
    assert writer.completed == [(1, "durable"), (2, "durable")]
    assert latest(checkpoints) == checkpoints / "step_2" and is_complete(checkpoints / "step_1")
    records = [r["checkpoint"] for r in read_metrics(trainer.run_dir / "metrics.jsonl") if r.get("kind") == "checkpoint"]
    assert records[1]["stall_s"] >= held - 0.01  # the second save's stall includes the wait for the first ...
    assert records[0]["stall_s"] < held / 2  # ... and the first's record does not
    assert_stall_adds_up(writer, records, blocked[0])  # counted once: no more than the thread was blocked


def test_a_failed_background_write_is_raised_at_the_next_poll_naming_the_file(cache, tmp_path, hook):
    trainer = make_trainer(cache, tmp_path / "run", "training.async_checkpoint=true")
    hook(lambda tmp: (tmp / "model.pt").mkdir())
    writer = trainer.checkpoints
    writer.save(1, writer.tiers["durable"])
    assert writer._pending is not None and writer._pending.done is not None
    writer._pending.done.exception()  # the thread has finished (no collective: it only waits)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint file \S+/step_1\.tmp/model\.pt \(.*Is a directory"):
        writer.poll()
    assert not (trainer.run_dir / "checkpoints" / "step_1.tmp").exists()  # its space back at once
    assert latest(trainer.run_dir / "checkpoints") is None


def test_closing_the_writer_drops_a_save_in_flight_which_is_never_renamed_or_reported(cache, tmp_path, hook):
    trainer = make_trainer(cache, tmp_path / "run", "training.async_checkpoint=true")
    writer, release, holding = trainer.checkpoints, threading.Event(), threading.Event()
    hook(lambda tmp: (holding.set(), release.wait(HANDSHAKE_S)))
    final = writer.save(1, writer.tiers["durable"])
    job = writer._pending
    assert holding.wait(HANDSHAKE_S)
    writers = [t for t in threading.enumerate() if t.name.startswith("checkpoint-writer")]
    assert writers and all(t.daemon for t in writers)  # never holding the interpreter's exit
    writer.close()
    release.set()
    assert isinstance(job.done.exception(timeout=HANDSHAKE_S), async_save._Dropped)
    writer.wait()
    writer.poll()
    assert writer.completed == [] and not final.exists() and final.with_name("step_1.tmp").is_dir()
    assert not [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if r.get("kind") == "checkpoint"]


def test_train_closes_the_writer_whatever_ends_fit(cache, tmp_path, hook, monkeypatch):
    config, _ = resolved(cache, "training.async_checkpoint=true")
    release, seen = threading.Event(), {}
    hook(lambda tmp: release.wait(HANDSHAKE_S))

    def failing_fit(trainer) -> None:
        seen["trainer"] = trainer
        trainer.checkpoints.save(1, trainer.checkpoints.tiers["durable"])
        seen["job"] = trainer.checkpoints._pending
        raise RuntimeError("a failure while a save is in flight")

    monkeypatch.setattr(train_module, "fit", failing_fit)
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")
    with pytest.raises(RuntimeError, match="a failure while"):
        train_module.train(config, runtime, str(tmp_path / "run"), setup_logging("CPU 0", "WARNING"))
    release.set()
    assert seen["trainer"].checkpoints._pending is None
    assert isinstance(seen["job"].done.exception(timeout=HANDSHAKE_S), async_save._Dropped)


def test_the_staged_copy_is_kept_between_saves_and_independent_of_the_training_tensors():
    stager = KeptBuffers(pinned=False)
    weight, step = torch.ones(3, 4), torch.tensor(2.0)
    state = {
        "model": {"w": weight},
        "optimizer": {"state": {"w": {"step": step}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]},
    }
    first = stager.stage(state)
    weight.add_(1)  # training changes the same tensors in place
    assert torch.equal(first["model"]["w"], torch.ones(3, 4)) and first["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    second = stager.stage(state)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # the same buffer, no new pages
    assert stager.nbytes == 2 * ALIGN  # 48 and 4 bytes, each at an aligned offset
    assert torch.equal(second["model"]["w"], weight)
    ahead = KeptBuffers(pinned=False)  # made ahead of the first save, in the writer's thread
    ahead.allocate(ahead.reserve(state))
    made = ahead.nbytes
    assert made == stager.nbytes and ahead.reserve(state) == []
    assert torch.equal(ahead.stage(state)["model"]["w"], weight) and ahead.nbytes == made
    # one flat buffer; each tensor a view of it with a storage of exactly its bytes (written alone)
    w, s = second["model"]["w"], second["optimizer"]["state"]["w"]["step"]
    assert w.untyped_storage().nbytes() == w.nbytes and s.untyped_storage().nbytes() == s.nbytes
    assert stager._flat is not None and stager._flat.data_ptr() <= w.data_ptr() < stager._flat.data_ptr() + stager.nbytes
    assert stager._flat.data_ptr() <= s.data_ptr() < stager._flat.data_ptr() + stager.nbytes
    stager.close()
    assert stager.nbytes == 0 and stager._flat is None


def test_the_staged_copy_takes_what_the_plan_counts(cache, tmp_path):
    trainer = make_trainer(cache, tmp_path / "run", "training.async_checkpoint=true")
    train_module.train_step(trainer, 0)  # the optimizer's state exists
    trainer.checkpoints.poll()  # makes the buffer in a thread
    trainer.checkpoints._warming.result(timeout=HANDSHAKE_S)
    made, planned_bytes = trainer.checkpoints._stager.nbytes, staged_bytes(trainer.config, 1, "ddp", 1)
    assert planned_bytes <= made <= planned_bytes * 1.02  # the step counts and the alignment beyond the plan's figure
    trainer.checkpoints.close()
    assert trainer.checkpoints._stager is None


def test_a_dtensor_shard_is_staged_on_the_host_without_moving_it_to_the_mesh_device(tmp_path, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        shard = distribute_tensor(torch.arange(12.0).reshape(4, 3), init_device_mesh("cpu", (1,)), [Shard(0)])

        def moved(*args, **kwargs):  # it does local_tensor.to(mesh.device_type): a GPU copy under a cuda mesh
            raise AssertionError("DTensor.from_local would move the staged shard to the mesh's device")

        monkeypatch.setattr(DTensor, "from_local", moved)
        staged = KeptBuffers(pinned=False).stage({"w": shard})["w"]
        assert isinstance(staged, DTensor) and staged._local_tensor.device.type == "cpu"
        assert staged._spec == shard._spec and torch.equal(staged.to_local(), shard.to_local())
        shard.to_local().add_(1)
        assert torch.equal(staged.to_local(), torch.arange(12.0).reshape(4, 3))
    finally:
        torch.distributed.destroy_process_group()


def test_a_peer_lost_during_the_background_dcp_write_is_peer_failed_in_one_line(tmp_path):
    from concurrent.futures import Future

    upload: Future = Future()
    upload.set_exception(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"))
    with pytest.raises(PeerFailed) as error:
        async_save._dcp_write(lambda tmp: None, upload, tmp_path)()
    assert "\n" not in str(error.value) and "Connection closed by peer" in str(error.value)
    assert f"checkpoint {tmp_path}" in str(error.value)


def test_a_rank_whose_node_writer_removed_the_checkpoint_names_that_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    runtime = Runtime(rank=5, world_size=8, device=torch.device("cpu"), label="CPU 5")
    with pytest.raises(PeerFailed, match="rank 4 removed the unfinished checkpoint"):
        save_restore.abandon(runtime, tmp_path / "gone.tmp", writer=False, per_node=True)
    with pytest.raises(PeerFailed, match="rank 0 removed the unfinished checkpoint"):
        save_restore.abandon(runtime, tmp_path / "gone.tmp", writer=False)


# --- two gloo ranks -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_ranks_resume_an_async_checkpoint_to_the_losses_of_the_synchronous_run(cache, tmp_path, parallelism):
    resolved(tmp_path / "cache", world_size=2)  # the dataset prepared once, before the ranks look
    (tmp_path / "parallelism").write_text(parallelism)
    ranks = run_gloo_ranks(WORKER.name, tmp_path, timeout=240)
    for seen in ranks:
        assert seen["true"]["mode"] == parallelism
        assert seen["true"]["losses"] == seen["false"]["losses"]
        assert seen["resumed"] == seen["false"]["losses"][2:]
        assert seen["true"]["completed"] == [[2, "durable"], [4, "durable"]]
        assert seen["true"]["own_group"] == (parallelism == "fsdp")  # DCP's thread on a gloo group of its own
    checkpoints = tmp_path / "run_true" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2", "step_4"]
    assert is_complete(checkpoints / "step_2", world_size=2)


@pytest.mark.slow
def test_the_checkpoint_is_renamed_only_once_every_ranks_marker_is_there(tmp_path):
    resolved(tmp_path / "cache", world_size=2)
    (tmp_path / "marker").touch()
    rank0, rank1 = run_gloo_ranks(WORKER.name, tmp_path, timeout=240)
    # rank 0's files and marker are on disk while rank 1's write is held: no step_2 yet
    assert rank0["done_before_release"] is False and rank0["final_while_held"] is False
    held = [".written_rank0", "config.json", "model.pt", "optimizer.pt", "rng_rank0.pt", "rng_rank1.pt", "state.json"]
    assert rank0["tmp_while_held"] == held  # rank 1 held after its small files, before its marker
    assert rank0["complete"] and rank1["complete"]
    assert sorted(p.name for p in (tmp_path / "run_marker" / "checkpoints").iterdir()) == ["step_2"]


# --- a training process: kill, failure, stop ----------------------------------------------


def held_run(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path, Path]:
    """python -m pretrain, 8 steps saving every 2 asynchronously, whose step_4 write the test hook
    holds (tests/support/workers/async_checkpoint_worker.py): the process, its run directory, the handshakes."""
    handshakes, run_dir = tmp_path / "handshakes", tmp_path / "run"
    handshakes.mkdir()
    sets = [
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.context_length=32",
        "training.batch_size=2",
        "training.max_steps=8",
        "training.checkpoint_interval=2",
        "training.async_checkpoint=true",
        "logging.log_interval=1",
        "logging.tensorboard=false",
        "system.device=cpu",
    ]
    argv = ["--debug", "--run-dir", str(run_dir), *[arg for value in sets for arg in ("--set", value)]]
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "--held", mode, str(handshakes), *argv],
        cwd=ROOT,
        env=launcher_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, run_dir, handshakes


def await_file(proc: subprocess.Popen, file: Path) -> None:
    """The handshake: file written by the process (it must still run)."""
    seen = threading.Event()
    while not file.exists():
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        seen.wait(0.02)


@pytest.mark.slow
def test_a_sigkill_during_the_background_write_leaves_the_previous_checkpoint_latest(tmp_path):
    proc, run_dir, handshakes = held_run(tmp_path, "kill")
    await_file(proc, handshakes / "holding")
    proc.kill()
    proc.communicate(timeout=60)
    checkpoints = run_dir / "checkpoints"
    # half-written: the hook holds the write after the small files, before the tensors
    assert sorted(p.name for p in (checkpoints / "step_4.tmp").iterdir()) == ["config.json", "rng_rank0.pt", "state.json"]
    assert not (checkpoints / "step_4").exists()
    assert latest(checkpoints, world_size=1) == checkpoints / "step_2" and is_complete(checkpoints / "step_2", 1)


@pytest.mark.slow
def test_a_failed_background_write_stops_the_run_with_exit_2_naming_the_file(tmp_path):
    proc, run_dir, _ = held_run(tmp_path, "fail")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == BAD_INPUT, output[-3000:]
    file = run_dir / "checkpoints" / "step_4.tmp" / "model.pt"
    assert f"cannot write checkpoint file {file} (" in output and "Traceback" not in output
    assert latest(run_dir / "checkpoints") == run_dir / "checkpoints" / "step_2"


@pytest.mark.slow
def test_sigterm_during_a_background_write_waits_for_it_and_then_saves_the_final_state(tmp_path):
    proc, run_dir, handshakes = held_run(tmp_path, "term")
    await_file(proc, handshakes / "holding")
    proc.send_signal(signal.SIGTERM)
    await_file(proc, handshakes / "waiting")  # the stop waits for step_4's write, still held
    checkpoints = run_dir / "checkpoints"
    assert not (checkpoints / "step_4").exists()
    (handshakes / "release").touch()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == by_signal(signal.SIGTERM), output[-3000:]
    stopped = output.split("Stopped by SIGTERM after step ")[1].split(";")[0]
    final = checkpoints / f"step_{int(stopped) + 1}"
    assert output.index(f"saved to {checkpoints / 'step_4'} (") < output.index("Stopped by SIGTERM")
    assert output.count(f"saved to {final}") == 1  # one line for the stop's save: "Stopped by ...; checkpoint saved to"
    assert f"Stopped by SIGTERM after step {stopped}; checkpoint saved to {final}\n" in output
    assert is_complete(checkpoints / "step_4", 1) and latest(checkpoints, 1) == final


# --- the config and the plan --------------------------------------------------------------
