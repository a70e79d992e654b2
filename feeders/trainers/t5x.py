"""t5x: the feeder's global stream as t5x's training dataset.

t5x (``t5x/train.py``) asks a gin-bound ``get_dataset_fn`` for the training
data, and names a ``utils.get_deterministic_dataset(model_dir, start_step)``
that it never defines. This module gives it:

    from __gin__ import dynamic_registration
    from seqcache.feeders.trainers import t5x as seqcache_t5x
    import __main__ as train_script

    train_script.train.get_dataset_fn = @seqcache_t5x.get_deterministic_dataset
    seqcache_t5x.get_deterministic_dataset.model_dir = %MODEL_DIR

``get_deterministic_dataset`` returns a clu ``DatasetIterator`` of this
host's rows of every global batch, converted to the fields of the model's
``FEATURE_CONVERTER_CLS``, positioned at step (latest checkpoint step in
``model_dir`` - ``start_step``) of the feeder's stream. The position comes from
t5x's own step, so t5x's dataset checkpoint (``save_dataset``) is not needed
and a run resumes on any process count (hosts h of H own rows
[h·B/H, (h+1)·B/H) of every global batch B, whatever H was before).

``vocabulary(cache)`` and ``seqio_task(cache)`` (or ``seqio_task_name``,
for gin) give seqio objects on the SentencePiece model the cache stores, for
t5x's vocabulary check and inference. The gin files in ``gin_dir()`` train t5x's T5.1.1 tiny
encoder–decoder and a tiny decoder-only model. docs/trainers/t5x.md has the
recipe.

Importing this module imports neither t5x, gin, clu, seqio, TensorFlow nor
JAX; the functions import what they need when called.
"""

from __future__ import annotations

import json
import os
import re
import threading
from importlib import import_module, resources
from typing import Any, Mapping

import numpy as np

from seqcache import bounded_json, fs
from seqcache.feeders.converters import ROW_KEYS, ConvertedFeeder
from seqcache.feeders.reader import CacheReader

STATE_FORMAT = "seqcache.feeders.t5x/1"
_CHECKPOINT_DIR = re.compile(r"^checkpoint_(\d+)$")
# seqio/t5x feature converter class name -> seqcache converter; a class is
# matched by the first of its bases (its MRO) named here.
_CONVERTER_NAMES = {
    "EncDecFeatureConverter": "encdec",
    "PrefixLMFeatureConverter": "prefix_lm",
    "LMFeatureConverter": "lm",
    "DecoderFeatureConverter": None,  # lm or prefix_lm, by the task's features
}
_LM_FIELDS = ("decoder_target_tokens", "decoder_input_tokens", "decoder_loss_weights",
              "decoder_segment_ids", "decoder_positions")
_FIELDS = {
    "lm": _LM_FIELDS,
    "encdec": ("encoder_input_tokens", "encoder_segment_ids", "encoder_positions") + _LM_FIELDS,
    "prefix_lm": _LM_FIELDS + ("decoder_causal_attention",),
}
# seqio name -> cache folder, filled by ``seqio_task``.
_TASK_CACHES: dict[str, str] = {}
_TASK_LOCK = threading.Lock()


def gin_dir() -> str:
    """The folder of the gin files shipped with seqcache (``seqcache_t5_1_1_tiny.gin``,
    ``seqcache_decoder_only_tiny.gin``): pass it to t5x's ``--gin_search_paths``."""
    return str(resources.files("seqcache.feeders.trainers").joinpath("t5x_gin"))


def converter_name(feature_converter_cls: Any, task_feature_lengths: Mapping[str, int]) -> str:
    """The seqcache converter (``"lm"``, ``"encdec"``, ``"prefix_lm"``) for a
    seqio feature converter class.

    Args:
      feature_converter_cls: a seqio ``FeatureConverter`` class (or a subclass),
        e.g. ``model.FEATURE_CONVERTER_CLS``, or a converter name itself.
      task_feature_lengths: feature -> length; ``DecoderFeatureConverter`` is
        ``prefix_lm`` when it has ``"inputs"``, else ``lm`` (as seqio chooses).

    Raises:
      ValueError: a class none of whose bases is a seqio converter seqcache has.
    """
    if isinstance(feature_converter_cls, str):
        return feature_converter_cls
    for klass in getattr(feature_converter_cls, "__mro__", (feature_converter_cls,)):
        name = getattr(klass, "__name__", "")
        if name in _CONVERTER_NAMES:
            conv = _CONVERTER_NAMES[name]
            if conv is None:
                conv = "prefix_lm" if "inputs" in task_feature_lengths else "lm"
            return conv
    raise ValueError(f"feature_converter_cls {feature_converter_cls!r} is not one seqcache converts to "
                     f"(a subclass of one of {sorted(_CONVERTER_NAMES)})")


