"""One worker: its environment, its process (in a process group of its own), and the two
threads that turn its output and its exit into events for the supervisor."""

from __future__ import annotations

import codecs
import errno
import os
import shutil
import site
import subprocess
import sysconfig
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from launcher import address_space
from launcher.gpus.devices import VISIBILITY_VARIABLES
from launcher.exit_codes import EXIT_CANNOT_EXECUTE, EXIT_COMMAND_NOT_FOUND, EXIT_NO_ADDRESS_SPACE
from launcher.processes.torchrun_env import NO_RESTARTS, Restarts, torchrun_defaults, torchrun_variables
from pretrain.run.allocator_env import set_default_allocator
from pretrain.run.parent_death import die_with_parent
from pretrain.run.refusal import Refusal

MAX_LINE_BYTES = 64 * 1024  # a longer line is passed on in pieces, so memory stays bounded
CUDA_DEVICE_INDEX_VAR = "LAUNCHER_CUDA_DEVICE_INDEX"
"""The cuda:<n> a GPU worker uses among those its visibility variable shows it: 0 when it sees only its
own GPU, LOCAL_RANK when it sees every run GPU of its node (pretrain/distributed/runtime.py reads it)."""


@dataclass(frozen=True)
class Line:
    """The worker wrote one line (decoded, newline stripped)."""

    worker: Worker
    text: str


@dataclass(frozen=True)
class Exited:
    """The worker's process ended with this returncode (negative: killed by that signal)."""

    worker: Worker
    returncode: int


@dataclass(frozen=True)
class OutputClosed:
    """The worker's output pipe reached end of file (every writer has closed it)."""

    worker: Worker


Event = Line | Exited | OutputClosed


class StartError(Refusal, OSError):
    """A worker's command could not be started, with the exit code a shell gives that: 127 when
    there is no such command, 126 when it exists but cannot be executed (no execute permission,
    a directory, not a program nor a script with #!, or a #! naming a missing interpreter).
    No memory left to start it (ENOMEM: `ulimit -v`) is the launcher's own refusal, exit 2."""

    def __init__(self, command: str, error: OSError, label: str = "") -> None:
        super().__init__(error.errno, error.strerror or str(error))
        self.command = command
        self.label = label
        """The worker that could not be started; empty when found before any was made."""
        self.exit_code = _exit_code(command, error)

    def __str__(self) -> str:
        if self.exit_code == EXIT_NO_ADDRESS_SPACE:  # no memory left to start it
            return address_space.refusal()
        if self.errno == errno.ENOENT and "/" not in self.command:
            return f"command not found: {self.command}"
        reason = f"cannot run {self.command}: {self.strerror}"
        if self.errno in (errno.EACCES, errno.EPERM) and os.path.isfile(self.command):
            reason += f" (it is not executable: chmod +x {self.command}, or name its interpreter, as in -- bash {self.command})"
        elif self.errno == errno.ENOEXEC:
            reason += " (neither a program nor a script whose first line is #! and its interpreter)"
        elif self.errno == errno.ENOENT and self.exit_code == EXIT_CANNOT_EXECUTE:
            named = _interpreter(shutil.which(self.command) or self.command)
            reason += f" (bad interpreter: its #! line names {named or 'a program'}, which is not there)"
        return reason


def _interpreter(script: str) -> str | None:
    """The program a script's #! line names, or None (no #! line, or unreadable)."""
    try:
        with open(script, "rb") as file:
            first = file.readline(256)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    return words[0] if words else None


def _exit_code(command: str, error: OSError) -> int:
    """127 for a command that is not there, else 126. A missing #! interpreter is also ENOENT, but
    the command is there: 126, as bash says "bad interpreter"."""
    if address_space.is_out_of_memory(error):
        return EXIT_NO_ADDRESS_SPACE
    missing = error.errno in (errno.ENOENT, errno.ENOTDIR) and shutil.which(command) is None
    return EXIT_COMMAND_NOT_FOUND if missing else EXIT_CANNOT_EXECUTE


def check_runnable(command: str, search_path: str | None) -> None:
    """Raise StartError where a shell could not run command (search_path: PATH): a name with a
    slash must be an executable file; a bare name, one on search_path, where a file that is
    there but not executable is "Permission denied" (as bash and execvp say), not "not found"."""
    if "/" in command:
        if not os.path.exists(command):
            raise StartError(command, FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT)))
        if os.path.isdir(command):
            raise StartError(command, IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)))
        if not os.access(command, os.X_OK):
            raise StartError(command, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
        return
    if shutil.which(command, path=search_path) is not None:
        return
    dirs = (search_path if search_path is not None else os.defpath).split(os.pathsep)
    for found in (os.path.join(d or ".", command) for d in dirs):
        if os.path.isfile(found):  # the first of its name on PATH, though not executable
            raise StartError(found, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
    raise StartError(command, FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT)))


