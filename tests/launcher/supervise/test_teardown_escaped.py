"""Teardown of descendants that left their worker's process group (setsid) but still hold its
output: they get SIGTERM with everyone else, so a failure or a stop does not wait out the
whole --kill-grace or --stop-timeout for them."""

from __future__ import annotations

import io
import re
import time

from support.processes import alive
from support.runs import run_launcher
from launcher.supervise.printer import Printer
from launcher.supervise.supervisor import Supervisor, SupervisorOptions
from test_supervisor import make_worker

# rank 1 exits 7 once it has. The crash time is the wall clock just before that exit.
ESCAPED_CHILD_AND_A_CRASH = """
    import os, subprocess, sys, time
    from pathlib import Path
    ready = Path(sys.argv[1])
    if os.environ["RANK"] == "0":
        child = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        print("escaped", child.pid, flush=True)
        ready.touch()
        time.sleep(60)
    else:
        while not ready.exists():
            time.sleep(0.01)
        print(f"crash at {time.time():.6f}", flush=True)
        sys.exit(7)
"""


def test_a_failure_does_not_wait_the_kill_grace_for_an_escaped_child_holding_a_workers_output(script, tmp_path):
    # A long --kill-grace, which a teardown that waited for the escaped child would take in full
    # (before the fix): the bounds are half of it, far above what a loaded machine adds (a run under
    # four test workers on two cores took 0.03 s to tear down and over 0.3 s to exit).
    kill_grace = 10.0
    command = [*script(ESCAPED_CHILD_AND_A_CRASH, "crash.py"), str(tmp_path / "ready")]
    result = run_launcher(
        "--device", "cpu", "--nproc", "2", "--kill-grace", str(kill_grace), "--run-dir", str(tmp_path / "run"), "--", *command,
        timeout=60,
    )  # fmt: skip
    exited = time.time()
    out = result.stdout

    assert result.returncode == 7, out + result.stderr
    crashed = float(re.search(r"^CPU1:crash at (\S+)$", out, re.M).group(1))
    assert exited - crashed < kill_grace / 2, out
    teardown = float(re.search(r"teardown took (\S+) s\.", out).group(1))
    assert teardown < kill_grace / 2
    assert "sending SIGKILL" not in out  # it ended on SIGTERM, before the deadline
    escaped = int(re.search(r"^CPU0:escaped (\d+)$", out, re.M).group(1))
    assert not alive(escaped)


# Rank 0 starts two children that record every SIGTERM they get: one in its process group,
# one in a session of its own.
RECORDS_SIGTERM = """
    import signal, sys, time
    from pathlib import Path
    record, name = Path(sys.argv[1]), sys.argv[2]
    def on_sigterm(signum, frame):
        with record.open("a") as file:
            file.write(name + "\\n")
    signal.signal(signal.SIGTERM, on_sigterm)
    (record.parent / f"{name}.ready").touch()
    while True:
        time.sleep(0.01)
"""
STARTS_BOTH_THEN_WAITS = """
    import os, subprocess, sys, time
    from pathlib import Path
    child, record = sys.argv[1], Path(sys.argv[2])
    ready = [record.parent / "in-group.ready", record.parent / "escaped.ready"]
    if os.environ["RANK"] == "0":
        subprocess.Popen([sys.executable, child, str(record), "in-group"])
        subprocess.Popen([sys.executable, child, str(record), "escaped"], start_new_session=True)
        time.sleep(60)
    else:
        while not all(path.exists() for path in ready):
            time.sleep(0.01)
        sys.exit(7)
"""


def test_on_a_failure_a_child_that_left_the_workers_group_gets_sigterm_like_one_in_it(script, tmp_path):
    child = script(RECORDS_SIGTERM, "records.py")[1]
    record = tmp_path / "sigterms"
    argv = [*script(STARTS_BOTH_THEN_WAITS, "starts.py"), child, str(record)]
    workers = [make_worker(0, argv), make_worker(1, argv)]
    (tmp_path / "logs").mkdir()
    printer = Printer(io.StringIO(), tmp_path / "logs")

    # A grace long enough for both to record the SIGTERM before the SIGKILL of the end.
    code = Supervisor(workers, printer, SupervisorOptions(kill_grace=0.5, run_dir=tmp_path)).run()
    printer.close()

    assert code == 7
    assert sorted(record.read_text().split()) == ["escaped", "in-group"]  # before: in-group only


# A generic command stopped with Ctrl-C: rank 0 starts an escaped child, then interrupts the
# supervisor (this test's process).
ESCAPED_CHILD_AND_A_CTRL_C = """
    import os, signal, subprocess, sys, time
    from pathlib import Path
    ready = Path(sys.argv[1])
    if os.environ["RANK"] == "0":
        child = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        print("escaped", child.pid, flush=True)
        while not ready.exists():  # rank 1 has started
            time.sleep(0.01)
        os.kill(os.getppid(), signal.SIGINT)
    else:
        ready.touch()
    time.sleep(60)
"""


def test_a_graceful_stop_of_a_command_does_not_wait_the_stop_timeout_for_an_escaped_child(script, tmp_path):
    argv = [*script(ESCAPED_CHILD_AND_A_CTRL_C, "stop.py"), str(tmp_path / "ready")]
    workers = [make_worker(0, argv), make_worker(1, argv)]
    (tmp_path / "logs").mkdir()
    console = io.StringIO()
    printer = Printer(console, tmp_path / "logs")

    stop_timeout = 10.0  # waited in full before the fix; the bound is half of it, as above
    code = Supervisor(workers, printer, SupervisorOptions(kill_grace=2, stop_timeout=stop_timeout, run_dir=tmp_path)).run()
    printer.close()
    out = console.getvalue()

    assert code == 130
    stopped_within = float(re.search(r"every worker exited within (\S+) s of SIGINT", out).group(1))
    assert stopped_within < stop_timeout / 2
    escaped = int(re.search(r"^CPU0:escaped (\d+)$", out, re.M).group(1))
    assert not alive(escaped)
