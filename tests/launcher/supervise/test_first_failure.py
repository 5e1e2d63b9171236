"""Who failed first when one rank's failure makes the others fail (issue 28, defect 1 and the peer
tracebacks): a consequence (exit code 4, pretrain/run/exit_codes.py) never decides while the cause
may still come, however the exits are timed; its traceback stays off the console, in its log.

The supervisor's side runs small real child scripts whose exits are ordered by files they
touch; the worker's side classifies real error texts of torch 2.13's gloo. The same story with
real training ranks on a full tmpfs is in tests/pretrain/run/test_full_disk.py."""

from __future__ import annotations

import io
import json
import logging
import re
import signal
import threading
import time

import pytest
import torch.distributed as dist

from launcher.supervise.printer import LOG_ONLY_MARK, LOG_ONLY_VAR, Printer
from launcher.supervise.supervisor import Supervisor, SupervisorOptions
from pretrain.run import exit_codes
from pretrain.distributed import peer_loss
from launcher.exit_codes import EXIT_OTHER_NODE_FAILED
from support.runs import run_launcher
from test_supervised_training import read_until, start_training, worker_processes
from test_supervisor import make_worker
from test_supervisor_nodes import NODE_1_FAILED, OtherNodes

GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:33165. This is typically caused by a remote worker crashing. Check the logs of the remote "
    "worker before reporting an error. GLHF!"
)
"""What rank 1's barrier raised (a plain RuntimeError) when rank 0 exited on a full disk."""

# Each script waits for the other's file (next to the scripts) before it goes on, so the order of
# the two exits is fixed by the files, not by how fast the machine is.
WAIT_FOR = """
    import os, sys, time
    from pathlib import Path
    def wait_for(name, then=0.0):
        path, deadline = Path(__file__).with_name(name), time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(then)
    def touch(name):
        Path(__file__).with_name(name).touch()
"""
CAUSE = (
    WAIT_FOR
    + """
    print("started", flush=True)
    touch("cause-started")
    wait_for("WAITS_FOR", then=DELAY)
    print("ERROR | [CPU 0] cannot write checkpoint file /run/checkpoints/step_5.tmp/optimizer.pt", flush=True)
    touch("cause-exits")
    sys.exit(2)
"""
)
CONSEQUENCE = (
    WAIT_FOR
    + """
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a rank busy failing on its own may not yet have stopped
    mark = os.environ["LAUNCHER_LOG_ONLY_MARK"]
    touch("consequence-started")
    wait_for("WAITS_FOR", then=DELAY)
    for line in ["Traceback (most recent call last):", '  File "train.py", line 1, in main', "RuntimeError: GLOO"]:
        print(mark + line, flush=True)
    print("ERROR | [CPU 1] lost the connection to another rank during barrier: Connection closed by peer", flush=True)
    touch("consequence-exits")
    sys.exit(4)
"""
).replace("GLOO", GLOO_CLOSED)


def supervise(workers, tmp_path, **options) -> tuple[int, str]:
    console = io.StringIO()
    (tmp_path / "logs").mkdir(exist_ok=True)
    printer = Printer(console, tmp_path / "logs")
    settings = SupervisorOptions(
        run_dir=tmp_path,
        exit_meanings=exit_codes.MEANINGS,
        **{
            "kill_grace": 2.0,
            "consequence_exit_codes": exit_codes.CONSEQUENCES,
            "stop_exit_codes": exit_codes.STOPPED,
            **options,
        },
    )
    code = Supervisor(workers, printer, settings).run()
    printer.close()
    return code, console.getvalue()


def exits(tmp_path) -> list[tuple[str, int, bool, bool]]:
    """workers.json as (label, exit code, failed first, consequence)."""
    record = json.loads((tmp_path / "workers.json").read_text())
    return [(r["label"], r["exit_code"], r["failed_first"], r["consequence"]) for r in record]


def summary_of(out: str) -> list[str]:
    return [line.removeprefix("launcher: ") for line in out.split("launcher: FAILED: ", 1)[1].splitlines()]


@pytest.mark.parametrize("repeat", range(3))
def test_a_consequence_that_exits_long_before_its_cause_leaves_the_cause_first(script, tmp_path, repeat):
    cause = script(CAUSE.replace("WAITS_FOR", "consequence-exits").replace("DELAY", "0.6"), "cause.py")
    consequence = script(CONSEQUENCE.replace("WAITS_FOR", "cause-started").replace("DELAY", "0"), "consequence.py")
    code, out = supervise([make_worker(0, cause), make_worker(1, consequence)], tmp_path)
    assert code == 2
    lines = summary_of(out)
    assert lines[0].startswith("CPU0 (rank 0) failed first at ") and lines[0].endswith(": exit code 2.")
    assert re.match(r"Not a cause: CPU1 \(rank 1\), exit code 4, \d+\.\d\d s before it: a consequence of this failure", lines[1])
    assert "CPU1 failed as a consequence of another worker's failure (exit code 4); waiting up to 5 s" in out
    assert exits(tmp_path) == [("CPU0", 2, True, False), ("CPU1", 4, False, True)]