def latest_checkpoint_step(model_dir: str) -> int | None:
    """The step of the latest t5x checkpoint in ``model_dir``: the largest N of a
    folder ``checkpoint_N``, as ``t5x.checkpoints_utils.latest_step`` finds it
    (that function is used when t5x is importable, so that its gin-bound
    checkpoint prefix and remote file systems are honoured); None when there
    is none.
    """
    try:
        from t5x import checkpoints_utils  # optional: t5x
    except ImportError:
        checkpoints_utils = None
    if checkpoints_utils is not None:
        return checkpoints_utils.latest_step(model_dir)
    if not os.path.isdir(model_dir):
        return None
    steps = [int(m.group(1)) for name in os.listdir(model_dir)
             if (m := _CHECKPOINT_DIR.match(name)) and os.path.isdir(os.path.join(model_dir, name))]
    return max(steps) if steps else None


def feeder_source(name_or_task: Any, *, split: str, caches_root: str | None) -> dict[str, Any]:
    """The ``Feeder`` arguments (``cache=`` or ``mixture=, caches_root=, split=``)
    for a ``DatasetConfig.mixture_or_task_name``.

    It is resolved in this order: a name registered by ``seqio_task`` (its
    cache); a cache folder (one holding manifest.json); with ``caches_root``, a
    seqcache ``Mixture`` of that name in ``MixtureRegistry`` (its tasks under
    ``caches_root/<task>/<split>``), else the folder ``caches_root/<name>/<split>``.

    Raises:
      ValueError: none of these matches; the message names what was looked for.
    """
    name = name_or_task if isinstance(name_or_task, str) else str(getattr(name_or_task, "name", name_or_task))
    with _TASK_LOCK:
        cache = _TASK_CACHES.get(name)
    if cache is not None:
        return {"cache": cache}
    if os.path.isfile(os.path.join(name, "manifest.json")):
        return {"cache": name}
    if caches_root is not None:
        from seqcache.tasks import MixtureRegistry  # the feeder imports numpy, array_record and msgspec only (trainers install seqcache --no-deps)

        if name in MixtureRegistry.names():
            return {"mixture": MixtureRegistry.get(name), "caches_root": caches_root, "split": split}
        folder = os.path.join(caches_root, name, split)
        if os.path.isfile(os.path.join(folder, "manifest.json")):
            return {"cache": folder}
    raise ValueError(
        f"train DatasetConfig.mixture_or_task_name {name!r} is not a seqcache cache: give a cache folder "
        f"(CACHE_DIR/<task>/<split>), a task registered with seqcache.feeders.trainers.t5x.seqio_task, or set "
        f"get_deterministic_dataset.caches_root to the folder holding <task>/{split}")


