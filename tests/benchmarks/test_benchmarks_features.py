"""benchmarks/features.py: AdamW vs Muon, dense vs MoE, as a table (a short run of each)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from support.processes import ROOT, launcher_env

sys.path.insert(0, str(ROOT))
from benchmarks import features, newton_schulz  # noqa: E402
from benchmarks.gpu_acceptance import checks, checks_features, procs  # noqa: E402
from launcher.cli import build_parser  # noqa: E402
from pretrain import config as cfg  # noqa: E402
from pretrain.observe.step_line import step_line  # noqa: E402


@pytest.mark.slow
def test_the_features_benchmark_prints_one_row_per_combination_with_its_speed_and_loss():
    result = subprocess.run(
        [sys.executable, "benchmarks/features.py", "--steps", "4"],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row[0].lstrip("| ") for row in rows] == ["AdamW, dense", "Muon, dense", "AdamW, MoE 4x top-2", "Muon, MoE 4x top-2"]
    assert all(float(row[1].replace(",", "")) > 0 for row in rows)
    assert rows[0][2] == "1.00x"


CAPTURED_FEATURES = """Machine: 2 CPUs, Linux; preset small, device cuda, 20 steps

| run | tokens/s (median, steps 2+) | vs AdamW dense | last loss |
| --- | --- | --- | --- |
| AdamW, dense | 21,975 | 1.00x | 3.0385 |
| Muon, dense | 19,347 | 0.88x | 2.6413 |
| AdamW, MoE 4x top-2 | 14,799 | 0.67x | 2.9683 |
| Muon, MoE 4x top-2 | 11,668 | 0.53x | nan |
"""


def run_newton_schulz(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/newton_schulz.py", *args],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_newton_schulz_benchmark_prints_one_row_per_size_with_its_times():
    result = run_newton_schulz("--device", "cpu", "--sizes", "64x64,32x96", "--repeats", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("Machine: ") and "CPUs" in result.stdout.splitlines()[0]
    rows = checks_features.table_rows(result.stdout, "size")
    assert [(row[0], row[1], row[2]) for row in rows] == [
        ("64x64", "bfloat16 -> bfloat16", "cpu"),
        ("32x96", "bfloat16 -> bfloat16", "cpu"),
    ]
    assert all(float(row[3]) > 0 and 0 < float(row[4]) <= float(row[3]) and float(row[5]) >= 0 for row in rows)
    assert "64x64 on cpu" in result.stderr  # progress on stderr, the table alone on stdout
    checked = checks_features.newton_schulz_rows(result.stdout, "1 GPU")
    assert [row.check for row in checked] == [
        "Muon Newton-Schulz, 5 iterations, 64x64, bfloat16 -> bfloat16, 1 GPU",
        "Muon Newton-Schulz, 5 iterations, 32x96, bfloat16 -> bfloat16, 1 GPU",
    ]
    assert checked[0].result.endswith(" TFLOP/s") and checked[0].met == "n.a."


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sizes", "12x"], "newton_schulz.py: error: --sizes: '12x' is not ROWSxCOLS"),
        (["--function", "qr"], "newton_schulz.py: error: --function: unknown 'qr'; choose from newton_schulz, svd"),
        (["--repeats", "0"], "newton_schulz.py: error: --repeats: must be at least 1"),
    ],
)
def test_bad_newton_schulz_input_is_one_line_and_exit_2(args, message):
    result = run_newton_schulz(*args)
    assert result.returncode == 2
    assert result.stdout == "" and result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_the_newton_schulz_flops_are_those_of_its_matmuls():
    assert newton_schulz.flops(4096, 4096, 5) == 5 * 6 * 4096**3
    assert newton_schulz.flops(3072, 768, 1) == newton_schulz.flops(768, 3072, 1) == 4 * 768**2 * 3072 + 2 * 768**3
    assert newton_schulz.parse_sizes("768x768, 768X3072") == [(768, 768), (768, 3072)]


def test_the_gpu_check_reads_the_four_rows_of_the_features_table_with_steps_per_second():
    rows = checks_features.feature_rows(CAPTURED_FEATURES + "\nrunning x ...\n", "1 GPU", step_tokens=65536)
    assert [row.check for row in rows] == [
        "`small` AdamW, dense, 1 GPU",
        "`small` Muon, dense, 1 GPU",
        "`small` AdamW, MoE 4x top-2, 1 GPU",
        "`small` Muon, MoE 4x top-2, 1 GPU",
    ]
    assert rows[0].result == "21,975 tokens/s (0.34 steps/s of 65,536 tokens), 1.00x AdamW dense's, last loss 3.0385"
    assert [row.met for row in rows] == ["yes", "yes", "yes", "no"]  # a NaN loss is not a measurement
    assert checks_features.feature_rows("launcher: error: x\n", "1 GPU", 65536) == []


def test_the_features_check_runs_the_small_preset_offline_on_one_gpu(tmp_path, monkeypatch):
    # No GPU here: the commands the check would run are captured, and answered with captured tables.
    ran = []

    def fake_run(argv, timeout, env=None):
        ran.append((argv, env))
        if "benchmarks/features.py" in argv:
            return procs.Proc(argv, 0, CAPTURED_FEATURES.replace("nan", "2.6288"), 1.0)
        table = "| size | dtype (in -> out) | device | median ms | min ms | TFLOP/s (median) |\n| --- |\n"
        table += "| 768x768 | bfloat16 -> bfloat16 | cuda | 0.210 | 0.200 | 32.35 |\n"
        return procs.Proc(argv, 0, table, 1.0)  # one of the two sizes: a failed row

    monkeypatch.setattr(checks_features, "run", fake_run)
    ctx = checks.Context(quick=True, sets=[], gpus=[3], tmp=tmp_path, log=lambda _: None, data_note="offline")
    rows = checks.CHECKS["features"](ctx)
    (features_argv, _), (ns_argv, ns_env) = ran
    assert features_argv[1:9] == ["benchmarks/features.py", "--preset", "small", "--device", "cuda", "--gpus", "3", "--steps"]
    sets = [features_argv[i + 1] for i, arg in enumerate(features_argv) if arg == "--set"]
    config = cfg.resolve(preset="small", sets=sets)
    assert (config.data.source, config.data.tokenizer, config.training.compile) == ("builtin", "byte", True)
    assert ns_env["CUDA_VISIBLE_DEVICES"] == "3" and ns_argv[ns_argv.index("--sizes") + 1] == "768x768,4096x4096"
    assert [row.met for row in rows] == ["yes"] * 4 + ["no"]
    assert rows[0].check == "`small` AdamW, dense, 1 GPU, bf16, compiled, 6 steps (offline)"
    assert rows[-1].result.startswith("FAILED: exit 0 after 1 s, 1 rows")


def test_the_features_benchmark_launches_the_preset_it_names_and_reads_gpu_step_lines(tmp_path, monkeypatch):
    # --preset small used to become `--small`, which the launcher refuses.
    calls = []
    trainer = SimpleNamespace(config=cfg.debug())
    out = "".join(
        f"GPU3:INFO | [GPU 3] {step_line(trainer, i, 5.0 - i, 1e-3, 0.5, 1.0, 1000.0 * i, None, None)}\n" for i in range(4)
    )

    def fake_run(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, out, "")

    monkeypatch.setattr(features.subprocess, "run", fake_run)
    args = SimpleNamespace(preset="small", device="cuda", steps=4, gpus="3", sets=["data.source=builtin"])
    assert features.run("Muon, dense", ["training.optimizer=muon"], args, tmp_path) == (2500.0, 2.0)
    (argv,) = calls
    parsed = build_parser().parse_args(argv[3:])
    assert (parsed.preset, parsed.device, parsed.gpus, parsed.max_steps) == ("small", "cuda", "3", 4)
    assert parsed.sets == ["logging.log_interval=1", "data.source=builtin", "training.optimizer=muon"]