def _die_with_parent(launcher_pid: int) -> Callable[[], None]:
    """A preexec_fn: the child asks Linux to SIGKILL it when the launcher dies, so even a
    SIGKILLed launcher leaves no worker behind."""
    return lambda: die_with_parent(launcher_pid)


@dataclass(eq=False)
class Worker:
    rank: int
    label: str
    """Console prefix and log name: GPU<physical index> or CPU<rank>."""
    argv: Sequence[str]
    env: dict[str, str]
    process: subprocess.Popen | None = field(default=None, repr=False)
    started_at: float = 0.0

    def start(self) -> None:
        """Spawn the process. Raises StartError (with a shell's exit code) for a bad command."""
        try:
            self.process = subprocess.Popen(
                list(self.argv),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,  # one pipe keeps their order
                start_new_session=True,
                preexec_fn=_die_with_parent(os.getpid()),
            )
        except OSError as error:
            raise StartError(self.argv[0], error, self.label) from None
        self.started_at = time.monotonic()

    def watch(self, emit: Callable[[Event], None]) -> None:
        """Start the reader and waiter threads; they report through emit."""
        threading.Thread(target=self._read, args=(emit,), daemon=True, name=f"read-{self.label}").start()
        threading.Thread(target=self._wait, args=(emit,), daemon=True, name=f"wait-{self.label}").start()

    def _read(self, emit: Callable[[Event], None]) -> None:
        assert self.process is not None and self.process.stdout is not None
        stream = self.process.stdout
        # Incremental, so a character split between two pieces of a long line survives;
        # bytes that are not UTF-8 become U+FFFD instead of an error.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := stream.readline(MAX_LINE_BYTES):
            # A piece is a whole line unless it was cut at MAX_LINE_BYTES; a short piece
            # without a newline is the last one before the end of output.
            whole = chunk.endswith(b"\n") or len(chunk) < MAX_LINE_BYTES
            emit(Line(self, decoder.decode(chunk.rstrip(b"\n"), final=whole)))
        stream.close()
        emit(OutputClosed(self))

    def _wait(self, emit: Callable[[Event], None]) -> None:
        """Report the exit without reaping: the process stays a zombie until reap(), so
        its pid, and so its process group id, cannot pass to another process while the
        supervisor may still signal them."""
        assert self.process is not None
        try:
            info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # reaped already: the supervisor is past teardown
            return
        assert info is not None  # None only with WNOHANG
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        emit(Exited(self, -info.si_status if killed else info.si_status))

    def reap(self) -> None:
        """Collect the ended process (after teardown); no signal is sent to it afterwards."""
        if self.process is not None:
            self.process.wait()

    def signal(self, signum: int) -> None:
        """Send signum to the worker's own process only (its helpers keep running)."""
        if self.process is not None and self.process.returncode is None:  # not reaped
            try:
                os.kill(self.process.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def signal_group(self, signum: int) -> None:
        """Send signum to the worker's whole process group (it and what it started)."""
        if self.process is None or self.process.returncode is not None:  # reaped: the id may be reused
            return
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is already gone


def worker_env(
    base: dict[str, str],
    *,
    rank: int,
    world_size: int,
    master_port: int,
    gpu: str | None,
    cpu_count: int,
    compile_cache: str | None,
    gpu_id: str | None = None,
    cuda_device_index: int = 0,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    nnodes: int = 1,
    run_id: str = "",
    error_file: str = "",
    restarts: Restarts = NO_RESTARTS,
    visibility_variable: str = "CUDA_VISIBLE_DEVICES",
) -> dict[str, str]:
    """The worker contract (docs/design.md): torchrun's variables, its GPU, bounded threads.

    rank and world_size are the job's; local_rank and local_world_size (default: the same)
    this node's, which also share its cores. node_rank, nnodes, run_id, error_file and restarts
    are torchrun's GROUP_RANK, GROUP_WORLD_SIZE, TORCHELASTIC_RUN_ID, TORCHELASTIC_ERROR_FILE and
    restart counts (launcher/processes/torchrun_env.py says what each means here).

    gpu is the value of visibility_variable (CUDA_VISIBLE_DEVICES on NVIDIA, ROCR_VISIBLE_DEVICES
    on AMD: Gpu.visibility_variable): the worker's own GPU (the launcher gives its UUID), or every
    run GPU of the node, comma-separated in local-rank order (launcher/gpus/visibility.py); None
    for a CPU worker, which sees no GPU of either vendor: CUDA_VISIBLE_DEVICES and
    ROCR_VISIBLE_DEVICES empty, HIP_VISIBLE_DEVICES removed (HIP takes an empty mask as no filter,
    ROCr a set but empty one as no device). On AMD, HIP_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES
    are removed: HIP applies one of them after ROCR_VISIBLE_DEVICES, to the list it left, so a value
    inherited from the launcher's environment would pick from the wrong list, or hide the worker's GPU.
    cuda_device_index is which of them is the worker's own (cuda:<n>, as LAUNCHER_CUDA_DEVICE_INDEX).
    gpu_id (default: gpu) is its GPU_RANK, the id its log prefix shows. Thread counts the user set explicitly are kept."""
    local_rank = rank if local_rank is None else local_rank
    local_world_size = world_size if local_world_size is None else local_world_size
    threads = str(max(1, cpu_count // local_world_size))
    env = dict(base)
    env.update(
        torchrun_variables(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=node_rank,
            nnodes=nnodes,
            master_addr=master_addr,
            master_port=master_port,
            run_id=run_id,
            error_file=error_file,
            restarts=restarts,
        )
    )
    env.update(
        {
            "NODE_RANK": str(node_rank),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            # A CPU worker sees no GPU at all, so nothing in it can initialise CUDA by accident.
            "CUDA_VISIBLE_DEVICES": gpu if gpu is not None else "",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if gpu is None:
        # ROCm: HIP takes an empty CUDA_VISIBLE_DEVICES as no filter at all; ROCr takes a set but
        # empty ROCR_VISIBLE_DEVICES as no device, and HIP's own mask could only pick among none.
        env.pop("HIP_VISIBLE_DEVICES", None)
        env["ROCR_VISIBLE_DEVICES"] = ""
    elif visibility_variable != "CUDA_VISIBLE_DEVICES":
        for name in VISIBILITY_VARIABLES:
            env.pop(name, None)
        env[visibility_variable] = gpu
    if gpu is not None:
        env["GPU_RANK"] = gpu_id or gpu
        env[CUDA_DEVICE_INDEX_VAR] = str(cuda_device_index)
    else:
        env.pop("GPU_RANK", None)
        env.pop(CUDA_DEVICE_INDEX_VAR, None)
    env.setdefault("OMP_NUM_THREADS", threads)
    for name, value in torchrun_defaults().items():  # the user's own value wins
        env.setdefault(name, value)
    # One compile cache for all ranks: they reuse each other's kernels instead of each
    # compiling the same ones. N ranks compiling at once would each start a pool as large as the machine.
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", threads)
    if compile_cache is not None:  # None: a run that does not compile names none (launcher/compile_cache.py)
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", compile_cache)
    # Segments that grow in place, unless the user set the allocator under any of torch's names
    # (pretrain/run/allocator_env.py: PYTORCH_HIP_ALLOC_CONF on ROCm must not be overridden).
    set_default_allocator(env)
    return env


def _entries(pythonpath: str | None) -> list[str]:
    return [entry for entry in (pythonpath or "").split(os.pathsep) if entry]


def _same_dir(entry: str, directory: Path) -> bool:
    try:
        return Path(entry).expanduser().resolve() == directory.resolve()
    except OSError:
        return False


def _site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    dirs = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [Path(d) for d in dirs]


def with_package_root(env: dict[str, str], root: Path) -> dict[str, str]:
    """env for a process of ours (`python -m pretrain`, the guardian) that imports this project:
    root (where the packages are) joins PYTHONPATH unless Python finds them there anyway (an
    installed copy, in site-packages) or PYTHONPATH names it already (a clone's run_training.sh)."""
    entries = _entries(env.get("PYTHONPATH"))
    if any(_same_dir(str(d), root) for d in _site_dirs()) or any(_same_dir(e, root) for e in entries):
        return env
    return env | {"PYTHONPATH": os.pathsep.join([str(root), *entries])}


def without_package_root(env: dict[str, str], root: Path) -> dict[str, str]:
    """env for the user's own command (`-- COMMAND`): PYTHONPATH without this project's packages,
    which run_training.sh puts there for the launcher, so they never shadow the user's modules."""
    if "PYTHONPATH" not in env:
        return env
    kept = [e for e in _entries(env["PYTHONPATH"]) if not _same_dir(e, root)]
    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    return env | {"PYTHONPATH": os.pathsep.join(kept)} if kept else env