def get_deterministic_dataset(
    cfg: Any,
    shard_id: int,
    num_shards: int,
    feature_converter_cls: Any,
    num_epochs: int | None = None,
    continue_from_last_checkpoint: bool = True,
    *,
    model_dir: str | None = None,
    start_step: int = 0,
    caches_root: str | None = None,
    seed: int | None = None,
    record_path: str | None = None,
    num_threads: int | None = None,
    prefetch: int | None = None,
):
    """t5x's ``GetDatasetCallable`` over the feeder's global stream.

    Bind it with gin: ``train_script.train.get_dataset_fn =
    @seqcache_t5x.get_deterministic_dataset`` and
    ``seqcache_t5x.get_deterministic_dataset.model_dir = %MODEL_DIR``.

    Args:
      cfg: t5x's ``utils.DatasetConfig``. Read: ``mixture_or_task_name`` (see
        ``feeder_source``), ``task_feature_lengths`` (the converter's sequence
        lengths, tokens), ``split``, ``batch_size`` (the global batch B, rows),
        ``seed`` (the feeder's seed, unless ``seed`` is given) and ``module``
        (imported first, to register tasks). Not read: ``shuffle``,
        ``use_cached``, ``pack`` and ``use_custom_packing_ops``: the order is the
        feeder's (a shuffled cache, a seeded permutation per epoch), and packing
        is the cache's.
      shard_id, num_shards: this host's data shard and the number of shards
        (t5x's data layout): the feeder's host index and count.
      feature_converter_cls: the model's ``FEATURE_CONVERTER_CLS`` (see
        ``converter_name``).
      num_epochs: None repeats forever; E reads every example E times, then stops.
      continue_from_last_checkpoint: True starts at the latest checkpoint's
        step; False at step 0.
      model_dir: t5x's model folder, whose ``checkpoint_<step>`` folders give
        the step; required when ``continue_from_last_checkpoint``.
      start_step: the t5x step at which this stream starts (its step 0): 0 when
        pre-training, the initial checkpoint's step when fine-tuning from one.
      caches_root: folder of ``<task>/<split>`` caches for names (see
        ``feeder_source``).
      seed: the feeder's seed; default ``cfg.seed``.
      record_path: if set, every batch this iterator yields appends one JSON
        line ``{"step", "shard_id", "num_shards", "cache_index", "task_index",
        "epoch"}`` (this host's rows) to that file: what the trainer consumed.
      num_threads, prefetch: the feeder's reader threads and steps read ahead.

    Returns:
      A clu ``DatasetIterator`` (``CacheDatasetIterator``) of the converter's fields, each
      (B // num_shards, L): int32 tokens, segment ids, positions, float32 loss weights.

    Raises:
      ValueError: B not divisible by ``num_shards``, no seed, no ``model_dir``
        when continuing, a latest step before ``start_step``, an unknown
        converter or source; from ``Feeder``, a cache that lacks a feature or
        is too long for the lengths.
    """
    if getattr(cfg, "module", None):
        import_module(cfg.module)
    batch_size = int(cfg.batch_size)
    if batch_size % num_shards:
        raise ValueError(f"train DatasetConfig.batch_size {batch_size} is not divisible by the number of data "
                         f"shards {num_shards}: choose a global batch that is a multiple of {num_shards}")
    seed = cfg.seed if seed is None else seed
    if seed is None:
        raise ValueError("train DatasetConfig.seed is None: set it (or get_deterministic_dataset.seed) to an "
                         "integer, the feeder's seed; a new seed at each restart would change the stream")
    lengths = dict(cfg.task_feature_lengths)
    step = _first_step(model_dir, start_step) if continue_from_last_checkpoint else 0
    feeder = ConvertedFeeder(
        converter=converter_name(feature_converter_cls, lengths), sequence_length=lengths,
        **feeder_source(cfg.mixture_or_task_name, split=cfg.split, caches_root=caches_root),
        global_batch_size=batch_size, host_index=int(shard_id), host_count=int(num_shards),
        seed=int(seed), num_epochs=num_epochs, start_step=step,
        num_threads=num_threads, prefetch=prefetch)
    _register_with_clu()
    return CacheDatasetIterator(feeder, record_path=record_path, shard_id=int(shard_id), num_shards=int(num_shards))


def _first_step(model_dir: str | None, start_step: int) -> int:
    """The feeder step to start from: the latest checkpoint step in ``model_dir``
    minus ``start_step`` (0 without a checkpoint).

    Raises:
      ValueError: no ``model_dir``; a latest step before ``start_step``.
    """
    if model_dir is None:
        raise ValueError("get_deterministic_dataset needs model_dir (bind "
                         "seqcache_t5x.get_deterministic_dataset.model_dir = %MODEL_DIR)")
    latest = latest_checkpoint_step(model_dir)
    if latest is None:
        return 0
    if latest < start_step:
        raise ValueError(f"{model_dir}: latest checkpoint step {latest} is before start_step {start_step}; "
                         f"start_step is the t5x step at which this data stream starts")
    return latest - start_step


