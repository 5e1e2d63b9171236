"""--max-restarts end to end, with real launchers and workers on CPU: a command of one's own restarted
as torchrun would by the rules of launcher/supervise/restarts.py, training resumed from its last
checkpoint with the same losses as an uninterrupted run, and the refusals of bad restart options."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from support.processes import ROOT, launcher_env, wait_until
from support.runs import assert_one_line_error, losses, run_launcher as launch
from launcher import cli
from launcher.attempts import Attempts, StoppedBetweenAttempts
from launcher.errors import UsageError
from launcher.exit_codes import by_signal
from launcher.gpus import vendors
from launcher.gpus.placement import GpuOptions, Placement
from launcher.restart_plan import Devices
from launcher.supervise.printer import Printer
from launcher.supervise.restarts import AttemptEnd
from pretrain import config as cfg
from pretrain.run.exit_codes import stop_signal

# Rank 1 dies by SIGKILL in the first FAILING attempts; every rank says what it sees first.
KILLED_WHILE = """
import os, signal, sys
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
print(f"attempt {attempt} of {os.environ['TORCHELASTIC_MAX_RESTARTS']}: rank {rank} of {os.environ['WORLD_SIZE']}", flush=True)
if rank == 1 and attempt < FAILING:
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(EXIT)
"""


def own_command(script, failing: int, exit_code: int = 0) -> list[str]:
    return script(KILLED_WHILE.replace("FAILING", str(failing)).replace("EXIT", str(exit_code)))


def attempts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]


def test_a_command_whose_worker_is_killed_runs_again_and_its_workers_see_the_restart_count(tmp_path, script):
    run_dir = tmp_path / "run"
    options = ["--nproc", "2", "--max-restarts", "2", "--restart-backoff", "0", "--run-dir", str(run_dir)]
    result = launch(*options, "--", *own_command(script, 1))
    assert result.returncode == 0, result.stdout[-2000:]
    assert "launcher: restart 1 of 2 in 0 s: CPU1 was killed by SIGKILL" in result.stdout
    assert "CPU1:attempt 0 of 2: rank 1 of 2" in result.stdout and "CPU1:attempt 1 of 2: rank 1 of 2" in result.stdout
    assert [(a["attempt"], a["exit_code"], a["worker"], a["restarted"]) for a in attempts(run_dir)] == [
        (0, 137, "CPU1", True),
        (1, 0, None, False),
    ]
    assert "launcher: attempts: 2 (restarts.jsonl)" in result.stdout
    combined = (run_dir / "logs" / "combined.log").read_text()  # the log tells the whole story too
    assert "launcher: restart 1 of 2 in 0 s" in combined and "launcher: attempts: 2" in combined


def test_a_spent_budget_ends_with_the_last_failures_code_and_every_attempt_listed(tmp_path, script):
    run_dir = tmp_path / "run"
    options = ["--nproc", "2", "--max-restarts", "1", "--restart-backoff", "0", "--run-dir", str(run_dir)]
    result = launch(*options, "--", *own_command(script, 9))
    assert result.returncode == 137
    assert "launcher: not restarted: CPU1 was killed by SIGKILL; the restart budget (1) is used up" in result.stdout
    assert [a["exit_code"] for a in attempts(run_dir)] == [137, 137]
    assert re.search(r"launcher:   1\. from step 0 on CPU0, CPU1: CPU1: killed by SIGKILL; exit code 137", result.stdout)


def test_a_command_that_fails_on_its_own_is_not_restarted(tmp_path, script):
    run_dir = tmp_path / "run"
    result = launch("--nproc", "2", "--max-restarts", "3", "--run-dir", str(run_dir), "--", *own_command(script, 0, exit_code=1))
    assert result.returncode == 1
    assert "launcher: not restarted: exit code 1 shows no hardware, network or timeout cause: it would repeat" in result.stdout
    assert len(attempts(run_dir)) == 1 and "restart 1" not in result.stdout


def test_a_worker_stopped_by_sigterm_from_outside_is_named_and_not_restarted(tmp_path, script):
    run_dir = tmp_path / "run"
    # Rank 1 reports a step, then another process (here: itself) sends it SIGTERM; rank 0 waits to be stopped.
    command = script(
        "import os, signal, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('[CPU 1] Step [3/10] | Loss: 1.0', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(60)\n"
    )
    result = launch("--nproc", "2", "--max-restarts", "2", "--restart-backoff", "0", "--run-dir", str(run_dir), "--", *command)
    assert result.returncode == 143, result.stdout[-2000:]
    said = "launcher: not restarted: CPU1 was stopped by SIGTERM from outside the launcher: a stop is never undone"
    assert said in result.stdout
    assert [(a["worker"], a["restarted"]) for a in attempts(run_dir)] == [("CPU1", False)]


def test_a_fail_fast_run_writes_no_record_and_says_nothing_of_restarts(tmp_path, script):
    run_dir = tmp_path / "run"
    result = launch("--nproc", "2", "--run-dir", str(run_dir), "--", *own_command(script, 1))
    assert result.returncode == 137
    assert not (run_dir / "restarts.jsonl").exists() and "restart" not in result.stdout


def test_ctrl_c_during_a_run_with_restarts_left_stops_it_without_a_restart(tmp_path, script, processes):
    run_dir = tmp_path / "run"
    command = script("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    launcher = processes(
        [sys.executable, "-m", "launcher", "--nproc", "2", "--max-restarts", "2", "--run-dir", str(run_dir), "--", *command],
        stdout=subprocess.PIPE,
        text=True,
    )
    seen = []
    assert wait_until(lambda: seen.append(launcher.stdout.readline()) or sum("ready" in line for line in seen) == 2, timeout=30)
    launcher.send_signal(signal.SIGINT)
    out = "".join(seen) + launcher.communicate(timeout=30)[0]
    assert launcher.returncode == 130, out
    assert "restart 1" not in out and attempts(run_dir)[0]["why"] == "the stop was asked for"


def test_restart_options_out_of_range_are_refused_in_one_line(tmp_path):
    for args, text in [
        (["--max-restarts", "-1"], "--max-restarts must be between 0 and 1000 (got -1); 0 turns restarts off"),
        (["--min-nproc", "1"], "--min-nproc only applies to restarts: add --max-restarts N"),
        (["--max-restarts", "1", "--min-nproc", "0"], "--min-nproc must be at least 1 (got 0)"),
        (["--max-restarts", "1", "--restart-backoff", "nan"], "--restart-backoff must be between 0 and 60 seconds (got nan)"),
    ]:
        result = launch(*args, "--debug", "--device", "cpu", "--run-dir", str(tmp_path / "r"))
        assert (result.returncode, result.stderr) == (2, f"launcher: error: {text}\n"), args


def test_min_nproc_above_the_workers_asked_for_or_a_global_batch_it_cannot_keep_is_refused_before_anything_runs(tmp_path):
    run_dir = tmp_path / "r"
    common = ["--debug", "--device", "cpu", "--max-restarts", "1", "--run-dir", str(run_dir)]
    above = launch(*common, "--nproc", "2", "--min-nproc", "3")
    assert above.returncode == 2
    assert above.stderr == "launcher: error: --min-nproc 3 is more than this run's 2 worker(s); give at most 2\n"
    batch = launch(*common, "--nproc", "3", "--min-nproc", "2")  # 3 x batch 8 = 24 sequences: 2 x 8 does not divide them
    assert batch.returncode == 2
    assert batch.stderr.startswith(
        "launcher: error: --min-nproc 2: the global batch of 24 sequences cannot be kept on 2 worker(s) "
        "(not a multiple of training.batch_size 8 x 2)"
    )
    auto = ["--set", "training.grad_accum_nums=auto", "--set", "training.global_batch_size=8"]
    shared = launch(*common, "--nproc", "4", "--min-nproc", "3", *auto)  # under auto, 8 is shared out: 3 cannot
    assert shared.returncode == 2
    assert shared.stderr.startswith(
        "launcher: error: --min-nproc 3: the global batch of 8 sequences cannot be kept on 3 worker(s) "
        "(not a multiple of 3: grad_accum_nums auto shares it equally over the workers)"
    )
    assert not run_dir.exists()  # refused before the run directory was made


def test_the_launcher_help_names_the_restart_options():
    out = launch("--help").stdout
    for option in ("--max-restarts N", "--min-nproc M", "--restart-backoff S"):
        assert option in out


# Rank 1 of the first attempt reports its GPU failing (the scripted machine's file, re-read by NVML's
# stand-in when it changes) and dies; the restart finds one healthy GPU.
GPU_FAILS = """
import json, os, signal, sys
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
gpu = os.environ.get("ROCR_VISIBLE_DEVICES") or os.environ["CUDA_VISIBLE_DEVICES"]  # AMD's, else NVIDIA's
print(f"attempt {attempt}: rank {rank} of {os.environ['WORLD_SIZE']} on {gpu}", flush=True)
if attempt == 0 and rank == 1:
    path = os.environ["LAUNCHER_SCRIPTED_GPUS"]
    machine = json.load(open(path))
    machine["gpus"][1]["ecc_uncorrected"] = 2
    with open(path + ".new", "w") as file:
        json.dump(machine, file)
    os.replace(path + ".new", path)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_restart_leaves_a_failing_gpu_out_and_with_min_nproc_continues_on_fewer(tmp_path, script, scripted_gpus):
    scripted_gpus([{"uuid": "GPU-a"}, {"uuid": "GPU-b"}])
    run_dir = tmp_path / "run"
    options = ["--gpus", "all", "--max-restarts", "1", "--restart-backoff", "0", "--min-nproc", "1", "--run-dir", str(run_dir)]
    result = launch(*options, "--", *script(GPU_FAILS))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "GPU1:attempt 0: rank 1 of 2 on GPU-b" in result.stdout
    assert "GPU0:attempt 1: rank 0 of 1 on GPU-a" in result.stdout  # GPU 1 failed its health check: left out
    assert [a["devices"] for a in attempts(run_dir)] == [["GPU0", "GPU1"], ["GPU0"]]


