"""The measuring side of benchmarks/efficiency.py:

    python benchmarks/efficiency_worker.py count JOBS RESULTS
    RANK=r WORLD_SIZE=w MASTER_ADDR=... MASTER_PORT=... python benchmarks/efficiency_worker.py run JOBS RESULTS

JOBS is a JSON list of rows (benchmarks/efficiency.py's job()). `count` counts each row's FLOPs of
one optimizer step on the meta device, in one process of its own (what the meta device needs
patched stays out of the real runs). `run` is one rank of a group that runs every row for real
(all on the same nodes x ranks: the group is joined once, the rows run one after the other, so
the imports and the group are paid once). Both build the trainer with the project's own
pretrain.build.build and step it with pretrain.train.train_step and evaluate, so what is counted
is what training runs. The config is the row's with the decisions the launcher's memory plan
makes for a GPU of --plan-gpu-gib (pretrain/plan/parallelism.py plan_parallelism): the counts follow
the choices a GPU run would get, whatever device measures them; a job of several "nodes"
(job["nodes"] x job["ranks"] per node, world job["world"]) is planned for that many, and its
collectives are counted by link (LOCAL_WORLD_SIZE ranks per node). Results are written as JSON lists
(`run`: RESULTS.rank<r>), one entry per row, {"error": ...} for a row that failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if Path(sys.path[0]).resolve() == REPO / "benchmarks":  # run as a script: the repository, not benchmarks/
    sys.path[0] = str(REPO)  # (whose launcher.py would shadow the launcher package)

import torch  # noqa: E402

from benchmarks import efficiency_counters as counters  # noqa: E402
from benchmarks import efficiency_forward as forward_counters  # noqa: E402
from benchmarks import efficiency_links as links  # noqa: E402
from pretrain import config as cfg  # noqa: E402
from pretrain.plan import parallelism  # noqa: E402
from pretrain.distributed import parallel  # noqa: E402
from pretrain import step as one_step  # noqa: E402
from pretrain import train as training  # noqa: E402
from pretrain.build import Trainer, build  # noqa: E402
from pretrain.data.fitting import fit_to_dataset  # noqa: E402
from pretrain.data.prepare import prepare  # noqa: E402
from pretrain.model import recompute  # noqa: E402
from pretrain.model.loss import next_token_loss  # noqa: E402
from pretrain.observe.metrics import flops_per_token  # noqa: E402
from pretrain.optim import muon  # noqa: E402
from pretrain.distributed.runtime import Runtime, exit_process, init_runtime, shutdown  # noqa: E402

GIB = 2**30
PLANNED = ("parallelism", "cpu_offload", "activation_checkpointing", "loss_chunk_tokens", "reshard_after_forward")
"""The training fields the memory plan decides (those this tree has): the run takes the decisions
made for the true geometry."""
COUNTED_STEPS = 2
"""Real runs: steps 1..COUNTED_STEPS are counted (step 0 creates the optimizer's state)."""
ACTIVATION_ROWS = (2, 3)
"""The two micro-batch sizes (rows of the run's context) whose saved bytes give the per-token slope."""


def log() -> logging.Logger:
    logger = logging.getLogger("benchmarks.efficiency")
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler(sys.stderr))
        logger.setLevel(logging.WARNING)
    return logger


def resolved(preset: str, sets: list[str], world_size: int) -> tuple[cfg.Config, Path]:
    """The preset with sets, fitted to the built-in corpus (prepared once in the job's cache)."""
    config = cfg.resolve(preset=preset, sets=sets)
    dataset = prepare(config.data, log=lambda _: None)
    config, _ = fit_to_dataset(config, dataset, world_size=world_size)
    return config, dataset


