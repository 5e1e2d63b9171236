"""One training process, without the supervisor.

    python3 pretrain_main.py --debug
    CUDA_VISIBLE_DEVICES=3 GPU_RANK=3 python3 pretrain_main.py --debug   # lines labelled [GPU 3]
"""

import logging
import os
import sys

from pretrain.train import main

if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization: there, C++ threads of the distributed runtime (gloo)
    # can be destroyed while joinable and abort a run that succeeded (seen in about 1 of 40
    # two-rank CPU runs with torch 2.13, even after destroy_process_group).
    os._exit(code)
