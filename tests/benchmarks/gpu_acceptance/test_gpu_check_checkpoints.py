"""The GPU check `checkpoints` (benchmarks/gpu_acceptance/checks_checkpoints.py) where no GPU is
needed: what it reads from a run's metrics.jsonl, the rows it makes of made-up runs, the tensor
comparison of two checkpoints, its launches on the chosen GPU, and the whole check run for real on
this CPU with the debug preset."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_acceptance import checks, checks_checkpoints as cc, groups, procs
from support.processes import ROOT, launcher_env
from pretrain import config as cfg

PLAN = cc.Plan("small", 40, 10, 4, ["--gpus", "0"])


def save(step: int, stall: float, write: float = 2.0, asynchronous: bool = True, tier: str = "durable", path: str = "") -> dict:
    return {"step": step, "tier": tier, "async": asynchronous, "stall_s": stall, "write_s": write, "path": path}


def finished(losses: dict[int, float] | None = None, saves: list[dict] | None = None, out: str = "") -> cc.Finished:
    return cc.Finished(losses if losses is not None else {s: 10.0 - 0.1 * s for s in range(40)}, saves or [], out)


def sync_and_async(async_stalls: list[float]) -> tuple[cc.Finished, cc.Finished]:
    """A sync run stalling about 2 s a save and an async one with these stalls at steps 10, 20, 30;
    each ends with its save at step 40, which every run waits for."""
    steps = (10, 20, 30)
    sync = finished(saves=[*(save(s, 2.0 + s / 100, asynchronous=False) for s in steps), save(40, 2.5, asynchronous=False)])
    staged = "launcher: checkpoints: asynchronous, staged in 1.7 GiB of host memory\n"
    asynchronous = finished(saves=[*(save(s, x) for s, x in zip(steps, async_stalls, strict=True)), save(40, 2.4)], out=staged)
    return sync, asynchronous


# --- what a run leaves ------------------------------------------------------------------------------


def test_a_runs_losses_and_saves_are_read_from_metrics_jsonl_past_other_records_and_a_half_line(tmp_path):
    lines = [
        {"kind": "train", "step": 0, "loss": 5.5, "lr": 1e-3},
        {"kind": "goodput", "step": 0, "goodput": 0.2},
        {"kind": "train", "step": 1, "loss": 5.25},
        {"kind": "checkpoint", "step": 2, "checkpoint": save(2, 0.01, path="/r/checkpoints/step_2")},
        {"kind": "checkpoint", "step": 3, "checkpoint": save(3, 0.02, tier="local", path="/dev/shm/x/step_3")},
        {"kind": "train", "step": 2, "loss": None},  # a non-finite loss, written as null
        {"kind": "checkpoint", "step": 4, "checkpoint": save(4, 0.5)},
    ]
    text = "\n".join(json.dumps(line) for line in lines) + '\n{"kind": "train", "step": 3, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    run = cc.read_run(tmp_path, "out")
    assert run.losses == {0: 5.5, 1: 5.25}
    assert [(s["step"], s["tier"], s["path"]) for s in run.saves] == [
        (2, "durable", "/r/checkpoints/step_2"),
        (3, "local", "/dev/shm/x/step_3"),
        (4, "durable", ""),
    ]
    assert [s["step"] for s in cc.periodic(run.saves, 4)] == [2]  # the end-of-run save and the local one left out
    assert [s["step"] for s in cc.periodic(run.saves, 4, "local")] == [3]
    assert cc.read_run(tmp_path / "nothing", "").losses == {}


def test_the_staged_size_is_read_from_the_launchers_plan_line():
    assert cc.staged_size("x\nlauncher: checkpoints: asynchronous, staged in 512 MiB of host memory\n") == "512 MiB"
    assert cc.staged_size("launcher: checkpoints: synchronous (training.async_checkpoint=false)") is None


# --- the rows --------------------------------------------------------------------------------------


def test_the_async_stall_must_be_at_most_a_tenth_of_the_sync_one_over_the_saves_after_the_first():
    sync, asynchronous = sync_and_async([1.5, 0.1, 0.3])  # the first pays once (its staging buffer)
    row = cc.stall_row(PLAN, sync, asynchronous)
    assert row.met == "yes", row.result  # 0.2 s against 2.25 s: 8.9%
    assert "async 0.200 s stall" in row.result and "sync 2.250 s stall" in row.result and "async/sync 8.9%" in row.result
    assert "first save's stall 2.10/1.50 s" in row.result and "staged 1.7 GiB" in row.result
    assert cc.stall_row(PLAN, *sync_and_async([0.1, 0.3, 0.4])).met == "no"  # 0.35 s: 15.6%


def test_a_save_made_in_the_other_mode_or_no_periodic_save_fails_the_stall_row():
    sync, asynchronous = sync_and_async([0.1, 0.1, 0.1])
    asynchronous.saves[1]["async"] = False
    row = cc.stall_row(PLAN, sync, asynchronous)
    assert row.met == "no" and "saved in the other mode: async step 20" in row.result
    sync.saves = sync.saves[-1:]  # only the end-of-run save
    row = cc.stall_row(PLAN, sync, asynchronous)
    assert row.met == "no" and row.result == "FAILED: no periodic save recorded in the sync run"


def test_where_the_gpu_reproduces_the_steps_before_the_first_save_the_losses_must_be_identical():
    sync = finished()
    assert cc.losses_row(PLAN, sync, finished(dict(sync.losses))).met == "yes"
    drifted = dict(sync.losses) | {25: sync.losses[25] * (1 + 1e-6)}  # after a save: a checkpoint changed training
    row = cc.losses_row(PLAN, sync, finished(drifted))
    assert row.met == "no" and "largest relative gap 1.0e-06 at step 25" in row.result
    assert row.target.startswith("identical step for step")
    missing = {step: loss for step, loss in sync.losses.items() if step != 39}
    assert "missing or not finite at step 39" in cc.losses_row(PLAN, sync, finished(missing)).result


def test_where_the_gpu_does_not_reproduce_a_run_the_losses_are_held_to_the_tolerance():
    sync = finished()
    noisy = {step: loss * (1 + 1e-7 * (step + 1)) for step, loss in sync.losses.items()}  # differs from step 0
    row = cc.losses_row(PLAN, sync, finished(noisy))
    assert row.met == "yes" and "before the first save already" in row.result and "within 0.001" in row.target
    off = noisy | {30: sync.losses[30] * 1.01}  # a wrong batch: 1%
    assert cc.losses_row(PLAN, sync, finished(off)).met == "no"


def test_the_resumed_run_must_start_at_the_checkpoint_and_continue_with_the_uninterrupted_runs_losses():
    uninterrupted = finished()
    resumed = finished({step: loss for step, loss in uninterrupted.losses.items() if step >= 30})
    row = cc.resume_row(PLAN, uninterrupted, resumed, exact=True)
    assert row.met == "yes" and row.result.startswith("first resumed step 7.000000 vs 7.000000; identical")
    resumed.losses[31] += 1e-3
    assert cc.resume_row(PLAN, uninterrupted, resumed, exact=True).met == "no"
    assert cc.resume_row(PLAN, uninterrupted, resumed, exact=False).met == "yes"  # 1.5e-4: within the tolerance
    started_over = cc.resume_row(PLAN, uninterrupted, uninterrupted, exact=True)
    assert started_over.met == "no" and "first step is 0, not 30" in started_over.result


def test_the_local_tier_row_needs_saves_in_dev_shm_that_are_gone_after_the_run(tmp_path):
    shm = "/dev/shm/pretrain-someone/run-0123456789ab"
    run = finished(
        saves=[save(34, 0.05, 1.0, tier="local", path=f"{shm}/step_34"), save(38, 0.04, 0.9, tier="local", path=f"{shm}/step_38")]
    )
    row = cc.local_row(PLAN, run)
    assert row.met == "yes", row.result
    assert row.result == f"2 saves in {shm}; stall 0.040 s, write 0.90 s (median after the first); removed at the end"
    kept = finished(saves=[save(34, 0.05, tier="local", path=str(tmp_path))])  # elsewhere, and still there
    row = cc.local_row(PLAN, kept)
    assert row.met == "no" and f"not in /dev/shm: {tmp_path}" in row.result and f"left after the run: {tmp_path}" in row.result


def test_a_local_tier_turned_off_for_want_of_room_is_not_applicable_and_silence_is_a_failure():
    line = "warning: no local checkpoints (/dev/shm has 0.1 GiB free, 3.4 GiB needed); only the durable ones"
    off = cc.local_row(PLAN, finished(out=f"launcher: {line}\n"))
    assert off.met == "n.a." and off.result == f"off on this machine: {line}"
    assert cc.local_row(PLAN, finished()).met == "no"


def write_checkpoint(directory: Path, weight: torch.Tensor) -> Path:
    directory.mkdir(parents=True)
    torch.save({"w": weight, "b": torch.zeros(3)}, directory / "model.pt")
    optimizer = {
        "state": {0: {"step": torch.tensor(30.0), "exp_avg": weight * 0.5}},
        "param_groups": [{"lr": 1e-3, "params": [0]}],
    }
    torch.save(optimizer, directory / "optimizer.pt")
    return directory


def test_two_checkpoints_are_compared_bit_for_bit_tensor_by_tensor_naming_those_that_differ(tmp_path):
    weight = torch.tensor([[1.0, float("nan")], [3.0, 4.0]])
    first = write_checkpoint(tmp_path / "a", weight)
    same = cc.compare_checkpoints(first, write_checkpoint(tmp_path / "b", weight.clone()))
    assert same == {"tensors": 4, "bytes": 4 * 4 + 3 * 4 + 4 + 4 * 4, "different": [], "count_different": 0, "max_relative": 0.0}
    assert cc.contents_row(PLAN, same, exact=True).met == "yes"
    changed = weight.clone()
    changed[1, 1] = 4.0 + 1e-6
    other = cc.compare_checkpoints(first, write_checkpoint(tmp_path / "c", changed))
    assert other["different"] == ["model.pt.w", "optimizer.pt.state.0.exp_avg"] and other["max_relative"] > 0
    row = cc.contents_row(PLAN, other, exact=True)
    assert row.met == "no" and "2 of 4 tensors differ (model.pt.w, optimizer.pt.state.0.exp_avg)" in row.result
    assert cc.contents_row(PLAN, other, exact=False).met == "n.a."  # a GPU that does not reproduce a run


# --- the check -------------------------------------------------------------------------------------


def test_the_runs_are_small_uncompiled_on_one_process_with_the_tiers_the_check_compares():
    for asynchronous, local in ((False, False), (True, False), (True, True)):
        config = cfg.resolve(preset="small", sets=cc.run_sets(cc.plan_for(context(quick=False)), asynchronous, local))
        t = config.training
        assert (t.async_checkpoint, t.checkpoint_interval, t.compile, t.parallelism) == (asynchronous, 10, False, "ddp")
        assert t.local_checkpoint_interval == (cc.LOCAL_INTERVAL if local else 0) and config.logging.log_interval == 1
    for quick in (False, True):
        plan = cc.plan_for(context(quick))
        assert plan.steps % plan.interval == 0 and plan.resume_step >= 2 * plan.interval  # saves after the first to take


def test_the_launches_and_the_comparison_fit_a_groups_limit():
    assert 2 * cc.RUN_TIMEOUT_S + cc.COMPARE_TIMEOUT_S + cc.RESUME_TIMEOUT_S <= groups.CHECK_LIMIT_S


def context(quick: bool, tmp: Path = Path("/nonexistent")) -> checks.Context:
    return checks.Context(quick=quick, sets=[], gpus=[3], tmp=tmp, log=lambda _: None)


def test_the_check_runs_sync_then_async_on_the_chosen_gpu_then_compares_and_resumes_and_a_failed_run_is_a_no_row(
    monkeypatch, tmp_path
):
    seen = []

    def fake_run(argv, timeout, env):
        seen.append((argv, timeout))
        if "compare" in argv:
            return procs.Proc(argv, 0, procs.RESULT_MARK + json.dumps({"tensors": 0, "bytes": 0, "different": []}) + "\n", 5.0)
        if fail and "training.async_checkpoint=true" in argv:
            return procs.Proc(argv, 2, "launcher: error: training.async_checkpoint=true: no room\n", 3.0)
        return procs.Proc(argv, 0, "", 60.0)

    monkeypatch.setattr(cc, "run", fake_run)
    fail = False
    rows = checks.CHECKS["checkpoints"](context(quick=True, tmp=tmp_path))
    assert len(rows) == 5 and [t for _, t in seen] == [
        cc.RUN_TIMEOUT_S,
        cc.RUN_TIMEOUT_S,
        cc.COMPARE_TIMEOUT_S,
        cc.RESUME_TIMEOUT_S,
    ]
    (sync, _), (asynchronous, _), (compare, _), (resumed, _) = seen
    for argv in (sync, asynchronous, resumed):
        assert argv[argv.index("--gpus") + 1] == "3" and argv[argv.index("--max-steps") + 1] == str(cc.QUICK_STEPS)
    assert "training.async_checkpoint=false" in sync and "training.async_checkpoint=true" in asynchronous
    step = f"step_{cc.QUICK_STEPS - cc.INTERVAL}"
    assert compare[-2:] == [
        str(tmp_path / "checkpoints-sync" / "checkpoints" / step),
        str(tmp_path / "checkpoints-async" / "checkpoints" / step),
    ]
    assert resumed[resumed.index("--resume") + 1] == compare[-1]
    assert f"training.local_checkpoint_interval={cc.LOCAL_INTERVAL}" in resumed
    assert "training.local_checkpoint_interval=0" in sync and "training.local_checkpoint_interval=0" in asynchronous
    fail = True
    (row,) = checks.CHECKS["checkpoints"](context(quick=True, tmp=tmp_path))
    assert row.met == "no" and "the async run" in row.check and "exit 2" in row.result and "no room" in row.failure


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_a_gpu_the_checkpoints_group_says_so_in_one_line_and_exits_2(tmp_path):
    output = tmp_path / "table.md"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--only", "checkpoints", "--output", str(output)],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == "" and not output.exists()
    assert result.stderr == "gpu_check: error: no NVIDIA GPU here (nvidia-smi not found); run it on a machine with one\n"


def test_on_this_cpu_the_whole_check_runs_the_debug_preset_for_real_and_meets_its_equalities(tmp_path):
    plan = cc.Plan("debug", 12, 4, 1, ["--device", "cpu", "--nproc", "1"], label="1 CPU process")
    stall, losses, contents, resumed, local = cc.measure(plan, tmp_path, launcher_env())
    assert "async/sync" in stall.result and "staged 5 MiB" in stall.result, stall.result  # its verdict: a CPU's
    assert losses.result == "identical at every step" and losses.met == "yes"
    assert contents.met == "yes" and contents.result.startswith("identical bit for bit (60 tensors"), contents.result
    assert resumed.met == "yes" and "identical at every step" in resumed.result, resumed.result
    room = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else 0
    assert local.met == ("yes" if room > 2**30 else "n.a."), local.result