@pytest.mark.parametrize("repeat", range(3))
def test_a_consequence_that_exits_after_its_cause_is_named_a_consequence(script, tmp_path, repeat):
    cause = script(CAUSE.replace("WAITS_FOR", "consequence-started").replace("DELAY", "0"), "cause.py")
    # It exits once the supervisor, having seen the cause fail, asks it to stop: after the cause
    # for the supervisor too, however late a loaded machine lets it see either exit.
    after_the_stop = CONSEQUENCE.replace(
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)", 'signal.signal(signal.SIGTERM, lambda *_: touch("asked-to-stop"))'
    )
    consequence = script(after_the_stop.replace("WAITS_FOR", "asked-to-stop").replace("DELAY", "0"), "consequence.py")
    code, out = supervise([make_worker(0, cause), make_worker(1, consequence)], tmp_path, kill_grace=5.0)
    assert code == 2
    lines = summary_of(out)
    assert lines[0].startswith("CPU0 (rank 0) failed first at ")
    assert re.match(r"Not a cause: CPU1 \(rank 1\), exit code 4, \d+\.\d\d s after it: ", lines[1])
    assert exits(tmp_path) == [("CPU0", 2, True, False), ("CPU1", 4, False, True)]


def test_a_consequence_traceback_is_in_its_log_and_not_on_the_console(script, tmp_path):
    cause = script(CAUSE.replace("WAITS_FOR", "consequence-exits").replace("DELAY", "0"), "cause.py")
    consequence = script(CONSEQUENCE.replace("WAITS_FOR", "cause-started").replace("DELAY", "0"), "consequence.py")
    code, out = supervise([make_worker(0, cause), make_worker(1, consequence)], tmp_path)
    assert code == 2
    assert "Traceback" not in out and "Connection closed by peer [127.0.0.1]" not in out and LOG_ONLY_MARK not in out
    assert "CPU1:ERROR | [CPU 1] lost the connection to another rank during barrier" in out
    log = (tmp_path / "logs" / "cpu1.log").read_text().splitlines()
    assert log == [
        "Traceback (most recent call last):",
        '  File "train.py", line 1, in main',
        f"RuntimeError: {GLOO_CLOSED}",
        "ERROR | [CPU 1] lost the connection to another rank during barrier: Connection closed by peer",
    ]
    assert "CPU1:Traceback (most recent call last):" in (tmp_path / "logs" / "combined.log").read_text()


def test_a_consequence_without_a_cause_within_the_wait_is_reported_naming_the_workers_still_running(script, tmp_path):
    stuck = script(WAIT_FOR + "\n    touch('cause-started')\n    time.sleep(60)\n", "stuck.py")
    consequence = script(CONSEQUENCE.replace("WAITS_FOR", "cause-started").replace("DELAY", "0"), "consequence.py")
    code, out = supervise([make_worker(0, stuck), make_worker(1, consequence)], tmp_path, cause_wait=0.5)
    assert code == 4
    lines = summary_of(out)
    assert lines[0].startswith("CPU1 (rank 1) failed first at ")
    assert lines[0].endswith("exit code 4 (a consequence of another rank's failure).")
    assert lines[1] == (
        "It failed as a consequence of another rank's failure, but no other worker failed within 0.5 s of it; "
        "still running then: CPU0 (rank 0). The cause is there (frozen, stuck, or slow to fail) or outside this node."
    )
    assert "CPU1 failed (exit code 4) and no other worker failed within 0.5 s; stopping the other workers" in out
    assert not any("Traceback" in line for line in lines)  # the tail is the console's
    assert exits(tmp_path) == [("CPU0", 143, False, False), ("CPU1", 4, True, True)]


def test_a_consequence_whose_peers_exit_cleanly_is_reported_without_waiting(script, tmp_path):
    clean = script(WAIT_FOR + "\n    wait_for('consequence-exits', then=0.2)\n", "clean.py")
    consequence = script(CONSEQUENCE.replace("WAITS_FOR", "consequence.py").replace("DELAY", "0"), "consequence.py")
    code, out = supervise([make_worker(0, clean), make_worker(1, consequence)], tmp_path, cause_wait=60)
    assert code == 4
    assert "no other worker here reported one" in out
    assert exits(tmp_path) == [("CPU0", 0, False, False), ("CPU1", 4, True, True)]


