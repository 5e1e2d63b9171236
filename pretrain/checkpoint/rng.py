"""Every random generator of a process, as values a checkpoint stores and loads back with
torch.load(weights_only=True): torch's CPU (and CUDA) generator, Python's `random`, NumPy's."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_states(device: torch.device) -> dict[str, Any]:
    """Every random generator of this process, as tensors and plain values (weights_only loads them)."""
    version, mt_state, gauss_next = random.getstate()
    bit_generator, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    states: dict[str, Any] = {
        "cpu": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": bit_generator,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
    }
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, Any], device: torch.device) -> None:
    """Undo rng_states. Generators a checkpoint lacks (format 1 had torch's only, a CPU run no
    CUDA) are left as they are."""
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)
    if "python" in states:
        python = states["python"]
        random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss_next"]))
    if "numpy" in states:
        numpy = states["numpy"]
        np.random.set_state(
            (
                numpy["bit_generator"],
                numpy["keys"].numpy().astype(np.uint32),
                numpy["pos"],
                numpy["has_gauss"],
                numpy["cached_gaussian"],
            )
        )


def seed_from(seed: int, steps_done: int, rank: int) -> None:
    """Seed every generator from (seed, steps_done, rank): for a rank a checkpoint has no
    state for, so that a second resume on the same ranks repeats it and ranks do not share
    one stream."""
    derived = int(np.random.SeedSequence([seed, steps_done, rank]).generate_state(1)[0])
    torch.manual_seed(derived)
    random.seed(derived)
    np.random.seed(derived)
