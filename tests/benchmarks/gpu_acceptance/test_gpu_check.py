"""scripts/gpu_check.sh (the benchmarks/gpu_acceptance package: its cli, checks, procs and workers
modules) on a machine without a GPU: its help, its one-line errors, its one-line refusal
to run; and the parts of it that need no GPU: reading the step lines training prints, naming the
results file, merging reruns into the table, starting a worker in a child process."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from support.processes import ROOT, alive, launcher_env, wait_until

sys.path.insert(0, str(ROOT))
from benchmarks.gpu_acceptance import checks, checks_runtime, cli, procs  # noqa: E402
from benchmarks.gpu_acceptance.workers_runtime import FAILURE, RAISING  # noqa: E402
from pretrain import config as cfg  # noqa: E402
from pretrain.plan import gpu_memory, parallelism  # noqa: E402
from pretrain.observe.step_line import step_line  # noqa: E402

HAS_NVIDIA_SMI = shutil.which("nvidia-smi") is not None


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_names_every_option_and_every_check():
    result = run_script("--help")
    assert result.returncode == 0, result.stderr
    for option in ("--quick", "--only", "--output", "--set"):
        assert option in result.stdout
    assert "--worker" not in result.stdout  # internal
    assert ", ".join(checks.CHECKS) in " ".join(result.stdout.split())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "gpu_check: error: unrecognized arguments: --bogus; see --help"),
        (["--only", "small,smal"], "gpu_check: error: --only: unknown check smal; choose from gpus, nvml-test,"),
        (["--only", ","], "gpu_check: error: --only: unknown check (none given)"),
        (["--set", "data.sorce=text"], "gpu_check: error: --set: data.sorce: unknown key; did you mean data.source?"),
        (["--output", "benchmarks"], "gpu_check: error: --output benchmarks is a directory; name a file"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(args, message):
    result = run_script(*args)
    assert result.returncode == 2
    assert result.stdout == "" and result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.skipif(HAS_NVIDIA_SMI, reason="this machine has nvidia-smi")
def test_without_a_gpu_it_says_so_in_one_line_exits_2_and_writes_nothing(tmp_path):
    output = tmp_path / "table.md"
    result = run_script("--quick", "--output", str(output))
    assert result.returncode == 2
    assert result.stderr == "gpu_check: error: no NVIDIA GPU here (nvidia-smi not found); run it on a machine with one\n"
    assert result.stdout == "" and not output.exists() and not output.with_suffix(".json").exists()


def test_the_step_lines_of_training_are_read_with_throughput_mfu_and_memory():
    trainer = SimpleNamespace(config=cfg.debug())
    line = step_line(trainer, 7, 3.25, 1e-3, 0.5, 12.0, 123456.0, 0.4567, 12.3)
    other = step_line(trainer, 8, 3.0, 1e-3, 0.5, 11.0, 1000.0, None, None)
    out = (
        f"launcher: run directory: x\nGPU3:INFO | [GPU 3] {line}\nGPU3:DEBUG | [GPU 3] Step [7/9] | Loss: 1\n"
        f"GPU5:INFO | [GPU 5] {other}\n"
    )
    first, second = procs.step_lines(out)
    assert first == {"prefix": "GPU3", "step": 7, "loss": 3.25, "tokens_per_s": 123456.0, "mfu": 45.7, "mem": 12.3}
    assert (second["prefix"], second["step"], second["mfu"], second["mem"]) == ("GPU5", 8, None, None)
    assert procs.losses_by_step(out, "GPU5") == {8: 3.0}


def test_falling_loss_compares_the_last_step_with_the_first():
    assert procs.falling({0: 5.0, 5: 6.0, 9: 4.0})
    assert not procs.falling({0: 5.0, 9: 5.0}) and not procs.falling({0: 5.0})


@pytest.mark.parametrize(
    "name, short",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
    ],
)
def test_the_results_file_is_named_after_the_gpu_model(name, short):
    assert cli.short_gpu_name(name) == short


def test_a_rerun_of_some_checks_replaces_their_rows_and_keeps_the_others_in_check_order(tmp_path):
    path, machine = tmp_path / "2026-01-01-h100.md", "Machine: 1 x NVIDIA H100; driver 1; 2026-01-01"
    first = [
        checks.Row("syncs row", "max 2", "<= 1", "no", key="syncs"),
        checks.Row("gpus row", "agree", "identical", "yes", key="gpus"),
    ]
    cli.write_report(path, machine, first, "note")
    text = cli.write_report(path, machine, [checks.Row("syncs row", "max 1", "<= 1", "yes", key="syncs", failure="")], "note")
    assert text == path.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == ["| gpus row | agree | identical | yes |", "| syncs row | max 1 | <= 1 | yes |"]
    assert text.index(machine) < text.index("| check | result | target | met? |")
    assert len(json.loads(path.with_suffix(".json").read_text())["rows"]) == 2


def test_rows_from_another_machine_are_not_merged(tmp_path):
    path = tmp_path / "table.md"
    cli.write_report(path, "Machine: 1 x A; 2026-01-01", [checks.Row("a", "r", "t", "yes", key="gpus")], "")
    text = cli.write_report(path, "Machine: 8 x B; 2026-01-01", [checks.Row("b", "r", "t", "yes", key="nan")], "")
    assert "| b |" in text and "| a |" not in text


def test_a_failed_check_keeps_its_last_output_lines_under_the_table_and_cells_stay_one_line():
    rows = [checks.Row("nan", "FAILED: a | b\nc", "-", "no", key="nan", failure="line 1\nline 2")]
    text = cli.render("Machine: x", rows, "note")
    assert "| nan | FAILED: a \\| b c | - | no |" in text
    assert text.index("## Output of what failed") > text.index("| nan |") and "line 1\nline 2" in text


def test_a_check_that_raises_becomes_a_failed_row_and_the_next_check_still_runs(tmp_path, monkeypatch):
    def broken(ctx):
        raise procs.CheckFailed("worker nvml: exit 1 after 2 s", "Traceback ...\nNVMLError")

    def fine(ctx):
        return [checks.Row("nvml test", "1 passed", "1 passed", "yes")]

    monkeypatch.setitem(checks.CHECKS, "gpus", broken)
    monkeypatch.setitem(checks.CHECKS, "nvml-test", fine)
    ctx = checks.Context(quick=True, sets=[], gpus=[0], tmp=tmp_path, log=lambda _: None)
    rows = [row for key in ("gpus", "nvml-test") for row in cli.run_check(key, ctx)]
    assert [(r.key, r.met) for r in rows] == [("gpus", "no"), ("nvml-test", "yes")]
    assert rows[0].result == "FAILED: worker nvml: exit 1 after 2 s" and "NVMLError" in rows[0].failure


@pytest.mark.slow
def test_a_check_command_that_outlives_its_timeout_is_killed_with_its_children():
    proc = procs.run(["bash", "-c", "sleep 60 & echo $!; wait"], timeout=2)
    assert proc.returncode is None and proc.how() == "timed out"
    sleeper = int(proc.out.split()[0])
    assert wait_until(lambda: not alive(sleeper), timeout=10)


def test_without_data_options_the_runs_use_the_offline_corpus_and_keep_the_presets_vocabulary(tmp_path):
    offline = checks.Context(quick=True, sets=[], gpus=[0], tmp=tmp_path)
    small = cfg.resolve(preset="small", sets=offline.small_sets)
    assert (small.data.source, small.data.tokenizer) == ("builtin", "byte")
    assert small.model.vocab_size == (cfg.small().model.vocab_size or checks.SMALL_FALLBACK_VOCAB)
    own = checks.Context(quick=True, sets=["data.source=text", "data.path=/data"], gpus=[0], tmp=tmp_path)
    assert own.small_sets == own.data_sets == ["data.source=text", "data.path=/data"]


def test_the_nvml_worker_run_as_a_script_reads_the_gpus_through_the_launchers_nvml(scripted_gpus):
    # benchmarks/launcher.py must not shadow the launcher package when the script runs.
    scripted_gpus(
        [{"uuid": "GPU-aaaa", "memory_total_mib": 81559, "processes": [{"pid": 4242, "memory_mib": 1024}]}, {"uuid": "GPU-bbbb"}]
    )
    result = subprocess.run(
        [sys.executable, str(procs.ENTRY), "--worker", "nvml"],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    gpus = json.loads(result.stdout.split(procs.RESULT_MARK)[1])
    assert [(g["index"], g["uuid"]) for g in gpus] == [(0, "GPU-aaaa"), (1, "GPU-bbbb")]
    assert gpus[0]["memory_total"] == 81559 * 2**20 and gpus[0]["processes"] == [[4242, 1024 * 2**20]]
    assert procs.worker("nvml", 60, env=launcher_env()) == gpus  # as the checks start their workers


def test_the_two_gpu_runtime_checks_are_not_applicable_on_one_gpu_and_start_nothing(tmp_path, monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError("a one-GPU machine must not start a two-GPU run")

    monkeypatch.setattr(checks_runtime, "run", no_process)
    monkeypatch.setattr(checks_runtime, "launcher", no_process)
    monkeypatch.setattr(checks_runtime.subprocess, "Popen", no_process)
    ctx = checks.Context(quick=True, sets=[], gpus=[3], tmp=tmp_path, log=lambda _: None)
    for key in ("torchrun", "nccl-timeout", "nccl-error"):
        (row,) = checks.CHECKS[key](ctx)
        assert (row.result, row.met) == ("1 GPU", "n.a."), key


@pytest.mark.slow
def test_under_torchrun_the_row_reads_each_ranks_device_and_wants_two_different_gpus(tmp_path):
    # A real 2-rank torchrun on CPU: the Model lines are read; both ranks on "cpu" is not a pass.
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "pretrain_main.py",
        "--debug",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "system.device=cpu",
        "--set",
        "training.max_steps=1",
        "--set",
        "training.compile=false",
    ]
    proc = procs.run(argv, timeout=300, env=launcher_env())
    assert proc.ok, proc.tail()
    row = checks_runtime.torchrun_row("torchrun", "different GPUs", proc)
    assert row.met == "no" and row.result.startswith("exit 0; ranks on cpu (CPU ") and row.result.count("cpu (") == 2
    on_gpus = proc.out.replace("[CPU 0]", "[GPU 0]").replace("[CPU 1]", "[GPU 1]")
    apart = dataclasses.replace(
        proc, out=on_gpus.replace("device cpu", "device cuda:0", 1).replace("device cpu", "device cuda:1")
    )
    assert checks_runtime.torchrun_row("torchrun", "t", apart).met == "yes"
    together = dataclasses.replace(proc, out=on_gpus.replace("device cpu", "device cuda:0"))
    assert checks_runtime.torchrun_row("torchrun", "t", together).met == "no"


@pytest.mark.slow
def test_a_rank_that_raises_under_the_launcher_prints_its_traceback_and_all_end_soon(tmp_path):
    # The nccl-error worker on two gloo CPU ranks: the same code, the launcher's real summary.
    proc = procs.launcher(
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--kill-grace",
        "1",
        "--run-dir",
        str(tmp_path / "r"),
        "--",
        *procs.worker_argv("nccl-error", "cpu"),
        timeout=120,
        env=launcher_env(),
        first_match=checks_runtime.re.compile(RAISING),
    )
    assert "FAILED: CPU" in checks_runtime.summary(proc.out), proc.tail()
    row = checks_runtime.error_row("nccl-error", "t", proc)
    assert row.met == "yes" and row.result.startswith("exit 1 ") and "rank 1's traceback printed" in row.result, row
    assert "failed first" in row.result and "summary: ?" not in row.result
    silent = dataclasses.replace(proc, out=proc.out.replace(f"RuntimeError: {FAILURE}", "RuntimeError: other"))
    assert checks_runtime.error_row("nccl-error", "t", silent).met == "no"


def memory_run(estimate_gib: float | None, mems: list[float | None]) -> procs.Proc:
    """A launcher's output: its parallelism line (as pretrain.plan.parallelism writes it) and step lines."""
    config = cfg.resolve(preset="small", sets=["model.vocab_size=50304"])
    _, line = parallelism.plan_parallelism(config, 1, 80 * 2**30)
    if estimate_gib is not None:
        line = checks_runtime.ESTIMATE.sub(f"estimated {estimate_gib:.1f} GiB of 80.0 GiB per GPU", line)
    trainer = SimpleNamespace(config=cfg.debug())
    steps = [f"GPU0:INFO | [GPU 0] {step_line(trainer, i, 3.0, 1e-3, 0.5, 1.0, 1000.0, None, mem)}" for i, mem in enumerate(mems)]
    out = "\n".join(([f"launcher: {line}"] if estimate_gib is not None else []) + steps)
    return procs.Proc(["python", "-m", "launcher"], 0, out, 1.0)


