"""Benchmark: hardware-independent efficiency of a training step, on a CPU or a GPU.

Run from the repository root:

    python benchmarks/efficiency.py [--quick] [--json FILE] [--markdown FILE] [--label NAME]
        [--presets small,production] [--features dense,moe,muon] [--nodes N] [--ranks 1,2]
        [--checkpointing none,selective,full,auto] [--compile all|none] [--device cpu|cuda]

For the `small` preset and a production-shaped model (production's widths and vocabulary, 2 layers,
FSDP as the 8B model needs), with the features dense, moe (model.moe.num_experts=4, top_k=2) and
muon (training.optimizer=muon; moe+muon, both, when --features names it), each activation-checkpointing
mode, on 1 and 2 ranks (gloo on a CPU), it measures, per optimizer step that logs nothing (--quick: the 8 rows of QUICK, compiled
with aot_eager, in under 5 minutes on 2 loaded cores; the full run compiles every row with inductor):

- executed / model FLOPs: torch's FlopCounterMode over forward, backward and optimizer of one
  step (pretrain.train.train_step, every micro-batch) at the preset's own geometry (batch,
  context, micro-batches), counted on the meta device so that no memory or time is needed,
  divided by the model FLOPs the step line's MFU uses (pretrain/observe/metrics.py flops_per_token x
  tokens). FlopCounterMode counts matmuls and attention, not element-wise ops. The count is one
  rank's: DDP and FSDP add no counted FLOPs, except Muon's orthogonalization, whose part is
  scaled by the share this rank does (measured in the real run below, largest rank). A Muon row
  above 1 (on either column) is Newton-Schulz's orthogonalization: the optimizer's own matmuls,
  executed every step but not model FLOPs (not what MFU counts), and no padding or recompute.
  The next column divides by the FLOPs the plan meant to run instead: the model's plus what its
  activation checkpointing and chunked loss recompute (pretrain/model/recompute.py, as the
  launcher's `parallelism:` line prints it), so a checkpointed row near 1 pays for nothing else
  (no capacity padding, no recompute the plan did not count).
- graph breaks and recompiles with training.compile on, over 3 steps, one evaluation pass
  (pretrain.train.evaluate) and one more step: breaks as dynamo's counters count them while
  tracing; a recompile is a frame compiled again in the same phase (the first train compile and
  the first eval compile, a grad-mode guard of its own, are expected). Muon's Newton-Schulz is
  compiled too, on a CPU as on CUDA (pretrain/optim/muon.py COMPILED_ON), and counted with them.
- host syncs per step: the ops that make the host wait for a CUDA device (`.item()` and its
  kind, `.tolist()`, nonzero, boolean-mask indexing, unique, bincount, ...), counted with a
  dispatch mode over steps 1 and 2 (the largest, over the steps and the ranks), so a CPU counts
  what a GPU would pay. The step's one intended sync is the finite check
  (pretrain/numerics/debug.py agree_on_step). torch AdamW's `step` counters, in host memory on a GPU too,
  are left out by identity.
- collective bytes per token, per kind: the payload each rank hands to collectives in a step
  (the gathered tensor of an all-gather, the input of a reduce-scatter, the buffer of an
  all-reduce; a ring moves about 2 (W-1)/W of it for an all-reduce, (W-1)/W for the others),
  from every c10d op (DDP's C++ reducer included) and functional collective (DTensor's), divided
  by the tokens one rank trains on per step at the preset's geometry. The minimum for the
  parallelism, the same way: DDP, one all-reduce of the fp32 gradients (4 bytes a parameter);
  FSDP, one all-gather of every weight (bf16 under use_amp, the embedding fp32 as this project
  gathers it) and one reduce-scatter of the fp32 gradients per step: a lower bound that holds
  the weights gathered across micro-batches; HSDP, FSDP's plus one all-reduce of the fp32
  gradient shard a rank holds; each plus the finite check's 32 bytes. 1 rank: 0.
- the same bytes by link (benchmarks/efficiency_links.py): --nodes N runs each row as N "nodes"
  of --ranks M gloo ranks on loopback (world N x M, node-major, LOCAL_WORLD_SIZE=M), and each
  collective counts as inter-node when its process group's ranks span nodes, else intra-node:
  inter_node_bytes_per_token beside its minimum (HSDP: the gradient shard's all-reduce and the
  finite check; FSDP over every rank and DDP: all of their minimum) and intra_node_bytes_per_token
  (one node: inter 0, intra everything). With --nodes above 1 each row runs twice, hsdp and
  fsdp (training.parallelism set), side by side; --quick then runs NODES_QUICK's rows.
- Muon's orthogonalize share per rank: the Newton-Schulz FLOPs of the matrices a rank passes to
  the optimizer's `orthogonalize` (a (k, m, n) stack counts k matrices) over those of every
  hidden matrix; the largest rank's (1 on one rank; 1/W when the work is split evenly).
- saved activations per token (activation_bytes_per_token, and of them float32:
  activation_fp32_bytes_per_token): what one micro-batch's forward hands autograd to keep for the
  backward pass (saved_tensors_hooks, each storage once), at 2 and 3 rows of the run's context,
  the difference over the tokens added, so weights and their bf16 casts (the same at both sizes)
  drop out; at the real run's widths (dim / 8 on a CPU: the fp32 statistics, per row or per head,
  then weigh 8x more than at the true width). A compiled row reports its compiled forward (the
  AOTAutograd partitioner's choice: under --quick aot_eager's min-cut over undecomposed aten ops,
  which recomputes less than inductor's, so it keeps as much or more: an upper bound), an eager row its
  eager one (a checkpointed block: what it keeps of its input, as the checkpoint hands it on). The
  per-row notes give both by dtype, and, for a compiled row, the ops its forward runs outside
  compiled code (torch.profiler; only the embedding lookup and its cast are expected).
- matmuls per block: the mm/addmm/bmm/baddbmm kernels one block's forward runs (a dispatch
  mode, in a one-block model of the run's shape on the CPU).
- where the step's host syncs sit: how many come before the optimizer step is issued.

The real runs (syncs, collectives, shares, compiles) take a short batch (1 x 64 tokens, the
preset's micro-batches per step). On a CPU they also divide the widths (dim, ffn_dim, vocabulary;
heads kept) by 8 for `small` and 16 for the production shape, so every matrix is 1/64 or 1/256 of
its size: the orthogonalize shares stay the same, and the collective bytes are scaled back by the
ratio of parameters (exact for the matrices; the norms' weights, a few thousand, scale less). Every
config takes the decisions the launcher's memory plan makes for a GPU of --plan-gpu-gib
(parallelism, and on trees that plan them the checkpointing mode and the loss chunk); the run's loss
is chunked iff the true geometry's is. A checkpointing mode the tree does not have (a bool there) is
marked so. Progress goes to stderr, the table to stdout and to the Markdown file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if Path(sys.path[0]).resolve() == REPO / "benchmarks":  # run as a script: the repository, not benchmarks/
    sys.path[0] = str(REPO)  # (whose launcher.py would shadow the launcher package)
from benchmarks.efficiency_groups import count_all, progress, run_group  # noqa: E402
from benchmarks.efficiency_links import NODES_QUICK, SHARDED_ACROSS_NODES, link_values, minimum_bytes  # noqa: E402
from benchmarks.efficiency_report import Outcome, Row, machine_slug, report  # noqa: E402

PRESETS = ("small", "production")
FEATURES = {"dense": [], "moe": ["model.moe.num_experts=4", "model.moe.top_k=2"], "muon": ["training.optimizer=muon"]}
FEATURES["moe+muon"] = FEATURES["moe"] + FEATURES["muon"]
"""moe+muon (Muon on the experts' 3-D weights too: the GPU acceptance's MoE+Muon row) runs when --features names it."""
CHECKPOINTING = ("none", "selective", "full", "auto")
ON_OLD_TREES = {"none": "false", "full": "true"}
"""Where training.activation_checkpointing is still a bool, the modes it has."""
RUN_GEOMETRY = ["data.context_length=64", "training.batch_size=1"]
PRODUCTION_SHAPE = ["model.n_layers=2", "training.parallelism=fsdp"]
"""(A row whose parallelism is set, on several nodes, sets that instead of fsdp.)"""
RUN_WIDTH_DIVISOR = {"cpu": {"small": 8, "production": 16}, "cuda": {"small": 1, "production": 1}}
"""The real runs divide the model's dim, ffn_dim and vocabulary by this (heads kept): every matrix
1/divisor^2 of its size (on a CPU; a GPU runs the true widths)."""
H100_GIB = 81559 / 1024
"""NVML's total memory of an H100 80GB HBM3 (81,559 MiB)."""
QUICK: dict[tuple[str, str, int, str], bool] = {
    ("small", "dense", 1, "none"): True,
    ("small", "dense", 1, "auto"): False,
    ("small", "moe", 1, "none"): True,
    ("small", "moe", 1, "full"): True,
    ("small", "muon", 2, "none"): True,
    ("small", "moe+muon", 1, "none"): True,
    ("production", "dense", 2, "full"): True,
    ("production", "muon", 2, "full"): True,
}
"""--quick's rows, and whether each runs compiled: the issue's checks (small dense's FLOPs and
syncs, MoE's graph breaks with and without checkpointing, Muon's share under DDP and FSDP and its
recompiles, with MoE's expert stacks too, FSDP's traffic and its compiled blocks) within 5 minutes on 2 loaded cores."""
KEYS = (
    "preset",
    "features",
    "nodes",
    "ranks",
    "parallelism",
    "activation_checkpointing",
    "executed_over_model_flops",
    "executed_over_planned_flops",
    "graph_breaks",
    "recompiles",
    "host_syncs_per_step",
    "collective_bytes_per_token",
    "collective_minimum_bytes_per_token",
    "inter_node_bytes_per_token",
    "inter_node_minimum_bytes_per_token",
    "intra_node_bytes_per_token",
    "inter_node_bytes_by_kind",
    "orthogonalize_share_per_rank",
    "activation_bytes_per_token",
    "activation_fp32_bytes_per_token",
    "matmuls_per_block",
)


