"""Training metrics: throughput, model FLOPs utilisation (MFU), peak memory, and the
metrics log (<run dir>/metrics.jsonl, optionally TensorBoard events).

MFU here is model FLOPs (what the architecture needs per token, not what the hardware
actually ran: activation checkpointing and the recomputed chunked loss are not counted)
divided by the GPU's dense bf16 tensor-core peak, so it compares across implementations. With
float8 matmuls (training.float8) it is still counted against the bf16 peak, as torchtitan counts
it (the build's "Float8:" line says so): a float8 run's MFU can exceed a bf16 run's ceiling, and a
speed-up shows as a higher MFU on the same scale, not against the float8 peak (twice bf16's).

torch is imported only where a function needs it: the plot command reads metrics.jsonl
through this module and should not pay for importing torch (or need it installed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pretrain import registry
from pretrain.config import ModelConfig
from pretrain.plan.gpu_memory import embedding_parameter_count, parameter_count

if TYPE_CHECKING:
    import torch

    from pretrain.evaluation.hellaswag import Tally

# Dense (no structured sparsity) bf16 tensor-core peak FLOP/s per GPU, from NVIDIA's
# datasheets, which print the sparse figure: the dense one is half of it.
#   H100 / H100 NVL:  nvidia.com/en-us/data-center/h100/ (datasheet): SXM 1,979, PCIe 1,513, NVL 1,671 (sparse)
#   H200 / H200 NVL:  nvidia.com/en-us/data-center/h200/: SXM 1,979, NVL 1,671 (sparse)
#   GH200:            GH200 Grace Hopper Superchip datasheet: 1,979 (sparse)
#   B200 / GB200:     HGX B200 datasheet (36 PFLOPS for 8 GPUs) and GB200 NVL72 (360 PFLOPS for 72), sparse
#   A100 (SXM, PCIe, 40 and 80 GB): A100 datasheet, 312 dense
#   A30: 165 dense; A10: 125 dense; A40: 149.7 dense (their datasheets)
#   L4: 242 (sparse); L40: 181.05 dense with fp32 accumulate; L40S: 362.05 dense, datasheets
#   GeForce RTX 4090: Ada Lovelace architecture whitepaper, 165.2 dense with fp32 accumulate
#     (training accumulates in fp32; the 330 figure is fp16 accumulate).
# AMD Instinct, from AMD's data sheets (amd.com/en/products/accelerators/instinct/...), which print
# the dense figure and, for CDNA 3 and 4, the structured-sparsity one (twice it) beside it. Each
# figure is CUs x peak engine clock x bf16 FLOPs per CU per clock, which is how a partition's
# share is worked out below:
#   MI300X, MI325X: "Peak bfloat16 1307.4 TFLOPs" (2614.9 with structured sparsity); 304 CUs x
#     2100 MHz x 2048
#   MI355X: "Peak bfloat16 2.5 PFLOPs" (5 with structured sparsity); 256 CUs x 2400 MHz x 4096 =
#     2516.6 TFLOPs
#   MI250X: "Peak bfloat16 383 TFLOPs" (CDNA 2 has no sparsity figure) for the package, which is
#     two GCDs that ROCm shows as two GPUs of 110 CUs each (220 CUs x 1700 MHz x 1024): 191.5 per
#     GPU torch sees. The MI250's GCDs have 104 CUs at the same clock (362.1 for the package),
#     and ROCm may name both "AMD Instinct MI250X / MI250": the compute units tell them apart.
# ROCm's torch names them as the amdgpu driver's ids table does, "AMD Instinct MI300X" (variants:
# "... OAM", "... VF" for a virtual function, "... HF"), hence the word-bounded patterns; a ROCm
# that reports an empty or generic name ("AMD Radeon Graphics", seen on some setups) gets no MFU.
# A GPU split into compute partitions (CPX: an MI300X as 8 GPUs of 38 CUs) keeps its name, so for
# AMD entries the compute units the device reports scale the peak (peak_bf16_flops' compute_units).
# Deliberately absent: the A10G (AWS's variant has no NVIDIA datasheet, and published
# figures disagree), and GPUs without bf16 tensor cores (V100, T4). An unknown GPU shows
# no MFU rather than a wrong one. Patterns are searched case-insensitively in
# torch.cuda.get_device_name() and tried in order, so variants come before their family.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"\bGB200\b", 2.5e15),
    (r"\bB200\b", 2.25e15),
    (r"\bGH200\b", 989e12),
    (r"\bH200\b.*\bNVL\b", 835e12),
    (r"\bH200\b", 989e12),
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH100\b.*\b(PCIe|HBM2e)\b", 756e12),  # the PCIe card has HBM2e; some drivers name it by that
    (r"\bH100\b", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    (r"\bA100\b", 312e12),  # SXM and PCIe have the same tensor peak
    (r"\bA30\b", 165e12),
    (r"\bA40\b", 149.7e12),
    (r"\bA10\b", 125e12),  # \b: not A100, not A10G
    (r"\bL40S\b", 362e12),
    (r"\bL40\b", 181e12),
    (r"\bL4\b", 121e12),
    (r"\bRTX 4090$", 165e12),  # not "4090 D" or "4090 Laptop GPU", which are smaller chips
    (r"\bMI355X\b", 2516.6e12),
    (r"\bMI325X\b", 1307.4e12),
    (r"\bMI300X\b", 1307.4e12),  # not the MI300A (an APU, 228 CUs) or the MI308X (fewer CUs)
    (r"\bMI250X\b", 191.5e12),  # per GCD: ROCm shows each of the package's two as a GPU
)
COMPUTE_UNITS: dict[str, int] = {
    r"\bMI355X\b": 256,
    r"\bMI325X\b": 304,
    r"\bMI300X\b": 304,
    r"\bMI250X\b": 110,
}
"""The compute units behind an AMD entry's peak (per GPU as ROCm shows it): a device reporting
fewer (a compute partition; an MI250's 104-CU GCD under MI250X's name) gets that share of it."""


def peak_bf16_flops(device_name: str, compute_units: int | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU named as torch.cuda.get_device_name() names it;
    None when unknown, or for a MIG slice (which has only part of the GPU's compute).
    compute_units: the device's multi_processor_count, which ROCm reports as its compute units;
    for an AMD entry, a device with fewer than the whole GPU's (a compute partition) gets that
    share of the peak (same clock, fewer CUs). Ignored for NVIDIA entries (a MIG slice is named)."""
    name = device_name.strip()
    if re.search(r"\bMIG\b", name):
        return None
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            whole = COMPUTE_UNITS.get(pattern)
            if whole is not None and compute_units is not None and 0 < compute_units < whole:
                return flops * compute_units / whole
            return flops
    return None


