"""One training process: what the launcher runs on every device, and what runs alone without it.

python -m pretrain --debug
CUDA_VISIBLE_DEVICES=3 GPU_RANK=3 python -m pretrain --debug   # lines labelled [GPU 3]
"""

import faulthandler
import signal

# First, before torch loads: on SIGUSR1 (the launcher sends it before tearing a run down)
# print the Python stack of every thread to stderr, which is this worker's log. It works
# even while the process is stuck in C code, such as a collective waiting for a peer.
faulthandler.register(signal.SIGUSR1, all_threads=True)
faulthandler.enable()  # and on a crash in native code (SIGSEGV, SIGFPE, SIGABRT, SIGBUS)

import os  # noqa: E402
import sys  # noqa: E402

# Also before torch (CUDA reads it once, when it starts): number GPUs in PCI bus order, as
# NVML, nvidia-smi and system.device_id do. CUDA's default puts the fastest GPU first, so
# on a mixed machine device_id 1 could be another GPU than nvidia-smi's GPU 1.
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
# As the launcher gives its workers (launcher/processes/worker.py): segments that grow in place, for far
# less fragmentation when allocation sizes vary (FSDP's gathered groups, the chunked loss), unless
# the user chose an allocator setting under any of torch's names (PYTORCH_HIP_ALLOC_CONF on ROCm).
from pretrain.run.allocator_env import set_default_allocator  # noqa: E402

set_default_allocator(os.environ)

# Before torch reads them: a thread count that is not one (OMP_NUM_THREADS=abc) would cost a
# libgomp warning and a run on all cores, or a ValueError at the first compile.
from pretrain.run.exit_codes import BAD_INPUT  # noqa: E402
from pretrain.run.thread_env import bad_thread_variable  # noqa: E402

if __name__ == "__main__" and (problem := bad_thread_variable(os.environ)):
    print(f"pretrain: error: {problem}", file=sys.stderr)
    sys.exit(BAD_INPUT)

# Before torch too: --help and a usage error answer at once, not after seconds of imports.
from pretrain.train_args import parse_args  # noqa: E402

if __name__ == "__main__":
    arguments = parse_args(sys.argv[1:])

from pretrain.run.startup_gc import imports_frozen  # noqa: E402

# torch's ~300,000 objects load without the cyclic collector and are then frozen out of its walks:
# 0.45 s less CPU before the first step, and collections during training that skip them.
with imports_frozen():
    from pretrain.distributed.runtime import exit_process
    from pretrain.train import run_command

if __name__ == "__main__":
    exit_process(run_command(arguments))  # without interpreter finalization, where gloo's threads can abort a run that succeeded
