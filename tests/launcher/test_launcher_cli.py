"""The launcher's command line: bad input, the generic mode, signals (device placement: test_placement.py)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from support.processes import ROOT, alive, launcher_env, wait_until
from support.runs import assert_one_line_error
from support.runs import run_launcher as launch
from launcher.processes.reaper import TOKEN_VAR


def launch_debug(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The debug preset on CPU workers into tmp_path/r, with the test's own data cache."""
    return launch(
        "--debug", "--device", "cpu", "--run-dir", str(tmp_path / "r"), "--set", f"data.cache_dir={tmp_path / 'cache'}", *args
    )


# The launcher's refusals: `launcher: error: ...` on stderr (its stdout may already have said what it did).
REFUSAL = {"prefix": "launcher: error: ", "quiet_stdout": False}


@pytest.mark.parametrize(
    "args, text",
    [
        (["--nproc", "0"], "--nproc must be at least 1 (got 0)"),
        (["--kill-grace", "-1"], "--kill-grace must be between 0 and 3600 seconds (got -1)"),
        (["--kill-grace", "inf"], "--kill-grace must be between 0 and 3600 seconds (got inf)"),
        (["--kill-grace", "nan"], "--kill-grace must be between 0 and 3600 seconds (got nan)"),
        (["--stop-timeout", "-5"], "--stop-timeout must be between 0 and 86400 seconds (got -5)"),
        (["--hang-timeout", "0"], "--hang-timeout must be between 1 and 86400 seconds (got 0)"),
        (["--set", "training.batchsize=4"], "training.batchsize: unknown key; did you mean training.batch_size?"),
        (["--config", "no/such.json"], "no/such.json: config file not found"),
        (
            ["--max-steps", "10000000000000000000000"],
            "--max-steps: training.max_steps: must be at most 1000000000000 (got 10000000000000000000000)",
        ),
    ],
)
def test_bad_options_give_one_line_and_exit_2(args, text, tmp_path):
    assert_one_line_error(launch("--device", "cpu", "--run-dir", str(tmp_path / "r"), *args, "--", "true"), text, **REFUSAL)


def test_a_command_that_does_not_exist_exits_127_with_one_line(tmp_path):
    result = launch("--device", "cpu", "--run-dir", str(tmp_path / "r"), "--", "no-such-command-xyz")
    assert_one_line_error(result, "command not found: no-such-command-xyz", code=127, **REFUSAL)


def test_an_unwritable_run_directory_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = launch("--device", "cpu", "--run-dir", str(blocker / "run"), "--", "true")
    assert_one_line_error(result, "cannot create run directory", **REFUSAL)


def test_generic_mode_runs_the_command_once_per_worker_with_the_contract_env(script, tmp_path):
    argv = script("import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], repr(os.environ['CUDA_VISIBLE_DEVICES']))")
    result = launch("--device", "cpu", "--nproc", "3", "--run-dir", str(tmp_path / "r"), "--", *argv)
    assert result.returncode == 0, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("CPU")) == [
        "CPU0:0 3 ''",
        "CPU1:1 3 ''",
        "CPU2:2 3 ''",
    ]


def test_a_failing_worker_makes_the_launcher_exit_with_its_code(script, tmp_path):
    argv = script("import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(7)\ntime.sleep(60)")
    result = launch("--device", "cpu", "--run-dir", str(tmp_path / "r"), "--", *argv, timeout=20)
    assert result.returncode == 7
    assert "CPU1 failed (exit code 7)" in result.stdout


SLEEPER = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"


def start_launcher(processes, tmp_path, *args: str) -> subprocess.Popen:
    """A launcher on the CPU (killed with all it started when the test ends, however it ends)."""
    return processes(
        [sys.executable, "-m", "launcher", "--device", "cpu", "--run-dir", str(tmp_path / "r"), *args],
        cwd=ROOT,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        text=True,
    )


def start_launcher_with_sleepers(
    processes, script, tmp_path, source: str = SLEEPER, *options: str
) -> tuple[subprocess.Popen, list[int]]:
    """A launcher running 2 workers that print their pid and sleep; return it and the pids."""
    proc = start_launcher(processes, tmp_path, *options, "--", *script(source))
    assert proc.stdout is not None
    pids: list[int] = []
    while len(pids) < 2:
        line = proc.stdout.readline()
        assert line, "launcher ended before its workers started"
        if ":pid " in line:
            pids.append(int(line.split()[-1]))
    return proc, pids


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_stops_every_worker_and_exits_128_plus_it(processes, script, tmp_path, signum, code):
    proc, pids = start_launcher_with_sleepers(processes, script, tmp_path)
    proc.send_signal(signum)
    assert proc.wait(timeout=10) == code
    assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout=3)