# --- the jobs ------------------------------------------------------------------------------------


def checkpointing_setting(mode: str, takes_modes: bool) -> str | None:
    """The value to set training.activation_checkpointing to; None when this tree has no such mode."""
    if takes_modes:
        return json.dumps(mode)
    return ON_OLD_TREES.get(mode)


def tree_takes_modes() -> bool:
    """Whether training.activation_checkpointing takes "none" | "selective" | "full" | "auto" here."""
    from pretrain import config as cfg

    try:
        cfg.resolve(preset="debug", sets=['training.activation_checkpointing="selective"'])
    except cfg.ConfigError:
        return False
    return True


def job(row: Row, args: argparse.Namespace, setting: str, compiled: bool) -> dict[str, Any]:
    common = [
        "data.source=builtin",
        "data.tokenizer=byte",
        f"data.cache_dir={json.dumps(str(args.cache_dir))}",
        f"system.device={args.device}",
        "logging.tensorboard=false",
        "debug.trace_nonfinite=false",
        "training.eval_batches=2",
        "training.max_steps=20",
        f"training.activation_checkpointing={setting}",
        *FEATURES[row.features],
    ]
    shape = PRODUCTION_SHAPE if row.preset == "production" else []
    if row.parallelism:
        shape = [s for s in shape if not s.startswith("training.parallelism=")] + [f"training.parallelism={row.parallelism}"]
    return {
        "name": row.name,
        "preset": row.preset,
        "nodes": row.nodes,
        "ranks": row.ranks,
        "world": row.nodes * row.ranks,
        "true_sets": [*common, *shape],
        "run_sets": [*common, *shape, *run_widths(row.preset, args.device), *RUN_GEOMETRY],
        "plan_gpu_bytes": int(args.plan_gpu_gib * 2**30),
        "compile": compiled,
        "compile_backend": args.compile_backend,
    }