def test_gpus_named_with_gpus_are_chosen_again_too_leaving_out_the_one_that_failed_its_health_check(
    tmp_path, script, scripted_gpus, vendor
):
    scripted_gpus([{}, {}, {}])
    first = vendors.backend(None).discover(window=0)[0].visible_id
    run_dir = tmp_path / "run"
    options = ["--gpus", "0,1", "--max-restarts", "1", "--restart-backoff", "0", "--min-nproc", "1", "--run-dir", str(run_dir)]
    result = launch(*options, "--", *script(GPU_FAILS))
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"GPU0:attempt 1: rank 0 of 1 on {first}" in result.stdout and "unhealthy" not in result.stdout.split("restart 1")[1]
    assert [a["devices"] for a in attempts(run_dir)] == [["GPU0", "GPU1"], ["GPU0"]]  # never GPU 2, which --gpus left out


def test_a_restart_that_cannot_get_its_gpus_back_waits_then_stops_with_the_last_failures_code(tmp_path, script, scripted_gpus):
    scripted_gpus([{"uuid": "GPU-a"}, {"uuid": "GPU-b"}])
    run_dir = tmp_path / "run"
    options = ["--gpus", "all", "--max-restarts", "1", "--restart-backoff", "0", "--join-timeout", "1", "--run-dir", str(run_dir)]
    result = launch(*options, "--", *script(GPU_FAILS))
    assert result.returncode == 137, result.stdout[-3000:]
    assert "launcher: waiting up to 1 s for 2 free, healthy device(s) to restart on (--min-nproc M would" in result.stdout
    assert "launcher: no restart: " in result.stdout and "waited 1 s (--join-timeout) for 2 device(s)" in result.stdout
    (only,) = attempts(run_dir)
    assert not only["restarted"] and only["why"].startswith("no restart: ")