def planned(job: dict[str, Any]) -> tuple[cfg.Config, cfg.Config, Path]:
    """(the true geometry's config, the real run's config, the dataset), both with the plan's
    decisions for the row's world size (job["ranks"] per node) on a GPU of job["plan_gpu_bytes"]."""
    world = job.get("world", job["ranks"])
    true_config, dataset = resolved(job["preset"], job["true_sets"], world)
    true_config, _ = parallelism.plan_parallelism(true_config, world, job["plan_gpu_bytes"], None, job["ranks"])
    run_config, _ = resolved(job["preset"], job["run_sets"], world)
    t, r = true_config.training, run_config.training
    decided = {name: getattr(t, name) for name in PLANNED if hasattr(t, name)}
    true_micro = t.batch_size * true_config.data.context_length
    run_micro = r.batch_size * run_config.data.context_length
    chunk = decided.get("loss_chunk_tokens")
    if chunk is not None:  # chunked at the true geometry -> chunked in the run (into 2), else whole
        decided["loss_chunk_tokens"] = run_micro // 2 if 0 < chunk < true_micro else 0
    # No local checkpoint tier: the rows never save, and build() would take a directory in /dev/shm for it.
    decided["local_checkpoint_interval"] = 0
    run_config = dataclasses.replace(run_config, training=dataclasses.replace(r, **decided))
    true_config = dataclasses.replace(true_config, training=dataclasses.replace(t, local_checkpoint_interval=0))
    return true_config, run_config, dataset


def model_flops_per_step(config: cfg.Config) -> float:
    """What the step line's MFU counts for one rank's optimizer step."""
    t, context = config.training, config.data.context_length
    return flops_per_token(config.model, context) * t.batch_size * context * cfg.grad_accum_nums(t)


# --- count: one step's FLOPs on the meta device -------------------------------------------------


