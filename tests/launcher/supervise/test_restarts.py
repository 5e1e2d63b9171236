"""The restart rules (launcher/supervise/restarts.py) and the record of attempts, without processes:
what restarts, what never does and in which order, and restarts.jsonl."""

from __future__ import annotations

import dataclasses
import json
import signal

import pytest

from launcher.exit_codes import EXIT_HANG, by_signal
from launcher.supervise.restarts import AttemptEnd, Record, backoff, judge, last_step, transient_cause

KILLED = AttemptEnd(by_signal(signal.SIGKILL), worker="GPU1", rank=1, how="killed by SIGKILL", step=10)


def test_a_worker_killed_by_sigkill_after_a_step_is_restarted_while_the_budget_lasts():
    verdict = judge(KILLED, attempt=0, max_restarts=2, previous=None, training=True)
    assert verdict.restart and verdict.why == "GPU1 was killed by SIGKILL"
    assert judge(KILLED, attempt=1, max_restarts=2, previous=None, training=True).restart


def test_the_budget_used_up_ends_the_run_with_its_cause_named():
    verdict = judge(KILLED, attempt=2, max_restarts=2, previous=None, training=True)
    assert not verdict.restart and "budget (2) is used up" in verdict.why and "SIGKILL" in verdict.why


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT])
def test_deaths_a_worker_did_not_ask_for_are_transient(signum):
    assert transient_cause(AttemptEnd(by_signal(signum), worker="GPU0")) == f"GPU0 was killed by {signum.name}"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_worker_ended_by_a_stop_signal_is_not_restarted(signum):
    end = AttemptEnd(by_signal(signum), worker="GPU0", how=f"killed by {signum.name}", step=5)
    assert not judge(end, 0, 3, None, training=True).restart


def test_a_stop_signal_sent_to_one_worker_from_outside_is_a_stop_and_never_undone():
    end = AttemptEnd(by_signal(signal.SIGTERM), worker="CPU1", how="stopped by SIGTERM from outside the launcher", step=5)
    verdict = judge(dataclasses.replace(end, stopped_from_outside="SIGTERM"), 0, 3, None, training=True)
    assert not verdict.restart
    assert verdict.why == "CPU1 was stopped by SIGTERM from outside the launcher: a stop is never undone"


def test_a_worker_that_exited_0_before_the_run_ended_is_not_restarted_though_its_peers_lost_it():
    end = AttemptEnd(4, worker="CPU1", how="exited 0 after step 5, before the run ended; its peers lost it", step=5)
    assert judge(end, 0, 3, None, training=True).restart  # exit 4 alone reads as a lost peer
    verdict = judge(dataclasses.replace(end, ended_early=True), 0, 3, None, training=True)
    assert not verdict.restart and verdict.why == "CPU1 exited 0 before the run ended: it would again"


def test_a_stop_the_user_asked_for_is_never_undone():
    end = AttemptEnd(by_signal(signal.SIGINT), stopped=True, step=5)
    assert judge(end, 0, 3, None, training=True).why == "the stop was asked for"
    failed_while_stopping = AttemptEnd(by_signal(signal.SIGKILL), worker="GPU0", stopped=True, step=5)
    assert not judge(failed_while_stopping, 0, 3, None, training=True).restart


def test_bad_input_and_a_numerical_failure_are_never_restarted():
    assert "bad input" in judge(AttemptEnd(2, worker="GPU0", step=3), 0, 3, None, training=True).why
    assert "numerical" in judge(AttemptEnd(3, worker="GPU0", step=3), 0, 3, None, training=True).why
    # a command of the user's own exiting 3 means nothing in particular: no cause, no restart
    assert "no hardware" in judge(AttemptEnd(3, worker="GPU0", how="exit code 3"), 0, 3, None, training=False).why


def test_an_exception_without_a_hardware_cause_would_repeat_and_is_not_restarted():
    end = AttemptEnd(1, worker="GPU0", how="exit code 1", tail=("torch.OutOfMemoryError: CUDA out of memory.",), step=7)
    verdict = judge(end, 0, 3, None, training=True)
    assert not verdict.restart and verdict.why == "exit code 1 shows no hardware, network or timeout cause: it would repeat"


@pytest.mark.parametrize(
    "line, cause",
    [
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "an uncorrectable ECC error"),
        ("NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.", "an Xid error"),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", "a CUDA illegal memory access"),
        ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5)", "a collective timed out"),
        ("RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv", "a collective timed"),
        ("ERROR | [CPU 1] a collective waited longer than system.collective_timeout (600 s) for the other ranks", "a collective"),
    ],
)
def test_a_worker_whose_last_lines_name_the_hardware_or_a_timeout_is_restarted(line, cause):
    end = AttemptEnd(1, worker="GPU2", how="exit code 1", tail=("INFO | step", line), step=4)
    verdict = judge(end, 0, 1, None, training=True)
    assert verdict.restart and verdict.why.startswith(cause) and verdict.why.endswith("on GPU2")


