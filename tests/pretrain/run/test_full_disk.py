"""A full disk (ENOSPC, EIO) is reported naming the file, never fatal where it need not be:
the launcher's logs, the console, metrics.jsonl, checkpoints and the dataset cache.

Each behaviour runs without root, on /dev/full (every write fails with ENOSPC) or a fake
file; where mount is permitted, on a real tmpfs that fills up mid-run as well."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from support.checkpointing import make_trainer
from support.processes import ROOT, launcher_env
from launcher.supervise.printer import Printer
from pretrain.checkpoint import save_restore as checkpoint
from pretrain.checkpoint.save_restore import CheckpointError
from pretrain.config import DataConfig
from pretrain.data import prepare as prep
from pretrain.data.cache import inspect_dataset
from pretrain.observe.metrics import MetricsLog
from pretrain.distributed.peer_loss import PeerFailed
from pretrain.run.files import atomic_write_text, os_error_message
from pretrain.hf import export as hf_export
from pretrain.run.refusal import Refusal
from pretrain.train import export_final, train_step

NO_SPACE = os.strerror(errno.ENOSPC)


def full(path: Path) -> Path:
    """Make path a file every write to which fails with ENOSPC, as on a full disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to("/dev/full")
    return path


@contextmanager
def tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A tmpfs of size at mount_point, unmounted afterwards; the test is skipped where mount
    is not permitted."""
    mount_point.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True, text=True
        )
    except FileNotFoundError:
        pytest.skip("no mount command on this machine")
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture
def tiny_tmpfs(tmp_path) -> Iterator[Path]:
    """A 64 KiB tmpfs (see tmpfs)."""
    with tmpfs(tmp_path / "tmpfs", "64k") as mount_point:
        yield mount_point


# --- the launcher's printer ---------------------------------------------------------------


def test_a_log_file_on_a_full_disk_is_reported_once_and_the_console_keeps_every_line(tmp_path):
    logs = tmp_path / "logs"
    full(logs / "gpu0.log")
    console = io.StringIO()
    printer = Printer(console, logs)
    for n in range(3):
        printer.worker_line("GPU0", f"line {n}")
    printer.launcher_line("the end")
    printer.close()
    out = console.getvalue().splitlines()
    warning = (
        f"launcher: warning: cannot write {logs / 'gpu0.log'}: {NO_SPACE}; this log stops here, the console keeps everything"
    )
    assert out == ["GPU0:line 0", warning, "GPU0:line 1", "GPU0:line 2", "launcher: the end"]
    # The other logs go on (the warning comes first there: it is written as gpu0.log fails).
    assert (logs / "combined.log").read_text().splitlines() == [
        warning,
        "GPU0:line 0",
        "GPU0:line 1",
        "GPU0:line 2",
        "launcher: the end",
    ]


def test_a_full_combined_log_and_a_log_that_cannot_be_created_are_reported_and_skipped(tmp_path):
    logs = tmp_path / "logs"
    full(logs / "combined.log")
    (logs / "gpu1.log").mkdir()  # opening it fails (EISDIR), as creating a file on a full disk can
    console = io.StringIO()
    printer = Printer(console, logs)
    printer.worker_line("GPU1", "hello")
    printer.worker_line("GPU1", "again")
    printer.close()
    out = console.getvalue().splitlines()
    assert [line for line in out if line.startswith("GPU1:")] == ["GPU1:hello", "GPU1:again"]
    warnings = sorted(line for line in out if line.startswith("launcher: warning: "))
    assert len(warnings) == 2
    assert warnings[0] == (
        f"launcher: warning: cannot write {logs / 'combined.log'}: {NO_SPACE}; this log stops here, the console keeps everything"
    )
    assert warnings[1].startswith(f"launcher: warning: cannot write {logs / 'gpu1.log'}: Is a directory;")


class FailingConsole(io.StringIO):
    """A terminal that hung up (EIO), or a pipe whose reader left (BrokenPipeError)."""

    def __init__(self, error: OSError) -> None:
        super().__init__()
        self.error, self.writes = error, 0

    def write(self, text: str) -> int:
        self.writes += 1
        raise self.error


def test_a_console_that_fails_with_eio_is_left_and_the_logs_keep_everything(tmp_path):
    console = FailingConsole(OSError(errno.EIO, os.strerror(errno.EIO)))
    (tmp_path / "logs").mkdir()
    printer = Printer(console, tmp_path / "logs")
    printer.worker_line("GPU0", "step 1")
    printer.worker_line("GPU0", "step 2")
    printer.launcher_line("FAILED: summary")
    printer.close()
    assert console.writes == 1  # tried once, then left alone
    assert (tmp_path / "logs" / "gpu0.log").read_text() == "step 1\nstep 2\n"
    assert (tmp_path / "logs" / "combined.log").read_text().splitlines() == [
        "launcher: warning: cannot write the console: Input/output error; it stops here, the logs keep everything",
        "GPU0:step 1",
        "GPU0:step 2",
        "launcher: FAILED: summary",
    ]


def test_a_console_whose_reader_went_away_still_ends_the_launcher(tmp_path):
    (tmp_path / "logs").mkdir()
    printer = Printer(FailingConsole(BrokenPipeError(errno.EPIPE, "Broken pipe")), tmp_path / "logs")
    with pytest.raises(BrokenPipeError):  # launcher/cli.py main turns it into exit 141
        printer.worker_line("GPU0", "anyone there?")
    printer.close()


# --- the launcher, end to end ---------------------------------------------------------------

WORKER = """
    import os, sys, time
    ready = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank0.ready")
    if os.environ["RANK"] == "0":
        print("waiting", flush=True)
        open(ready, "w").close()
        time.sleep(60)
    while not os.path.exists(ready):  # rank 0's line is out before rank 1 fails: its log is written to
        time.sleep(0.01)
    for n in range(LINES):
        print(f"line {n} " + "x" * 70, flush=True)
    print("last words", flush=True)
    sys.exit(5)