@contextlib.contextmanager
def on_meta(use_amp: bool = False) -> Any:
    """What building and stepping on the meta device needs: no weight initialisation (a meta
    generator draws nothing), no autocast (torch refuses the meta device, even to ask whether it is
    on; FLOPs do not depend on the dtype), and nonzero assumed all-true (a mixture of experts' training path keeps every
    assignment in its capacity-sized buffers either way: the matmuls have static shapes). Under
    use_amp a mixture of experts' matmuls take bf16, as autocast gives them on a GPU, so the
    dropless experts run the grouped matmuls a GPU runs, not the fp32 fallback's every-token buffer."""
    import torch.fx.experimental._config as fx_config

    from pretrain.model import moe

    def shapes_only(model: Any, device: torch.device, seed: int, offload: bool) -> None:
        model.to_empty(device=device)
        model.reset_rotary(device)

    is_autocast_enabled = torch.is_autocast_enabled

    def autocast_enabled(*args: Any) -> bool:  # torch raises for the meta device: autocast is off there
        return False if args and "meta" in str(args[0]) else is_autocast_enabled(*args)

    matmul_dtype = moe.matmul_dtype

    def amp_matmul_dtype(activations: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
        return torch.bfloat16 if use_amp and activations.device.type == "meta" else matmul_dtype(activations, weight)

    saved = parallel.materialize, one_step.autocast, training.autocast
    parallel.materialize = shapes_only
    # train_step's (pretrain/step.py) and evaluate's (pretrain/train.py, which imports it)
    one_step.autocast = training.autocast = lambda trainer: contextlib.nullcontext()
    torch.is_autocast_enabled = autocast_enabled  # type: ignore[assignment]
    moe.matmul_dtype = amp_matmul_dtype
    try:
        with fx_config.patch(meta_nonzero_assume_all_nonzero=True):  # type: ignore[attr-defined]
            yield
    finally:
        parallel.materialize, one_step.autocast, training.autocast = saved
        torch.is_autocast_enabled = is_autocast_enabled
        moe.matmul_dtype = matmul_dtype


def count(job: dict[str, Any]) -> dict[str, Any]:
    """FLOPs of one optimizer step (forward, backward and optimizer, every micro-batch) at the
    true geometry, as one rank, and the part of them Muon's orthogonalization does."""
    from torch.utils.flop_counter import FlopCounterMode

    true_config, run_config, dataset = planned(job)
    t = dataclasses.replace(true_config.training, compile=False)
    config = dataclasses.replace(true_config, training=t, debug=dataclasses.replace(true_config.debug, check_finite=False))
    runtime = Runtime(rank=0, world_size=1, device=torch.device("meta"), label="meta")
    with on_meta(config.training.use_amp), tempfile.TemporaryDirectory(prefix="efficiency-count-") as run_dir:
        trainer = build(config, runtime, dataset, Path(run_dir), log())
        flops = FlopCounterMode(display=False, custom_mapping=counters.FLOP_FORMULAS)
        orthogonalize_flops = 0.0
        if hasattr(trainer.optimizer, "orthogonalize"):
            original = trainer.optimizer.orthogonalize

            def measured(tensor: torch.Tensor, steps: int, *args: Any, **kwargs: Any) -> torch.Tensor:
                nonlocal orthogonalize_flops
                before = flops.get_total_flops()
                result = original(tensor, steps, *args, **kwargs)
                orthogonalize_flops += flops.get_total_flops() - before
                return result

            trainer.optimizer.orthogonalize = measured
        with flops:
            training.train_step(trainer, 0)
    return {
        "executed_flops": flops.get_total_flops(),
        "orthogonalize_flops": orthogonalize_flops,
        "model_flops": model_flops_per_step(true_config),
        "planned_recompute_share": recompute.extra_flops_share(true_config),
        "true_tokens_per_step": true_config.training.batch_size * true_config.data.context_length * t.grad_accum_nums,
        "plan": {name: getattr(true_config.training, name) for name in PLANNED if hasattr(true_config.training, name)},
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "gather_bytes": gathered_bytes(parallel.unwrap(trainer.model), config.training.use_amp),
        "matmuls_per_block": matmuls_per_block(run_config.model, run_config.data.context_length, t.use_amp),
    }


def gathered_bytes(model: torch.nn.Module, use_amp: bool) -> int:
    """The bytes of one all-gather of every weight as FSDP2 gathers them here (pretrain/distributed/parallel.py
    shard): bf16 under use_amp, except the embedding, gathered in fp32."""
    embedding = {id(p) for p in model.tok_embed.parameters()}  # type: ignore[union-attr]
    return sum(p.numel() * (4 if id(p) in embedding or not use_amp else 2) for p in model.parameters())


# --- rank: a real run's syncs, collectives, orthogonalizations, compiles ------------------------


def on_host_of(runtime: Runtime, optimizer: torch.optim.Optimizer) -> Any:
    """on_host for DispatchCounter: on a GPU, host memory; on a CPU, the optimizer's host-side
    state (its step counters), by identity."""
    if runtime.device.type == "cuda":
        return lambda tensor: tensor.device.type == "cpu"
    host = counters.host_tensors(optimizer)
    return lambda tensor: id(tensor) in host


def ranks_per_node(runtime: Runtime) -> int:
    """The ranks of one node: the runtime's where it knows them, else torchrun's LOCAL_WORLD_SIZE
    (default: every rank, one node)."""
    known = getattr(runtime, "ranks_per_node", None)
    return int(known) if known else int(os.environ.get("LOCAL_WORLD_SIZE", runtime.world_size))


def eager_counts(trainer: Trainer) -> dict[str, Any]:
    """Steps 0..COUNTED_STEPS (the first uncounted), then one evaluation pass."""
    runtime = trainer.runtime
    ortho = counters.Orthogonalizations(trainer.optimizer) if hasattr(trainer.optimizer, "orthogonalize") else None
    syncs, sites, collective, by_link = [], {}, [], []  # collective: per step, kind -> bytes; by_link: link/kind
    training.train_step(trainer, 0)
    syncs_before_step: int | None = None
    for step in range(1, COUNTED_STEPS + 1):
        counter = counters.DispatchCounter(on_host_of(runtime, trainer.optimizer), ranks_per_node(runtime))
        with counters.counting_syncs(counter), marking_step(trainer.optimizer, counter):
            training.train_step(trainer, step)
        syncs.append(counter.sync_count)
        sites = dict(counter.syncs)  # the last counted step's
        syncs_before_step = counter.marks.get("optimizer.step")
        collective.append({kind: float(n) for kind, n in counter.collective_bytes.items()})
        by_link.append({key: float(n) for key, n in counter.link_bytes.items()})
    counter = counters.DispatchCounter(on_host_of(runtime, trainer.optimizer))
    with counters.counting_syncs(counter):
        training.evaluate(trainer)
    hidden = counters.hidden_matrix_flops(
        parallel.unwrap(trainer.model).named_parameters(), trainer.config.training.muon_ns_steps, trainer.config.model
    )
    return {
        "syncs_per_step": syncs,
        "sync_sites": sites,
        "eval_syncs": counter.sync_count,
        "eval_sync_sites": dict(counter.syncs),
        "collective_bytes_per_step": {k: v / COUNTED_STEPS for k, v in counters.merge_counts(collective).items()},
        "collective_bytes_by_link_per_step": links.by_link(
            {k: v / COUNTED_STEPS for k, v in counters.merge_counts(by_link).items()}
        ),
        # step 0 and the counted steps each orthogonalize once: the share of one step
        "orthogonalize_share": ortho.flops / (COUNTED_STEPS + 1) / hidden if ortho is not None and hidden else None,
        "run_parameters": sum(p.numel() for p in parallel.unwrap(trainer.model).parameters()),
        "syncs_before_optimizer_step": syncs_before_step,
    }


@contextlib.contextmanager
def marking_step(optimizer: torch.optim.Optimizer, counter: counters.DispatchCounter) -> Any:
    """counter.mark("optimizer.step") when the step calls optimizer.step: how many of its syncs come before it."""
    original, had_own = optimizer.step, "step" in vars(optimizer)

    def step(*args: Any, **kwargs: Any) -> Any:
        counter.mark("optimizer.step")
        return original(*args, **kwargs)

    optimizer.step = step  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had_own:
            optimizer.step = original  # type: ignore[method-assign]
        else:
            del optimizer.step


def forward_counts(trainer: Trainer, compiled: bool) -> dict[str, Any]:
    """What the forward of one micro-batch keeps for the backward pass, per token and by dtype
    (forward_counters.activation_bytes_per_token, at ACTIVATION_ROWS rows of the run's context, each
    forward followed by its backward pass, without gradient sync, as a micro-batch of gradient
    accumulation; the gradients are dropped), and, compiled, the ops its forward runs outside
    the compiled regions. Run last: the trainer is not stepped after it."""
    config, model, device = trainer.config, trainer.model, trainer.runtime.device
    context, vocab = config.data.context_length, int(config.model.vocab_size or 2)
    chunk = cfg.loss_chunk_tokens(config)

    batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for rows in ACTIVATION_ROWS:
        tokens = torch.randint(0, vocab, (rows, context + 1), generator=torch.Generator().manual_seed(rows))
        batches[rows] = (tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device))

    def forward_at(rows: int) -> Any:
        with training.autocast(trainer):
            return next_token_loss(model, *batches[rows], chunk).total

    with parallel.gradient_sync(model, enabled=False):
        per_dtype = forward_counters.activation_bytes_per_token(
            forward_at, context, ACTIVATION_ROWS, lambda loss: loss.backward()
        )
        uncompiled: dict[str, int] = {}
        if compiled:
            losses: list[torch.Tensor] = []
            uncompiled = dict(forward_counters.uncompiled_ops(lambda: losses.append(forward_at(ACTIVATION_ROWS[0]))))
            losses.pop().backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    return {
        "activation_bytes_per_token": sum(per_dtype.values()),
        "activation_fp32_bytes_per_token": per_dtype.get("float32", 0.0),
        "activation_bytes_by_dtype": per_dtype,
        **({"uncompiled_forward_ops": uncompiled} if compiled else {}),
    }


