"""The failure summary, printed once after teardown: which worker failed first, when and
how, a hint where the cause is known, its last lines, and where every worker was."""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from launcher.address_space import address_space_limit
from launcher.exit_codes import STOP_SIGNALS, by_signal

RULE = "=" * 72
CUDA_OOM_MARKERS = ("CUDA out of memory", "torch.OutOfMemoryError", "CUDA error: out of memory")
HOST_OOM_MARKERS = ("DefaultCPUAllocator: can't allocate memory", "std::bad_alloc")
"""Where a worker's line says host memory (or address space, under `ulimit -v`) ran out, besides a
traceback's last line starting with MemoryError: torch's CPU allocator, C++'s allocation failure."""
FRAMES_SHOWN = 3
KILLED_BY_STOP = frozenset(-s for s in STOP_SIGNALS)
"""How any worker ends on a stop signal it does not handle: killed by it. A training worker that
handles one exits with its shell code after saving (SupervisorOptions.stop_exit_codes): a command
of one's own exiting 143 by itself was sent no signal."""
SIGNAL_CAME = re.compile(r"\] (SIG[A-Z]+) came to this rank: every rank stops after step \d+$")
"""The line of the training rank a stop signal came to (pretrain/train.py), before its stop line:
every rank stops at the same step with the same stop line, and this says which one was sent it."""

_NONFINITE_REPORT = re.compile(r"^(NaN|Inf) (GRADIENT|LOSS) DETECTED \[")
"""The banner of a training worker's report on a NaN or Inf (pretrain/numerics/debug.py)."""
_NCCL_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout: WorkNCCL\(.*?\bOpType=(?P<op>\w+)"
    r".*?\bTimeout\(ms\)=(?P<ms>\d+)"
)
"""torch's ProcessGroupNCCL watchdog on a collective past its timeout (system.collective_timeout)."""
_NCCL_STUCK = re.compile(r"ProcessGroupNCCL's watchdog got stuck for (?P<seconds>\d+) seconds")
"""Its heartbeat monitor: the watchdog thread itself stopped (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC)."""
OUR_PACKAGES = ("pretrain", "launcher")
"""A frame in them is named from the package on: their folders go two deep."""
_THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")
_FAULTHANDLER_NOTES = ("  Garbage-collecting", "  <no Python frame>", "  ...")
"""faulthandler's own lines within a thread's stack (frames are _FAULTHANDLER_FRAME)."""
_FAULTHANDLER_FRAME = re.compile(r'^  File (?:"(?P<file>.+)"|\?\?\?), line (?P<line>\d+|\?\?\?) in (?P<func>.+)$')
"""One frame as faulthandler writes it. It writes ??? for what it cannot tell: the line of a frame
that is at an instruction without one, as a closure is on its first (COPY_FREE_VARS), say the
debug preset's hooks, which run thousands of times a step and so are often innermost."""


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def first_failure_line(label: str, returncode: int, stop_exit_codes: frozenset[int] = frozenset()) -> str:
    """The launcher's line when a worker fails first: a stop signal the launcher did not send ends a
    worker too, and may have been sent to another (all training ranks stop together)."""
    if stop_signal(returncode, stop_exit_codes) is not None:
        return f"{label} stopped ({describe(returncode)}) on a signal the launcher did not send; stopping the other workers"
    return f"{label} failed ({describe(returncode)}); stopping the other workers"


def signal_came(tail: list[str]) -> str | None:
    """The stop signal that came to this training worker (its stop line says so), else None."""
    return next((found[1] for line in reversed(tail) if (found := SIGNAL_CAME.search(line))), None)


def stop_signal(returncode: int, stop_exit_codes: frozenset[int] = frozenset()) -> str | None:
    """The stop signal a worker ended on (killed by it, or exiting with one of stop_exit_codes, its
    code after saving), else None."""
    if returncode not in KILLED_BY_STOP | stop_exit_codes:
        return None
    return signal.Signals(-returncode if returncode < 0 else returncode - by_signal(0)).name


def is_cuda_oom(line: str) -> bool:
    return any(marker in line for marker in CUDA_OOM_MARKERS)


def is_host_oom(line: str) -> bool:
    """Whether a worker's line says host memory ran out (MemoryError ends a traceback's last line)."""
    return line.startswith("MemoryError") or any(marker in line for marker in HOST_OOM_MARKERS)


def nonfinite_banner(line: str) -> str | None:
    """ "NaN GRADIENT DETECTED" when line is the banner of a NaN/Inf report, else None."""
    return match.group(0).removesuffix(" [") if (match := _NONFINITE_REPORT.match(line)) else None


