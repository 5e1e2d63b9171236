"""Too little memory for the launcher itself: one line naming the limit and the fix, not a traceback.

Under a small address-space limit (`ulimit -v`, RLIMIT_AS) the launcher's own start fails in many
ways, each with a traceback or a library's own words: a MemoryError while importing, a shared
library that cannot be mapped ("failed to map segment from shared object"), a thread or a worker
that cannot start (ENOMEM), or OpenBLAS giving up as numpy loads, which ends the process with no
Python error at all. is_out_of_memory tells them apart from other errors, refusal says what to do,
and the entry point (launcher/__main__.py's start) runs the command line so that all of them,
wherever in the launcher's start-up, end in that one line and exit code 2. A limit too small for
any training worker is refused the same way before one starts (too_small_for_workers); a worker
that runs out above that floor (a larger model, more threads) fails on its own, and the summary's
hint names the limit.

Standard library only, and imported before anything else: it must work where little else can. It
imports no launcher module, so every one may import it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import sys
from collections.abc import Iterator

_NO_MAPPING = ("failed to map segment from shared object", "Cannot allocate memory")
"""What the dynamic loader says (in an ImportError) when a library does not fit the address space."""


def address_space_limit() -> int | None:
    """The soft RLIMIT_AS in bytes (what `ulimit -v` set, in KiB there); None when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def is_out_of_memory(error: BaseException | None) -> bool:
    """Whether error (or what caused it) is the process running out of memory or address space."""
    while error is not None:
        if isinstance(error, MemoryError):
            return True
        if isinstance(error, OSError) and error.errno == errno.ENOMEM:
            return True
        if isinstance(error, ImportError | OSError) and any(words in str(error) for words in _NO_MAPPING):
            return True
        if isinstance(error, RuntimeError) and "can't start new thread" in str(error):
            return True
        if isinstance(error, SystemError) and address_space_limit() is not None:
            return True  # a MemoryError lost in C code ("returned NULL without setting an exception")
        error = error.__cause__ or error.__context__
    return False


def refusal() -> str:
    """The one line: the limit, read from RLIMIT_AS, and how to raise it."""
    limit = address_space_limit()
    if limit is None:
        return "out of memory while starting (no address-space limit is set: the machine's memory is used up); free some memory"
    return (
        f"not enough address space to start: ulimit -v is {limit // 1024} KiB (RLIMIT_AS, {limit >> 20} MiB); "
        "raise it (ulimit -v unlimited)"
    )


WORKER_ADDRESS_SPACE = 736 << 20
"""The least address space a training worker needs alone: torch, the debug model on CPU, a few
steps. Measured here (torch 2.13's CPU build, 2 cores): it fails at 757 MiB and trains at 781 MiB;
a larger model, more cores or CUDA's libraries need more. Below that no worker starts training."""
WORKER_BESIDE_PEERS_ADDRESS_SPACE = 980 << 20
"""The same beside other ranks, whose collectives (gloo) and DDP add threads, each with its own
stack and malloc arena: measured here, two ranks fail at 1001 MiB each and train at 1025 MiB."""


def too_small_for_workers(world_size: int) -> str | None:
    """The one line refusing training workers an address-space limit (which they inherit) that
    none of them could train in, before any starts; None without a limit, or above that floor."""
    limit = address_space_limit()
    floor = WORKER_ADDRESS_SPACE if world_size == 1 else WORKER_BESIDE_PEERS_ADDRESS_SPACE
    if limit is None or limit >= floor:
        return None
    alone = "alone" if world_size == 1 else "beside other ranks"
    return (
        f"not enough address space for the training workers: ulimit -v is {limit // 1024} KiB (RLIMIT_AS, {limit >> 20} MiB), "
        f"which every worker inherits, and one {alone} needs more than {floor >> 20} MiB; raise it (ulimit -v unlimited)"
    )


NUMPY_ADDRESS_SPACE = 96 << 20
"""Address space numpy takes as it loads with one OpenBLAS thread (85 MiB measured, with a margin)."""


def address_space_in_use() -> int:
    """This process's mapped address space in bytes (VmSize), which RLIMIT_AS bounds."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def loading_numpy() -> Iterator[None]:
    """Around the launcher's first import of numpy (the data preparation's): under an address-space
    limit, OpenBLAS loads with one thread instead of one per core, and where even that does not fit,
    MemoryError now. OpenBLAS reserves its buffers as it loads, and where they do not fit it exits
    the process with a line of its own, no Python error to catch. It reads its variable then, once:
    the workers get the environment as it was."""
    limit = address_space_limit()
    if limit is None or "numpy" in sys.modules:
        yield
        return
    if limit - address_space_in_use() < NUMPY_ADDRESS_SPACE:
        raise MemoryError("no address space left to load numpy")
    before = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = before