ESCAPES_THEN_SLEEPS = """
import os, subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
escaped = [subprocess.Popen(sleep, start_new_session=True).pid]
read, write = os.pipe()
if os.fork() == 0:  # a daemon with a clean environment: fork, new session, fork, exit
    os.setsid()
    if (pid := os.fork()) == 0:
        os.execve(sys.executable, sleep, {})
    os.write(write, str(pid).encode())
    os._exit(0)
os.wait()
escaped.append(int(os.read(read, 32)))
print("escaped", *escaped, flush=True)
print("pid", os.getpid(), flush=True)
if os.environ["RANK"] == "0":
    time.sleep(60)
"""


def run_tokens(token_owner_pids: list[int]) -> set[str]:
    return {psutil.Process(pid).environ().get("LAUNCHER_RUN_TOKEN") for pid in token_owner_pids}


def told_the_guardian(processes, launcher: subprocess.Popen, log: Path, token: str) -> subprocess.Popen:
    """Return once the launcher has told its guardian of every process that existed when its two
    workers printed their pids, and return the new process of the run this starts to know it.
    The launcher looks every SNAPSHOT_INTERVAL, between relaying lines, and reports only what is
    new; once the pid lines are in the combined log (its last write of a line), anything it writes
    is a report from a look that came after them. A newcomer carrying the run's token makes one."""
    assert wait_until(lambda: log.read_text().count(":pid ") == 2, timeout=60)
    io = psutil.Process(launcher.pid).io_counters
    written = io().write_chars
    newcomer = processes([sys.executable, "-c", "import time; time.sleep(60)"], env={**launcher_env(), TOKEN_VAR: token})
    assert wait_until(lambda: io().write_chars > written, timeout=60)  # into the guardian's pipe: it will read it
    return newcomer


def test_workers_and_everything_they_started_die_with_a_launcher_killed_by_sigkill(processes, script, tmp_path):
    proc, pids = start_launcher_with_sleepers(
        processes, script, tmp_path, ESCAPES_THEN_SLEEPS.replace('if os.environ["RANK"] == "0":', "if True:")
    )
    escaped = escaped_descendants(tmp_path)
    (token,) = run_tokens(pids)
    newcomer = told_the_guardian(processes, proc, tmp_path / "r" / "logs" / "combined.log", token)
    proc.kill()
    proc.wait(timeout=5)
    # Workers by their parent-death signal; the rest by the guardian: the setsid children and
    # the newcomer carry the run's token; the clean-environment daemons were in the launcher's reports.
    assert wait_until(lambda: not any(alive(pid) for pid in pids + escaped + [newcomer.pid]), timeout=10)
    newcomer.wait(timeout=10)  # reaped, so that it is not counted below

    def left() -> list:
        return [
            (p.pid, p.status(), p.cmdline())
            for p in psutil.process_iter(["environ"])
            if (p.info["environ"] or {}).get("LAUNCHER_RUN_TOKEN") == token
        ]

    assert wait_until(lambda: not left(), timeout=3), left()


def escaped_descendants(tmp_path) -> list[int]:
    """The pids the workers printed: [setsid child, daemon] per worker."""
    lines = (tmp_path / "r" / "logs" / "combined.log").read_text().splitlines()
    return [int(pid) for line in lines if ":escaped " in line for pid in line.split()[1:]]


def test_descendants_that_left_the_group_and_cleared_their_environment_do_not_outlive_the_run(script, tmp_path):
    result = launch(
        "--device",
        "cpu",
        "--run-dir",
        str(tmp_path / "r"),
        "--",
        *script(ESCAPES_THEN_SLEEPS.replace('if os.environ["RANK"] == "0":', "if False:")),
        timeout=30,
    )
    assert result.returncode == 0, result.stdout
    escaped = escaped_descendants(tmp_path)
    assert len(escaped) == 4
    assert wait_until(lambda: not any(alive(pid) for pid in escaped), timeout=3)


def test_ctrl_c_reaches_a_command_run_by_a_shell_in_generic_mode(processes, script, tmp_path):
    handles = script(
        """
        import os, signal, sys, time
        def stop(*_):
            time.sleep(0.5)  # slower than bash, which dies of SIGTERM at once
            print("child got SIGTERM", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        print("pid", os.getpid(), flush=True)
        time.sleep(60)
    """,
        "child.py",
    )
    proc = start_launcher(processes, tmp_path, "--", "bash", "-c", f"{' '.join(handles)}; echo after")
    read = [proc.stdout.readline(), proc.stdout.readline()]
    assert all(":pid " in line for line in read), read
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 130
    assert proc.stdout.read().count("child got SIGTERM") == 2  # the whole group was asked, and waited for