def nccl_watchdog(line: str) -> str | None:
    """What NCCL's watchdog reported on this line, as the hint words it, else None. By default
    (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) the watchdog then ends the process with SIGABRT: no
    Python error follows, so this line is the only record of why."""
    if "atchdog" not in line:  # most lines: skip the regular expressions
        return None
    if match := _NCCL_TIMEOUT.search(line):
        return (
            f"NCCL's watchdog found a collective ({match['op']}) waiting longer than system.collective_timeout "
            f"({int(match['ms']) / 1000:g} s) for the other ranks, and on NCCL that ends the process with "
            f"SIGABRT (exit 134) rather than a Python error. One rank is frozen, gone or far behind (a slow "
            f"checkpoint save or compilation, a data stall): the other workers' logs and stack dumps say which. "
            f"Raise system.collective_timeout only if that rank is legitimately this slow."
        )
    if match := _NCCL_STUCK.search(line):
        return (
            f"NCCL's watchdog thread made no progress for {match['seconds']} s (a CUDA or NCCL call hung) and "
            f"its monitor ended the process with SIGABRT (exit 134). system.collective_timeout does not bound "
            f"this; TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC does. The other workers' logs and stack dumps show where "
            f"each was."
        )
    return None


def short_path(file: str) -> str:
    """A frame's file as the summary names it: from this project's package on (pretrain/run/stopping.py),
    or its last two parts elsewhere (distributed/c10d_logger.py)."""
    parts = Path(file).parts
    ours = [i for i, part in enumerate(parts[:-1]) if part in OUR_PACKAGES and len(parts) - i <= 3]
    return "/".join(parts[ours[-1] :] if ours else parts[-2:])


@dataclass
class StackDump:
    """Reads faulthandler's output (all threads, most recent call first) line by line."""

    threads: list[list[str]] = field(default_factory=list)
    took_line: bool = False
    """Whether the line fed last was part of the dump (a header, a frame, a note, the blank after)."""
    _in_thread: bool = False

    def feed(self, line: str) -> bool:
        """Take one line of output; True if it starts a thread's stack. A thread's stack runs from
        its header to the blank line before the next thread's: another line within it, such as
        faulthandler's own note ("  Garbage-collecting") or a line another thread of the worker
        wrote meanwhile, is passed over, never the frames after it."""
        self.took_line = False
        if _THREAD_HEADER.match(line):
            self.threads.append([])
            self._in_thread = self.took_line = True
            return True
        if not self._in_thread:
            return False
        if frame := _FAULTHANDLER_FRAME.match(line):
            where = short_path(frame["file"]) if frame["file"] is not None else "???"
            self.threads[-1].append(f"{frame['func']} ({where}:{frame['line']})")
            self.took_line = True
        elif not line.strip():
            self._in_thread = False
            self.took_line = True
        else:
            self.took_line = line.startswith(_FAULTHANDLER_NOTES)
        return False

    def where(self) -> str | None:
        """The innermost frames of the deepest thread (the main thread, in a training
        process), or None if no dump arrived."""
        if not any(self.threads):
            return None
        deepest = max(self.threads, key=len)
        return " <- ".join(deepest[:FRAMES_SHOWN])


def hint(
    returncode: int,
    *,
    hung_for: float | None,
    cuda_oom: bool,
    nonfinite_reports: Mapping[str, str] | None = None,
    nccl_watchdog: str | None = None,
    host_oom: bool = False,
    injected: bool = False,
    ended_early: bool = False,
    stopped_by: str | None = None,
) -> str | None:
    """nonfinite_reports: label -> banner, for the workers that reported a NaN or Inf.
    nccl_watchdog: what nccl_watchdog() made of the failed worker's output, if anything.
    host_oom: the worker said host memory ran out (is_host_oom).
    injected: its last line says PRETRAIN_FAULTS made it fail (pretrain/run/faults.py).
    ended_early: it exited 0 while its peers still ran, and they lost it.
    stopped_by: the stop signal another process sent it (stop_signal)."""
    if injected:
        return "the worker failed on purpose: PRETRAIN_FAULTS injected this fault (a testing aid, docs/testing.md)."
    if ended_early:
        return (
            "a worker that exits 0 while the others still run ends the run as a crash would: their next "
            "collective finds it gone. Its last lines say why it returned early."
        )
    if stopped_by is not None:
        return (
            f"another process (kill, a scheduler signalling one process) sent {stopped_by} to this worker alone; "
            f"the launcher, when it is signalled itself, stops every worker. Training ranks stop together after "
            f"the same step and save a checkpoint, which --resume auto goes on from."
        )
    if nonfinite_reports:
        banners = sorted(set(nonfinite_reports.values()))
        return (
            f"the loss or the gradients became NaN or Inf: {', '.join(nonfinite_reports)} logged "
            f"{' / '.join(banners)} with the tensors involved, and where the checkpoint of the state "
            f"before that step and the tensor dump went. docs/numerics.md (Troubleshooting) says what to change "
            f"(configs/config_stable.json)."
        )
    if hung_for is not None:
        return (
            f"it printed nothing for {hung_for:g} s (--hang-timeout); the stack dumps show what each "
            f"worker was waiting for. Raise --hang-timeout if start-up or compilation is this slow."
        )
    if cuda_oom:
        return (
            "the GPU ran out of memory: lower training.batch_size (raise training.grad_accum_nums to keep "
            "the tokens per step) or data.context_length."
        )
    if nccl_watchdog:
        return nccl_watchdog
    if host_oom:
        return host_memory_hint()
    if returncode == -signal.SIGKILL:
        return (
            "SIGKILL came from outside the launcher, most often the kernel's out-of-memory killer "
            "(check `dmesg | grep -i oom`): the host ran out of memory."
        )
    return None