"""


def launch_printing_worker(script, run_dir: Path, lines: int) -> subprocess.CompletedProcess:
    argv = script(WORKER.replace("LINES", str(lines)), "printer.py")
    return subprocess.run(
        [sys.executable, "-m", "launcher", "--device", "cpu", "--nproc", "2", "--run-dir", str(run_dir), "--", *argv],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_full_outcome(result: subprocess.CompletedProcess, run_dir: Path, lines: int) -> None:
    """The worker's own exit code, every line on the console and the whole summary."""
    assert result.returncode == 5, result.stderr
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert sum(line.startswith("CPU1:line ") for line in out.splitlines()) == lines
    summary = out.split("launcher: FAILED: ", 1)[1]
    assert summary.startswith("CPU1 (rank 1) failed first")
    assert "exit code 5" in summary and "launcher:   last words" in summary
    assert "launcher: Stopped 1 other running worker(s); teardown took " in summary
    assert f"launcher: Full logs: {run_dir / 'logs'}\nlauncher: {'=' * 72}\n" in summary


def test_a_launcher_whose_logs_are_on_a_full_disk_ends_with_the_workers_code_and_the_full_summary(script, tmp_path):
    run_dir = tmp_path / "run"
    for name in ("cpu0.log", "cpu1.log", "combined.log"):
        full(run_dir / "logs" / name)
    result = launch_printing_worker(script, run_dir, lines=50)
    assert_full_outcome(result, run_dir, lines=50)
    for name in ("cpu0.log", "cpu1.log", "combined.log"):
        assert (
            result.stdout.count(
                f"launcher: warning: cannot write {run_dir / 'logs' / name}: {NO_SPACE}; "
                "this log stops here, the console keeps everything"
            )
            == 1
        )


def test_a_launcher_whose_logs_fill_a_tmpfs_mid_run_ends_with_the_workers_code_and_the_full_summary(script, tiny_tmpfs):
    run_dir = tiny_tmpfs / "run"
    result = launch_printing_worker(script, run_dir, lines=2000)  # about 300 KB of logs for 64 KiB
    assert_full_outcome(result, run_dir, lines=2000)
    warnings = [line for line in result.stdout.splitlines() if line.startswith("launcher: warning: cannot write ")]
    assert warnings and all(NO_SPACE in line for line in warnings)
    assert (run_dir / "logs" / "cpu1.log").read_text().startswith("line 0 ")  # written until the disk was full