def test_a_shell_commands_child_that_ignores_sigterm_is_killed_at_the_stop_timeout(processes, script, tmp_path):
    handles = script(
        """
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("pid", os.getpid(), flush=True)
        time.sleep(60)
    """,
        "child.py",
    )
    proc = start_launcher(
        processes, tmp_path, "--nproc", "1", "--stop-timeout", "1", "--", "bash", "-c", f"{' '.join(handles)}; echo after"
    )
    child = int(proc.stdout.readline().split()[-1])
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 130
    assert 1 <= time.monotonic() - started < 10
    assert "processes started by CPU0 still running after 1 s (--stop-timeout); sending SIGKILL" in proc.stdout.read()
    assert wait_until(lambda: not alive(child), timeout=3)


def test_workers_that_do_not_stop_within_the_stop_timeout_are_killed(processes, script, tmp_path):
    ignores_sigterm = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SLEEPER
    proc, pids = start_launcher_with_sleepers(processes, script, tmp_path, ignores_sigterm, "--stop-timeout", "0.5")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 143
    assert 0.5 <= time.monotonic() - started < 10  # the sleepers would take 60 s
    assert "CPU0, CPU1 still running after 0.5 s (--stop-timeout); sending SIGKILL" in proc.stdout.read()
    assert not any(alive(pid) for pid in pids)


def test_a_batch_larger_than_the_dataset_stops_before_spawning_and_writes_no_run_dir(tmp_path):
    result = launch_debug(
        tmp_path,
        "--set",
        "training.batch_size=50000",
    )
    assert_one_line_error(
        result,
        "fewer than one optimizer step needs: batch_size 50000 x grad_accum_nums 1 "
        "x 2 rank(s) = 100,000; reduce training.batch_size",
        **REFUSAL,
    )
    assert not (tmp_path / "r").exists()
    assert "CPU0:" not in result.stdout  # no worker started


def test_token_ids_beyond_the_models_vocabulary_stop_before_spawning(tmp_path):
    result = launch_debug(
        tmp_path,
        "--set",
        "model.vocab_size=100",
    )
    assert_one_line_error(
        result,
        "the dataset's token ids go up to 256, beyond model.vocab_size 100; "
        "set model.vocab_size to at least 257, or to null to follow the tokenizer",
        **REFUSAL,
    )
    assert not (tmp_path / "r").exists() and "CPU0:" not in result.stdout


def test_a_missing_source_file_is_one_line_and_leaves_nothing_in_the_cache(tmp_path):
    result = launch_debug(
        tmp_path,
        "--set",
        "data.source=jsonl",
        "--set",
        f"data.path={tmp_path / 'nowhere.jsonl'}",
    )
    assert_one_line_error(result, f"data.path: {tmp_path / 'nowhere.jsonl'} does not exist", **REFUSAL)
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


@pytest.mark.slow
def test_a_jsonl_source_with_a_trained_bpe_tokenizer_trains_for_whole_epochs(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bakers".split()
    with corpus.open("w") as file:
        for i in range(60):  # 2 epochs of 28 steps each (300 documents made 290 steps: 6 s more)
            file.write(json.dumps({"id": i, "body": " ".join(rng.choices(words, k=60))}) + "\n")
    result = launch(
        "--debug",
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "r"),
        "--set",
        f"data.cache_dir={tmp_path / 'cache'}",
        "--set",
        "data.source=jsonl",
        "--set",
        f"data.path={corpus}",
        "--set",
        "data.text_field=body",
        "--set",
        "data.tokenizer=bpe",
        "--set",
        "data.bpe_vocab_size=300",
        "--set",
        "data.context_length=32",
        "--set",
        "training.batch_size=4",
        "--set",
        "training.epochs=2",
        timeout=120,
    )

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    assert "launcher: dataset: trained a 300-token BPE tokenizer on jsonl" in result.stdout
    (length,) = [line for line in result.stdout.splitlines() if line.startswith("launcher: run length: ")]
    per_epoch = int(length.split("run length: ")[1].split(" optimizer steps per epoch")[0])
    assert f"2 epochs = {2 * per_epoch} steps" in length
    assert f"CPU0:INFO | [CPU 0] Step [{2 * per_epoch - 1}/{2 * per_epoch}]" in result.stdout
    resolved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert resolved["model"]["vocab_size"] == 300 and resolved["training"]["max_steps"] == 2 * per_epoch


