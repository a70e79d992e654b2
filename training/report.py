"""What a run reports and writes beside its checkpoints: the result of ``fit``,
the parameter digest, the compiled program's memory analysis, and the run's
files (config.json, metrics.jsonl, the TensorBoard folder)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from seqcache import fs
from seqcache.training import config as config_lib
from seqcache.training.metrics import TENSORBOARD_DIR

log = logging.getLogger("seqcache.training")

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


@dataclasses.dataclass(kw_only=True)
class TrainResult:
    """What ``Trainer.fit`` did.

    Attributes:
      start_step: the step training (re)started at (0, or a restored checkpoint's).
      end_step: number of updates applied when ``fit`` returned.
      metrics: one dict per step trained in this call (as in the metrics file).
      eval: the last evaluation's metrics, or None.
      stopped_by_signal: SIGTERM (or a multi-host preemption notice) stopped the
        run after saving a checkpoint.
      data_exhausted: the feeder's stream ended before ``config.steps``.
      compile_time_s: seconds to lower and compile the train step.
      memory_analysis: ``memory_analysis_dict`` of the train step.
      params, opt_state: the final state (sharded jax.Arrays).
    """

    start_step: int
    end_step: int
    metrics: list[dict]
    eval: dict | None
    stopped_by_signal: bool
    data_exhausted: bool
    compile_time_s: float
    memory_analysis: dict
    params: Any
    opt_state: Any

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]


def params_digest(params) -> str:
    """sha256 (hex) of every parameter's path, dtype, shape and bytes, in path
    order: two runs with the same digest have bit-identical parameters, whatever
    their shardings or how many hosts hold them."""
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            # Sharded over several hosts: every host gathers the whole array (every
            # host must call this function).
            value = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        else:
            value = np.asarray(jax.device_get(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(f"{value.dtype}{value.shape}".encode())
        h.update(value.tobytes())
    return h.hexdigest()


def ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> "0..2, 5..6"."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}..{v}" if v != start else str(v))
            start = None
    return ", ".join(out) or "none"


def memory_analysis_dict(compiled) -> dict:
    """``compiled.memory_analysis()`` as ``{field: bytes}`` (empty if unavailable)."""
    try:
        stats = compiled.memory_analysis()
    except Exception as e:  # some backends do not implement it
        log.info("memory analysis unavailable: %s", e)
        return {}
    values = {} if stats is None else {n: getattr(stats, n) for n in dir(stats) if n.endswith("_in_bytes")}
    return {n: int(v) for n, v in values.items() if isinstance(v, (int, np.integer))}


# The memory_analysis fields logged after compiling, with their labels.
_MEMORY_FIELDS = (
    ("argument_size_in_bytes", "arguments"),
    ("output_size_in_bytes", "outputs"),
    ("alias_size_in_bytes", "aliased"),
    ("temp_size_in_bytes", "temporaries"),
    ("generated_code_size_in_bytes", "code"),
    ("peak_memory_in_bytes", "peak"),
)


def format_memory_analysis(memory: Mapping[str, int]) -> str:
    """One log line of a compiled program's device memory in MB (10^6 bytes), e.g.
    "arguments 7.5 MB, outputs 7.4 MB, temporaries 1,396.9 MB, peak 7.5 MB";
    fields absent or zero are left out (except arguments and outputs)."""
    parts = []
    for key, label in _MEMORY_FIELDS:
        value = memory.get(key)
        if value is None or (value == 0 and label not in ("arguments", "outputs")):
            continue
        parts.append(f"{label} {value / 1e6:,.1f} MB")
    return ", ".join(parts) if parts else "unavailable"


def write_json_atomic(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fs.write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"), fsync=False)


def tensorboard_dir_for(config: config_lib.TrainConfig, metrics_path: str | None) -> str | None:
    """Where a run writes its TensorBoard event files: the folder ``tensorboard``
    next to its metrics file, or None (``config.tensorboard`` off, or no metrics file)."""
    return os.path.join(os.path.dirname(metrics_path), TENSORBOARD_DIR) if config.tensorboard and metrics_path else None


def metrics_path_for(config: config_lib.TrainConfig) -> str | None:
    """``config.metrics_file``, else ``<checkpoint dir>/metrics.jsonl``, else None."""
    ckpt_dir = config.checkpoint.directory
    return config.metrics_file or (os.path.join(ckpt_dir, METRICS_FILE) if ckpt_dir else None)
