"""Per-step metrics as JSON lines, and a rich progress bar.

One line per training step in the metrics file, for instance::

    {"step": 12, "loss": 3.91, "learning_rate": 0.0012, "grad_norm": 0.83,
     "accuracy": 0.21, "loss_weight_sum": 2011.0, "tokens_per_s": 18233.4,
     "step_time_s": 0.112, "data_wait_s": 0.0004}

``step`` is the 0-based index of the step (it trained on global batch ``step``);
loss is in nats per token (weighted by loss weights); ``tokens_per_s`` counts all
B * L tokens of the global batch, padding included, per second of wall time
between two consecutive completed steps (``step_time_s``); ``data_wait_s`` is the
host time spent inside the feeder's ``next`` for that step's batch. Eval lines
carry ``eval_loss``, ``eval_accuracy``, ``eval_tokens`` (sum of loss weights) and
``eval_batches`` instead.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping


class MetricsWriter:
    """Appends one JSON object per line to ``path`` (flushed every line, so a
    preempted run keeps every completed step). ``path`` None writes nothing."""

    def __init__(self, path: str | None):
        self.path = path
        self._file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(dict(record), sort_keys=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str) -> list[dict]:
    """All records of a metrics file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class ProgressBar:
    """A rich progress bar over steps [start, total) showing loss and tokens/s,
    on stderr. Disabled (a no-op) when ``enabled`` is False."""

    def __init__(self, *, total: int, start: int, enabled: bool):
        self._progress = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._task = self._progress.add_task("train", total=total, completed=start, loss="-", tps="-")
        self._progress.start()

    def update(self, *, completed: int, loss: float, tokens_per_s: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
