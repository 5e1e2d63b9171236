"""The restart rules (launcher/supervise/restarts.py) and the record of attempts, without processes:
what restarts, what never does and in which order, and restarts.jsonl."""

from __future__ import annotations

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