def matmuls_per_block(model_config: cfg.ModelConfig, context: int, use_amp: bool) -> int:
    """The matmul kernels one block's forward runs (forward_counters.matmuls_in), in a one-block model of
    model_config on the CPU, under autocast as training.use_amp says."""
    from pretrain.model.transformer import Transformer

    one_block = dataclasses.replace(model_config, n_layers=1)
    model = Transformer(one_block, max_seq_len=context, seed=0)
    tokens = torch.zeros((1, context), dtype=torch.long)

    def forward() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_amp):
            model(tokens)

    return forward_counters.matmuls_in(model.layers[0], forward)


def compile_counts(trainer: Trainer) -> dict[str, Any]:
    """Graph breaks and recompiles over steps 0..2, one evaluation pass, and one more step."""
    with counters.CompileEvents() as events:
        for step in range(3):
            training.train_step(trainer, step)
        events.phase = "eval"
        training.evaluate(trainer)
        events.phase = "train"
        training.train_step(trainer, 3)
    return {
        "graph_breaks": events.graph_breaks,
        "graph_break_reasons": dict(events.graph_break_reasons),
        "recompiles": events.recompiles,
        "graphs": events.graphs,
        "compiles": {f"{frame}/{phase}": n for (frame, phase), n in events.compiles.items()},
    }


