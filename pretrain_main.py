"""One training process, without the supervisor, from a clone: the same as `python -m pretrain`.

python3 pretrain_main.py --debug
CUDA_VISIBLE_DEVICES=3 GPU_RANK=3 python3 pretrain_main.py --debug   # lines labelled [GPU 3]
"""

import runpy

if __name__ == "__main__":
    # pretrain/__main__.py sets up the stack dumps and CUDA's device order before torch loads.
    runpy.run_module("pretrain", run_name="__main__", alter_sys=True)
else:  # imported (tests/pretrain/distributed/test_runtime.py checks what torch sees as it loads): the same set-up, no run
    runpy.run_module("pretrain", run_name="pretrain_main_import")
