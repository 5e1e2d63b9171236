"""The failure summary: stack dumps read, hints chosen, the report laid out."""

from __future__ import annotations

import signal
from pathlib import Path

from launcher.supervise import summary

FAULTHANDLER_DUMP = """\
Thread 0x00007f3a1b7fe640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 622 in wait

Current thread 0x00007f3a2c1e4b80 (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/work/pretrain/run/stopping.py", line 58 in agreed
  File "/work/pretrain/train.py", line 191 in fit
INFO | [CPU 0] a normal line after the dump
""".splitlines()


def test_the_stack_dump_reader_names_the_innermost_frames_of_the_deepest_thread():
    dump = summary.StackDump()
    starts = [dump.feed(line) for line in FAULTHANDLER_DUMP]
    assert starts.count(True) == 2
    assert dump.where() == (
        "all_reduce (distributed/distributed_c10d.py:3252) <- "
        "wrapper (distributed/c10d_logger.py:83) <- agreed (pretrain/run/stopping.py:58)"
    )


def test_a_python_traceback_is_not_mistaken_for_a_stack_dump():
    dump = summary.StackDump()
    for line in ["Traceback (most recent call last):", '  File "x.py", line 3, in <module>', "ValueError: no"]:
        assert dump.feed(line) is False
    assert dump.where() is None


def test_a_frame_whose_line_faulthandler_cannot_tell_is_read_with_the_frames_after_it():
    # A real dump (Python 3.11, a debug run's rank 0 in backward): the innermost frame is a hook,
    # a closure, caught on its first instruction, which has no line number. About 1 dump in 1000
    # of such a rank; the whole stack was dropped, and the summary lost its "Where each worker was".
    dump = summary.StackDump()
    for line in [
        "Current thread 0x00007f9dd541eb80 (most recent call first):",
        '  File "/work/main/pretrain/numerics/debug.py", line ??? in <lambda>',
        '  File "/work/main/.venv/lib/python3.11/site-packages/torch/utils/hooks.py", line 137 in hook',
        '  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward',
        '  File "/work/main/pretrain/train.py", line 73 in train_step',
        "  File ???, line ??? in ???",
    ]:
        dump.feed(line)
    assert dump.where() == (
        "<lambda> (pretrain/numerics/debug.py:???) <- hook (utils/hooks.py:137) <- _engine_run_backward (autograd/graph.py:979)"
    )
    assert dump.threads[0][-1] == "??? (???:???)"


def test_other_lines_within_a_threads_stack_are_passed_over_up_to_the_blank_line_that_ends_it():
    dump = summary.StackDump()
    for line in [
        "Current thread 0x00007f637d25ab80 (most recent call first):",
        "  Garbage-collecting",  # faulthandler's own note, when the signal came during a collection
        '  File "/work/pretrain/numerics/debug.py", line 139 in _not_finite',
        "[W1121 08:10:23 ProcessGroupGloo.cpp:12] a line another thread wrote meanwhile",
        '  File "/work/pretrain/train.py", line 73 in train_step',
        "",
        '  File "/work/pretrain/other.py", line 5 in not_in_any_thread',
    ]:
        dump.feed(line)
    assert dump.threads == [["_not_finite (pretrain/numerics/debug.py:139)", "train_step (pretrain/train.py:73)"]]


def test_hints_name_the_likely_cause():
    assert "hang-timeout" in summary.hint(-signal.SIGTERM, hung_for=60.0, cuda_oom=False)
    assert "training.batch_size" in summary.hint(1, hung_for=None, cuda_oom=True)
    assert "out-of-memory killer" in summary.hint(-signal.SIGKILL, hung_for=None, cuda_oom=False)
    assert summary.hint(1, hung_for=None, cuda_oom=False) is None
    assert summary.is_cuda_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB")


def test_the_report_says_who_failed_how_and_what_it_printed_last():
    lines = summary.render(
        summary.Failure(
            label="GPU3",
            rank=1,
            after_start=12.34,
            clock="07:44:12",
            exit_code=137,
            how="killed by SIGKILL",
            hint="the OOM killer",
            tail=["step 7", "step 8"],
            stopped=7,
            teardown_seconds=0.123,
            where={"GPU0": "all_reduce (x.py:1)"},
            logs=Path("/runs/r/logs"),
        )
    )
    assert lines[1] == ("FAILED: GPU3 (rank 1) failed first at 07:44:12, 12.3 s after start: killed by SIGKILL, exit code 137.")
    assert "Hint: the OOM killer" in lines and "  step 8" in lines and "  GPU0: all_reduce (x.py:1)" in lines
    assert "Stopped 7 other running worker(s); teardown took 0.12 s." in lines
    assert lines[0] == lines[-1] == summary.RULE
    plain = summary.render(summary.Failure("CPU1", 1, 0.3, "07:44:12", 7, "exit code 7", None, [], 1, 0.01, {}, None))
    assert plain[1].endswith("0.3 s after start: exit code 7.") and not any(line.startswith("Hint") for line in plain)


