"""One training process, without the supervisor.

    python3 pretrain_main.py --debug
    CUDA_VISIBLE_DEVICES=3 GPU_RANK=3 python3 pretrain_main.py --debug   # lines labelled [GPU 3]
"""

import sys

from pretrain.train import main

if __name__ == "__main__":
    sys.exit(main())
