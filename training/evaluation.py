"""The Evaluator: a trained model's predictions over a cached eval split, the
task's metrics on them, and the files that record both (seqio's Evaluator and
t5x's eval/infer, on seqcache's caches and feeders).

For each task (one cache folder; a mixture is evaluated per task), every
example of the split is read exactly once through ``seqcache.feeders.Feeder``
(``num_epochs=1``): each process reads only its own rows of each global batch,
and the last, partial batch is padded with rows whose cache index is -1, which
are decoded with the others (every process runs every compiled call) and then
dropped. Each batch is decoded with ``seqcache.training.decoding.predict`` and,
when the task has score metrics, scored with ``decoding.score``; token ids are
turned into text with the cache's own vocabulary (a prediction ends at its
first EOS id); ``seqcache.tasks.metrics.postprocess`` is applied to the
predictions (``is_target=False``) and to the targets (``is_target=True``:
the source's text before tokenisation, ``metrics.pretokenized_text``, when the
cache keeps it, else the decoded target tokens). The rows of every process are
gathered to process 0, which checks that each example came exactly once and
runs ``metrics.run_metrics`` once over all of them.

Files (process 0), under ``OUT/eval/<task>/<split>/step_<N>/``:

  predictions.jsonl  one JSON object per example, in cache order: ``task``,
                     ``cache_index``, ``source`` (the file), ``record_number``
                     and ``locator`` (what the number counts), ``line`` (1-based,
                     for line-oriented sources) and ``place`` (the same in words,
                     as ``seqcache which`` gives it), ``inputs``, ``targets``,
                     ``prediction`` (texts) and ``score`` (nats) when computed.
  metrics.json       {"task", "split", "step", "num_examples", "decode" (the DecodeConfig's fields),
                     "global_batch_size", "metrics": {name: value}}.

Both are written to a temporary file and renamed into place only once the
metrics have been computed, so a metric that fails leaves neither behind.

Errors: a metric that raises or returns a non-number raises
``seqcache.tasks.metrics.MetricError`` (a ValueError) whose one-line message
names the task and the metric; so does a postprocessed target or prediction
that the metrics do not take (``metrics.check_postprocessed``: None, or a
type one of seqcache's metrics refuses), checked before any metric runs,
the message naming the postprocess_fn and the example (its cache index and
source); ``EvalError`` (a ValueError) for an eval split
that did not give every example exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from seqcache import format as fmt
from seqcache import fs
from seqcache.feeders import Feeder
from seqcache.feeders.reader import source_of
from seqcache.tasks import metrics as metrics_lib
from seqcache.tasks import registry
from seqcache.tasks.sources.base import describe_record
from seqcache.tasks.sources.lines import line_number_at
from seqcache.training import config as config_lib
from seqcache.training import data as data_lib
from seqcache.training import decoding
from seqcache.training import metrics as run_metrics_lib
from seqcache.training.checkpoints import Checkpointer
from seqcache.training.report import CONFIG_FILE
from seqcache.training.trainer import Trainer

log = logging.getLogger("seqcache.training")

PREDICTIONS_FILE = "predictions.jsonl"
METRICS_JSON = "metrics.json"
# The key of a mixture's rate-weighted means in ``EvalResult.metrics``.
MIXTURE_KEY = "mixture"


class EvalError(ValueError):
    """An eval split that cannot be evaluated as asked (the message names it)."""


@dataclasses.dataclass(frozen=True)
class EvalTask:
    """One cache to evaluate.

    Attributes:
      name: the task's name (the cache manifest's ``task``); names the output folder.
      cache_dir: the cache folder of the split.
      task: the registered ``seqcache.tasks.Task`` (its ``metric_fns`` and
        ``postprocess_fn``), or None: predictions only.
      rate: the task's mixing rate, the weight of its metrics in a mixture's mean.
      named_metrics: the metric functions' names the cache's manifest records
        (its ``evaluation``), which need the task registered to run.
    """

    name: str
    cache_dir: str
    task: Any = None
    rate: float = 1.0
    named_metrics: tuple[str, ...] = ()

    @property
    def metric_fns(self) -> tuple:
        return tuple(getattr(self.task, "metric_fns", ()) or ())

    @property
    def score_metric_fns(self) -> tuple:
        return tuple(getattr(self.task, "score_metric_fns", ()) or ())


@dataclasses.dataclass
class EvalResult:
    """What ``Evaluator.evaluate`` computed (on every process; the rows and
    metrics only on process 0).

    Attributes:
      step: the checkpoint step (updates applied) the model has.
      metrics: task name -> {metric: value}; with several tasks also
        ``MIXTURE_KEY`` -> the rate-weighted mean of each metric over the tasks that have it.
      rows: task name -> the predictions.jsonl records, in cache order.
      paths: task name -> the folder its files were written to (when written).
    """

    step: int
    metrics: dict[str, dict[str, float]]
    rows: dict[str, list[dict]]
    paths: dict[str, str]

    def flat(self) -> dict[str, float]:
        """``{"eval_<task>/<metric>": value}``: metrics.jsonl fields, which
        TensorBoard shows as ``eval/<task>/<metric>``."""
        return {f"eval_{task}/{name}": value for task, values in self.metrics.items()
                for name, value in values.items()}


def output_dir(root: str, task: str, split: str, step: int, kind: str = "eval") -> str:
    """``root/<kind>/<task>/<split>/step_<step>``: where an evaluation's files
    go (``kind``: "eval", or "infer" for predictions without metrics)."""
    return os.path.join(root, kind, task, split, f"step_{step}")


class Evaluator:
    """Decodes and scores every example of an eval split once, and runs the
    tasks' metrics (module docstring).

    Args:
      tasks: the caches to evaluate (one per task; a mixture gives several).
      split: the split's name (for the output folders and metrics.json).
      decode: the decoding settings (``max_decode_length``, method, ...).
      global_batch_size: rows decoded together over all processes; the
        process count must divide it.
      inputs_length, targets_length: the most tokens of ``inputs`` (the prompt)
        and ``targets`` read from an example; longer ones are cut, as in training.
      mesh: the device mesh the model's parameters live on (passed to decoding).
      seed: the feeder's seed (the order of reading; the results do not depend on it).
      metrics: False to write predictions only (``seqcache infer``).
      rules: the logical axis rules preset the parameters are sharded by (the run's).

    Raises:
      EvalError: no tasks; a packed cache (``packing`` in its manifest: a row
        holds several examples, and seqio evaluates unpacked ones), refused
        before anything is decoded or written; or a cache without ``targets``.
    """

    def __init__(self, tasks: Sequence[EvalTask], *, split: str, decode: decoding.DecodeConfig,
                 global_batch_size: int, inputs_length: int | None, targets_length: int, mesh=None, seed: int = 0,
                 metrics: bool = True, rules: str = "dp"):
        if not tasks:
            raise EvalError("nothing to evaluate: no task caches given")
        for task in tasks:
            refuse_packed(task, split)
        self.tasks = list(tasks)
        self.split = split
        self.decode = decode
        self.global_batch_size = int(global_batch_size)
        self.inputs_length = inputs_length
        self.targets_length = int(targets_length)
        self.mesh = mesh
        self.seed = int(seed)
        self.with_metrics = metrics
        self.rules = rules

    def evaluate(self, model, *, step: int, out_root: str | None = None) -> EvalResult:
        """Evaluates ``model`` (an ``nnx.Module``: the run's graph with the
        checkpoint's parameters) on every task; writes the files under
        ``out_root`` (process 0; None: nothing written).

        Raises:
          MetricError: a metric raised or returned a non-number, or the
            postprocess_fn returned what the metrics do not take (nothing
            written for that task).
          EvalError: an example was not read exactly once.
        """
        result = EvalResult(step=step, metrics={}, rows={}, paths={})
        chief = jax.process_index() == 0
        for task in self.tasks:
            rows = gather_to_chief(self._predict_task(model, task))
            if not chief:
                continue
            rows = _merge_rows(task, rows)
            values = self._task_metrics(task, rows) if self.with_metrics else {}
            clean = [r["record"] for r in rows]
            if out_root is not None:
                folder = output_dir(out_root, task.name, self.split, step, "eval" if self.with_metrics else "infer")
                summary = {"task": task.name, "split": self.split, "step": step, "num_examples": len(clean),
                           "decode": dataclasses.asdict(self.decode), "global_batch_size": self.global_batch_size,
                           "metrics": values}
                write_outputs(folder, clean, summary if self.with_metrics else None)
                result.paths[task.name] = folder
            result.rows[task.name] = clean
            if values:
                result.metrics[task.name] = values
        if chief and len(self.tasks) > 1 and result.metrics:
            result.metrics[MIXTURE_KEY] = mixture_means(
                {t.name: result.metrics.get(t.name, {}) for t in self.tasks}, {t.name: t.rate for t in self.tasks})
        return result

    # -- one task ------------------------------------------------------------------

    def _feeders(self, task: EvalTask) -> dict[str, Feeder]:
        """One finite feeder per token feature read (``targets``, and ``inputs``
        when the cache has it), over the same stream."""
        manifest = fmt.read_manifest(task.cache_dir)
        names = [f.name for f in manifest.features]
        if "targets" not in names:
            raise EvalError(f"{task.cache_dir}: the cache of task {task.name!r} has no feature 'targets' "
                            f"(features: {', '.join(names)}); evaluation decodes targets")
        lengths = {"targets": self.targets_length}
        if "inputs" in names and self.inputs_length:
            lengths["inputs"] = int(self.inputs_length)
        feeders: dict[str, Feeder] = {}
        try:
            for feature, length in lengths.items():
                feeders[feature] = Feeder(cache=task.cache_dir, feature=feature, sequence_length=length,
                                          global_batch_size=self.global_batch_size, seed=self.seed, num_epochs=1)
        except BaseException:
            for f in feeders.values():
                f.close()
            raise
        return feeders

    def _predict_task(self, model, task: EvalTask) -> list[dict]:
        """This process's rows of ``task``: one dict per (non-padding) example,
        with its record (``predictions.jsonl``) and postprocessed target and
        prediction."""
        feeders = self._feeders(task)
        reader = feeders["targets"].readers[0]
        vocabs = {f: reader.vocabulary(f) for f in feeders}
        scoring = self.with_metrics and bool(task.score_metric_fns)
        out: list[dict] = []
        try:
            for step, batches in enumerate(zip(*(iter(f) for f in feeders.values()))):
                batch = dict(zip(feeders, batches))
                raw = {f: np.asarray(b[f]) for f, b in batch.items()}
                predicted, scores = self._decode_global(model, raw, step, scoring)
                out.extend(self._rows(task, reader, vocabs, batch["targets"]["cache_index"], raw, predicted, scores))
        finally:
            for f in feeders.values():
                f.close()
        return out

    def _decode_global(self, model, raw: dict[str, np.ndarray], step: int, scoring: bool):
        """(predictions, scores or None) of this process's rows: the rows of
        every process are put together into the global batch, which every
        process decodes together (one SPMD program over the mesh); each keeps
        its own rows [h * R, (h + 1) * R) of the result."""
        rows = next(iter(raw.values())).shape[0]
        first = jax.process_index() * rows
        full = gather_rows(raw)
        kwargs = {"mesh": self.mesh, "rules": self.rules}
        predicted = np.asarray(decoding.predict(model, full, self.decode, row_offset=step * self.global_batch_size,
                                                **kwargs))[first:first + rows]
        scores = np.asarray(decoding.score(model, full, **kwargs))[first:first + rows] if scoring else None
        return predicted, scores

    def _rows(self, task: EvalTask, reader, vocabs, cache_index, raw, predicted, scores) -> list[dict]:
        """The rows of one host batch that are examples (cache index >= 0)."""
        keep = np.flatnonzero(np.asarray(cache_index) >= 0)
        if not keep.size:
            return []
        indices = np.asarray(cache_index)[keep].astype(np.int64)
        examples = [reader.decode(rec, int(i)) for rec, i in zip(reader.read(indices), indices)]
        provenance = reader.read_provenance(indices)
        eos = self.decode.eos_id
        predictions = [vocabs["targets"].decode(until_eos(predicted[k], eos)) for k in keep]
        targets = [_text(ex, "targets", vocabs["targets"], eos) for ex in examples]
        inputs = [_text(ex, "inputs", vocabs["inputs"], eos) for ex in examples] if "inputs" in raw else [None] * keep.size
        post_targets = metrics_lib.postprocess(task.task, targets, examples, is_target=True)
        post_predictions = metrics_lib.postprocess(task.task, predictions, examples, is_target=False)
        rows = []
        for j, k in enumerate(keep):
            record = {"task": task.name, "cache_index": int(indices[j]),
                      **_source_fields(reader, provenance[j]),
                      "inputs": inputs[j], "targets": targets[j], "prediction": predictions[j]}
            if scores is not None:
                record["score"] = float(scores[k])
            rows.append({"record": record, "target": post_targets[j], "prediction": post_predictions[j],
                         "score": None if scores is None else float(scores[k])})
        return rows

    def _task_metrics(self, task: EvalTask, rows: list[dict]) -> dict[str, float]:
        """``run_metrics`` once over all the task's rows (``MetricError`` passes through)."""
        if not task.metric_fns:
            return {}
        scores = [r["score"] for r in rows] if task.score_metric_fns else None
        targets = [r["target"] for r in rows]
        predictions = [r["prediction"] for r in rows]
        predicted = len(task.score_metric_fns) < len(task.metric_fns)  # a predict metric takes them
        metrics_lib.check_postprocessed(task.task, targets=targets, predictions=predictions if predicted else None,
                                        examples=[example_words(r["record"]) for r in rows])
        return metrics_lib.run_metrics(task.name, task.metric_fns, targets=targets, predictions=predictions,
                                       scores=scores)


def example_words(record: Mapping) -> str:
    """An example of a ``predictions.jsonl`` record in words, for messages:
    ``"cache index 3 (/data/val.txt, line 4)"``; the cache index alone when
    the cache has no provenance for it."""
    where = ", ".join(str(record[k]) for k in ("source", "place") if record.get(k) is not None)
    return f"cache index {record['cache_index']}" + (f" ({where})" if where else "")


def refuse_packed(task: EvalTask, split: str) -> None:
    """Refuses a packed eval cache, whose rows are not examples.

    Raises:
      EvalError: the manifest's ``packing`` is set (names the cache, the task and the packing).
    """
    packing = fmt.read_manifest(task.cache_dir).packing
    if packing:
        raise EvalError(f"{task.cache_dir}: the {split!r} cache of task {task.name!r} is packed "
                        f"(packing {packing!r}: a row holds several examples), so it cannot be evaluated example "
                        "by example; build the eval split without packing, as seqio evaluates unpacked examples")


def until_eos(ids: np.ndarray, eos_id: int) -> list[int]:
    """The ids before the first ``eos_id`` (all of them when there is none), 0s dropped."""
    ids = np.asarray(ids).ravel()
    hits = np.flatnonzero(ids == eos_id)
    if hits.size:
        ids = ids[:hits[0]]
    return [int(i) for i in ids if i != 0]


def _text(example: Mapping, feature: str, vocab, eos_id: int) -> str:
    """The source's text of ``feature`` when the cache keeps it, else the
    example's tokens (all of them, not cut to the run's length) decoded; the
    ids joined by spaces when the cache has no vocabulary."""
    text = metrics_lib.pretokenized_text(example, feature)
    if text is not None:
        return text
    ids = until_eos(example[feature], eos_id)
    return vocab.decode(ids) if vocab is not None else " ".join(map(str, ids))


_LINE_CACHE: dict[tuple[str, int], int] = {}


def _source_fields(reader, provenance: Mapping[str, np.ndarray]) -> dict:
    """The source file and place of an unpacked example (its first segment):
    source, record_number, locator, line (1-based, or None) and place (in words)."""
    if not len(provenance["source_index"]):
        return {"source": None, "record_number": None, "locator": None, "line": None, "place": None}
    path, locator = source_of(reader.sources, int(provenance["source_index"][0]))
    number = int(provenance["record_number"][0])
    line = None
    if locator == "line":
        line = number + 1
    elif locator == "byte_offset" and path and fs.is_local(path):
        try:
            line = line_number_at(path, number) + 1
        except (OSError, ValueError):
            line = None
    return {"source": path, "record_number": number, "locator": locator, "line": line,
            "place": describe_record(path, locator, number)}


def _merge_rows(task: EvalTask, per_process: list[list[dict]]) -> list[dict]:
    """Every process's rows in cache order, each example exactly once.

    Raises:
      EvalError: an example missing or read twice (names the task and the index).
    """
    rows = sorted((r for part in per_process for r in part), key=lambda r: r["record"]["cache_index"])
    indices = [r["record"]["cache_index"] for r in rows]
    expected = fmt.read_manifest(task.cache_dir).num_examples
    if indices != list(range(expected)):
        seen = set(indices)
        twice = sorted({i for i in indices if indices.count(i) > 1})[:5]
        missing = sorted(set(range(expected)) - seen)[:5]
        raise EvalError(f"{task.cache_dir}: task {task.name!r}: the evaluation read {len(indices)} rows of "
                        f"{expected} examples (read twice: {twice or 'none'}; missing: {missing or 'none'})")
    return rows


def gather_rows(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each process's host-local rows (R, ...) put together into the global
    batch (H * R, ...), in process order, on every process; one process: the
    arrays themselves. Every process must call it."""
    if jax.process_count() == 1:
        return dict(arrays)
    return {k: np.asarray(multihost_utils.process_allgather(np.asarray(v), tiled=True)) for k, v in arrays.items()}


def gather_to_chief(obj: Any) -> list:
    """``[obj of process 0, obj of process 1, ...]`` on process 0 (pickled and
    gathered as bytes with ``jax.experimental.multihost_utils``); on the other
    processes an empty list. One process: ``[obj]``. Every process must call it."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    if jax.process_index() != 0:
        return []
    return [pickle.loads(gathered[p, :int(n)].tobytes()) for p, n in enumerate(sizes)]


def mixture_means(per_task: Mapping[str, Mapping[str, float]], rates: Mapping[str, float]) -> dict[str, float]:
    """Each metric's mean over the tasks that have it, weighted by their rates
    (seqio's mixture evaluation reports the per-task values; this adds one
    number per metric). A metric that no task with a rate > 0 has is left out."""
    out = {}
    names = dict.fromkeys(n for values in per_task.values() for n in values)
    for name in names:
        pairs = [(rates.get(t, 0.0), v[name]) for t, v in per_task.items() if name in v and rates.get(t, 0.0) > 0]
        total = sum(w for w, _ in pairs)
        if total > 0:
            out[name] = sum(w * x for w, x in pairs) / total
    return out


def write_outputs(folder: str, records: Sequence[Mapping], summary: Mapping | None) -> None:
    """``predictions.jsonl`` and (unless ``summary`` is None) ``metrics.json``
    in ``folder``, each written to a temporary file and renamed into place
    (``seqcache.fs.atomic_path``)."""
    os.makedirs(folder, exist_ok=True)
    with fs.atomic_path(os.path.join(folder, PREDICTIONS_FILE)) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(run_metrics_lib.strict_json(record), ensure_ascii=False, sort_keys=True) + "\n")
    if summary is None:
        return
    with fs.atomic_path(os.path.join(folder, METRICS_JSON)) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(run_metrics_lib.strict_json(dict(summary)), indent=2, sort_keys=True) + "\n")


# -- a run's model and eval tasks ------------------------------------------------------


@dataclasses.dataclass
class LoadedRun:
    """A training run's config, its trainer (mesh, graph) and the model of one checkpoint."""

    config: Any
    trainer: Any
    model: Any
    step: int


def load_run(checkpoint_dir: str, *, step: int | None = None, devices=None) -> LoadedRun:
    """The model of checkpoint ``step`` (None: the latest) of the run in
    ``checkpoint_dir``, built from the run's ``config.json``; the checkpoint is
    only read.

    Raises:
      EvalError: no config.json in the folder.
      seqcache.training.checkpoints.CheckpointError: no such checkpoint.
      ConfigError: a damaged config.json.
    """
    path = os.path.join(checkpoint_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise EvalError(f"{checkpoint_dir}: no {CONFIG_FILE}; is this the --checkpoint-dir of a seqcache train run?")
    config = config_lib.load_config_file(path)
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint,
                                                                        directory=checkpoint_dir))
    trainer = Trainer(config, devices=devices)
    checkpointer = Checkpointer(checkpoint_dir, max_to_keep=config.checkpoint.max_to_keep, async_save=False)
    try:
        restored = checkpointer.restore(step, abstract_state=trainer.abstract_state(),
                                        global_batch_size=config.global_batch_size)
    finally:
        checkpointer.close()
    model = nnx.merge(trainer.graphdef, restored.state["params"])
    return LoadedRun(config=config, trainer=trainer, model=model, step=restored.step)