def _register_with_clu() -> None:
    """Makes ``CacheDatasetIterator`` a clu ``DatasetIterator`` (a registered
    virtual subclass, so that this module need not import clu)."""
    from clu.data.dataset_iterator import DatasetIterator  # optional: clu

    if not issubclass(CacheDatasetIterator, DatasetIterator):
        DatasetIterator.register(CacheDatasetIterator)


class CacheDatasetIterator:
    """A clu ``DatasetIterator`` over a ``ConvertedFeeder``: ``element_spec``,
    ``__next__``, ``reset``, ``save``, ``restore``.

    Each element is this host's rows of the next global batch (the converter's
    fields only; the rows' ``cache_index``, ``task_index`` and ``epoch`` go to
    ``record_path`` when one is given).

    ``save`` writes the feeder's JSON state; ``restore`` reads one back, checks
    that it describes this stream (caches, seed, global batch, converter and
    lengths) and leaves the position where it is: the position is the
    trainer's step. t5x saves its dataset after it has peeked at the next
    batch, so a saved state can be one step ahead of the checkpoint it sits in.

    Args:
      feeder: the converted feeder, at its start step.
      record_path: see ``get_deterministic_dataset``.
      shard_id, num_shards: recorded with each line.
    """

    def __init__(self, feeder: ConvertedFeeder, *, record_path: str | None = None,
                 shard_id: int = 0, num_shards: int = 1):
        self.feeder = feeder
        self.record_path = record_path
        self.shard_id, self.num_shards = shard_id, num_shards
        self._rows = feeder.feeders["targets"].global_batch_size // num_shards

    @property
    def step(self) -> int:
        """The step of the next batch."""
        return self.feeder.step

    @property
    def element_spec(self) -> dict:
        """Field -> clu ``ArraySpec``: int32 (R, L), ``decoder_loss_weights``
        float32 (R, L); R = B // num_shards, L the decoder length (Li + Lt for
        ``prefix_lm``) or the encoder length."""
        from clu.data.dataset_iterator import ArraySpec  # optional: clu

        lengths = self.feeder.sequence_length
        conv = self.feeder.converter
        dec = sum(lengths.values()) if conv == "prefix_lm" else lengths["targets"]
        spec = {}
        for name in _FIELDS[conv]:
            length = lengths["inputs"] if name.startswith("encoder_") else dec
            dtype = np.float32 if name == "decoder_loss_weights" else np.int32
            spec[name] = ArraySpec(dtype=dtype, shape=(self._rows, length))
        return spec

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        step = self.feeder.step
        batch = next(self.feeder)
        if self.record_path is not None:
            self._record(step, batch)
        return {k: v for k, v in batch.items() if k not in ROW_KEYS}

    def _record(self, step: int, batch: Mapping[str, np.ndarray]) -> None:
        line = {"step": step, "shard_id": self.shard_id, "num_shards": self.num_shards}
        line.update({k: np.asarray(batch[k]).tolist() for k in ROW_KEYS if k in batch})
        data = (json.dumps(line) + "\n").encode()
        fd = os.open(self.record_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)  # one append per line: hosts may share the file
        finally:
            os.close(fd)

    def get_next(self) -> dict[str, np.ndarray]:
        return next(self)

    def reset(self) -> None:
        """Back to the beginning of the stream: step 0."""
        self.feeder.step = 0

    def save(self, filename) -> None:
        """Writes ``{"format", "state"}`` (the feeder's JSON state) to ``filename``."""
        text = json.dumps({"format": STATE_FORMAT, "state": self.feeder.state()}, sort_keys=True)
        fs.write_bytes_atomic(os.fspath(filename), text.encode("utf-8"), fsync=False)

    def restore(self, filename) -> None:
        """Checks the state in ``filename`` against this stream; keeps the position.

        Raises:
          ValueError: the file is not such a state (names it), or describes
            another stream; ``FeederStateError``: another cache, seed or
            global batch.
        """
        path = os.fspath(filename)
        saved = bounded_json.read_file(path, what="t5x dataset state")
        if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT or not isinstance(saved.get("state"), dict):
            raise ValueError(f"{path}: not a seqcache t5x dataset state (expected format {STATE_FORMAT!r})")
        step = self.feeder.step
        self.feeder.set_state(saved["state"])  # validates caches, seed, global batch, converter
        self.feeder.step = step

    def load(self, filename) -> None:
        self.restore(filename)

    def close(self) -> None:
        self.feeder.close()