def test_a_hang_and_a_lost_peer_are_transient_and_exit_4_means_a_lost_peer_only_for_training():
    assert judge(AttemptEnd(EXIT_HANG, worker="GPU0", hung=True, step=3), 0, 1, None, training=True).restart
    # a command that exits 124 by itself (timeout(1) inside it) did not hang for the supervisor
    assert not judge(AttemptEnd(EXIT_HANG, worker="GPU0", how="exit code 124", step=3), 0, 1, None, training=True).restart
    assert judge(AttemptEnd(4, worker="GPU0", step=3), 0, 1, None, training=True).restart
    assert not judge(AttemptEnd(4, worker="GPU0"), 0, 1, None, training=False).restart


def test_a_transient_failure_before_the_first_step_of_the_first_attempt_is_not_restarted():
    early = AttemptEnd(by_signal(signal.SIGKILL), worker="GPU0", how="killed by SIGKILL", step=None)
    verdict = judge(early, 0, 3, None, training=True)
    assert not verdict.restart and "before the first step" in verdict.why
    assert judge(early, 1, 3, KILLED, training=True).restart  # a later attempt that dies while starting again
    assert judge(early, 0, 3, None, training=False).restart  # a command of one's own prints no steps


def test_the_same_failure_at_the_same_step_twice_in_a_row_stops_and_says_so():
    verdict = judge(KILLED, 1, 5, previous=KILLED, training=True)
    assert not verdict.restart and verdict.why == "the same failure (killed by SIGKILL) at the same step (10) twice in a row"
    later = AttemptEnd(KILLED.exit_code, worker="GPU1", how="killed by SIGKILL", step=25)
    assert judge(later, 1, 5, previous=KILLED, training=True).restart


def test_the_backoff_doubles_from_its_first_value_up_to_a_minute():
    assert [backoff(n, 1.0) for n in (1, 2, 3, 7, 8)] == [1.0, 2.0, 4.0, 60.0, 60.0]
    assert backoff(3, 0.0) == 0.0


def test_the_last_step_is_read_from_training_step_lines_only():
    lines = [
        "INFO | [GPU 0] Step [9/40] | Loss: 3.2 | LR: 1e-3",
        "INFO | [GPU 0] Validation | Step [10/40] | Loss: 3.0",
        "INFO | [GPU 0] Step [10/40] | Loss: 3.1 | LR: 1e-3",
        "a line of the user's own mentioning Step [99/100]",
    ]
    assert last_step(lines) == 10
    assert last_step(["no steps here"]) is None


def test_the_record_lists_every_attempt_in_restarts_jsonl_and_in_the_summary(tmp_path):
    record = Record(tmp_path / "restarts.jsonl")
    first = record.begin(["GPU0", "GPU1"], None)
    record.end(first, KILLED, judge(KILLED, 0, 1, None, training=True))
    second = record.begin(["GPU0", "GPU2"], str(tmp_path / "checkpoints" / "step_10"))
    assert record.end(second, AttemptEnd(0, step=39), judge(AttemptEnd(0), 1, 1, KILLED, training=True)) is None
    lines = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert [(a["attempt"], a["exit_code"], a["worker"], a["step"], a["restarted"]) for a in lines] == [
        (0, 137, "GPU1", 10, True),
        (1, 0, None, 39, False),
    ]
    assert lines[1]["devices"] == ["GPU0", "GPU2"] and lines[1]["resumed_from"].endswith("step_10")
    assert record.summary() == [
        "attempts: 2 (restarts.jsonl)",
        "  0. from step 0 on GPU0, GPU1: GPU1: killed by SIGKILL at step 10; restarted",
        "  1. from step_10 on GPU0, GPU2: finished; exit code 0",
    ]


def test_a_record_that_cannot_be_written_is_a_warning_not_a_failure(tmp_path):
    (tmp_path / "run").write_text("a file where the run directory should be")
    record = Record(tmp_path / "run" / "restarts.jsonl")
    warning = record.end(record.begin(["CPU0"], None), KILLED, judge(KILLED, 0, 1, None, training=True))
    assert warning is not None and warning.startswith("warning: could not record the attempt in restarts.jsonl")


def test_an_attempt_stopped_by_sigterm_is_listed_as_stopped_not_as_a_worker_named_none(tmp_path):
    record = Record(tmp_path / "restarts.jsonl")
    stopped = AttemptEnd(by_signal(signal.SIGTERM), step=19, stopped=True)
    record.end(record.begin(["CPU0", "CPU1"], str(tmp_path / "step_5")), stopped, judge(stopped, 1, 2, None, training=True))
    assert record.summary()[1] == "  0. from step_5 on CPU0, CPU1: stopped by SIGTERM at step 19; exit code 143"


