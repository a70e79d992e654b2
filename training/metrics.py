"""Per-step metrics as JSON lines, and a rich progress bar.

One line per training step in the metrics file, for instance::

    {"step": 12, "loss": 3.91, "learning_rate": 0.0012, "grad_norm": 0.83,
     "accuracy": 0.21, "loss_weight_sum": 2011.0, "tokens_per_s": 18233.4,
     "step_time_s": 0.112, "data_wait_s": 0.0004,
     "model_flops_per_token": 984192.0, "tflops_per_s_per_device": 0.0179,
     "mfu": null}

``step`` is the 0-based index of the step (it trained on global batch ``step``);
loss is in nats per token (weighted by loss weights); ``tokens_per_s`` counts all
B * L tokens of the global batch, padding included, per second of wall time
between two consecutive completed steps (``step_time_s``); ``data_wait_s`` is the
host time spent inside the feeder's ``next`` for that step's batch.
``model_flops_per_token`` is the step's model FLOPs (forward and backward,
``seqcache.training.flops.model_flops_per_step``) per token,
``tflops_per_s_per_device`` those FLOPs per second of ``step_time_s`` per chip of
the mesh, in TFLOP/s, and ``mfu`` that rate over the chip's dense bf16 peak (a
fraction; null where the device's peak is unknown, e.g. on CPU). Eval lines
carry ``eval_loss``, ``eval_accuracy``, ``eval_tokens`` (sum of loss weights) and
``eval_batches`` instead.

The same values go to TensorBoard event files (``TensorBoardWriter``; no
TensorFlow needed) next to the metrics file, at the line's ``step``:
``train/<name>`` for a step's line (``train/loss``), ``eval/<name>`` without the
``eval_`` prefix for an evaluation's (``eval/loss``); a null value (``mfu`` on
CPU) is left out.

Every line is strict JSON: a NaN or infinite value (the loss of a step that
diverged, before the run stops on it; a task metric that returned NaN) is
written as null, as in ``seqcache train``'s and ``seqcache eval``'s summaries
and in metrics.json; TensorBoard gets the value as it is.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import struct
import time
from typing import Any, Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

# The folder of event files, next to the metrics file.
TENSORBOARD_DIR = "tensorboard"


class MetricsWriter:
    """Appends one JSON object per line to ``path`` (None: nothing), flushed
    every line so a preempted run keeps every completed step; with
    ``tensorboard_dir`` also to event files there (``TensorBoardWriter``, which
    ``start_step`` is for)."""

    def __init__(self, path: str | None, *, tensorboard_dir: str | None = None, start_step: int = 0):
        self.path = path
        self._file = None
        self.tensorboard = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")
        if tensorboard_dir:
            self.tensorboard = TensorBoardWriter(tensorboard_dir, start_step=start_step)

    def write(self, record: Mapping[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(strict_json(dict(record)), sort_keys=True, allow_nan=False) + "\n")
            self._file.flush()
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def strict_json(value):
    """``value`` (dicts, lists and tuples within) with every NaN and infinite number as None
    (numpy scalars as Python numbers)."""
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    return float(value) if math.isfinite(value) else None


def tensorboard_tag(name: str) -> str:
    """``loss`` -> ``train/loss``, ``eval_loss`` -> ``eval/loss``."""
    return f"eval/{name[len('eval_'):]}" if name.startswith("eval_") else f"train/{name}"


class TensorBoardWriter:
    """One metrics record -> one TensorBoard scalar per numeric field at step
    ``record["step"]`` (tags: see the module docstring), through tensorboardX's
    ``SummaryWriter`` into ``logdir``; flushed after every record. Non-finite
    values are written as they are.

    A run resumed at ``start_step`` > 0 writes a new event file that drops the
    earlier files' values from that step on (``purge_step``), so steps trained
    again after a preemption are shown once.

    Raises:
      ModuleNotFoundError: tensorboardX is not installed (the ``train`` extra
        installs it); the message says so.
    """

    def __init__(self, logdir: str, *, start_step: int = 0):
        try:
            from tensorboardX import SummaryWriter  # optional: tensorboardX (the message names the extra)
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                "TensorBoard event files need tensorboardX: pip install 'seqcache[train]' (or tensorboardX), or "
                "turn them off (seqcache train --no-tensorboard, config tensorboard=false)", name=e.name) from None
        self.logdir = logdir
        os.makedirs(logdir, exist_ok=True)
        # tensorboardX names a file by the second it was opened and the host: a run
        # resumed within the same second would reopen, and truncate, the earlier
        # file. The suffix (nanoseconds, fixed width) keeps each file apart and in
        # creation order by name, the order TensorBoard reads them in.
        self._writer = SummaryWriter(logdir=logdir, purge_step=int(start_step) if start_step else None,
                                     flush_secs=3600, filename_suffix=f".{time.time_ns():020d}")

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for name, value in record.items():
            if name == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self._writer.add_scalar(tensorboard_tag(name), float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_tensorboard(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files of ``logdir``: tag -> [(step, value)] in
    file order (by name, i.e. creation time), read with tensorboardX's ``Event``
    protobuf; no TensorFlow."""
    from tensorboardX.proto import event_pb2  # optional: tensorboardX

    out: dict[str, list[tuple[int, float]]] = {}
    names = sorted(n for n in os.listdir(logdir) if n.startswith("events.out.tfevents."))
    for name in names:
        with open(os.path.join(logdir, name), "rb") as f:
            data = f.read()
        offset = 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            start = offset + 12  # length, then its masked crc32c
            event = event_pb2.Event.FromString(data[start:start + length])
            offset = start + length + 4  # the data, then its masked crc32c
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((int(event.step), float(v.simple_value)))
    return out


def read_metrics(path: str) -> list[dict]:
    """All records of a metrics file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class ProgressBar:
    """A rich progress bar on stderr over steps [start, total) with loss, tokens/s,
    model TFLOP/s per chip and MFU ("-" when unknown); a no-op unless ``enabled``."""

    def __init__(self, *, total: int, start: int, enabled: bool):
        self._progress = None
        if not enabled:
            return
        self._progress = Progress(
            TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"), TextColumn("{task.fields[tflops]} TFLOP/s/chip"),
            TextColumn("MFU {task.fields[mfu]}"), TimeRemainingColumn(), console=Console(stderr=True))
        self._task = self._progress.add_task("train", total=total, completed=start, loss="-", tps="-",
                                             tflops="-", mfu="-")
        self._progress.start()

    def update(self, *, completed: int, loss: float, tokens_per_s: float,
               tflops_per_s_per_device: float | None = None, mfu: float | None = None) -> None:
        """Shows step ``completed``'s values; a None TFLOP/s or MFU shows "-"."""
        if self._progress is not None:
            self._progress.update(
                self._task, completed=completed, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}",
                tflops="-" if tflops_per_s_per_device is None else f"{tflops_per_s_per_device:,.3g}",
                mfu="-" if mfu is None else f"{mfu:.1%}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
