"""The supervisor's teardown rules, with small real child processes."""

from __future__ import annotations

import io
import json
import os
import signal
import time

import psutil
import pytest

from support.processes import alive, wait_until
from launcher.supervise.printer import Printer
from launcher.exit_codes import EXIT_HANG
from launcher.supervise.supervisor import Supervisor, SupervisorOptions, exit_code
from launcher.processes.worker import Worker, worker_env

# A handshake: the peer of FAILS_WITH_7 touches this file (next to the scripts) once it has set
# itself up, so that the failure, and the teardown it starts, find it ready however slow its start.
PEER_READY = 'Path(__file__).with_name("peer-ready").touch()'
FAILS_WITH_7 = """
    import sys, time
    from pathlib import Path
    ready, deadline = Path(__file__).with_name("peer-ready"), time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("about to fail", flush=True)
    sys.exit(7)
"""
SLEEPS = f"""
    import os, time
    from pathlib import Path
    print(f"sleeper {{os.getpid()}}", flush=True)
    {PEER_READY}
    time.sleep(60)
"""
IGNORES_SIGTERM = f"""
    import signal, time
    from pathlib import Path
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring SIGTERM", flush=True)
    {PEER_READY}
    time.sleep(60)
"""


def make_worker(rank: int, argv: list[str], label: str | None = None) -> Worker:
    env = worker_env(
        dict(os.environ), rank=rank, world_size=2, master_port=29500, gpu=None, cpu_count=2, compile_cache="/tmp/unused"
    )
    return Worker(rank=rank, label=label or f"CPU{rank}", argv=argv, env=env)


def supervise(workers: list[Worker], tmp_path, kill_grace: float = 2.0, **options) -> tuple[int, str, float]:
    console = io.StringIO()
    (tmp_path / "logs").mkdir(exist_ok=True)
    printer = Printer(console, tmp_path / "logs")
    started = time.monotonic()
    code = Supervisor(workers, printer, SupervisorOptions(kill_grace=kill_grace, run_dir=tmp_path, **options)).run()
    printer.close()
    return code, console.getvalue(), time.monotonic() - started


def test_a_worker_that_exits_7_makes_the_supervisor_exit_7_and_stops_its_peer(script, tmp_path):
    workers = [make_worker(0, script(SLEEPS, "sleep.py")), make_worker(1, script(FAILS_WITH_7, "fail.py"))]
    code, out, elapsed = supervise(workers, tmp_path)
    assert code == 7
    assert elapsed < 10.0  # the sleeper would take 60 s; loaded cores take seconds to start the two
    assert not alive(workers[0].process.pid)
    assert "CPU1 failed (exit code 7)" in out and "FAILED: CPU1 (rank 1) failed first" in out
    assert "launcher:   about to fail" in out.split("FAILED")[1]  # its last lines are in the summary


def test_success_means_every_worker_exited_zero(script, tmp_path):
    ok = script("print('done')", "ok.py")
    code, out, _ = supervise([make_worker(0, ok), make_worker(1, ok)], tmp_path)
    assert code == 0
    assert "FAILED" not in out and out.count(":done") == 2