def host_memory_hint() -> str:
    """What a worker that ran out of host memory should change: under `ulimit -v` (which the workers
    inherit from the launcher) the limit, else the run's host memory."""
    limit = address_space_limit()
    if limit is not None:
        return (
            f"the worker ran out of address space: ulimit -v is {limit // 1024} KiB, which every worker inherits "
            "(a training process maps several GiB); raise it (ulimit -v unlimited)"
        )
    return (
        "the host ran out of memory: lower training.batch_size or data.num_workers, or stop what else uses "
        "the host's memory (`free -g`)"
    )


@dataclass(frozen=True)
class Failure:
    label: str
    rank: int
    after_start: float
    """Seconds from the worker's start to its failure."""
    clock: str
    """Wall-clock time of the failure (HH:MM:SS), to match against dmesg or other logs."""
    exit_code: int
    how: str
    """"exit code 7", "killed by SIGKILL", or what the hang watchdog saw."""
    hint: str | None
    tail: list[str]
    stopped: int
    """Workers still running at the failure, which the teardown stopped."""
    teardown_seconds: float
    where: dict[str, str]
    """Label -> innermost frames, for every worker whose stack dump arrived."""
    logs: Path | None
    consequences: list[str] = field(default_factory=list)
    """The other workers whose failure this one caused (they lost the connection to it), each
    'CPU1 (rank 1), exit code 4, 0.31 s before it'."""
    lost_peer: str | None = None
    """When this failure is itself a consequence that no cause followed: what that means."""
    stopped_by: str | None = None
    """When a stop signal the launcher did not send ended it (another process sent it to this worker
    alone): that signal's name. The run was stopped rather than failed."""


def render(failure: Failure) -> list[str]:
    said = re.search(rf"\bexit code {failure.exit_code}\b", failure.how)  # the how of a worker that exited 0 names the run's
    how = failure.how if said else f"{failure.how}, exit code {failure.exit_code}"
    when = f"at {failure.clock}, {failure.after_start:.1f} s after start"
    if failure.stopped_by is not None:
        headline = (
            f"STOPPED: {failure.label} (rank {failure.rank}) was stopped by {failure.stopped_by} from outside the "
            f"launcher (the launcher did not send it) {when}; exit code {failure.exit_code}."
        )
    else:
        headline = f"FAILED: {failure.label} (rank {failure.rank}) failed first {when}: {how}."
    lines = [RULE, headline]
    if failure.lost_peer:
        lines.append(failure.lost_peer)
    if len(failure.consequences) == 1:
        lines.append(
            f"Not a cause: {failure.consequences[0]}: a consequence of this failure (it lost the connection "
            f"to the rank, or what they shared); its last line says which, its log has the traceback."
        )
    elif failure.consequences:
        lines.append(
            f"Not causes: {'; '.join(failure.consequences)}: consequences of this failure (each lost the "
            f"connection to a rank, or what they shared); their last lines say which, their logs have the tracebacks."
        )
    if failure.hint:
        lines.append(f"Hint: {failure.hint}")
    if failure.tail:
        lines.append(f"Last {len(failure.tail)} lines of {failure.label}:")
        lines += [f"  {line}" for line in failure.tail]
    if failure.where:
        lines.append("Where each worker was (innermost frames first; full stacks in its log):")
        lines += [f"  {label}: {frames}" for label, frames in failure.where.items()]
    lines.append(f"Stopped {failure.stopped} other running worker(s); teardown took {failure.teardown_seconds:.2f} s.")
    if failure.logs is not None:
        lines.append(f"Full logs: {failure.logs}")
    lines.append(RULE)
    return lines