def test_the_memory_row_compares_the_launchers_estimate_with_what_the_run_used():
    assert checks_runtime.ESTIMATE.search(memory_run(None, []).out) is None
    assert checks_runtime.ESTIMATE.search(memory_run(9.5, []).out) is not None
    fits = checks_runtime.estimate_row("m", memory_run(9.5, [3.0, 4.2, None]), used_gib=6.0)
    assert fits.met == "yes"
    assert fits.result.startswith("estimate 9.5 GiB; used 6.0 GiB (nvidia-smi); allocated peak 4.2")
    assert checks_runtime.estimate_row("m", memory_run(9.5, [4.2]), used_gib=9.8).met == "no"  # estimate low
    missed = checks_runtime.estimate_row("m", memory_run(9.5, [4.2]), used_gib=3.0)  # below what torch allocated
    assert missed.met == "no" and missed.result.endswith("nvidia-smi's samples missed the peak")
    missing = checks_runtime.estimate_row("m", memory_run(None, [4.2]), used_gib=6.0)
    assert missing.met == "no" and "the launcher's estimate line" in missing.result


def test_the_launchers_estimate_line_is_the_one_the_memory_row_reads():
    config = cfg.resolve(preset="small", sets=["model.vocab_size=50304"])
    _, line = parallelism.plan_parallelism(config, 1, 80 * 2**30)
    found = checks_runtime.ESTIMATE.search(line)
    assert found and float(found["gib"]) == float(gpu_memory.gib(gpu_memory.estimate(config, 1, "ddp").total))