def test_a_command_that_cannot_be_executed_exits_126_with_one_line(tmp_path):
    no_shebang = tmp_path / "train.sh"
    no_shebang.write_text("echo hi\n")
    no_shebang.chmod(0o755)
    result = launch("--device", "cpu", "--run-dir", str(tmp_path / "r"), "--", str(no_shebang))
    assert_one_line_error(result, f"cannot run {no_shebang}: Exec format error", code=126, **REFUSAL)


def test_a_script_whose_interpreter_is_not_there_exits_126_naming_the_interpreter(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("#!/no/such/python3 -u\nprint('hi')\n")
    script.chmod(0o755)
    result = launch("--device", "cpu", "--run-dir", str(tmp_path / "r"), "--", str(script))
    said = f"cannot run {script}: No such file or directory (bad interpreter: its #! line names /no/such/python3, which is not"
    assert_one_line_error(result, said, code=126, **REFUSAL)


def test_a_script_without_its_execute_bit_exits_126_with_permission_denied(tmp_path):
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "--device", "cpu", "--run-dir", str(tmp_path / "r"), "--", "./script.sh"],
        cwd=tmp_path,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    fix = "(it is not executable: chmod +x ./script.sh"
    assert_one_line_error(result, f"cannot run ./script.sh: Permission denied {fix}", code=126, **REFUSAL)


def test_a_path_to_no_file_exits_127_with_no_such_file(tmp_path):
    result = launch("--device", "cpu", "--run-dir", str(tmp_path / "r"), "--", str(tmp_path / "missing.sh"))
    assert_one_line_error(result, f"cannot run {tmp_path / 'missing.sh'}: No such file or directory", code=127, **REFUSAL)


def test_a_worker_that_cannot_be_started_is_the_first_failure_in_workers_json(tmp_path):
    no_shebang = tmp_path / "train.sh"
    no_shebang.write_text("echo hi\n")
    no_shebang.chmod(0o755)
    result = launch("--device", "cpu", "--nproc", "2", "--run-dir", str(tmp_path / "r"), "--", str(no_shebang))
    assert result.returncode == 126, result.stderr
    first, second = json.loads((tmp_path / "r" / "workers.json").read_text())
    assert first["failed_first"] and first["exit_code"] == 126
    assert first["start_error"] == result.stderr.removeprefix("launcher: error: ").strip()
    assert not second["failed_first"] and second["exit_code"] is None and second["pid"] is None


@pytest.mark.parametrize("driver", [False, True])
def test_the_gpus_command_without_a_gpu_says_why_there_is_nothing_to_show_not_use_device_cpu(driver, scripted_gpus):
    scripted_gpus([], driver=driver)
    result = launch("gpus")
    assert_one_line_error(result, "no GPU to show" if not driver else "reports no GPU: none to show", "nvidia-smi", **REFUSAL)
    assert "--device cpu" not in result.stderr


def test_an_unwritable_cache_directory_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = launch(
        "--debug", "--device", "cpu", "--run-dir", str(tmp_path / "r"), "--set", f"data.cache_dir={blocker / 'cache'}"
    )
    assert_one_line_error(result, str(blocker), **REFUSAL)


def test_a_reader_that_goes_away_ends_the_run_quietly_with_141(processes, script, tmp_path):
    endless = script("import os, time\nwhile True:\n    print('line', flush=True)\n    time.sleep(0.001)")
    proc = processes(
        [sys.executable, "-m", "launcher", "--device", "cpu", "--run-dir", str(tmp_path / "r"), "--", *endless],
        cwd=ROOT,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.readline()
    proc.stdout.close()  # like `| head -1`
    assert proc.wait(timeout=10) == 141
    assert "Traceback" not in proc.stderr.read()


def test_a_second_sigint_kills_workers_that_ignore_sigterm_at_once(processes, script, tmp_path):
    ignores_sigterm = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SLEEPER
    proc, pids = start_launcher_with_sleepers(processes, script, tmp_path, ignores_sigterm, "--stop-timeout", "60")
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().startswith("launcher: received SIGINT")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 130  # long before the 60 s stop timeout
    assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout=3)
    assert "still running after" not in proc.stdout.read()


def test_training_workers_never_ask_the_hub_but_generic_commands_keep_the_users_setting(monkeypatch):
    from launcher.launch import make_workers
    from launcher.gpus.placement import Placement

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    training = make_workers(Placement("cpu", 2), ["python3", "pretrain_main.py"], training=True)
    generic = make_workers(Placement("cpu", 2), ["python3", "my_script.py"])
    assert [w.env["HF_HUB_OFFLINE"] for w in training] == ["1", "1"]
    assert [w.env["HF_HUB_OFFLINE"] for w in generic] == ["0", "0"]
