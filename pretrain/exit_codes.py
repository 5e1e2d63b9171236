"""Exit codes of a training process, which the launcher passes on as its own (torch-free,
so the launcher can name them without importing torch).

    0    success
    1    an unexpected error (a Python traceback says where), or a collective timed out
    2    bad input: config, data, resume point, an unwritable directory; one line says which
    3    numerical failure: the loss or the gradient norm became NaN or Inf (a report, a
         checkpoint and a tensor dump were written; docs/numerics.md, "Troubleshooting")
    4    a consequence of another rank's failure: that rank went away during a collective
         (gloo's "Connection closed by peer", NCCL's remote error), or removed what they shared
         (an unfinished checkpoint); the launcher waits a moment for that rank's own failure and
         reports it as the cause (pretrain/peer_loss.py)
    128+n  stopped by signal n after saving (129: SIGHUP, 130: SIGINT, 143: SIGTERM)
"""

SUCCESS = 0
ERROR = 1
BAD_INPUT = 2
NUMERICAL_FAILURE = 3
PEER_LOST = 4

MEANINGS = {
    NUMERICAL_FAILURE: "numerical failure: NaN or Inf in training",
    PEER_LOST: "a consequence of another rank's failure",
}
"""What the launcher's failure summary says of a training worker's exit code."""
AGREED = frozenset({NUMERICAL_FAILURE})
"""Codes that every rank exits with together, having agreed on the step: the launcher gives
the others a moment to finish and exit on their own before it stops them."""
CONSEQUENCES = frozenset({PEER_LOST})
"""Codes of a failure that another rank's failure caused: the launcher waits a moment for that
rank's own exit, and reports it as the first failure (the cause) when it comes."""