def test_death_by_signal_becomes_128_plus_the_signal(script, tmp_path):
    killed = script("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "kill.py")
    code, out, _ = supervise([make_worker(0, killed), make_worker(1, script(SLEEPS))], tmp_path)
    assert code == 128 + signal.SIGKILL == exit_code(-signal.SIGKILL)
    assert "killed by SIGKILL" in out


def test_the_first_failure_decides_the_exit_code(script, tmp_path):
    early = script("import time, sys; time.sleep(0.2); sys.exit(3)", "early.py")
    late = script("import time, sys\ntry:\n    time.sleep(60)\nexcept BaseException:\n    pass\nsys.exit(9)", "late.py")
    code, _, _ = supervise([make_worker(0, late), make_worker(1, early)], tmp_path)
    assert code == 3


def test_a_peer_that_ignores_sigterm_is_killed_after_the_grace_period(script, tmp_path):
    stubborn = make_worker(0, script(IGNORES_SIGTERM, "stubborn.py"))
    failing = make_worker(1, script(FAILS_WITH_7, "fail.py"))
    code, out, elapsed = supervise([stubborn, failing], tmp_path, kill_grace=0.5)
    assert code == 7
    assert 0.5 <= elapsed < 10.0  # the stubborn worker would sleep 60 s; loaded cores take seconds to start the two
    assert "CPU0 still running after 0.5 s (--kill-grace); sending SIGKILL" in out
    assert not alive(stubborn.process.pid)


def test_a_grandchild_left_in_the_workers_group_does_not_survive_the_run(script, tmp_path):
    parent = script(
        """
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(f"grandchild {child.pid}", flush=True)
    """,
        "parent.py",
    )
    code, out, _ = supervise([make_worker(0, parent), make_worker(1, script("pass", "ok.py"))], tmp_path)
    grandchild = int(out.split("grandchild ")[1].split()[0])
    assert code == 0
    assert wait_until(lambda: not alive(grandchild), timeout=2.0)


def test_every_line_is_prefixed_including_stderr_and_a_last_line_without_newline(script, tmp_path):
    noisy = script(
        """
        import sys
        print("out line", flush=True)
        print("err line", file=sys.stderr, flush=True)
        sys.stdout.buffer.write(b"bad \\xff utf8\\n")
        sys.stdout.write("no newline at exit")
    """,
        "noisy.py",
    )
    code, out, _ = supervise([make_worker(0, noisy, "GPU3"), make_worker(1, script("pass"), "GPU5")], tmp_path)
    assert code == 0
    lines = out.splitlines()
    assert "GPU3:out line" in lines and "GPU3:err line" in lines
    assert "GPU3:bad \ufffd utf8" in lines
    assert "GPU3:no newline at exit" in lines
    assert all(line.startswith(("GPU3:", "GPU5:", "launcher")) for line in lines)


def test_per_worker_logs_are_prefix_free_and_the_combined_log_has_every_line(script, tmp_path):
    hello = script("import os; print('hello', os.environ['RANK'])")
    supervise([make_worker(0, hello), make_worker(1, hello)], tmp_path)
    assert (tmp_path / "logs" / "cpu0.log").read_text() == "hello 0\n"
    assert (tmp_path / "logs" / "cpu1.log").read_text() == "hello 1\n"
    combined = (tmp_path / "logs" / "combined.log").read_text().splitlines()
    assert sorted(line for line in combined if not line.startswith("launcher")) == ["CPU0:hello 0", "CPU1:hello 1"]


def test_a_very_long_line_is_passed_on_whole_in_bounded_pieces(script, tmp_path):
    long_line = script("print('x' * 200_000)")
    code, out, _ = supervise([make_worker(0, long_line), make_worker(1, script("pass", "ok.py"))], tmp_path)
    pieces = [line for line in out.splitlines() if line.startswith("CPU0:")]
    assert code == 0 and len(pieces) > 1
    assert sum(len(p) - len("CPU0:") for p in pieces) == 200_000


def test_exit_codes_are_recorded_in_the_run_directory(script, tmp_path):
    workers = [make_worker(0, script(SLEEPS, "sleep.py")), make_worker(1, script(FAILS_WITH_7, "fail.py"))]
    supervise(workers, tmp_path)
    record = json.loads((tmp_path / "workers.json").read_text())
    assert [(r["label"], r["exit_code"], r["failed_first"]) for r in record] == [
        ("CPU0", 128 + signal.SIGTERM, False),
        ("CPU1", 7, True),
    ]


@pytest.mark.parametrize("gpu, label", [(None, None), ("3", "3")])
def test_worker_environment_follows_the_contract(gpu, label):
    env = worker_env(
        {"GPU_RANK": "stale", "PATH": "/bin"}, rank=1, world_size=4, master_port=1234, gpu=gpu, cpu_count=8, compile_cache="/c"
    )
    assert {
        k: env[k]
        for k in [
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "NODE_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "CUDA_DEVICE_ORDER",
            "PYTHONUNBUFFERED",
            "OMP_NUM_THREADS",
            "TORCHINDUCTOR_CACHE_DIR",
            "TORCHINDUCTOR_COMPILE_THREADS",
        ]
    } == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1234",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "2",
        "TORCHINDUCTOR_CACHE_DIR": "/c",
        "TORCHINDUCTOR_COMPILE_THREADS": "2",
    }
    assert env["CUDA_VISIBLE_DEVICES"] == (gpu or "")
    assert env.get("GPU_RANK") == label
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_worker_environment_keeps_the_users_allocator_settings():
    env = worker_env(
        {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
        rank=0,
        world_size=1,
        master_port=1,
        gpu="0",
        cpu_count=8,
        compile_cache="/c",
    )
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


@pytest.mark.parametrize("variable", ["PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_worker_environment_keeps_an_allocator_setting_under_torchs_other_names(variable):
    # torch reads PYTORCH_CUDA_ALLOC_CONF before PYTORCH_HIP_ALLOC_CONF (ROCm's name): a default
    # written beside the user's HIP setting would silently replace it on an AMD machine.
    env = worker_env(
        {variable: "max_split_size_mb:512"}, rank=0, world_size=1, master_port=1, gpu="0", cpu_count=8, compile_cache="/c"
    )
    assert env[variable] == "max_split_size_mb:512"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env


def test_an_amd_worker_sees_its_gpu_through_rocr_visible_devices_and_no_hip_or_cuda_mask():
    inherited = {"ROCR_VISIBLE_DEVICES": "0,1,2", "HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0"}
    env = worker_env(
        inherited,
        rank=0,
        world_size=1,
        master_port=1,
        gpu="GPU-8d1457e2c20f59d2",
        gpu_id="2",
        cpu_count=8,
        compile_cache="/c",
        visibility_variable="ROCR_VISIBLE_DEVICES",
    )
    assert env["ROCR_VISIBLE_DEVICES"] == "GPU-8d1457e2c20f59d2" and env["GPU_RANK"] == "2"
    assert "HIP_VISIBLE_DEVICES" not in env and "CUDA_VISIBLE_DEVICES" not in env  # ROCm would apply them after ROCR's


def test_a_cpu_worker_sees_no_gpu_of_either_vendor_whatever_masks_it_inherits():
    inherited = {"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0"}
    env = worker_env(inherited, rank=0, world_size=2, master_port=1, gpu=None, cpu_count=8, compile_cache="/c")
    # HIP takes an empty CUDA_VISIBLE_DEVICES (or HIP_VISIBLE_DEVICES) as no filter; ROCr takes a set
    # but empty ROCR_VISIBLE_DEVICES as no device, so the HIP runtime finds none.
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["ROCR_VISIBLE_DEVICES"] == ""
    assert "HIP_VISIBLE_DEVICES" not in env and "GPU_RANK" not in env


LEAVES_ESCAPED_DESCENDANTS = """
    import os, subprocess, sys
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    setsid = subprocess.Popen(sleep, start_new_session=True)  # returns once the child has exec'd
    execed, told = os.pipe()  # close-on-exec: the write end closes when the daemon execs
    if os.fork() == 0:  # a daemon: fork, new session, fork again, the middle one exits
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, sleep)
        os._exit(0)
    os.close(told)
    os.read(execed, 1)  # end of file: the daemon has exec'd (and the middle one exited)
    os.wait()
    print("escaped", setsid.pid, flush=True)
"""


def test_descendants_that_left_the_workers_group_do_not_survive_the_run(script, tmp_path):
    leaver = make_worker(0, script(LEAVES_ESCAPED_DESCENDANTS, "leaver.py"))
    code, out, _ = supervise([leaver, make_worker(1, script("pass", "ok.py"))], tmp_path)
    assert code == 0
    setsid_pid = int(next(text for text in out.splitlines() if text.startswith("CPU0:escaped")).split()[-1])
    assert wait_until(lambda: not alive(setsid_pid), timeout=2.0)
    assert wait_until(
        lambda: (
            not [
                p
                for p in psutil.process_iter(["environ"])
                if (p.info["environ"] or {}).get("LAUNCHER_RUN_TOKEN") == leaver.env["LAUNCHER_RUN_TOKEN"]
            ]
        ),
        timeout=2.0,
    )


SILENT_AFTER_ONE_LINE = f"""
    import faulthandler, signal, time
    from pathlib import Path
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    print("started", flush=True)
    {PEER_READY}
    def wait_for_peer():
        time.sleep(60)
    wait_for_peer()
"""


@pytest.mark.slow
def test_a_silent_worker_counts_as_failed_after_the_hang_timeout_with_exit_124(script, tmp_path):
    chatty = script("import time\nfor i in range(800):\n    print(i, flush=True)\n    time.sleep(0.01)", "chatty.py")
    silent = make_worker(1, script(SILENT_AFTER_ONE_LINE, "silent.py"))
    code, out, elapsed = supervise([make_worker(0, chatty), silent], tmp_path, hang_timeout=1.5, stack_dump_signal=signal.SIGUSR1)
    assert code == EXIT_HANG == 124
    assert 1.5 <= elapsed < 4.0
    assert "CPU1 printed nothing for 1.5 s (--hang-timeout)" in out
    assert "FAILED: CPU1 (rank 1) failed first" in out and "printed nothing for 1.5 s, exit code 124" in out
    assert "CPU1: wait_for_peer (" in out  # where it was, from its stack dump
    record = json.loads((tmp_path / "workers.json").read_text())
    assert [r["hung"] for r in record] == [False, True]


@pytest.mark.slow
def test_a_hang_timeout_does_not_fire_while_workers_keep_printing(script, tmp_path):
    chatty = script("import time\nfor i in range(20):\n    print(i, flush=True)\n    time.sleep(0.1)", "chatty.py")
    code, out, elapsed = supervise([make_worker(0, chatty), make_worker(1, chatty)], tmp_path, hang_timeout=1.0)
    assert code == 0 and elapsed > 1.5  # longer than the hang timeout, yet no worker was silent that long


def test_before_teardown_the_summary_shows_where_each_surviving_worker_was(script, tmp_path):
    waiting = make_worker(0, script(SILENT_AFTER_ONE_LINE, "waiting.py"))
    failing = make_worker(1, script(FAILS_WITH_7, "fail.py"))
    code, out, _ = supervise([waiting, failing], tmp_path, stack_dump_signal=signal.SIGUSR1)
    assert code == 7
    summary = out.split("FAILED")[1]
    assert "Where each worker was" in summary and "CPU0: wait_for_peer (" in summary
    assert "most recent call first" in (tmp_path / "logs" / "cpu0.log").read_text()  # the full dump
    assert "most recent call first" not in out and 'CPU0:  File "' not in out  # ... in the log, not on the console


@pytest.mark.parametrize(
    "source, hint",
    [
        (
            "print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB', flush=True)\nraise SystemExit(1)",
            "the GPU ran out of memory: lower training.batch_size",
        ),
        (
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
            "SIGKILL came from outside the launcher, most often the kernel's out-of-memory killer",
        ),
        # NCCL's watchdog on a collective timeout: its line, then a long stack dump, then SIGABRT
        (
            "import os, sys\n"
            "print('[rank1]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:629] [Rank 1] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
            "600081 milliseconds before timing out.', file=sys.stderr, flush=True)\n"
            "print('  frame\\n' * 200, file=sys.stderr, flush=True)\n"
            "os.abort()",
            "NCCL's watchdog found a collective (ALLREDUCE) waiting longer than system.collective_timeout "
            "(600 s) for the other ranks, and on NCCL that ends the process with SIGABRT (exit 134)",
        ),
    ],
)
def test_the_summary_gives_a_hint_when_the_cause_is_known(script, tmp_path, source, hint):
    code, out, _ = supervise([make_worker(0, script(source, "oom.py")), make_worker(1, script(SLEEPS))], tmp_path)
    assert code != 0
    if "os.abort()" in source:
        assert code == 134 and "killed by SIGABRT, exit code 134." in out
    assert f"Hint: {hint}" in out.split("FAILED")[1]


def test_a_multibyte_character_cut_by_the_line_length_bound_survives(script, tmp_path):
    wide = script("print('\u00e9' * 100_000)")  # 200,000 bytes: pieces end inside characters
    code, out, _ = supervise([make_worker(0, wide), make_worker(1, script("pass", "ok.py"))], tmp_path)
    text = "".join(line[len("CPU0:") :] for line in out.splitlines() if line.startswith("CPU0:"))
    assert code == 0 and text == "\u00e9" * 100_000


def test_lines_of_workers_writing_at_once_never_mix(script, tmp_path):
    flood = script("import os\nr = os.environ['RANK']\nfor i in range(500):\n    print(f'rank{r}-' + r * 3000)")
    code, out, _ = supervise([make_worker(0, flood), make_worker(1, flood)], tmp_path)
    lines = [line for line in out.splitlines() if not line.startswith("launcher")]
    assert code == 0 and len(lines) == 1000
    assert set(lines) == {f"CPU{r}:rank{r}-" + str(r) * 3000 for r in (0, 1)}


GRACEFUL = """
    import os, signal, subprocess, sys, time
    from pathlib import Path
    helper = subprocess.Popen([sys.executable, "-c", "import signal, time\\n"
        "signal.signal(signal.SIGTERM, lambda *_: print('helper got SIGTERM', flush=True))\\n"
        "time.sleep(60)"])
    def finish_step_and_save(signum, frame):
        time.sleep(0.5)  # the step and the save take a while
        print("saved; helper alive:", helper.poll() is None, flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, finish_step_and_save)
    print("helper", helper.pid, flush=True)
    Path(__file__).with_name(f"ready{os.environ['RANK']}").touch()
    if os.environ["RANK"] == "0":
        deadline = time.monotonic() + 60
        while not Path(__file__).with_name("ready1").exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # until rank 1 is ready too
        os.kill(os.getppid(), signal.SIGINT)  # Ctrl-C to the supervisor
    time.sleep(60)
"""


def test_a_graceful_stop_of_training_workers_signals_each_worker_alone_and_waits_for_it(script, tmp_path):
    graceful = script(GRACEFUL, "graceful.py")
    code, out, elapsed = supervise([make_worker(0, graceful), make_worker(1, graceful)], tmp_path, stop_leaders_only=True)
    assert code == 130 and elapsed < 5
    assert out.count("saved; helper alive: True") == 2 and "helper got SIGTERM" not in out
    assert "launcher: stopped: every worker exited within" in out
    helpers = [int(line.split()[-1]) for line in out.splitlines() if ":helper " in line]
    assert len(helpers) == 2 and not any(alive(pid) for pid in helpers)


@pytest.mark.slow
def test_a_worker_that_fails_while_stopping_is_a_failure_not_a_clean_stop(script, tmp_path):
    fails_to_save = script(GRACEFUL.replace("sys.exit(0)", "sys.exit(2 if os.environ['RANK'] == '1' else 0)"), "fails.py")
    code, out, _ = supervise([make_worker(0, fails_to_save), make_worker(1, fails_to_save)], tmp_path, stop_leaders_only=True)
    assert code == 2
    assert "FAILED: CPU1 (rank 1) failed first" in out and "launcher: stopped:" not in out


def test_an_exited_worker_keeps_its_pid_until_teardown_so_no_other_process_can_take_it(script, tmp_path):
    # Rank 1 waits for rank 0's exit (a handshake through a file, then its state), and says
    # whether it is still a zombie of the supervisor's: reaped early, its pid could be reused.
    checks_sibling = script(f"""
        import os, sys, time, psutil
        from pathlib import Path
        handshake = Path({str(tmp_path / "rank0.pid")!r})
        if os.environ["RANK"] == "0":
            handshake.write_text(str(os.getpid()))
            sys.exit(0)
        deadline = time.monotonic() + 30
        while not handshake.exists() or not handshake.read_text():
            time.sleep(0.01)
        sibling = psutil.Process(int(handshake.read_text()))
        while sibling.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        print("sibling", sibling.pid, sibling.status(), sibling.ppid() == os.getppid(), flush=True)
    """)
    workers = [make_worker(0, checks_sibling), make_worker(1, checks_sibling)]
    code, out, _ = supervise(workers, tmp_path)
    assert code == 0
    assert f"CPU1:sibling {workers[0].process.pid} zombie True" in out.splitlines(), out
    assert workers[0].process.returncode == 0  # reaped at the end


def test_the_summary_names_what_a_known_exit_code_means(script, tmp_path):
    workers = [make_worker(0, script(SLEEPS, "sleep.py")), make_worker(1, script(FAILS_WITH_7, "fail.py"))]
    code, out, _ = supervise(workers, tmp_path, exit_meanings={7: "seven: the test's own failure"})
    assert code == 7
    assert "failed first" in out and "exit code 7 (seven: the test's own failure)." in out


AGREED_EXIT = """
    import sys, time
    time.sleep(float(sys.argv[1]))
    sys.exit(3)
"""


def test_after_an_agreed_exit_code_the_others_may_exit_on_their_own_within_the_grace(script, tmp_path):
    path = script(AGREED_EXIT, "agreed.py")
    workers = [make_worker(0, [*path, "0.1"]), make_worker(1, [*path, "1.0"])]
    code, out, elapsed = supervise(workers, tmp_path, agreed_exit_codes=frozenset({3}))
    assert code == 3 and [w.process.returncode for w in workers] == [3, 3]  # not SIGTERMed at 0.1 s
    assert "Stopped 0 other running worker(s)" in out


def test_after_an_agreed_exit_code_a_worker_that_does_not_follow_is_stopped_after_the_grace(script, tmp_path, monkeypatch):
    monkeypatch.setattr("launcher.supervise.supervisor.AGREED_EXIT_GRACE", 0.5)
    workers = [make_worker(0, [*script(AGREED_EXIT, "agreed.py"), "0.1"]), make_worker(1, script(SLEEPS, "sleep.py"))]
    code, out, elapsed = supervise(workers, tmp_path, agreed_exit_codes=frozenset({3}))
    assert code == 3 and elapsed < 10.0  # the sleeper would take 60 s
    assert "Stopped 1 other running worker(s)" in out and not alive(workers[1].process.pid)


def test_a_straggler_line_gets_the_clock_reasons_of_that_gpu_and_another_threads_lines_come_out_whole(script, tmp_path):
    straggler = "import sys\nprint('INFO | [GPU 0] straggler: GPU5 1.31x the median over the last 50 steps', flush=True)\n"
    workers = [make_worker(0, script(straggler, "straggler.py"), label="GPU0")]
    console = io.StringIO()
    printer = Printer(console, tmp_path)
    supervisor = Supervisor(workers, printer, SupervisorOptions(run_dir=tmp_path))
    supervisor.clocks_of = {"GPU5": "thermal slowdown"}.get
    supervisor.on_started = lambda: supervisor.say("GPU5: clocks: thermal slowdown")  # as the health watch's thread does
    assert supervisor.run() == 0
    printer.close()
    out = console.getvalue()
    assert "GPU0:INFO | [GPU 0] straggler: GPU5 1.31x the median over the last 50 steps; clocks: thermal slowdown\n" in out
    assert "launcher: GPU5: clocks: thermal slowdown\n" in out
    assert supervisor.attempt_end(0).step is None
