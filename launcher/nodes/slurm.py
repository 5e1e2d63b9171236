"""What a Slurm job says about a multi-node launch: how many nodes, which one this is, and
where rank 0 listens.

Slurm hands each task its place in environment variables (SLURM_NNODES, SLURM_NODEID,
SLURM_JOB_NODELIST, ...), the node list in a compressed form such as `gpu[01-04],login2`.
This module reads them into a `SlurmJob`, so the launcher can fill in --nnodes, --node-rank,
MASTER_ADDR and MASTER_PORT itself instead of every sbatch script doing it by hand.
It reads a mapping given to it (os.environ in use, a dictionary in the tests) and never
imports torch, so it costs the launcher nothing at start.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

# A port derived from the job id lands in [20000, 30000): below Linux's ephemeral range
# (32768 and up, where the kernel picks outgoing ports and could already hold ours), and
# spread over 10000 values so two jobs sharing nodes rarely pick the same one.
DERIVED_PORT_BASE = 20000
DERIVED_PORT_SPAN = 10000

# Far beyond any real allocation; a typo such as `n[1-100000000]` fails at once instead of
# building a list that fills the memory.
MAX_HOSTS = 1 << 16

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_UNSIGNED = re.compile(r"[0-9]+")
_BRACKET = re.compile(r"\[([^\[\]]*)\]")


class SlurmError(ValueError):
    """A Slurm variable the launcher cannot use; the message names the variable or text and the fault."""


def expand_nodelist(text: str) -> list[str]:
    """The host names of a Slurm hostlist (`host[01-04],login2`), in Slurm's order.

    Slurm compresses node lists, so the first host (where rank 0 runs) can only be found by
    expanding them. Ranges keep the zero padding of their start (`[01-04]` gives 01..04),
    several bracket groups in one name expand left to right, the leftmost varying slowest
    (as `scontrol show hostnames` prints them), and commas inside brackets do not split hosts.
    Bad syntax raises SlurmError rather than guessing: a wrong master address would only show
    up as a rendezvous that hangs.
    """
    hosts: list[str] = []
    for name in _split_hosts(text):
        hosts.extend(_expand_name(text, name))
    return hosts


def _split_hosts(text: str) -> list[str]:
    """The comma-separated names of a hostlist, with commas inside brackets kept in their name,
    after checking that brackets are balanced and not nested (Slurm has no nesting)."""
    if not text.strip():
        raise SlurmError(f"bad Slurm nodelist {text!r}: it is empty")
    names: list[str] = []
    start = 0
    depth = 0
    for i, char in enumerate(text):
        if char == "[":
            if depth:
                raise SlurmError(f"bad Slurm nodelist {text!r}: '[' inside brackets at position {i}")
            depth = 1
        elif char == "]":
            if not depth:
                raise SlurmError(f"bad Slurm nodelist {text!r}: ']' without '[' at position {i}")
            depth = 0
        elif char == "," and not depth:
            names.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmError(f"bad Slurm nodelist {text!r}: '[' is never closed")
    names.append(text[start:])
    for name in names:
        if not name.strip():
            raise SlurmError(f"bad Slurm nodelist {text!r}: an empty host name between commas")
    return [name.strip() for name in names]


def _expand_name(text: str, name: str) -> list[str]:
    """Every host one name stands for: the product of its bracket groups, around its literal parts."""
    parts = _BRACKET.split(name)  # literal, bracket, literal, bracket, ..., literal
    literals = parts[0::2]
    choices = [_expand_bracket(text, body) for body in parts[1::2]]
    count = math.prod(len(choice) for choice in choices)
    if count > MAX_HOSTS:
        raise SlurmError(f"bad Slurm nodelist {text!r}: {name!r} stands for {count} hosts, more than {MAX_HOSTS}")
    hosts = []
    for combination in itertools.product(*choices):
        pieces = [literals[0]]
        for number, literal in zip(combination, literals[1:], strict=True):
            pieces += [number, literal]
        hosts.append("".join(pieces))
    return hosts


def _expand_bracket(text: str, body: str) -> list[str]:
    """The numbers one bracket group lists (`1,3,7-8`), as text, padded to the width of each range's start."""
    numbers: list[str] = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item.strip())
        if match is None:
            what = "an empty bracket" if not body.strip() else f"{item!r} is not a number or a range such as 01-04"
            raise SlurmError(f"bad Slurm nodelist {text!r}: {what}")
        lo_text, hi_text = match.group(1), match.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise SlurmError(f"bad Slurm nodelist {text!r}: range {item.strip()!r} goes down")
        if hi - lo + 1 > MAX_HOSTS:
            raise SlurmError(f"bad Slurm nodelist {text!r}: range {item.strip()!r} is more than {MAX_HOSTS} hosts")
        width = len(lo_text)
        numbers.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return numbers