# A worker that leaves early: it exits (its file names its pid), and the other goes on only once
# the first is gone (a zombie: the launcher has seen its exit, and keeps it until teardown), as a
# rank whose peer left does. The file is renamed into place: read between its creation and its
# write, it was empty, and the waiting script died on int("") (exit 1) on a loaded machine.
GONE = """
    import psutil
    def wait_gone(name):
        wait_for(name)
        pid = int(Path(__file__).with_name(name).read_text())
        while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
    def leave(name, code):
        partial = Path(__file__).with_name(name + ".partial")
        partial.write_text(str(os.getpid()))
        partial.rename(Path(__file__).with_name(name))
        sys.exit(code)
"""
EARLY_EXIT = (
    WAIT_FOR
    + GONE
    + """
    print("INFO | [CPU 1] Step [5/20] | Loss: 3.7618", flush=True)
    print("INFO | [CPU 1] returning early", flush=True)
    leave("early-exits", 0)
"""
)


def test_a_worker_that_exits_0_while_its_peer_still_runs_is_named_as_the_cause_its_peer_lost(script, tmp_path):
    early = script(EARLY_EXIT, "early.py")
    lost = script(
        CONSEQUENCE.replace('wait_for("WAITS_FOR", then=DELAY)', 'wait_gone("early-exits")').replace(
            "import signal", GONE + "    import signal"
        ),
        "lost.py",
    )
    code, out = supervise([make_worker(0, lost), make_worker(1, early)], tmp_path, cause_wait=60)
    assert code == 4  # the code of the peer that lost it: the run did not succeed
    assert "CPU1 exited 0 before the run ended; CPU0 lost it (exit code 4); stopping the other workers" in out
    lines = summary_of(out)
    assert lines[0].startswith("CPU1 (rank 1) failed first at ")
    assert lines[0].endswith(": exited 0 after step 5, before the run ended; its peers lost it (exit code 4).")
    assert re.match(r"Not a cause: CPU0 \(rank 0\), exit code 4, \d+\.\d\d s after it: a consequence", lines[1])
    assert lines[2].startswith("Hint: a worker that exits 0 while the others still run ends the run as a crash would")
    assert "another node, or was ended from outside the launcher" not in out
    assert exits(tmp_path) == [("CPU0", 4, False, True), ("CPU1", 0, True, False)]


STOPS = (
    WAIT_FOR
    + """
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it is stopping on its own already
    touch("RANK-ready")
    wait_for("OTHER-ready")
"""
    + GONE
    + """
    if "WAITS_FOR":
        wait_gone("WAITS_FOR")
    print("INFO | [CPU RANK] CAME", flush=True)
    print("INFO | [CPU RANK] Stopped by SIGTERM after step 6; checkpoint saved to /run/checkpoints/step_7", flush=True)
    leave("RANK-stops", 143)
"""
)


def test_a_sigterm_from_outside_to_one_rank_is_a_stop_of_that_rank_even_when_another_rank_exits_first(script, tmp_path):
    """Training ranks all stop after the step a signal came to one of them; rank 0 may exit first."""
    first = script(
        STOPS.replace("RANK", "0").replace("OTHER", "1").replace('"WAITS_FOR"', '""').replace("CAME", "Step [6/20]"), "0.py"
    )
    signalled = STOPS.replace("RANK", "1").replace("OTHER", "0").replace("WAITS_FOR", "0-stops")
    signalled = signalled.replace("CAME", "SIGTERM came to this rank: every rank stops after step 6")
    code, out = supervise([make_worker(0, first), make_worker(1, script(signalled, "1.py"))], tmp_path, kill_grace=30)
    assert code == 143
    assert "CPU0 stopped (exit code 143) on a signal the launcher did not send; stopping the other workers" in out
    [headline] = [line for line in out.splitlines() if "STOPPED:" in line or "FAILED:" in line]
    assert headline.startswith(
        "launcher: STOPPED: CPU1 (rank 1) was stopped by SIGTERM from outside the launcher (the launcher did not send it) at "
    )
    assert headline.endswith("; exit code 143.")
    assert "Hint: another process (kill, a scheduler signalling one process) sent SIGTERM to this worker alone" in out
    assert [(label, first) for label, _, first, _ in exits(tmp_path)] == [("CPU0", False), ("CPU1", True)]