def device_peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of the GPU device (peak_bf16_flops, with its name and the compute units
    it reports: on ROCm a compute partition keeps the whole GPU's name); None on a CPU."""
    if device.type != "cuda":
        return None
    import torch

    units = torch.cuda.get_device_properties(device).multi_processor_count
    return peak_bf16_flops(torch.cuda.get_device_name(device), units)


# --- FLOPs ------------------------------------------------------------------------------


def flops_per_token(model_cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length seq_len.

    6 N + 12 L d T (the PaLM paper's appendix B, as nanoGPT and torchtitan count): N is the
    parameters without the token embedding (a lookup, no matmul; the untied output projection
    is a matmul and counts), each costing 2 FLOPs forward and 4 backward per token; the
    attention scores and their weighted sum cost 12 L d T, with the causal mask counted in
    full (as if no work were skipped). seq_len is the trained sequence length
    (data.context_length), not model.max_seq_len. A feed-forward block that runs each token through
    part of its parameters (pretrain/registry.py, active_parameters) counts that part only.
    ValueError while model.vocab_size is null.
    """
    non_embedding = parameter_count(model_cfg) - embedding_parameter_count(model_cfg)
    feed_forward = registry.FEED_FORWARDS[model_cfg.feed_forward]
    if feed_forward.active_parameters is not None:  # a mixture of experts: a token runs through top_k of them
        non_embedding -= model_cfg.n_layers * (feed_forward.parameters(model_cfg) - feed_forward.active_parameters(model_cfg))
    return 6.0 * non_embedding + 12.0 * model_cfg.n_layers * model_cfg.dim * seq_len


def mfu(tokens_per_second_per_gpu: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction (0.42 is 42%); None when the peak is unknown."""
    if peak is None or peak <= 0:
        return None
    return tokens_per_second_per_gpu * flops_per_token / peak


# --- memory -----------------------------------------------------------------------------


def peak_memory_gib(device: torch.device) -> float | None:
    """Most memory allocated by tensors on a CUDA device since the last reset, in GiB
    (the caching allocator reserves more); None on CPU, where torch does not track it."""
    if device.type != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30


def reset_peak_memory(device: torch.device) -> None:
    """Start a new window for peak_memory_gib (a no-op on CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)


# --- the metrics log --------------------------------------------------------------------


def _number(value: Any) -> float | None:
    """A JSON-safe float: NaN and Inf become null (strict JSON has neither; jq and pandas
    read the file), and a 0-dim tensor becomes its value."""
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _end_of_last_line(out, size: int) -> int:
    """The offset just after the file's last newline (0 when it has none)."""
    position = size
    while position > 0:
        start = max(0, position - 65536)
        out.seek(start)
        cut = out.read(position - start).rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        position = start
    return 0


def _open_for_append(path: Path):
    """Open path for appending, first cutting a partial last line left by a killed writer,
    so the records a resumed run appends start on a line of their own. OSError when it cannot
    be opened (or cut)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out = open(path, "a+b")
    try:
        size = out.seek(0, os.SEEK_END)
        if size and (end := _end_of_last_line(out, size)) != size:  # (an append-only file refuses any truncate)
            out.truncate(end)
    except BaseException:
        out.close()
        raise
    return out


def _tensorboard_writer(log_dir: Path, logger: logging.Logger | None):
    """A SummaryWriter, or None when the tensorboard package is not installed or its directory
    cannot be written (said in one warning: the events are optional, the run goes on)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        if logger is not None:
            logger.debug(f"TensorBoard events not written: {error} (pip install tensorboard)")
        return None
    try:
        return SummaryWriter(log_dir=str(log_dir))
    except Exception as error:  # OSError, or the TensorFlow file layer's own errors where it is installed
        _warn_lost(logger, f"TensorBoard events in {log_dir}", error, "they are not recorded")
        return None


def _warn_lost(logger: logging.Logger | None, what: str, error: BaseException, lost: str) -> None:
    """The one warning for an optional output that cannot be written: it names the file and the
    reason, and says the run goes on."""
    if logger is not None:
        reason = (error.strerror if isinstance(error, OSError) else None) or str(error).strip() or type(error).__name__
        logger.warning(f"cannot write {what}: {reason}; {lost}; training goes on")


class MetricsLog:
    """One JSON object per line in <run_dir>/metrics.jsonl, flushed per line; with
    tensorboard, the same scalars as TensorBoard events in <run_dir>/tensorboard/.

    Only rank 0 should be enabled: a disabled log writes and creates nothing. A resumed run
    appends to the same file, so a step may appear twice; readers keep the later record.
    Neither output is worth a run: a file or directory that cannot be opened or written (full
    disk, permissions, an immutable file, a directory in its place) is one warning naming it,
    and the run goes on without it.
    """

    def __init__(
        self, run_dir: Path, enabled: bool, tensorboard: bool, logger: logging.Logger | None = None, wandb: Any = None
    ) -> None:
        """wandb: a pretrain.observe.wandb_log.WandbRun, which gets the same scalars (rank 0's)."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._logger = logger
        self._file = self._open() if enabled else None
        self._tensorboard_dir = Path(run_dir) / "tensorboard"
        self._writer = _tensorboard_writer(self._tensorboard_dir, logger) if enabled and tensorboard else None
        self._wandb = wandb if enabled else None

    def log_train(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float | None,
        tokens_per_s: float | None,
        mfu: float | None,
        peak_memory_gib: float | None,
        elapsed_s: float | None,
        aux_losses: dict[str, float] | None = None,
    ) -> None:
        """The optimizer step taken from the weights after step steps (checkpoint step_<step>'s, as
        every record at that step measures): its loss and gradient norm are theirs, lr the rate it
        updates them with. mfu is a fraction, elapsed_s the seconds since training started;
        aux_losses the weighted auxiliary losses by name (a mixture of experts' load balancing)."""
        scalars = {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "peak_memory_gib": peak_memory_gib,
            **(aux_losses or {}),
        }
        self._write({"kind": "train", "step": int(step), **scalars, "elapsed_s": elapsed_s})
        self._scalars("train", step, scalars)

    def log_val(self, step: int, val_loss: float) -> None:
        """The validation loss of the weights after step steps (checkpoint step_<step>'s)."""
        self._write({"kind": "val", "step": int(step), "val_loss": val_loss})
        self._scalars("val", step, {"loss": val_loss})

    def log_task(self, task: str, step: int, tally: Tally) -> None:
        """A benchmark's result (pretrain/evaluation/hellaswag.py) with the weights after step steps
        (checkpoint step_<step>'s)."""
        scalars = {"accuracy": tally.accuracy, "accuracy_norm": tally.accuracy_norm, "examples": tally.examples}
        self._write({"kind": task, "step": int(step), **scalars})
        self._scalars(task, step, scalars)

    def log_goodput(self, step: int, ledger: dict[str, Any] | None) -> None:
        """The goodput ledger so far (pretrain/observe/goodput.py): goodput (a fraction), the wall
        seconds and each part's seconds; None (another rank, or no ledger) writes nothing."""
        if ledger is None:
            return
        scalars = {"goodput": ledger["goodput"], "wall_s": ledger["wall_s"]}
        scalars |= {f"{part}_s": seconds for part, seconds in ledger["parts_s"].items()}
        self._write({"kind": "goodput", "step": int(step), **scalars})
        self._scalars("goodput", step, scalars)

    def log_checkpoint(self, step: int, tier: str, asynchronous: bool, stall_s: float, write_s: float, path: str) -> None:
        """A completed checkpoint save after step steps, to tier ("durable" or "local"): stall_s the
        seconds the training thread was blocked for it (staging, waiting for the save before it, or
        the whole write when synchronous), write_s from its staging to its completion. One record:
        {"kind": "checkpoint", "step": N, "checkpoint": {"step", "tier", "async", "stall_s", "write_s", "path"}}."""
        seconds = {"stall_s": round(stall_s, 3), "write_s": round(write_s, 3)}
        entry = {"step": int(step), "tier": tier, "async": asynchronous, **seconds, "path": path}
        self._write({"kind": "checkpoint", "step": int(step), "checkpoint": entry})
        self._scalars("checkpoint", step, seconds)

    def _open(self):
        """metrics.jsonl opened for appending; None, said in one warning, when it cannot be."""
        try:
            return _open_for_append(self.path)
        except OSError as error:
            _warn_lost(self._logger, str(self.path), error, "metrics are not recorded there")
            return None

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        record = {key: value if key in ("kind", "step", "checkpoint") else _number(value) for key, value in record.items()}
        record["time"] = round(time.time(), 3)  # wall clock: tells the runs of a resumed file apart
        try:
            self._file.write(json.dumps(record, allow_nan=False).encode() + b"\n")
            self._file.flush()  # a reader (the plot command, tail -f) sees whole lines as they come
        except OSError as error:
            # A full disk (ENOSPC, EIO, EDQUOT) costs the metrics, not the run: its
            # checkpoints are what matter, and their own write errors stop it.
            self._stop_writing(error)

    def _stop_writing(self, error: OSError) -> None:
        """Close metrics.jsonl after a failed write, and say so once."""
        file, self._file = self._file, None
        with contextlib.suppress(OSError):  # close flushes the line that failed again
            if file is not None:
                file.close()
        _warn_lost(self._logger, str(self.path), error, "metrics are no longer recorded there")

    def _scalars(self, section: str, step: int, values: dict[str, Any]) -> None:
        if self._wandb is not None:
            self._wandb.log(section, step, {name: _number(value) for name, value in values.items()})
        if self._writer is None:
            return
        try:
            for name, value in values.items():
                number = _number(value)
                if number is not None:
                    self._writer.add_scalar(f"{section}/{name}", number, global_step=int(step))
        except Exception as error:  # as in _tensorboard_writer
            writer, self._writer = self._writer, None
            with contextlib.suppress(Exception):
                writer.close()
            _warn_lost(self._logger, f"TensorBoard events in {self._tensorboard_dir}", error, "they are no longer recorded")

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):  # every line was flushed as written (or reported)
                self._file.close()
            self._file = None
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()  # flushes the events still queued
            except Exception as error:  # as in _tensorboard_writer
                _warn_lost(self._logger, f"TensorBoard events in {self._tensorboard_dir}", error, "the last of them are lost")
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in file order.

    A last line without its newline that does not parse is a record being written (or cut
    off by a kill) and is skipped. Any other line that is not a JSON object is corruption:
    ValueError naming the file and line number."""
    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    unfinished = lines.pop()  # "" when the file ends with a newline
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            records.append(_parse_line(line, path, number))
    if unfinished.strip():
        try:
            records.append(_parse_line(unfinished, path, len(lines) + 1))
        except ValueError:
            pass
    return records


def _parse_line(line: str, path: Path, number: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: line {number} is not valid JSON ({error.msg}); delete or fix that line") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: line {number} is not a JSON object; delete or fix that line")
    return record