def eval_tasks(config, split: str, *, task: str | None = None, cache_dir: str | None = None,
               modules: Sequence[str] = ()) -> list[EvalTask]:
    """The caches of ``split`` to evaluate and their registered tasks: ``task``
    (a cache folder, a task under ``cache_dir``, or a registered task or
    mixture), else the run's own ``data.task``; a mixture gives one EvalTask
    per task, weighted by its rates. A cache whose task is not registered
    (after importing ``modules``) is evaluated without metrics.

    Raises:
      ConfigError: the name resolves to no cache (what was tried).
    """
    data = dataclasses.replace(config.data, task=task or config.data.task,
                               cache_dir=cache_dir if cache_dir is not None else config.data.cache_dir,
                               mixture=None if task else config.data.mixture)
    source = data_lib.resolve_source(data, split, tuple(modules))
    rates = _source_rates(source)
    out = []
    for path in source.cache_dirs:
        manifest = fmt.read_manifest(path)
        found = registry.registered(manifest.task, tuple(modules))
        named = manifest.evaluation.metrics if manifest.evaluation is not None else ()
        out.append(EvalTask(name=manifest.task, cache_dir=path,
                            task=found if hasattr(found, "output_features") else None,
                            rate=rates.get(path, 1.0), named_metrics=tuple(named)))
    return out