def test_a_worker_killed_by_sigterm_from_outside_is_named_stopped_not_failed(script, tmp_path):
    killed = script(WAIT_FOR + "\n    import os, signal\n    os.kill(os.getpid(), signal.SIGTERM)\n", "killed.py")
    waits = script(WAIT_FOR + "\n    time.sleep(60)\n", "waits.py")
    code, out = supervise([make_worker(0, waits), make_worker(1, killed)], tmp_path)
    assert code == 143
    assert "launcher: STOPPED: CPU1 (rank 1) was stopped by SIGTERM from outside the launcher" in out
    assert "FAILED" not in out


def test_a_command_of_ones_own_exiting_143_by_itself_failed_and_no_signal_is_claimed(script, tmp_path):
    exits = script(WAIT_FOR + "\n    sys.exit(143)\n", "exits.py")
    waits = script(WAIT_FOR + "\n    time.sleep(60)\n", "waits.py")
    # a command of one's own: not a training worker, which exits 143 after a stop signal it saved on
    code, out = supervise([make_worker(0, waits), make_worker(1, exits)], tmp_path, stop_exit_codes=frozenset())
    assert code == 143
    assert "launcher: CPU1 failed (exit code 143); stopping the other workers" in out
    assert "launcher: FAILED: CPU1 (rank 1) failed first" in out
    assert "STOPPED" not in out and "did not send" not in out


# --- the same with real training ranks -------------------------------------------------------


@pytest.mark.slow
def test_a_training_rank_that_exits_0_mid_run_is_named_and_the_run_exits_with_its_peers_code(tmp_path):
    options = ["--debug", "--device", "cpu", "--max-steps", "12", "--run-dir", str(tmp_path / "run")]
    options += ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "training.checkpoint_interval=3"]
    result = run_launcher(*options, timeout=240, PRETRAIN_FAULTS="0:1:3:exit=0")
    assert result.returncode == 4, result.stdout[-3000:]
    assert "launcher: CPU1 exited 0 before the run ended; CPU0 lost it (exit code 4)" in result.stdout
    assert re.search(r"FAILED: CPU1 \(rank 1\) failed first at .*: exited 0 after step 3, before the run ended", result.stdout)
    assert "another node, or was ended from outside the launcher" not in result.stdout
    assert exits(tmp_path / "run") == [("CPU0", 4, False, True), ("CPU1", 0, True, False)]


@pytest.mark.slow
def test_sigterm_to_one_training_rank_from_outside_saves_a_checkpoint_and_names_that_rank_stopped(tmp_path, processes):
    proc = start_training(processes, tmp_path)
    read_until(proc, "CPU1:INFO | [CPU 1] Step [2/")
    worker_processes(proc)[1].send_signal(signal.SIGTERM)  # not the launcher: one rank alone
    assert proc.wait(timeout=120) == 143
    out = proc.stdout.read()
    stopped = [line for line in out.splitlines() if line.startswith("CPU") and "Stopped by SIGTERM after step" in line]
    assert len(stopped) == 2, out[-3000:]  # both ranks, after the same step
    came = [line for line in out.splitlines() if line.startswith("CPU") and "came to this rank" in line]
    assert [line.split(" | ")[0] for line in came] == ["CPU1:INFO"], came
    assert "launcher: STOPPED: CPU1 (rank 1) was stopped by SIGTERM from outside the launcher (the launcher did not" in out
    assert "FAILED" not in out
    assert [(label, code, first) for label, code, first, _ in exits(tmp_path / "run")] == [
        ("CPU0", 143, False),
        ("CPU1", 143, True),
    ]


# --- the printer ----------------------------------------------------------------------------


def test_log_only_lines_go_to_the_logs_without_their_mark_and_not_to_the_console(tmp_path):
    console = io.StringIO()
    printer = Printer(console, tmp_path)
    printer.worker_line("CPU1", f"{LOG_ONLY_MARK}Traceback (most recent call last):")
    printer.worker_line("CPU1", "ERROR | [CPU 1] lost the connection")
    printer.close()
    assert console.getvalue() == "CPU1:ERROR | [CPU 1] lost the connection\n"
    assert (tmp_path / "cpu1.log").read_text() == "Traceback (most recent call last):\nERROR | [CPU 1] lost the connection\n"
    assert (tmp_path / "combined.log").read_text().splitlines()[0] == "CPU1:Traceback (most recent call last):"


def test_log_only_lines_reach_the_console_when_the_workers_log_cannot_take_them(tmp_path):
    (tmp_path / "cpu1.log").symlink_to("/dev/full")
    console = io.StringIO()
    printer = Printer(console, tmp_path)
    printer.worker_line("CPU1", f"{LOG_ONLY_MARK}RuntimeError: Connection closed by peer")
    printer.close()
    assert console.getvalue().splitlines()[-1] == "CPU1:RuntimeError: Connection closed by peer"