def _stored_model(cache: str, feature: str) -> tuple[str, int]:
    """(absolute path of the SentencePiece model the cache stores for
    ``feature``, its extra ids); of several stored files with the same bytes,
    the first by name.

    Raises:
      ValueError: the feature has no SentencePiece vocabulary, or its stored
        model is missing or differs from the manifest's sha256.
    """
    with CacheReader(cache) as reader:
        desc = reader.manifest.vocabularies.get(feature)
        if desc is None or desc.kind != "sentencepiece":
            raise ValueError(f"{cache}: feature {feature!r} has no SentencePiece vocabulary "
                             f"(manifest: {desc!r}); seqio_task and vocabulary need one")
        reader.vocabulary(feature)  # checks the stored model's sha256
        # seqio compares vocabularies by file name: features whose models are
        # the same bytes (one file per feature in the cache) share one file.
        same = [d.file for d in reader.manifest.vocabularies.values()
                if d.kind == "sentencepiece" and d.sha256 == desc.sha256 and d.file is not None]
        # Absolute, as seqio_task makes its cache path: seqio compares the task's and
        # the model's vocabularies by file name, so a relative CACHE would differ.
        return os.path.join(os.path.abspath(cache), min(same)), int(desc.extra_ids or 0)


def vocabulary(cache: str, feature: str = "targets"):
    """A ``seqio.SentencePieceVocabulary`` on the model stored in ``cache``
    for ``feature``, with the cache's extra ids: the model's vocabulary in gin
    (``VOCABULARY = @seqcache_t5x.vocabulary()``).

    Raises:
      ValueError: see ``_stored_model``.
    """
    import seqio  # optional: seqio

    path, extra_ids = _stored_model(cache, feature)
    return seqio.SentencePieceVocabulary(path, extra_ids=extra_ids)


