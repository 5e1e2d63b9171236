"""Metrics: the GPU peak table, FLOPs per token, MFU, memory, metrics.jsonl and TensorBoard."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from support.checkpointing import make_trainer
from support.runs import as_nobody
from pretrain import config as cfg
from pretrain.config import ModelConfig
from pretrain.observe.metrics import (
    MetricsLog,
    device_peak_flops,
    flops_per_token,
    mfu,
    peak_bf16_flops,
    peak_memory_gib,
    read_metrics,
    reset_peak_memory,
)
from pretrain.model.transformer import Transformer
from pretrain.train import train_step

TINY = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=257, rope_theta=10000.0, max_seq_len=32)


# --- the peak table -------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40", 181e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("AMD Instinct MI300X", 1307.4e12),
        ("AMD Instinct MI300X OAM", 1307.4e12),
        ("AMD Instinct MI300X VF", 1307.4e12),  # a virtual function (SR-IOV), as cloud VMs name it
        ("AMD Instinct MI325X", 1307.4e12),
        ("AMD Instinct MI355X", 2516.6e12),
        ("AMD Instinct MI250X", 191.5e12),  # one of the package's two GCDs, which ROCm shows as a GPU each
        ("AMD Instinct MI250X / MI250", 191.5e12),
    ],
)
def test_known_gpus_get_their_dense_bf16_peak(name, peak):
    assert peak_bf16_flops(name) == peak


@pytest.mark.parametrize(
    "name",
    [
        "Tesla V100-SXM2-16GB",  # no bf16 tensor cores
        "Tesla T4",
        "NVIDIA A10G",  # no NVIDIA datasheet: left out rather than guessed
        "NVIDIA GeForce RTX 4090 D",  # a cut-down 4090, not the 4090's peak
        "NVIDIA GeForce RTX 4090 Laptop GPU",
        "NVIDIA A100-SXM4-40GB MIG 1g.5gb",  # a slice of a GPU has a slice of its compute
        "AMD Instinct MI300A",  # an APU with fewer CUs than the MI300X
        "AMD Instinct MI308X",
        "AMD Radeon Graphics",  # the generic name some ROCm setups report
        "",
    ],
)
def test_unknown_gpus_and_gpu_slices_have_no_peak_and_so_no_mfu(name):
    assert peak_bf16_flops(name) is None
    assert mfu(10_000.0, 1e9, peak_bf16_flops(name)) is None


def test_an_amd_compute_partition_gets_its_share_of_the_gpus_peak():
    assert peak_bf16_flops("AMD Instinct MI300X", compute_units=304) == 1307.4e12
    assert peak_bf16_flops("AMD Instinct MI300X", compute_units=38) == pytest.approx(1307.4e12 / 8)  # CPX: 8 partitions
    assert peak_bf16_flops("AMD Instinct MI355X", compute_units=128) == pytest.approx(2516.6e12 / 2)  # DPX
    # the MI250's GCD (104 CUs, same clock) under the shared name: AMD's 362.1 TFLOPs over two GCDs
    assert peak_bf16_flops("AMD Instinct MI250X / MI250", compute_units=104) == pytest.approx(362.1e12 / 2, rel=1e-3)


def test_an_nvidia_gpus_peak_ignores_its_streaming_multiprocessor_count():
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3", compute_units=132) == 989e12
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3", compute_units=16) == 989e12


def test_the_device_peak_reads_the_name_and_compute_units_torch_reports(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "AMD Instinct MI300X")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(multi_processor_count=38))
    assert device_peak_flops(torch.device("cuda", 0)) == pytest.approx(1307.4e12 / 8)
    assert device_peak_flops(torch.device("cpu")) is None


def test_mfu_is_achieved_model_flops_over_the_peak_as_a_fraction():
    assert mfu(1_000.0, 6e9, 1e13) == pytest.approx(0.6)
    assert mfu(1_000.0, 6e9, 0.0) is None


# --- FLOPs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model_cfg",
    [
        TINY,
        dataclasses.replace(TINY, n_kv_heads=4, ffn_dim=96, vocab_size=300),  # no grouping
        dataclasses.replace(TINY, n_layers=3, n_heads=8, n_kv_heads=1),  # one key/value head
    ],
)
def test_flops_count_every_parameter_of_the_built_model_but_the_embedding(model_cfg):
    model = Transformer(model_cfg, max_seq_len=8)
    non_embedding = model.num_params() - model.tok_embed.weight.numel()
    attention = 12 * model_cfg.n_layers * model_cfg.dim * 32
    assert flops_per_token(model_cfg, seq_len=32) == 6 * non_embedding + attention


def test_the_production_preset_costs_the_flops_of_llama_3_8b():
    # Meta's 8,030,261,248 parameters less the 128,256 x 4,096 embedding
    assert flops_per_token(cfg.production().model, seq_len=1) == 6 * (8_030_261_248 - 128_256 * 4096) + 12 * 32 * 4096


def test_flops_per_token_is_six_per_non_embedding_parameter_plus_full_attention():
    per_layer = (
        64 * 64 * 2  # wqkv's query rows (wq's), wo
        + 64 * 32 * 2  # wqkv's key and value rows (wk's, wv's): 2 kv heads of 16
        + 3 * 64 * 128  # w13 (w1's and w3's rows), w2
        + 2 * 64
    )  # two RMSNorm weights
    non_embedding = 2 * per_layer + 64 + 257 * 64  # layers, final norm, output projection
    attention = 12 * 2 * 64 * 32  # 12 x layers x dim x seq_len
    assert non_embedding == 90_496
    assert flops_per_token(TINY, seq_len=32) == 6 * 90_496 + attention == 592_128


def test_flops_per_token_grows_with_the_sequence_length_through_attention_only():
    assert flops_per_token(TINY, 64) - flops_per_token(TINY, 32) == 12 * 2 * 64 * 32


def test_flops_need_a_known_vocabulary():
    with pytest.raises(ValueError, match="vocab_size"):
        flops_per_token(dataclasses.replace(TINY, vocab_size=None), 32)


# --- memory ---------------------------------------------------------------------------


def test_peak_memory_is_unknown_on_cpu():
    reset_peak_memory(torch.device("cpu"))
    assert peak_memory_gib(torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_peak_memory_sees_an_allocation_and_forgets_it_after_a_reset():
    device = torch.device("cuda", 0)
    block = torch.empty(2**28, dtype=torch.uint8, device=device)  # 0.25 GiB
    assert peak_memory_gib(device) >= 0.25
    del block
    reset_peak_memory(device)
    assert peak_memory_gib(device) < 0.25


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_this_machines_gpu_is_in_the_peak_table():
    name = torch.cuda.get_device_name()
    assert peak_bf16_flops(name) is not None, f"{name!r} is missing from PEAK_BF16_FLOPS"


# --- metrics.jsonl --------------------------------------------------------------------


def log_two_steps(log: MetricsLog) -> None:
    log.log_train(0, 5.5, 1e-3, 2.0, 12_000.0, 0.41, 3.5, 1.25)
    log.log_train(1, 5.0, 2e-3, None, None, None, None, 2.5)
    log.log_val(1, 5.25)


def test_each_record_is_one_json_line_readable_before_the_log_is_closed(tmp_path):
    with MetricsLog(tmp_path, enabled=True, tensorboard=False) as log:
        log_two_steps(log)
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # flushed per line
    assert [json.loads(line)["kind"] for line in lines] == ["train", "train", "val"]
    first, second, val = read_metrics(tmp_path / "metrics.jsonl")
    assert {k: first[k] for k in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_memory_gib", "elapsed_s")} == {
        "step": 0,
        "loss": 5.5,
        "lr": 1e-3,
        "grad_norm": 2.0,
        "tokens_per_s": 12_000.0,
        "mfu": 0.41,
        "peak_memory_gib": 3.5,
        "elapsed_s": 1.25,
    }
    assert second["grad_norm"] is None and second["mfu"] is None and second["peak_memory_gib"] is None
    assert val == {"kind": "val", "step": 1, "val_loss": 5.25, "time": val["time"]}


def test_non_finite_values_and_tensors_are_written_as_strict_json(tmp_path):
    with MetricsLog(tmp_path, enabled=True, tensorboard=False) as log:
        log.log_train(0, float("nan"), 1e-3, torch.tensor(float("inf")), 1.0, None, None, 0.0)
        log.log_train(1, torch.tensor(4.5), 1e-3, torch.tensor(0.5), 1.0, None, None, 0.0)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) for line in lines]
    assert records[0]["loss"] is None and records[0]["grad_norm"] is None
    assert records[1]["loss"] == 4.5 and records[1]["grad_norm"] == 0.5


def test_a_disabled_log_writes_and_creates_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsLog(run_dir, enabled=False, tensorboard=True) as log:
        log_two_steps(log)
    assert not run_dir.exists()


def test_a_reopened_log_appends_to_the_same_file(tmp_path):
    with MetricsLog(tmp_path, enabled=True, tensorboard=False) as log:
        log_two_steps(log)
    with MetricsLog(tmp_path, enabled=True, tensorboard=False) as log:
        log.log_train(2, 4.0, 1e-3, 1.0, 1.0, None, None, 3.0)
    assert [(r["kind"], r["step"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        ("train", 0),
        ("train", 1),
        ("val", 1),
        ("train", 2),
    ]


def test_a_reopened_log_drops_the_partial_line_a_killed_writer_left(tmp_path):
    with MetricsLog(tmp_path, enabled=True, tensorboard=False) as log:
        log_two_steps(log)
    with open(tmp_path / "metrics.jsonl", "a") as out:
        out.write('{"kind": "train", "step": 2, "lo')  # killed mid-line
    with MetricsLog(tmp_path, enabled=True, tensorboard=False) as log:
        log.log_train(2, 4.0, 1e-3, 1.0, 1.0, None, None, 3.0)
    records = read_metrics(tmp_path / "metrics.jsonl")  # no corrupt line in the middle
    assert [(r["kind"], r["step"]) for r in records] == [("train", 0), ("train", 1), ("val", 1), ("train", 2)]
    assert records[-1]["loss"] == 4.0


def test_reading_skips_a_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 0, "loss": 5.0}\n{"kind": "train", "step": 1, "lo')
    assert read_metrics(path) == [{"kind": "train", "step": 0, "loss": 5.0}]


def test_reading_keeps_a_complete_last_line_without_its_newline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 0}\n{"kind": "val", "step": 0, "val_loss": 5.0}')
    assert [r["kind"] for r in read_metrics(path)] == ["train", "val"]


@pytest.mark.parametrize("bad_line", ['{"kind": "train", "st', "[1, 2]", "\udcff garbage"])
def test_reading_rejects_a_corrupt_line_before_the_last_naming_its_number(tmp_path, bad_line):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        ('{"kind": "train", "step": 0}\n' + bad_line + '\n{"kind": "train", "step": 1}\n').encode(
            "utf-8", errors="surrogateescape"
        )
    )
    with pytest.raises(ValueError, match=r"line 2\b") as excinfo:
        read_metrics(path)
    assert "\n" not in str(excinfo.value)


# --- TensorBoard ----------------------------------------------------------------------


def test_tensorboard_events_are_written_when_the_package_is_installed(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    with MetricsLog(tmp_path, enabled=True, tensorboard=True) as log:
        log_two_steps(log)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3


def test_tensorboard_without_the_package_is_skipped_with_one_debug_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes its import fail
    logger = logging.getLogger("test-metrics")
    with caplog.at_level(logging.DEBUG, logger="test-metrics"):
        with MetricsLog(tmp_path, enabled=True, tensorboard=True, logger=logger) as log:
            log_two_steps(log)
    assert not (tmp_path / "tensorboard").exists()
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert "tensorboard" in caplog.records[0].getMessage().lower()


# --- a metrics.jsonl that cannot be opened: one warning, the run goes on ---------------------


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    """chattr +i: not even root may write, append to or remove path; undone on the way out."""
    path.write_text('{"kind": "train", "step": 0}\n')
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"chattr +i does not work here ({made.stderr.strip()}): the test needs an ext4-like file system")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@contextlib.contextmanager
def a_directory(path: Path) -> Iterator[None]:
    path.mkdir()
    yield


UNWRITABLE = {"an immutable file": (immutable, "Operation not permitted"), "a directory": (a_directory, "Is a directory")}


@pytest.mark.parametrize("kind", UNWRITABLE)
def test_a_metrics_file_that_cannot_be_opened_is_one_warning_naming_it_and_the_log_goes_on(tmp_path, caplog, kind):
    make, reason = UNWRITABLE[kind]
    logger = logging.getLogger("test-metrics")
    with make(tmp_path / "metrics.jsonl"), caplog.at_level(logging.WARNING, logger="test-metrics"):
        with MetricsLog(tmp_path, enabled=True, tensorboard=False, logger=logger) as log:
            log_two_steps(log)
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot write {tmp_path / 'metrics.jsonl'}: {reason}; metrics are not recorded there; training goes on"
    ]


def warnings_as_nobody(run_dir: Path) -> str:
    """The warnings a MetricsLog of run_dir gives when uid and gid 65534 open it and log a step."""

    def open_and_log() -> str:
        messages: list[str] = []
        logger = logging.getLogger("test-metrics-nobody")
        logger.addHandler(logging.Handler())
        logger.handlers[-1].emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
        with MetricsLog(run_dir, enabled=True, tensorboard=False, logger=logger) as log:
            log_two_steps(log)
        return "\n".join(messages)

    return as_nobody(open_and_log)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as another user (nobody)")
def test_a_metrics_file_another_user_owns_is_one_warning_for_a_run_that_is_not_root():
    with tempfile.TemporaryDirectory() as name:  # in /tmp: pytest's own are closed to other users
        run = Path(name)
        run.chmod(0o755)
        (run / "metrics.jsonl").write_text("")  # root's, 0644
        assert warnings_as_nobody(run) == (
            f"cannot write {run / 'metrics.jsonl'}: Permission denied; metrics are not recorded there; training goes on"
        )


class _Writer:
    """torch.utils.tensorboard's SummaryWriter as far as the log uses it, making its directory as
    the real one does (the tensorboard package is not installed everywhere)."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir, self.closed = log_dir, False

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        (Path(self.log_dir) / "events").open("a").write(f"{tag} {value} {global_step}\n")

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_tensorboard(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=_Writer))