def test_a_later_launch_keeps_the_earlier_launches_attempts_and_lists_only_its_own(tmp_path):
    path = tmp_path / "restarts.jsonl"
    first = Record(path)
    first.end(first.begin(["CPU0"], None), KILLED, judge(KILLED, 0, 1, None, training=True))
    first.end(first.begin(["CPU0"], "step_10"), AttemptEnd(0), judge(AttemptEnd(0), 1, 1, KILLED, training=True))
    again = Record(path)  # the next launch in the run directory (--resume auto, a Slurm requeue)
    again.end(again.begin(["CPU1"], "step_20"), AttemptEnd(0), judge(AttemptEnd(0), 0, 1, None, training=True))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(a["launch"], a["attempt"], a["devices"]) for a in lines] == [(1, 0, ["CPU0"]), (1, 1, ["CPU0"]), (2, 0, ["CPU1"])]
    assert again.summary() == ["attempts of launch 2: 1 (restarts.jsonl)", "  0. from step_20 on CPU1: finished; exit code 0"]


def test_the_backoff_not_given_starts_at_one_second():
    assert [backoff(n, None) for n in (1, 2)] == [1.0, 2.0]


# Timeouts in the words of the libraries that time out (torch 2.13's gloo, NCCL and c10d store, as
# they print them) and of pretrain/train.py, each beside a line of a command of one's own that is no
# such timeout and would only time out again.
TIMEOUTS = [
    (
        "[rank1]:[E1218 20:27:21.426 ProcessGroupNCCL.cpp:629] [Rank 1] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=1, OpType=BROADCAST, NumelIn=8, NumelOut=8, Timeout(ms)=600000) ran for 600081 milliseconds "
        "before timing out.",
        "a collective timed out",
        "ERROR | the evaluation server's collective operation timeout is 30 s",
    ),
    (
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
        "waiting 2000ms for recv operation to complete",
        "a collective timed out",
        "Timed out waiting for the lock on /data/shard_0.bin",
    ),
    ("RuntimeError: Application timeout caused pair closure", "a collective timed out", "the application timed out"),
    (
        "RuntimeError: [Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms",
        "a collective timed out",
        "the job failed to pass the health check in time",
    ),
    (
        "ERROR | [CPU 1] a collective waited longer than system.collective_timeout (600 s) for the other ranks: one of "
        "them is frozen or gone",
        "a collective timed out",
        "ERROR | a request waited longer than 30 s",
    ),
    (
        "torch.distributed.DistStoreError: wait timeout after 1000ms, keys: /default_pg/0//cpu//0",
        "torch.distributed's store timed out",
        "wait timeout: the queue stayed empty",
    ),
    (
        "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients joined.",
        "torch.distributed's store timed out",
        "download of shard_3.bin timed out after 30 s",
    ),
    (
        "torch.distributed.DistNetworkError: The client socket has timed out after 1000ms while trying to connect to "
        "(127.0.0.1, 29500).",
        "torch.distributed's store timed out",
        "requests.exceptions.ConnectTimeout: the connection timed out after 10000ms",
    ),
    (
        "torch.distributed.DistNetworkError: Socket Timeout",
        "torch.distributed's store timed out",
        "urllib3: socket timeout while reading https://example.com/data",
    ),
    (
        "RuntimeError: Timed out initializing process group in store based barrier on rank 1, for key: store_based_barrier_key:1",
        "torch.distributed's store timed out",
        "Timed out initializing the tokenizer cache",
    ),
]


@pytest.mark.parametrize("line, cause, near_miss", TIMEOUTS, ids=[t[1] + ": " + t[0][:40] for t in TIMEOUTS])
def test_only_the_collective_libraries_own_timeout_messages_make_a_failure_transient(line, cause, near_miss):
    timed_out = AttemptEnd(1, worker="CPU1", how="exit code 1", tail=("INFO | step", line), step=4)
    assert transient_cause(timed_out) == f"{cause} on CPU1"
    own = AttemptEnd(1, worker="CPU1", how="exit code 1", tail=("INFO | step", near_miss), step=4)
    assert transient_cause(own) is None and not judge(own, 0, 3, None, training=True).restart


def test_a_command_whose_download_timed_out_is_not_restarted():
    download = AttemptEnd(1, worker="CPU0", how="exit code 1", tail=("download of data.bin timed out after 30 s",))
    verdict = judge(download, 0, 3, None, training=False)
    assert not verdict.restart and verdict.why == "exit code 1 shows no hardware, network or timeout cause: it would repeat"