def unregistered_metrics(tasks: Sequence[EvalTask]) -> str | None:
    """Why metrics would be missing: the first task whose cache names metrics
    (its manifest's ``evaluation``) but that is not registered here, in words
    (names the cache, the metrics and the task); None when there is none."""
    for t in tasks:
        if t.task is None and t.named_metrics:
            return (f"{t.cache_dir}: the cache names metrics {', '.join(t.named_metrics)}, but task {t.name!r} "
                    "is not registered here; give --module with the module that registers it (seqcache infer "
                    "writes predictions without metrics)")
    return None


def _source_rates(source) -> dict[str, float]:
    """Cache folder -> rate of a mixture source (numbers only; 1.0 otherwise)."""
    mixture = source.kwargs.get("mixture")
    if isinstance(mixture, Mapping):
        return {p: float(r) for p, r in mixture.items() if isinstance(r, (int, float))}
    if mixture is not None and hasattr(mixture, "get_rates"):
        try:
            rates = mixture.get_rates({os.path.basename(os.path.dirname(p)): fmt.read_manifest(p).num_examples
                                       for p in source.cache_dirs})
        except (TypeError, ValueError):
            return {}
        root, split = source.kwargs.get("caches_root"), source.kwargs.get("split")
        return {os.path.join(root, name, split): float(r) for name, r in rates.items()} if root else {}
    return {}


def evaluator_for(run_config, tasks: Sequence[EvalTask], *, split: str, mesh=None,
                  decode: decoding.DecodeConfig | None = None, global_batch_size: int | None = None,
                  metrics: bool = True) -> Evaluator:
    """An Evaluator with the run's lengths, batch size and feeder seed; the
    decode length defaults to the run's targets length."""
    lengths = run_config.sequence_length  # {"targets": L}, and "inputs" for encdec and prefix_lm
    targets_length = lengths["targets"]
    inputs_length = lengths.get("inputs") if run_config.converter != "lm" else None
    decode = decode or decoding.DecodeConfig(max_decode_length=targets_length)
    return Evaluator(tasks, split=split, decode=decode,
                     global_batch_size=global_batch_size or run_config.global_batch_size,
                     inputs_length=inputs_length, targets_length=targets_length, mesh=mesh,
                     seed=run_config.data.seed or 0, metrics=metrics, rules=run_config.rules)