def run_widths(preset: str, device: str) -> list[str]:
    """The --set of the real run's widths: the preset's divided by RUN_WIDTH_DIVISOR."""
    from pretrain import config as cfg

    model, divisor = cfg.resolve(preset=preset).model, RUN_WIDTH_DIVISOR[device][preset]
    if divisor == 1:
        return []
    return [f"model.{name}={getattr(model, name) // divisor}" for name in ("dim", "ffn_dim", "vocab_size")]


# --- from the jobs' results to a row --------------------------------------------------------------


def combine(row: Row, count: dict[str, Any], ranks: list[dict[str, Any]]) -> Outcome:
    eager = [r for r in ranks if "syncs_per_step" in r]
    shares = [r["orthogonalize_share"] for r in eager if r.get("orthogonalize_share") is not None]
    share = max(shares) if shares else None
    ortho = count["orthogonalize_flops"]
    executed = count["executed_flops"] - ortho + (share if share is not None else 1.0) * ortho
    scale = count["parameters"] / eager[0]["run_parameters"] if eager else 1.0
    tokens = count["true_tokens_per_step"]
    measured: dict[str, float] = {}
    for r in eager:
        for kind, value in r["collective_bytes_per_step"].items():
            measured[kind] = measured.get(kind, 0.0) + value * scale / tokens / len(eager)
    compiled = [r for r in ranks if "graph_breaks" in r]
    values = {
        "preset": row.preset,
        "features": row.features,
        "ranks": row.ranks,
        "activation_checkpointing": row.activation_checkpointing,
        "executed_over_model_flops": executed / count["model_flops"],
        "executed_over_planned_flops": executed / (count["model_flops"] * (1 + count.get("planned_recompute_share", 0.0))),
        "graph_breaks": max(r["graph_breaks"] for r in compiled) if compiled else None,
        "recompiles": max(r["recompiles"] for r in compiled) if compiled else None,
        "host_syncs_per_step": max(max(r["syncs_per_step"]) for r in eager) if eager else None,
        "collective_bytes_per_token": measured if eager else None,
        "collective_minimum_bytes_per_token": minimum_bytes(count, row),
        **link_values(row, count, eager, scale),
        "orthogonalize_share_per_rank": share if "muon" in row.features else None,
        **activations(ranks),
        "matmuls_per_block": count.get("matmuls_per_block"),
    }
    details = {
        "plan": count["plan"],
        "mode": eager[0].get("mode") if eager else None,
        "sync_sites": merged(r.get("sync_sites", {}) for r in eager[:1]),
        "eval_syncs": max((r["eval_syncs"] for r in eager), default=None),
        "eval_sync_sites": merged(r.get("eval_sync_sites", {}) for r in eager[:1]),
        "graph_break_reasons": merged(r.get("graph_break_reasons", {}) for r in compiled[:1]),
        "compiles": compiled[0]["compiles"] if compiled else None,
        "graphs": compiled[0].get("graphs") if compiled else None,
        "activations_measured": ("compiled" if compiled else "eager") if eager else None,
        "activation_bytes_by_dtype": {
            kind: r.get(f"{kind}_activation_bytes_by_dtype") for kind in ("eager", "compiled") for r in ranks[:1]
        },
        "uncompiled_forward_ops": compiled[0].get("compiled_uncompiled_forward_ops") if compiled else None,
        "syncs_before_optimizer_step": eager[0].get("syncs_before_optimizer_step") if eager else None,
    }
    return Outcome(row, values, details)