def test_a_tensorboard_directory_that_cannot_be_made_is_one_warning_and_the_metrics_file_goes_on(
    tmp_path, caplog, fake_tensorboard
):
    (tmp_path / "tensorboard").write_text("a file in its place")
    logger = logging.getLogger("test-metrics")
    with caplog.at_level(logging.WARNING, logger="test-metrics"):
        with MetricsLog(tmp_path, enabled=True, tensorboard=True, logger=logger) as log:
            log_two_steps(log)
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot write TensorBoard events in {tmp_path / 'tensorboard'}: File exists; they are not recorded; training goes on"
    ]
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3


def test_tensorboard_events_that_cannot_be_written_are_one_warning_and_the_writer_is_closed(tmp_path, caplog, fake_tensorboard):
    logger = logging.getLogger("test-metrics")
    with caplog.at_level(logging.WARNING, logger="test-metrics"):
        with MetricsLog(tmp_path, enabled=True, tensorboard=True, logger=logger) as log:
            writer = log._writer
            (tmp_path / "tensorboard").rename(tmp_path / "gone")  # its directory taken away while the run writes
            log_two_steps(log)
    assert writer.closed
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot write TensorBoard events in {tmp_path / 'tensorboard'}: No such file or directory; "
        "they are no longer recorded; training goes on"
    ]
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_a_run_whose_metrics_file_is_immutable_trains_without_it(cache, tmp_path, capfd):
    # The case the issue reports: such a file stopped the run before step 0.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with immutable(run_dir / "metrics.jsonl"):
        trainer = make_trainer(cache, run_dir)
        with trainer.metrics:
            for step in range(2):
                train_step(trainer, step)
                trainer.metrics.log_train(step, 1.0, 1e-3, None, None, None, None, None)
        assert (run_dir / "metrics.jsonl").read_text() == '{"kind": "train", "step": 0}\n'  # untouched
    captured = capfd.readouterr()
    assert (captured.out + captured.err).count(f"cannot write {run_dir / 'metrics.jsonl'}: Operation not permitted") == 1
