"""Pieces of the training loop: ETA, labels, the non-finite stop."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from support.processes import ROOT, free_port
from support.runs import run_debug_training
from pretrain.checkpoint import save_restore
from pretrain import config as cfg
from pretrain.data.fitting import fit_to_dataset
from pretrain.data.prepare import prepare
from pretrain.distributed.runtime import Runtime, device_label, setup_logging
from pretrain.run.stopping import Stopped
from pretrain.numerics.debug import NumericalFailure
from pretrain.build import build
from pretrain.observe.metrics import read_metrics
from pretrain.observe.step_line import format_eta
from pretrain.optim.schedule import lr_at
from pretrain.train import fit, train_step


def training(**changes) -> cfg.TrainingConfig:
    return dataclasses.replace(cfg.debug().training, **changes)


@pytest.mark.parametrize("seconds, text", [(0, "0:00"), (330.7, "5:30"), (7530, "2:05:30"), (-4, "0:00")])
def test_eta_reads_minutes_and_seconds_and_hours_when_long(seconds, text):
    assert format_eta(seconds) == text


def test_labels_use_the_physical_gpu_index(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("GPU_RANK", "3")
    assert device_label(torch.device("cuda", 0), rank=0) == "GPU 3"
    monkeypatch.delenv("GPU_RANK")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert device_label(torch.device("cuda", 0), rank=0) == "GPU 5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,6")
    assert device_label(torch.device("cuda", 1), rank=0) == "GPU 6"  # cuda:1 is the second listed
    assert device_label(torch.device("cpu"), rank=1) == "CPU 1"


@pytest.fixture
def trainer(tmp_path):
    config = cfg.resolve(preset="debug", sets=[f"data.cache_dir={tmp_path}", "training.batch_size=2", "data.context_length=32"])
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")
    dataset = prepare(config.data, log=lambda _: None)
    config, _ = fit_to_dataset(config, dataset, world_size=1)
    return build(config, runtime, dataset, tmp_path / "run", setup_logging("CPU 0", "WARNING"))


def test_a_training_step_returns_a_finite_loss_near_ln_vocab_at_init(trainer):
    loss, grad_norm, lr = train_step(trainer, 0)
    assert abs(float(loss) - math.log(257)) < 0.3
    assert math.isfinite(float(grad_norm)) and lr == lr_at(0, trainer.config.training)


def test_a_nan_weight_stops_training_at_that_step(trainer):
    with torch.no_grad():
        trainer.model.layers[1].feed_forward.w2.weight[0, 0] = float("nan")
    before = trainer.model.output.weight.detach().clone()
    with pytest.raises(NumericalFailure, match="step 4: NaN gradient norm; stopped .*configs/config_stable.json"):
        train_step(trainer, 4)
    assert torch.equal(trainer.model.output.weight, before)  # the bad update was not applied


def test_a_requested_stop_ends_training_after_the_step_with_a_loadable_checkpoint(trainer):
    trainer.stop.signum = signal.SIGTERM  # as the handler records a SIGTERM
    with pytest.raises(Stopped) as stopped:
        fit(trainer)
    assert stopped.value.signum == signal.SIGTERM
    assert len(trainer.losses) == 1  # one step ran, then it stopped
    saved = trainer.run_dir / "checkpoints" / "step_1"
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "model.pt", "optimizer.pt", "rng_rank0.pt", "state.json"]
    assert not list(saved.parent.glob("*.tmp"))
    state = save_restore.read_state(saved)
    assert state["steps_done"] == 1 and state["loader"] == trainer.loader.state_dict()
    weights = save_restore.load_tensors(saved, "model.pt")
    assert all(torch.equal(weights[k], v) for k, v in trainer.model.state_dict().items())
    assert save_restore.load_tensors(saved, "optimizer.pt")["state"]  # the Adam moments are there
    assert cfg.load(saved / "config.json") == trainer.config


def test_a_second_stop_signal_ends_the_process_at_once_unless_it_is_the_same_request_twice(tmp_path):
    source = (
        "import os, signal, time\n"
        "from pretrain.run.stopping import StopRequest\n"
        "with StopRequest().installed():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # within a second: the same request\n"
        "    print('first SIGTERMs only recorded', flush=True)\n"
        "    time.sleep(1.1)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "    print('not reached', flush=True)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    assert result.returncode == -signal.SIGTERM
    assert result.stdout == "first SIGTERMs only recorded\n"


@pytest.mark.parametrize(
    "error", [RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), ValueError("something unexpected")]
)
def test_a_failing_rank_prints_its_traceback_before_it_leaves_the_process_group(monkeypatch, capsys, error):
    import pretrain.train as train_module

    def failing_train(*_args):
        raise error

    printed_before_shutdown = []
    monkeypatch.setattr(train_module, "train", failing_train)
    monkeypatch.setattr(
        train_module,
        "shutdown",
        lambda runtime, peers_alive: printed_before_shutdown.append((capsys.readouterr().err, peers_alive)),
    )
    assert train_module.main(["--debug", "--set", "system.device=cpu"]) == 1
    ((stderr, peers_alive),) = printed_before_shutdown
    assert "Traceback (most recent call last)" in stderr and str(error) in stderr.splitlines()[-1]
    assert peers_alive is False  # no barrier: the peers may never arrive


@pytest.mark.parametrize(
    "backend, peers_alive, destroyed",
    [
        ("nccl", False, False),  # could block on peers that never come
        ("cuda:nccl,cpu:gloo", False, False),
        ("gloo", False, True),
        ("nccl", True, True),
    ],
)
def test_after_a_failure_a_rank_leaves_an_nccl_group_to_the_process_exit(monkeypatch, backend, peers_alive, destroyed):
    import pretrain.distributed.runtime as runtime_module

    calls = []
    monkeypatch.setattr(runtime_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime_module.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(runtime_module.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(runtime_module.dist, "destroy_process_group", lambda: calls.append("destroy"))
    runtime_module.shutdown(Runtime(rank=0, world_size=2, device=torch.device("cpu"), label="GPU 0"), peers_alive)
    assert ("destroy" in calls) is destroyed
    assert ("barrier" in calls) is peers_alive


def test_the_throughput_window_leaves_out_a_checkpoint_save_between_two_step_lines():
    from pretrain.observe.step_line import Throughput

    speed = Throughput(
        tokens_per_step=1000, world_size=1, flops_per_token=1.0, peak_flops=None, device=torch.device("cpu"), window_start=0.0
    )
    ticks = iter([3.0, 8.0])  # the save runs from t=3 s to t=8 s
    speed.step_done()
    with speed.paused(clock=lambda: next(ticks)):
        pass
    speed.step_done()
    tokens_per_s, _, _ = speed.measure(now=10.0)  # 2 steps in 10 s, 5 of them saving
    assert tokens_per_s == pytest.approx(2 * 1000 / 5)
    assert (speed.window_start, speed.window_steps) == (10.0, 0)  # the next window starts clean


def test_ranks_plan_on_the_smallest_memory_any_of_them_reports(tmp_path):
    probe = (
        "import os, torch, torch.distributed as dist\n"
        "from pretrain.distributed.runtime import Runtime\n"
        "from pretrain.build import smallest_across_ranks\n"
        "rank = int(os.environ['RANK'])\n"
        "dist.init_process_group('gloo', rank=rank, world_size=2)\n"
        "runtime = Runtime(rank=rank, world_size=2, device=torch.device('cpu'), label=f'CPU {rank}')\n"
        "print(smallest_across_ranks(runtime, *((80, 500) if rank == 0 else (40, 900))))\n"
        "dist.destroy_process_group()\n"
        "from pretrain.distributed.runtime import exit_process; exit_process(0)\n"  # finalization can abort a gloo rank
    )
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", probe],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        )
        for rank in (0, 1)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [out.strip().splitlines()[-1] for out in outputs] == ["(40, 500)", "(40, 500)"], outputs


def recorded(run_dir, kind: str, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == kind}


@pytest.mark.slow
def test_one_rank_accumulating_two_micro_batches_reports_the_validation_loss_of_two_ranks(tmp_path):
    # The same global batch either way, so the same training; validation covers eval_batches global
    # batches, so the same windows too (evaluated at step 0, during training and after the last step).
    options = ("--max-steps", "2", "--set", "training.eval_interval=1")
    launcher = ["-m", "launcher", "--device", "cpu", "--nproc"]
    run_debug_training(tmp_path, [*launcher, "2"], tmp_path / "two", *options)
    run_debug_training(tmp_path, [*launcher, "1"], tmp_path / "one", *options, "--set", "training.grad_accum_nums=2")

    two, one = recorded(tmp_path / "two", "val", "val_loss"), recorded(tmp_path / "one", "val", "val_loss")
    assert sorted(two) == [0, 1, 2]
    assert recorded(tmp_path / "one", "train", "loss") == pytest.approx(recorded(tmp_path / "two", "train", "loss"), abs=1e-5)
    assert one == pytest.approx(two, abs=1e-5)  # float order differs: the last bits may