@contextlib.contextmanager
def compile_backend(backend: str) -> Any:
    """torch.compile calls that name no backend get this one (the project names none); Muon's
    Newton-Schulz is compiled on a CPU as on CUDA (muon.COMPILED_ON), so its recompiles are counted too."""
    original, compiled_on = torch.compile, muon.COMPILED_ON

    def compile_with(*args: Any, **kwargs: Any) -> Any:
        if backend != "inductor":  # a mode is inductor's: torch refuses one with another backend
            kwargs.pop("mode", None)
        return original(*args, **({"backend": backend} | kwargs))

    torch.compile = compile_with
    muon.COMPILED_ON = (*compiled_on, "cpu")
    try:
        yield
    finally:
        torch.compile, muon.COMPILED_ON = original, compiled_on


def with_compile(config: cfg.Config, on: bool) -> cfg.Config:
    return dataclasses.replace(config, training=dataclasses.replace(config.training, compile=on))


def run_rows(jobs: list[dict[str, Any]], runtime: Runtime) -> list[dict[str, Any]]:
    """Each job in turn, in this process group. A job that fails is recorded and the next one runs."""
    results = []
    for i, job in enumerate(jobs, 1):
        if runtime.is_main:
            print(f"[{i}/{len(jobs)}] {job['name']} ...", file=sys.stderr, flush=True)
        results.append(recorded(lambda job=job: measure_rank(job, runtime)))
    return results


def count_rows(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each job's FLOP count, in this process of its own: what the meta device needs patched
    (on_meta) stays away from the real runs' compiles."""
    return [recorded(lambda job=job: count(job)) for job in jobs]


def recorded(measure: Any) -> dict[str, Any]:
    """measure()'s result, or {"error": its first line} (the traceback goes to stderr)."""
    try:
        return measure()
    except Exception as error:  # the row says so; the others still run
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]}


def measure_rank(job: dict[str, Any], runtime: Runtime) -> dict[str, Any]:
    _, run_config, dataset = planned(job)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="efficiency-run-") as run_dir:
        trainer = build(with_compile(run_config, False), runtime, dataset, Path(run_dir), log())
        result |= eager_counts(trainer) | {"mode": trainer.mode}
        result |= {"eager_" + key: value for key, value in forward_counts(trainer, compiled=False).items()}
        del trainer
        if job["compile"]:
            torch._dynamo.reset()
            with compile_backend(job["compile_backend"]):
                trainer = build(with_compile(run_config, True), runtime, dataset, Path(run_dir), log())
                result |= compile_counts(trainer)
                result |= {"compiled_" + key: value for key, value in forward_counts(trainer, compiled=True).items()}
            del trainer
    return result


def main(argv: list[str]) -> int:
    """argv: "count" or "run", the jobs file (a JSON list; to run, every job with the same nodes
    and ranks) and the results file (to run, each rank writes it with its rank appended)."""
    what, jobs = argv[0], json.loads(Path(argv[1]).read_text())
    warnings.filterwarnings("ignore")
    if what == "count":
        Path(argv[2]).write_text(json.dumps(count_rows(jobs)))
        return 0
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // jobs[0].get("world", jobs[0]["ranks"])))
    runtime = init_runtime(planned(jobs[0])[1])
    try:
        results = run_rows(jobs, runtime)
    finally:
        shutdown(runtime, peers_alive=True)
    Path(f"{argv[2]}.rank{runtime.rank}").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))  # as a training process ends: finalization can abort a gloo rank that succeeded