def train(cache: Path, run_dir: Path, *options: str, faults: str = "", nproc: int = 2) -> subprocess.CompletedProcess:
    """A debug run of 12 steps on nproc CPU ranks, a checkpoint every 3, into run_dir, with PRETRAIN_FAULTS."""
    argv = ["--debug", "--device", "cpu", "--nproc", str(nproc), "--max-steps", "12", "--run-dir", str(run_dir)]
    argv += ["--set", f"data.cache_dir={cache}", "--set", "training.checkpoint_interval=3", *options]
    return launch(*argv, timeout=180, **({"PRETRAIN_FAULTS": faults} if faults else {}))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The reference: the same 2-rank run without a fault (its data cache beside it, for the others too)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    plain = train(root / "cache", root / "plain")
    assert plain.returncode == 0, plain.stdout[-2000:]
    return root / "plain"


def test_training_killed_twice_resumes_from_its_checkpoints_with_the_losses_of_an_uninterrupted_run(uninterrupted, tmp_path):
    restarts = ["--max-restarts", "2", "--restart-backoff", "0"]
    healed = train(uninterrupted.parent / "cache", tmp_path / "healed", *restarts, faults="0:1:4:sigkill,1:1:8:sigkill")
    assert healed.returncode == 0, healed.stdout[-3000:]
    assert "launcher: resuming from " in healed.stdout and healed.stdout.count("launcher: restart ") == 2
    reference, redone = losses(uninterrupted), losses(tmp_path / "healed")
    assert sorted(redone) == sorted(reference) == list(range(12))
    for step, values in redone.items():  # steps 3-4 and 6-8 ran twice: the same loss each time
        assert values == [reference[step][0]] * len(values), step
    assert [(a["resumed_from"] or "").rpartition("/")[2] for a in attempts(tmp_path / "healed")] == ["", "step_3", "step_6"]