def test_a_worker_out_of_host_memory_is_told_the_address_space_limit_it_inherited(monkeypatch):
    import resource

    assert summary.is_host_oom("MemoryError")
    assert summary.is_host_oom("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")
    assert not summary.is_host_oom("INFO | [CPU 0] no MemoryError this step")
    limit = 700000 * 1024
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limit, resource.RLIM_INFINITY))
    limited = summary.hint(1, hung_for=None, cuda_oom=False, host_oom=True)
    assert limited is not None and "ulimit -v is 700000 KiB" in limited and "ulimit -v unlimited" in limited
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    unlimited = summary.hint(1, hung_for=None, cuda_oom=False, host_oom=True)
    assert unlimited is not None and "ulimit" not in unlimited and "training.batch_size" in unlimited
    assert summary.hint(1, hung_for=None, cuda_oom=False, host_oom=False) is None


def test_a_nan_report_banner_is_recognised_and_named_in_the_hint():
    assert summary.nonfinite_banner("NaN GRADIENT DETECTED [GPU 6]") == "NaN GRADIENT DETECTED"
    assert summary.nonfinite_banner("Inf LOSS DETECTED [CPU 0]") == "Inf LOSS DETECTED"
    assert summary.nonfinite_banner("INFO | [GPU 6] NaN GRADIENT DETECTED [GPU 6]") is None  # a banner starts the line
    text = summary.hint(3, hung_for=None, cuda_oom=False, nonfinite_reports={"GPU6": "NaN GRADIENT DETECTED"})
    assert text.startswith("the loss or the gradients became NaN or Inf: GPU6 logged NaN GRADIENT DETECTED")
    assert "configs/config_stable.json" in text


def test_an_exit_code_with_a_meaning_is_not_repeated():
    lines = summary.render(
        summary.Failure("GPU6", 6, 1.0, "07:44:12", 3, "exit code 3 (numerical failure)", None, [], 1, 0.01, {}, None)
    )
    assert lines[1].endswith("1.0 s after start: exit code 3 (numerical failure).")


NCCL_TIMEOUT_LINE = (
    "[rank1]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:629] [Rank 1] Watchdog caught collective "
    "operation timeout: WorkNCCL(SeqNum=14863, OpType=ALLREDUCE, NumelIn=14845952, "
    "NumelOut=14845952, Timeout(ms)=90000) ran for 90048 milliseconds before timing out."
)
NCCL_STUCK_LINE = (
    "[rank1]:[E1111 17:10:53.000000000 ProcessGroupNCCL.cpp:1700] [PG ID 0 PG GUID 0(default_pg) Rank 1] "
    "ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress in monitoring "
    "enqueued collectives."
)


def test_an_nccl_watchdog_timeout_names_the_collective_the_timeout_and_the_setting():
    said = summary.nccl_watchdog(NCCL_TIMEOUT_LINE)
    assert said.startswith(
        "NCCL's watchdog found a collective (ALLREDUCE) waiting longer than system.collective_timeout (90 s) for the other ranks"
    )
    assert "SIGABRT (exit 134)" in said
    assert summary.hint(-signal.SIGABRT, hung_for=None, cuda_oom=False, nccl_watchdog=said) == said


def test_a_stuck_nccl_watchdog_points_to_the_heartbeat_timeout_not_the_collective_timeout():
    said = summary.nccl_watchdog(NCCL_STUCK_LINE)
    assert said.startswith("NCCL's watchdog thread made no progress for 480 s")
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC does" in said


def test_lines_that_only_mention_the_watchdog_give_no_nccl_hint():
    for line in (
        "INFO | [GPU 0] Step [3/10] | Loss: 2.1",
        "a collective waited longer than system.collective_timeout",
        "Watchdog caught collective operation timeout: WorkGloo(OpType=ALLREDUCE)",
    ):
        assert summary.nccl_watchdog(line) is None
    assert summary.hint(-signal.SIGABRT, hung_for=None, cuda_oom=False) is None


def test_a_cuda_out_of_memory_in_the_same_log_outranks_an_nccl_timeout():
    said = summary.nccl_watchdog(NCCL_TIMEOUT_LINE)
    assert "training.batch_size" in summary.hint(-signal.SIGABRT, hung_for=None, cuda_oom=True, nccl_watchdog=said)