@dataclass(frozen=True)
class SlurmJob:
    """This node's place in a multi-node Slurm job: what torchrun-style launches call
    --nnodes, --node-rank, MASTER_ADDR and MASTER_PORT."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmJob | None:
        """The job described by `env` (os.environ), or None when not under Slurm.

        None also when a variable the launch needs is missing (SLURM_JOB_ID, SLURM_NNODES or
        SLURM_JOB_NUM_NODES, SLURM_NODEID, and a node list unless MASTER_ADDR is set): `salloc`
        gives a shell on the login node with no SLURM_NODEID, and guessing a node rank there
        would make two nodes claim the same one. Values that are present but wrong raise
        SlurmError naming the variable, since a launch on them could only hang or collide.

        MASTER_ADDR and MASTER_PORT, when set, win: a script that sets them knows better.
        Otherwise rank 0 runs on the first host of the node list, and the port comes from the
        job id, so every node of a job derives the same port without talking to the others.
        """
        job_text = env.get("SLURM_JOB_ID")
        nnodes_var = "SLURM_NNODES" if "SLURM_NNODES" in env else "SLURM_JOB_NUM_NODES"
        nodelist_var = "SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in env else "SLURM_NODELIST"
        if job_text is None or nnodes_var not in env or "SLURM_NODEID" not in env:
            return None
        if "MASTER_ADDR" not in env and nodelist_var not in env:
            return None

        job_id = _unsigned(env, "SLURM_JOB_ID")
        nnodes = _unsigned(env, nnodes_var)
        node_rank = _unsigned(env, "SLURM_NODEID")
        if nnodes < 1:
            raise SlurmError(f"{nnodes_var}={env[nnodes_var]!r}: a job has at least one node")
        if node_rank >= nnodes:
            raise SlurmError(f"SLURM_NODEID={env['SLURM_NODEID']!r} is not below {nnodes_var}={env[nnodes_var]!r}")

        if "MASTER_ADDR" in env:
            master_addr = env["MASTER_ADDR"].strip()
            if not master_addr:
                raise SlurmError(f"MASTER_ADDR={env['MASTER_ADDR']!r} is empty")
        else:
            try:
                master_addr = expand_nodelist(env[nodelist_var])[0]
            except SlurmError as error:
                raise SlurmError(f"{nodelist_var}: {error}") from None

        if "MASTER_PORT" in env:
            master_port = _unsigned(env, "MASTER_PORT")
            if not 1 <= master_port <= 65535:
                raise SlurmError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port (1 to 65535)")
        else:
            master_port = derived_port(job_id)
        return cls(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port)


def derived_port(job_id: int) -> int:
    """The rendezvous port for a job with no MASTER_PORT: the same on every node of the job
    (each computes it alone), in [DERIVED_PORT_BASE, DERIVED_PORT_BASE + DERIVED_PORT_SPAN)."""
    return DERIVED_PORT_BASE + job_id % DERIVED_PORT_SPAN


def _unsigned(env: Mapping[str, str], name: str) -> int:
    """env[name] as a non-negative integer. Stricter than int(), which would take '-1', '+3'
    or '1_000': none of these is something Slurm writes, so each points at a broken script."""
    value = env[name]
    if _UNSIGNED.fullmatch(value.strip()) is None:
        raise SlurmError(f"{name}={value!r} is not an integer")
    return int(value)