def vocabulary_size(cache: str, feature: str = "targets", multiple: int = 128) -> int:
    """The embedding size for ``cache``'s vocabulary of ``feature``: its size
    (base pieces + extra ids) rounded up to a multiple of ``multiple`` (t5x's
    configurations round to 128); for gin: ``network.T5Config.vocab_size =
    @seqcache_t5x.vocabulary_size()``.

    Raises:
      ValueError: see ``_stored_model``; ``multiple`` < 1.
    """
    if multiple < 1:
        raise ValueError(f"vocabulary_size multiple must be >= 1 (got {multiple=})")
    _stored_model(cache, feature)
    with CacheReader(cache) as reader:
        size = reader.vocabulary(feature).vocab_size
    return -(-size // multiple) * multiple


def seqio_task(cache: str, name: str | None = None, *, task=None):
    """Registers (once) and returns a seqio ``Task`` for ``cache``, so that
    t5x's vocabulary check (``verify_matching_vocabs``), inference and
    ``seqio.get_mixture_or_task`` see the cache's vocabulary, and
    ``get_deterministic_dataset`` finds the cache by the task's name.

    Its output features are the cache's token features (``inputs``,
    ``targets``), each with the stored SentencePiece vocabulary and
    ``add_eos=False`` (the cache's records already end as built). Its source
    yields the cache's records in cache order, as stored (a packed cache's
    records are packed rows), for the split the cache was built for, with the
    source's target text (``targets_pretokenized``, a string) where the cache
    keeps it, as seqio's evaluator reads it.

    Its ``postprocess_fn`` and metrics (what t5x's evaluator runs) are those
    of ``task`` when given; else those of a seqio Task registered under the
    cache's task name (the manifest's ``task``) or under ``name`` by someone
    else (its ``metric_fns`` and ``metric_objs`` carried over by seqio's
    ``Task.replace``); else none.

    Args:
      cache: a cache folder, ``CACHE_DIR/<task>/<split>``.
      name: the seqio name; default ``seqcache:<task>:<split>`` of the manifest.
      task: optional seqcache ``Task`` (the cache's), whose ``postprocess_fn``
        and ``metric_fns`` the seqio Task gets; given, it re-registers a task
        already registered for the cache.

    Raises:
      ValueError: a name already registered for another cache; see
        ``_stored_model``.
    """
    import seqio  # optional: seqio

    cache = os.path.abspath(cache)
    with CacheReader(cache) as reader:
        manifest = reader.manifest
        names = {f.name for f in reader.features}
        features = [f for f in ("inputs", "targets") if f in names]
        texts = [f for f in ("targets_pretokenized",) if f in names]
        split = manifest.split
        task_name = name or f"seqcache:{manifest.task}:{split}"
    with _TASK_LOCK:
        known = _TASK_CACHES.get(task_name)
        if known is not None and known != cache:
            raise ValueError(f"seqio task {task_name!r} is already registered for {known}; pick another name for {cache}")
        registered = set(seqio.TaskRegistry.names())
        if known is not None and task_name in registered and task is None:
            return seqio.TaskRegistry.get(task_name)
        theirs = next((seqio.TaskRegistry.get(n) for n in (task_name, manifest.task)
                       if n in registered and not (n == task_name and known is not None)), None)
        made = _seqio_task(seqio, cache, task_name, split, features, texts, task, theirs)
        if task_name in registered:
            seqio.TaskRegistry.remove(task_name)
        seqio.TaskRegistry.add_provider(task_name, made)
        _TASK_CACHES[task_name] = cache
        return made


def _seqio_task(seqio, cache: str, task_name: str, split: str, features, texts, task, theirs):
    """``seqio_task``'s Task (not registered): the cache's features and
    records, with ``task``'s postprocess_fn and metrics, or else those of the
    registered seqio Task ``theirs`` (None: none)."""
    import tensorflow as tf  # optional: tensorflow

    output_features = {}
    for f in features:
        path, extra_ids = _stored_model(cache, f)
        output_features[f] = seqio.Feature(seqio.SentencePieceVocabulary(path, extra_ids=extra_ids),
                                           add_eos=False, dtype=tf.int32)
    signature = {**{f: tf.TensorSpec([None], tf.int32) for f in features},
                 **{f: tf.TensorSpec([], tf.string) for f in texts}}

    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None):
        del split, shuffle_files, seed  # the cache's one split, in cache order
        return tf.data.Dataset.from_generator(lambda: _records(cache, features, texts), output_signature=signature)

    source = seqio.FunctionDataSource(dataset_fn, splits=[split])
    if task is not None:
        return seqio.Task(task_name, source=source, output_features=output_features,
                          postprocess_fn=task.postprocess_fn, metric_fns=list(task.metric_fns))
    if theirs is not None and hasattr(theirs, "replace"):
        return theirs.replace(name=task_name, source=source, output_features=output_features, preprocessors=[])
    if theirs is not None:  # a seqio without Task.replace
        return seqio.Task(task_name, source=source, output_features=output_features,
                          postprocess_fn=theirs.postprocessor, metric_fns=list(theirs.metric_fns))
    return seqio.Task(task_name, source=source, output_features=output_features)


def seqio_task_name(cache: str, name: str | None = None) -> str:
    """``seqio_task(cache, name).name``: registers the task and returns its
    name, for gin (``MIXTURE_OR_TASK_NAME = @seqcache_t5x.seqio_task_name()``).
    t5x's vocabulary check reads a task given by name through seqio's
    registry; a seqio ``Task`` object given directly is taken for an airio
    provider there and fails."""
    return seqio_task(cache, name).name


def _records(cache: str, features, texts=()) -> Any:
    """The cache's records in cache order: {feature: int32 tokens}, and each
    text feature of ``texts`` as its UTF-8 bytes (a tf.string)."""
    with CacheReader(cache) as reader:
        n = reader.num_examples
        for start in range(0, n, 256):
            for ex in reader.read_examples(np.arange(start, min(n, start + 256))):
                yield {**{f: np.asarray(ex[f], np.int32) for f in features},
                       **{f: ex[f].tobytes() for f in texts}}


__all__ = [
    "CacheDatasetIterator",
    "converter_name",
    "feeder_source",
    "get_deterministic_dataset",
    "gin_dir",
    "latest_checkpoint_step",
    "seqio_task",
    "seqio_task_name",
    "vocabulary",
    "vocabulary_size",
]