def test_the_8b_shape_memory_row_fails_when_the_reserved_peak_exceeds_the_estimate():
    shape = {"estimate_gib": 60.0, "estimate_parts": "weights 1.0 GiB", "run_allocated_gib": 50.0}
    assert checks_runtime.shape_estimate_row({**shape, "run_reserved_gib": 58.0}).met == "yes"
    low = checks_runtime.shape_estimate_row({**shape, "run_reserved_gib": 61.5})
    assert low.met == "no" and "peak reserved 61.5" in low.result and "(102% of the estimate)" in low.result


@pytest.mark.slow
def test_the_small_run_worker_times_its_steps_and_profiles_more_on_cpu(tmp_path, monkeypatch, capsys):
    # The step-profile and compile-mode checks' worker, its own code on CPU: a tiny `small`, uncompiled.
    from benchmarks.gpu_acceptance import workers_profile

    monkeypatch.setattr(workers_profile, "DEVICE", "cpu")
    with_sets = workers_profile.small_run_sets
    monkeypatch.setattr(workers_profile, "small_run_sets", lambda *a: [*with_sets(*a), "training.compile=false"])
    tiny = ["model.n_heads=4", "model.n_kv_heads=2", "model.dim=64", "model.n_layers=2", "model.ffn_dim=128"]
    tiny += ["model.vocab_size=257", "training.batch_size=2", "training.grad_accum_nums=1", "data.context_length=32"]
    data = [*checks.OFFLINE_DATA, f"data.cache_dir={tmp_path}", *tiny]
    workers_profile.worker_small_run("2", "2", json.dumps(data))
    (r,) = procs.results(capsys.readouterr().out)
    assert r["shape"] == "batch 2 x 32, 1 micro-batches" and r["tokens_per_s"] == pytest.approx(64 / r["step_s"])
    assert r["first_step_s"] > 0 and r["mfu"] is None and r["compile_mode"] == "default"
    split = r["profile"]
    assert split["steps"] == 2 and split["device"] == "cpu" and sum(split["shares"].values()) == pytest.approx(100)
    assert split["ms"]["matmuls"] > 0 and split["ms"]["optimizer"] > 0


def test_the_script_sets_up_python_with_the_float8_extra_which_never_pulls_a_torch(tmp_path):
    # gpu_check.sh with a setup.sh that records what setup_python is asked to install
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gpu_check.sh", tmp_path / "scripts" / "gpu_check.sh")
    (tmp_path / "scripts" / "setup.sh").write_text('setup_python() { shift; printf "%s\\n" "$@"; exit 0; }\n')
    result = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert [line.rsplit("/", 1)[-1] for line in result.stdout.split()] == ["requirements.txt", "requirements-float8.txt"]
    # torchao declares no torch of its own: setup_python installs it without touching the installed torch
    import importlib.metadata
    import re

    pytest.importorskip("torchao")
    required = [r for r in importlib.metadata.requires("torchao") or [] if "extra ==" not in r]
    assert not [r for r in required if re.match(r"torch([^a-z0-9_]|$)", r, re.IGNORECASE)]