def test_the_same_failure_at_the_same_step_twice_in_a_row_is_not_restarted_again(tmp_path):
    result = train(tmp_path / "cache", tmp_path / "r", "--max-restarts", "5", "--restart-backoff", "0", faults="*:1:4:sigkill")
    assert result.returncode == 137, result.stdout[-3000:]
    assert "launcher: not restarted: the same failure (killed by SIGKILL) at the same step (4) twice in a row" in result.stdout
    assert [a["step"] for a in attempts(tmp_path / "r")] == [4, 4]
    assert "launcher: Hint: the worker failed on purpose: PRETRAIN_FAULTS injected this fault" in result.stdout


def test_a_malformed_pretrain_faults_is_refused_by_the_launcher_before_anything_runs(tmp_path):
    result = launch("--debug", "--device", "cpu", "--run-dir", str(tmp_path / "r"), PRETRAIN_FAULTS="0:1:x:sigkill")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("launcher: error: PRETRAIN_FAULTS entry '0:1:x:sigkill': STEP 'x' is not a whole number")
    assert not (tmp_path / "r").exists()


def test_a_training_worker_killed_before_its_first_step_is_not_restarted(tmp_path, processes):
    argv = [sys.executable, "-m", "launcher", "--debug", "--device", "cpu", "--nproc", "2", "--max-restarts", "2"]
    argv += ["--run-dir", str(tmp_path / "r"), "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    launcher = processes(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=launcher_env())
    seen: list[str] = []
    # The handshake: rank 1 says it built its model; its first step is still to come.
    assert wait_until(lambda: seen.append(launcher.stdout.readline()) or "CPU1:INFO | [CPU 1] Model:" in seen[-1], timeout=120)
    rank1 = [p for p in psutil.Process(launcher.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
    rank1[0].send_signal(signal.SIGKILL)
    out = "".join(seen) + launcher.communicate(timeout=120)[0]
    assert launcher.returncode == 137, out[-3000:]
    assert "launcher: not restarted: CPU1 was killed by SIGKILL before the first step" in out


def test_a_restart_on_fewer_workers_keeps_the_global_batch_and_the_losses(uninterrupted, tmp_path):
    args = cli.build_parser().parse_args(["--debug", "--max-restarts", "1", "--min-nproc", "1"])
    config = cfg.with_world_size(cfg.from_args(args), 2)
    attempts_ = Attempts(args, config, [], uninterrupted, Printer(io.StringIO(), None))
    shrunk = attempts_.restart_config(world_size=1, first_world=2)  # what a restart onto 1 worker runs
    assert shrunk.training.global_batch_size == 16 and shrunk.training.resume.endswith("checkpoints/step_12")
    batch = f"training.global_batch_size={shrunk.training.global_batch_size}"
    step_9 = str(uninterrupted / "checkpoints" / "step_9")
    one = train(uninterrupted.parent / "cache", tmp_path / "one", "--resume", step_9, "--set", batch, nproc=1)
    assert one.returncode == 0, one.stdout[-2000:]
    assert "accum 2 x 1 rank" in one.stdout  # 2,048 tokens per step, as on 2 ranks
    reference, resumed = losses(uninterrupted), losses(tmp_path / "one")
    assert sorted(resumed) == [9, 10, 11]
    for step in resumed:
        assert resumed[step][0] == pytest.approx(reference[step][0], rel=1e-5), step


def test_a_restart_resumes_from_the_checkpoint_the_run_started_from_while_it_has_none_of_its_own(uninterrupted, tmp_path):
    step_9 = (uninterrupted / "checkpoints" / "step_9").resolve()  # another run's checkpoint, given to --resume
    restarts = ["--resume", str(step_9), "--max-restarts", "1", "--restart-backoff", "0"]
    result = train(
        uninterrupted.parent / "cache",
        tmp_path / "b",
        *restarts,
        "--set",
        "training.checkpoint_interval=100",
        faults="0:1:10:sigkill",
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"launcher: resuming from {step_9} (where the run started: it has no newer complete checkpoint)" in result.stdout
    assert "starting again at step 0" not in result.stdout
    reference, resumed = losses(uninterrupted), losses(tmp_path / "b")
    assert sorted(resumed) == [9, 10, 11]
    for step, values in resumed.items():  # steps 9-10 ran twice, from step_9 both times
        assert values == [reference[step][0]] * len(values), step


def restarts_of(run_dir: Path, config_changes: dict | None = None, *options: str) -> Attempts:
    """The restart loop of a 2-worker debug run in run_dir, as the launcher makes it (its lines on stdout)."""
    args = cli.build_parser().parse_args(["--debug", "--max-restarts", "1", "--restart-backoff", "0", *options])
    config = cfg.with_world_size(cfg.from_args(args), 2)
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, **(config_changes or {})))
    return Attempts(args, config, [], run_dir, Printer(sys.stdout, None))


def test_a_restart_passes_over_an_older_checkpoint_of_its_own_for_the_one_it_started_from(uninterrupted, tmp_path, capsys):
    shutil.copytree(uninterrupted / "checkpoints" / "step_9", tmp_path / "run" / "checkpoints" / "step_9")
    step_12 = str((uninterrupted / "checkpoints" / "step_12").resolve())
    assert restarts_of(tmp_path / "run", {"resume": step_12}).restart_config(2, 2).training.resume == step_12


def test_a_restart_without_a_checkpoint_starts_again_from_the_init_from_weights(tmp_path, capsys):
    restarted = restarts_of(tmp_path / "run", {"init_from": "/exports/llama"}).restart_config(2, 2)
    assert (restarted.training.resume, restarted.training.init_from) == ("", "/exports/llama")
    said = "no complete checkpoint yet: starting again at step 0 from training.init_from's weights (/exports/llama)"
    assert f"launcher: {said}" in capsys.readouterr().out


def test_a_restart_says_why_it_passes_over_a_damaged_newer_checkpoint(uninterrupted, tmp_path, capsys):
    for step in ("step_9", "step_12"):
        shutil.copytree(uninterrupted / "checkpoints" / step, tmp_path / "run" / "checkpoints" / step)
    model = tmp_path / "run" / "checkpoints" / "step_12" / "model.pt"
    model.write_bytes(model.read_bytes()[:100])  # truncated while the launcher waited to restart
    restarted = restarts_of(tmp_path / "run").restart_config(2, 2)
    assert Path(restarted.training.resume).name == "step_9"
    out = capsys.readouterr().out
    assert "launcher: warning: not resuming from the later step_12: model.pt" in out, out
    assert "launcher: resuming from " in out


KILLED_AT_5 = AttemptEnd(by_signal(signal.SIGKILL), worker="CPU1", rank=1, how="killed by SIGKILL", step=5)


def killed_then(prepare):
    """An attempt function: the first attempt's CPU1 killed after step 5; the next one's preparation
    (before its workers are spawned) is prepare(config)."""

    def attempt(config: cfg.Config, restarts, started) -> tuple[int, AttemptEnd]:
        if restarts.count == 0:
            started()
            return KILLED_AT_5.exit_code, KILLED_AT_5
        prepare(config)
        raise AssertionError("prepare() was to end the launch")

    return attempt


def cpu_devices() -> Devices:
    return Devices(GpuOptions(device="cpu", nproc=2), Placement("cpu", 2))


def test_a_full_disk_while_the_next_attempt_is_prepared_records_no_restart_and_names_the_fix(tmp_path, capsys):
    config_json = tmp_path / "run" / "config.json"

    def full(config: cfg.Config) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(config_json))

    with pytest.raises(UsageError) as refused:
        restarts_of(tmp_path / "run").run(killed_then(full), cpu_devices())
    assert str(refused.value) == (
        f"no restart: {config_json}: No space left on device; make room on its disk (or make it writable), "
        "then continue the run with --resume auto"
    )
    (only,) = attempts(tmp_path / "run")
    assert (only["restarted"], only["why"]) == (False, str(refused.value))
    out = capsys.readouterr().out
    assert "launcher: attempts: 1 (restarts.jsonl)\nlauncher:   0. from step 0 on CPU0, CPU1: CPU1: killed by SIGKILL" in out


def test_a_stop_signal_while_the_next_attempt_is_prepared_records_no_restart_and_lists_the_attempts(tmp_path, capsys):
    def stopped(config: cfg.Config) -> None:
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # (else it would end pytest itself)
        signal.raise_signal(signal.SIGTERM)

    assert restarts_of(tmp_path / "run").run(killed_then(stopped), cpu_devices()) == 143
    (only,) = attempts(tmp_path / "run")
    assert (only["restarted"], only["why"]) == (False, "stopped by SIGTERM before the restart")
    out = capsys.readouterr().out
    assert "launcher: stopped by SIGTERM: no restart; the run's checkpoints are kept" in out
    assert "launcher: attempts: 1 (restarts.jsonl)" in out


def test_the_record_says_no_restart_until_the_next_attempt_begins_and_a_stop_in_the_backoff_lists_the_attempts(
    tmp_path, script, processes
):
    run_dir = tmp_path / "run"
    options = ["--nproc", "2", "--max-restarts", "2", "--restart-backoff", "60", "--run-dir", str(run_dir)]
    argv = [sys.executable, "-m", "launcher", *options, "--", *own_command(script, 1)]
    launcher = processes(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=launcher_env())
    seen: list[str] = []
    assert wait_until(
        lambda: seen.append(launcher.stdout.readline()) or "launcher: restart 1 of 2 in 60 s" in seen[-1], timeout=60
    )
    (waiting,) = attempts(run_dir)
    assert (waiting["restarted"], waiting["why"]) == (False, "CPU1 was killed by SIGKILL (restart 1 pending)")
    launcher.send_signal(signal.SIGTERM)
    out = "".join(seen) + launcher.communicate(timeout=30)[0]
    assert launcher.returncode == 143, out
    (only,) = attempts(run_dir)
    assert (only["restarted"], only["why"]) == (False, "stopped by SIGTERM before the restart")
    assert "launcher: attempts: 1 (restarts.jsonl)" in out


def test_a_second_launch_in_the_same_run_directory_keeps_the_first_launchs_attempts(tmp_path, script):
    run_dir = tmp_path / "run"
    options = ["--nproc", "2", "--max-restarts", "1", "--restart-backoff", "0", "--run-dir", str(run_dir)]
    for _ in range(2):  # as `--resume auto` or a Slurm requeue launches a run again
        result = launch(*options, "--", *own_command(script, 1))
        assert result.returncode == 0, result.stdout[-2000:]
    assert [(a["launch"], a["attempt"], a["restarted"]) for a in attempts(run_dir)] == [
        (1, 0, True),
        (1, 1, False),
        (2, 0, True),
        (2, 1, False),
    ]
    assert "launcher: attempts of launch 2: 2 (restarts.jsonl)" in result.stdout


def test_a_restart_backoff_without_max_restarts_is_refused_like_min_nproc(tmp_path):
    result = launch("--restart-backoff", "5", "--run-dir", str(tmp_path / "r"), "--", sys.executable, "-c", "pass")
    assert_one_line_error(result, "--restart-backoff only applies to restarts: add --max-restarts N", prefix="launcher: error: ")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_between_attempts_is_read_as_its_signal_by_a_dataset_preparation_on_its_way(signum):
    # The first attempt's dataset preparation says "preparation interrupted by SIGINT" and cleans up.
    assert stop_signal(StoppedBetweenAttempts(signum)) == signum