def activations(ranks: list[dict[str, Any]]) -> dict[str, float | None]:
    """The row's saved bytes per token: its compiled run's when it ran compiled (what training
    runs), else its eager run's; the largest over the ranks."""
    values: dict[str, float | None] = {}
    for key in ("activation_bytes_per_token", "activation_fp32_bytes_per_token"):
        found = [v for r in ranks if (v := r.get(f"compiled_{key}", r.get(f"eager_{key}"))) is not None]
        values[key] = max(found) if found else None
    return values


def merged(dicts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for key, value in d.items():
            total[key] = total.get(key, 0) + value
    return total


def measure(rows: list[Row], args: argparse.Namespace) -> list[Outcome]:
    """Every row's FLOP count (one process), then its real run, grouped by nodes x ranks (one
    process group each); in the order given."""
    takes_modes = tree_takes_modes()
    outcomes: dict[Row, Outcome] = {}
    jobs: dict[Row, dict[str, Any]] = {}
    for row in rows:
        setting = checkpointing_setting(row.activation_checkpointing, takes_modes)
        if setting is None:
            outcomes[row] = Outcome(row, note="not on this tree (activation_checkpointing is a bool)")
        else:
            compiled = args.compile == "all" and quick_set(args).get(astuple(row), True) if args.quick else args.compile == "all"
            jobs[row] = job(row, args, setting, compiled)
    with tempfile.TemporaryDirectory(prefix="efficiency-") as tmp:
        progress(f"counting the FLOPs of {len(jobs)} row(s) on the meta device ...")
        counts = dict(zip(jobs, count_all(list(jobs.values()), Path(tmp), args.timeout), strict=True))
        for nodes, ranks in sorted({(row.nodes, row.ranks) for row in jobs}):
            group = [row for row in jobs if (row.nodes, row.ranks) == (nodes, ranks)]
            where = f"{nodes} node(s) x {ranks} rank(s)" if nodes > 1 else f"{ranks} rank(s)"
            progress(f"{len(group)} row(s) on {where} ...")
            started = time.monotonic()
            per_rank, error = run_group([jobs[row] for row in group], ranks, Path(tmp), args.timeout, nodes)
            for i, row in enumerate(group):
                results = [r[i] for r in per_rank]
                failed = error or counts[row].get("error") or next((r["error"] for r in results if "error" in r), "")
                outcomes[row] = Outcome(row, note=f"failed: {failed}") if failed else combine(row, counts[row], results)
            progress(f"  {time.monotonic() - started:.0f} s")
    return [outcomes[row] for row in rows]


def astuple(row: Row) -> tuple[str, str, int, str]:
    return (row.preset, row.features, row.ranks, row.activation_checkpointing)


def quick_set(args: argparse.Namespace) -> dict[tuple[str, str, int, str], bool]:
    """--quick's rows (ranks per node), and whether each runs compiled: NODES_QUICK on several nodes."""
    return NODES_QUICK if args.nodes > 1 else QUICK


# --- command line ---------------------------------------------------------------------------------


def choices(allowed: tuple[str, ...] | list[str]) -> Any:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        unknown = [v for v in values if v not in allowed]
        if not values or unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or repr(text)}; choose from {', '.join(allowed)}")
        return values

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="QUICK's rows only, compiled as it says, with aot_eager")
    parser.add_argument("--presets", type=choices(PRESETS), default=list(PRESETS))
    parser.add_argument("--features", type=choices(list(FEATURES)), default=[f for f in FEATURES if f != "moe+muon"])
    parser.add_argument("--nodes", type=int, default=1, help="loopback nodes, each of --ranks ranks (default 1)")
    parser.add_argument(
        "--ranks", type=choices(("1", "2", "4")), default=None, help="ranks per node (default 1,2; on several nodes 2)"
    )
    parser.add_argument("--checkpointing", type=choices(CHECKPOINTING), default=list(CHECKPOINTING))
    parser.add_argument("--compile", choices=["all", "none"], default="all", help="whether rows also run compiled (default all)")
    parser.add_argument(
        "--compile-backend", help="torch.compile's backend (default inductor; --quick: aot_eager, the same breaks)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--plan-gpu-gib", type=float, default=H100_GIB, help="the GPU memory the plan assumes (default an H100's)"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help='also write {"rows": [...]} to FILE')
    parser.add_argument(
        "--markdown",
        type=Path,
        metavar="FILE",
        help="where the table goes (default benchmarks/results/<date>-efficiency[-LABEL]-<machine>.md)",
    )
    parser.add_argument("--no-markdown", action="store_true", help="print the table only")
    parser.add_argument("--label", default="", help="a word for the file name and title, e.g. before or after")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job (default 900)")
    parser.add_argument(
        "--cache-dir", type=Path, default=REPO / "cache" / "datasets", help="data.cache_dir for the built-in corpus"
    )
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error(f"--nodes must be 1 or more (got {args.nodes})")
    args.ranks = args.ranks or (["1", "2"] if args.nodes == 1 else ["2"])
    args.argv = sys.argv[1:] if argv is None else argv
    args.compile_backend = args.compile_backend or ("aot_eager" if args.quick else "inductor")
    args.cache_dir = args.cache_dir.resolve()
    return args


def rows_of(args: argparse.Namespace) -> list[Row]:
    """The rows to run; on several nodes each twice, hsdp then fsdp, side by side."""
    if args.quick:
        keys = list(quick_set(args))
    else:
        keys = [
            (preset, features, int(ranks), mode)
            for preset in args.presets
            for features in args.features
            for ranks in args.ranks
            for mode in args.checkpointing
        ]
    if args.nodes == 1:
        return [Row(*key) for key in keys]
    return [Row(*key, nodes=args.nodes, parallelism=mode) for key in keys for mode in SHARDED_ACROSS_NODES]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    outcomes = measure(rows_of(args), args)
    text = report(outcomes, args, time.monotonic() - started)
    print(text)
    if not args.no_markdown:
        label = f"-{args.label}" if args.label else ""
        path = (
            args.markdown
            or REPO
            / "benchmarks"
            / "results"
            / f"{datetime.date.today().isoformat()}-efficiency{label}-{machine_slug(args.device)}.md"
        )
        path.write_text(text)
        progress(f"written to {path}")
    if args.json:
        rows = [{key: o.values.get(key) for key in KEYS} | ({} if o.values else asdict(o.row)) for o in outcomes]
        args.json.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 1 if any(o.note.startswith("failed") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