# --- metrics.jsonl --------------------------------------------------------------------------


def test_metrics_that_cannot_be_written_are_one_warning_naming_the_file_and_training_goes_on(tmp_path, caplog):
    full(tmp_path / "run" / "metrics.jsonl")
    logger = logging.getLogger("test_full_disk.metrics")
    with (
        caplog.at_level(logging.WARNING, logger=logger.name),
        MetricsLog(tmp_path / "run", enabled=True, tensorboard=False, logger=logger) as metrics,
    ):
        for step in range(3):
            metrics.log_train(step, 2.0, 1e-3, 1.0, 100.0, None, None, 1.0)
        metrics.log_val(2, 2.5)
    assert [record.getMessage() for record in caplog.records] == [
        f"cannot write {tmp_path / 'run' / 'metrics.jsonl'}: {NO_SPACE}; metrics are no longer recorded there; training goes on"
    ]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.slow
def test_a_training_run_whose_metrics_file_is_on_a_full_disk_trains_to_the_end(cache, tmp_path):
    run_dir = tmp_path / "run"
    full(run_dir / "metrics.jsonl")
    result = subprocess.run(
        [
            sys.executable,
            "pretrain_main.py",
            "--debug",
            "--max-steps",
            "3",
            "--run-dir",
            str(run_dir),
            "--set",
            f"data.cache_dir={cache}",
        ],
        cwd=ROOT,
        env=launcher_env(HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    log = result.stdout + result.stderr
    assert log.count(f"cannot write {run_dir / 'metrics.jsonl'}: {NO_SPACE}") == 1
    assert "Training complete: 3 steps" in log
    assert checkpoint.latest(run_dir / "checkpoints") == run_dir / "checkpoints" / "step_3"


# --- checkpoints ----------------------------------------------------------------------------


def test_a_checkpoint_that_hits_a_full_disk_names_the_file_and_leaves_the_previous_one_resumable(cache, tmp_path, monkeypatch):
    trainer = make_trainer(cache, tmp_path / "run")
    for step in range(2):
        train_step(trainer, step)
    previous = checkpoint.save(trainer, 2, trainer.run_dir)
    train_step(trainer, 2)
    real_save = torch.save

    def disk_fills(value, handle, *args, **kwargs):
        if Path(handle.name).name != "model.pt":
            return real_save(value, handle, *args, **kwargs)
        handle.write(b"\0" * 4096)  # half-way through, as a write(2) fails: no file named
        raise OSError(errno.ENOSPC, NO_SPACE)

    monkeypatch.setattr(torch, "save", disk_fills)
    with pytest.raises(CheckpointError) as error:
        checkpoint.save(trainer, 3, trainer.run_dir)
    monkeypatch.undo()
    assert str(error.value).startswith(
        f"cannot write checkpoint file {trainer.run_dir / 'checkpoints' / 'step_3.tmp' / 'model.pt'} ("
    )
    assert sorted(p.name for p in (trainer.run_dir / "checkpoints").iterdir()) == ["step_2"]  # no partial step_3
    assert checkpoint.latest(trainer.run_dir / "checkpoints") == previous
    resumed = make_trainer(cache, tmp_path / "resumed")
    assert checkpoint.restore(resumed, previous) == 2


def test_an_export_at_the_end_of_training_on_a_full_disk_names_the_file_and_how_to_export_the_saved_checkpoint(
    cache, tmp_path, monkeypatch
):
    trainer = make_trainer(cache, tmp_path / "run")
    train_step(trainer, 0)
    final = checkpoint.save(trainer, 1, trainer.run_dir)
    weights = trainer.run_dir / "export" / "model.safetensors"

    def disk_fills(*args, **kwargs):
        raise OSError(errno.ENOSPC, NO_SPACE, str(weights))

    monkeypatch.setattr(hf_export, "write_shards", disk_fills)
    with pytest.raises(Refusal) as error:
        export_final(trainer, final)
    assert error.value.exit_code == 2
    assert str(error.value) == (
        f"{weights}: {NO_SPACE}; the final checkpoint {final} is saved but not exported: make room (or make the "
        f"directory writable), then `python -m pretrain.export --checkpoint {final}` exports it"
    )


def test_the_export_command_an_unwritten_export_names_runs_as_pasted_into_a_shell_whatever_the_run_dirs_name():
    final = "/runs/my run/checkpoints/step_2"
    line = hf_export.not_written(OSError(errno.ENOSPC, NO_SPACE, "/runs/my run/export"), final)
    command = line.split("`")[1]
    assert shlex.split(command) == ["python", "-m", "pretrain.export", "--checkpoint", final]


def test_a_checkpoint_that_fills_a_tmpfs_names_the_file_gives_the_space_back_and_keeps_the_previous_one(cache, tmp_path):
    trainer = make_trainer(cache, tmp_path / "measure")
    train_step(trainer, 0)
    size = sum(f.stat().st_size for f in checkpoint.save(trainer, 1, trainer.run_dir).iterdir())
    # Room for one checkpoint and half of the next: the second save fills the disk.
    with tmpfs(tmp_path / "tmpfs", str(size * 3 // 2)) as disk:
        trainer.run_dir = disk / "run"
        previous = checkpoint.save(trainer, 1, trainer.run_dir)
        train_step(trainer, 1)
        with pytest.raises(CheckpointError) as error:
            checkpoint.save(trainer, 2, trainer.run_dir)
        unfinished = disk / "run" / "checkpoints" / "step_2.tmp"
        assert str(error.value).startswith(f"cannot write checkpoint file {unfinished}/")
        assert "KiB free on its disk); make room on its disk" in str(error.value)
        assert entries(disk / "run" / "checkpoints") == ["step_1"]
        assert shutil.disk_usage(disk).used < size * 5 // 4  # the unfinished save's space came back
        assert checkpoint.restore(make_trainer(cache, tmp_path / "resumed"), previous) == 1


def test_a_rank_whose_unfinished_checkpoint_rank_0_removed_fails_as_a_consequence_not_a_cause(cache, tmp_path):
    trainer = make_trainer(cache, tmp_path / "run")
    trainer.runtime = dataclasses.replace(trainer.runtime, rank=1)  # it writes into the directory rank 0 made
    unfinished = trainer.run_dir / "checkpoints" / "step_1.tmp"
    with pytest.raises(PeerFailed) as error:  # rank 0's part failed, and it took the directory away
        checkpoint.save(trainer, 1, trainer.run_dir)
    assert str(error.value) == (
        f"cannot write this rank's part of checkpoint {unfinished}: rank 0 removed the unfinished checkpoint, "
        "its own part having failed (a consequence of that rank's failure, which its own lines name)"
    )
    (unfinished / "rng_rank1.pt").mkdir(parents=True)  # the directory is there: this rank's own failure is a cause
    with pytest.raises(CheckpointError, match="cannot write checkpoint file .*rng_rank1.pt"):
        checkpoint.save(trainer, 1, trainer.run_dir)


def test_a_state_file_that_hits_a_full_disk_names_the_file(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    target.write_text("old\n")

    def write_to_full_disk(self, text, *args, **kwargs):
        with open("/dev/full", "w") as device:
            device.write(text)

    monkeypatch.setattr(Path, "write_text", write_to_full_disk)
    with pytest.raises(OSError) as error:
        atomic_write_text(target, "new\n")
    monkeypatch.undo()
    assert os_error_message(error.value) == f"{target}: {NO_SPACE}"
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


# --- a full disk under two ranks: who failed first (issue 28) -------------------------------


def launch_two_ranks_onto(disk: Path, cache: Path) -> subprocess.CompletedProcess:
    """The debug preset on 2 gloo CPU workers for one step into disk/run: its final checkpoint
    (weights 1.8 MB, optimizer state 3.7 MB) fills a 3 MB disk while rank 0 writes it, and rank 1
    waits at the checkpoint's barrier."""
    argv = ["--debug", "--device", "cpu", "--nproc", "2", "--max-steps", "1", "--run-dir", str(disk / "run")]
    sets = [f"data.cache_dir={cache}", "data.context_length=64", "training.batch_size=4", "logging.tensorboard=false"]
    return subprocess.run(
        [sys.executable, "-m", "launcher", *argv, *[part for value in sets for part in ("--set", value)]],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
@pytest.mark.parametrize("repeat", range(3))
def test_a_checkpoint_that_fills_a_tmpfs_under_two_ranks_names_the_rank_that_could_not_write(cache, tmp_path, repeat):
    with tmpfs(tmp_path / "tmpfs", "3m") as disk:
        result = launch_two_ranks_onto(disk, cache)
        record = json.loads((disk / "run" / "workers.json").read_text())
        rank1_log = (disk / "run" / "logs" / "cpu1.log").read_text()
    out = result.stdout
    assert result.returncode == 2, out[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in out + result.stderr
    # Rank 0 cannot write the optimizer's state. Rank 1 then loses the connection at the barrier,
    # or finds the unfinished checkpoint removed: a consequence, exit 4 (unless the teardown's
    # SIGTERM comes first: 143). Rarely, under load, its own small file lands while the disk is
    # full: then it is a cause as well, and either may be named.
    causes = [label for label in ("CPU0", "CPU1") if f"{label}:ERROR | [CPU {label[3]}] cannot write checkpoint file " in out]
    assert causes[0] == "CPU0" and "0 KiB free on its disk" in out
    summary = out.split("launcher: FAILED: ", 1)[1].splitlines()
    named = summary[0].split(" ", 1)[0]
    assert named in causes and summary[0].endswith(": exit code 2."), out[-3000:]
    exits = {r["label"]: (r["exit_code"], r["failed_first"], r["consequence"]) for r in record}
    assert exits[named] == (2, True, False)
    if causes == ["CPU0"]:
        assert named == "CPU0"
        assert exits["CPU1"] in [(4, False, True), (143, False, False)], exits
    if exits["CPU1"][0] == 4:
        assert "launcher: Not a cause: CPU1 (rank 1), exit code 4, " in out
    if "CPU1:ERROR | [CPU 1] lost the connection to another rank during barrier" in out:
        # gloo says the peer went away as "closed" or "reset", as the socket happened to see it
        # (pretrain/distributed/peer_loss.py takes both)
        gone = ("Connection closed by peer", "Connection reset by peer")
        assert "Traceback (most recent call last):" in rank1_log and any(word in rank1_log for word in gone), rank1_log[-2000:]


# --- the dataset cache ----------------------------------------------------------------------

DOCUMENTS = [f"document {i}: " + "some text to tokenize " * 20 for i in range(400)]  # ~180 KB of tokens


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_preparing_into_a_full_disk_names_the_file_and_keeps_the_last_good_cache(tmp_path, monkeypatch):
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    built = prep.prepare(cfg, log=lambda _: None, documents=DOCUMENTS)
    meta_before = json.loads((built / "meta.json").read_text())

    def open_on_full_disk(path, mode="r", *args, **kwargs):  # tokens.bin lands on a full disk
        if Path(path).name == prep.TOKENS_FILE:
            return open("/dev/full", mode, *args, **kwargs)
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(prep, "open", open_on_full_disk, raising=False)
    with pytest.raises(OSError) as error:
        prep.prepare(cfg, log=lambda _: None, documents=DOCUMENTS, force=True)
    monkeypatch.undo()
    message = os_error_message(error.value)
    assert message.startswith(str(tmp_path / "cache")) and message.endswith(f"/{prep.TOKENS_FILE}: {NO_SPACE}")
    assert entries(tmp_path / "cache") == [built.name]  # no temporary directory, no lock left
    assert inspect_dataset(built, meta_before["key"])[0] == meta_before


def test_preparing_into_a_tmpfs_that_fills_up_names_the_file_and_leaves_nothing(tiny_tmpfs):
    cfg = DataConfig(cache_dir=str(tiny_tmpfs / "cache"))
    with pytest.raises(OSError) as error:
        prep.prepare(cfg, log=lambda _: None, documents=DOCUMENTS)
    assert os_error_message(error.value).endswith(f"/{prep.TOKENS_FILE}: {NO_SPACE}")
    assert error.value.filename.startswith(str(tiny_tmpfs / "cache"))
    assert entries(tiny_tmpfs / "cache") == []