def test_the_worker_and_the_launcher_name_the_same_log_only_variable():
    assert peer_loss.LOG_ONLY_VAR == LOG_ONLY_VAR


# --- the worker: what is a consequence --------------------------------------------------------


@pytest.mark.parametrize(
    "error, words",
    [
        (RuntimeError(GLOO_CLOSED), "Connection closed by peer"),
        (
            RuntimeError("[gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:80: Connection reset by peer"),
            "Connection reset by peer",
        ),
        (dist.DistNetworkError("failed to send: Broken pipe"), "Broken pipe"),
        (
            dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:2012, remote process exited or there was a network error"),
            "remote process exited or there was a network error",
        ),
        (RuntimeError("Broken pipe"), None),  # not from the distributed runtime
        (BrokenPipeError(32, "Broken pipe"), None),  # the console's reader went away: no rank was lost
        (RuntimeError("[gloo] Timed out waiting 1800000ms for recv operation to complete"), None),  # a timeout: exit 1
    ],
)
def test_only_a_distributed_error_that_says_a_peer_went_away_is_a_consequence(error, words):
    assert peer_loss.peer_gone(error) == words


def test_a_lost_peer_wrapped_in_another_error_is_still_a_consequence():
    try:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as inner:
            raise ValueError("checkpoint save failed on rank 1") from inner
    except ValueError as outer:
        assert peer_loss.peer_gone(outer) == "Connection closed by peer"


def barrier_error() -> BaseException:
    """An error raised from inside torch.distributed's barrier, as gloo's is (here: no process group)."""
    try:
        dist.barrier()
    except (RuntimeError, ValueError) as error:
        return error
    raise AssertionError("barrier without a process group passed")


def test_a_consequence_is_its_traceback_for_the_log_then_one_line_naming_the_collective(monkeypatch, capsys, caplog):
    monkeypatch.setenv(LOG_ONLY_VAR, LOG_ONLY_MARK)
    log = logging.getLogger("test_first_failure")
    with caplog.at_level(logging.ERROR, logger=log.name):
        peer_loss.report(barrier_error(), "Connection closed by peer", log)
    traceback_lines = capsys.readouterr().err.splitlines()
    assert traceback_lines[0] == f"{LOG_ONLY_MARK}Traceback (most recent call last):"
    assert all(line.startswith(LOG_ONLY_MARK) for line in traceback_lines)
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith("lost the connection to another rank during barrier: Connection closed by peer. ")
    assert line.endswith("this worker's log has the traceback")


def test_without_a_launcher_a_consequence_traceback_is_printed_as_usual(monkeypatch, capsys):
    monkeypatch.delenv(LOG_ONLY_VAR, raising=False)
    peer_loss.report(barrier_error(), "Connection closed by peer", logging.getLogger("test_first_failure"))
    assert capsys.readouterr().err.startswith("Traceback (most recent call last):\n")
    assert peer_loss.describe(barrier_error(), "Connection closed by peer").endswith("the traceback is above")


def test_a_consequence_here_waits_for_another_nodes_word_and_is_never_told_as_a_failure(script, tmp_path):
    stuck = script(WAIT_FOR + "\n    touch('cause-started')\n    time.sleep(60)\n", "stuck.py")
    consequence = script(CONSEQUENCE.replace("WAITS_FOR", "cause-started").replace("DELAY", "0"), "consequence.py")
    peers = OtherNodes()

    def node_1_fails_a_moment_later() -> None:  # its word comes through the store during the wait
        exited = tmp_path / "consequence-exits"
        while not exited.exists():
            time.sleep(0.01)
        time.sleep(0.3)
        assert peers.emit is not None
        peers.emit(NODE_1_FAILED)

    threading.Thread(target=node_1_fails_a_moment_later, daemon=True).start()
    console = io.StringIO()
    (tmp_path / "logs").mkdir()
    options = SupervisorOptions(kill_grace=2.0, consequence_exit_codes=exit_codes.CONSEQUENCES, cause_wait=30)
    code = Supervisor(
        [make_worker(0, stuck), make_worker(1, consequence)], Printer(console, tmp_path / "logs"), options, peers
    ).run()
    assert code == EXIT_OTHER_NODE_FAILED
    assert peers.told == []  # the other nodes never heard of a failure here: the cause is theirs
    assert "STOPPED: node 1 (gpu-b) failed first: CPU3 (rank 3) exit code 9." in console.getvalue()
    assert "CPU1 here failed as a consequence of another rank's failure (exit code 4)." in console.getvalue()
