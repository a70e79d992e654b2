"""Features and tasks (seqio's vocabulary, rebuilt for deterministic caches).

A ``Task`` names a source, the output features (each with a vocabulary), the
preprocessors that turn records into examples and optionally packing.
``Task.fingerprint`` identifies everything that shapes the cache's content.
For evaluation a task may carry seqio's ``postprocess_fn`` and ``metric_fns``
(see ``seqcache.tasks.metrics``); an unpacked cache of such a task keeps the
source's text of its targets (``"targets_pretokenized"``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import re
from typing import Callable, Mapping, Sequence

import numpy as np

from seqcache.codec import PRETOKENIZED_SUFFIX
from seqcache.tasks.preprocessors import ExampleBatch, PreprocessContext, Preprocessor, PreprocessorError, run_columns
from seqcache.tasks.sources import (BadInputError, Source, SourceFile, SourceRecord, describe_record, error_hint,
                                   is_error_record)
from seqcache.tasks.vocabularies import Vocabulary

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float32")
PACKING_MODES = (None, "lm", "first_fit")
# The features whose source text an evaluation cache keeps, as "<feature>_pretokenized".
PRETOKENIZED_FEATURES = ("targets",)
_EMPTY_INT32 = np.zeros((0,), dtype=np.int32)


def _a(noun: str) -> str:
    """``"an int"``, ``"a list"``."""
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def _outside(name: str, size: int, lo: int, hi: int) -> str | None:
    """The vocabulary check of ids from ``lo`` to ``hi``: what is wrong, or None."""
    bad = lo if lo < 0 else hi if hi >= size else None
    return None if bad is None else f"feature {name!r} has token id {bad}, outside its vocabulary [0, {size})"


def _ranges(columns: dict) -> dict:
    return {name: (int(v.min()), int(v.max())) for name, (v, _) in columns.items() if v.size}


def _checked_ids(name: str, feature: "Feature", value, example: Callable[[], dict]) -> np.ndarray:
    """A feature's value as ids of its dtype (empty for an absent optional
    feature), inside the vocabulary.

    Raises:
      ValueError: the value is missing, null, text or not a 1-D integer sequence.
    """
    if value is None or value is ExampleBatch.ABSENT:
        if not feature.required:
            return np.zeros((0,), dtype=feature.dtype)
        if value is None:
            raise ValueError(f"feature {name!r} is null (expected text or token ids)")
        raise ValueError(f"required feature {name!r} is missing (example keys: {sorted(example())})")
    if isinstance(value, (str, bytes)):
        raise ValueError(f"feature {name!r} is still text; add the tokenize() preprocessor")
    try:
        ids = np.asarray(value)
    except ValueError:  # ragged nesting
        ids = np.asarray(None)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ValueError(f"feature {name!r} is {_a(type(value).__name__)} ({shown}); "
                         "expected text (a string) or a 1-D sequence of integer token ids")
    problem = ids.size and _outside(name, feature.vocabulary.vocab_size, int(ids.min()), int(ids.max()))
    if problem:
        raise ValueError(problem)
    return ids.astype(feature.dtype, copy=False)


def function_names(fns) -> list[str]:
    """The name of each function of ``fns`` (``__name__``; a
    ``functools.partial``'s function's name; else its type's name), as the
    manifest and ``seqcache info`` show them."""
    names = []
    for fn in fns:
        while isinstance(fn, functools.partial):
            fn = fn.func
        names.append(str(getattr(fn, "__name__", None) or type(fn).__name__))
    return names


def metric_kind(fn) -> str | None:
    """``"predict"`` for a metric ``fn(targets, predictions)``, ``"score"`` for
    ``fn(targets, scores)``; None for any other. seqio's rule: the kind is
    read from the names of the parameters a call must give (positional or
    keyword, without a default), in order; other parameters need defaults. A
    ``functools.partial`` is seen through ``inspect.signature``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    needed = tuple(p.name for p in params if p.default is inspect.Parameter.empty
                   and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {("targets", "predictions"): "predict", ("targets", "scores"): "score"}.get(needed)


def _checked_metric_fns(name: str, metric_fns) -> tuple:
    """``metric_fns`` as a tuple, each callable with one of seqio's two signatures.

    Raises:
      TypeError: naming the task and the bad entry.
    """
    if callable(metric_fns) or isinstance(metric_fns, (str, bytes)):
        raise TypeError(f"task {name!r}: metric_fns must be a sequence of functions (got {metric_fns!r}); "
                        "wrap a single metric in a list")
    out = tuple(metric_fns)
    for fn in out:
        if not callable(fn):
            raise TypeError(f"task {name!r}: metric_fns holds {fn!r}, which is not callable")
        if metric_kind(fn) is None:
            raise TypeError(f"task {name!r}: metric {function_names([fn])[0]!r} must take (targets, "
                            "predictions) or (targets, scores) (seqio's predict and score metrics), by those "
                            "parameter names, any others with defaults")
    return out


def _text_column(texts: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """The UTF-8 bytes of ``texts`` as a column: uint8 values and int64 ``(n +
    1,)`` offsets; a value that is not text (absent, token ids) stores no bytes."""
    encoded = [t.encode("utf-8") if isinstance(t, str) else bytes(t) if isinstance(t, bytes) else b""
               for t in texts]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets


def check_name(name: str, what: str) -> str:
    """Validates a task or mixture name (it becomes a folder name in caches)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"bad {what} name {name!r}: use letters, digits, '_', '.', '-', starting with a letter or digit")
    return name


@dataclasses.dataclass(frozen=True)
class Feature:
    """One output feature of a task (seqio meaning).

    Attributes:
      vocabulary: the vocabulary that tokenizes and decodes the feature.
      add_eos: whether ``append_eos`` / ``append_eos_after_trim`` end the feature
        with the vocabulary's EOS id.
      required: whether every example must have it; a missing optional feature
        is stored as an empty array.
      dtype: numpy dtype name of the stored 1-D array (default int32).
    """

    vocabulary: Vocabulary
    add_eos: bool = True
    required: bool = True
    dtype: str = "int32"

    def __post_init__(self):
        if not isinstance(self.vocabulary, Vocabulary):
            raise TypeError(f"Feature.vocabulary must be a Vocabulary (got {type(self.vocabulary).__name__})")
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported feature dtype {self.dtype!r} (expected one of {_DTYPES})")
        kind = np.dtype(self.dtype)  # a narrow dtype must hold every id (int32 and wider always do)
        if kind.kind in "iu" and kind.itemsize < 4 and np.iinfo(kind).max < self.vocabulary.vocab_size - 1:
            raise ValueError(f"feature dtype {self.dtype} cannot hold the ids of a vocabulary of "
                             f"{self.vocabulary.vocab_size} (largest {np.iinfo(kind).max}); use a wider dtype")

    def fingerprint(self) -> dict:
        return {"vocabulary": self.vocabulary.fingerprint(), "add_eos": self.add_eos,
                "required": self.required, "dtype": self.dtype}


def _checked_sources(name: str, source) -> dict[str, Source] | None:
    """A task's ``source`` argument as ``{split: Source}`` (a mapping), or None
    (one Source for every split).

    Raises:
      TypeError / ValueError: naming the task and the bad split or value.
    """
    if isinstance(source, Source):
        return None
    if not isinstance(source, Mapping):
        raise TypeError(f"task {name!r}: source must be a Source or a mapping of split -> Source "
                        f"(got {type(source).__name__})")
    if not source:
        raise ValueError(f"task {name!r}: source maps no split; give at least one, e.g. {{'train': ...}}")
    out = {}
    for split, s in source.items():
        check_name(split, f"task {name!r}: split")
        if not isinstance(s, Source):
            raise TypeError(f"task {name!r}: the source of split {split!r} must be a Source (got {type(s).__name__})")
        out[split] = s
    return out


class Task:
    """A source, output features and preprocessors: one cache per (task, split).

    Args:
      name: task name; letters, digits, ``_ . -`` (it names a cache folder).
      source: where the records come from: one Source, read for every split,
        or a mapping ``{split: Source}`` (seqio's ``split_to_filepattern``,
        with any sources), of which a cache of split S reads only S's (see
        ``for_split``). Split names follow the task-name rule.
      output_features: feature name -> Feature; the cache stores exactly these.
      preprocessors: applied in order to each batch of records.
      packing: None, or ``"lm"`` (concatenate the single output feature of all
        examples of a shard and split it into chunks of the sequence length; see
        ``seqcache.tasks.packing.pack_lm``). ``"lm"`` needs exactly one output
        feature. ``"first_fit"``: first-fit packing of whole examples, every
        feature at once, into rows of the sequence length per feature
        (``seqcache.tasks.packing.pack_first_fit``; needs a length for every
        feature).

    Raises:
      ValueError / TypeError: a bad name, a source that is neither a Source nor
        a non-empty mapping of split name -> Source, no output features, a
        preprocessor that is not a Preprocessor, or an unknown packing mode.
    """

    def __init__(self, name: str, *, source: Source, output_features: Mapping[str, Feature],
                 preprocessors: Sequence[Preprocessor] = (), packing: str | None = None,
                 postprocess_fn: Callable | None = None, metric_fns: Sequence[Callable] = ()):
        self.name = check_name(name, "task")
        self.sources = _checked_sources(name, source)
        if not output_features:
            raise ValueError(f"task {name!r} needs at least one output feature")
        for fname, f in output_features.items():
            if not isinstance(f, Feature):
                raise TypeError(f"task {name!r}: output feature {fname!r} must be a Feature (got {type(f).__name__})")
        for p in preprocessors:
            if not isinstance(p, Preprocessor):
                raise TypeError(
                    f"task {name!r}: preprocessor {p!r} is not a Preprocessor; wrap functions in FunctionPreprocessor")
        if packing not in PACKING_MODES:
            raise ValueError(f"task {name!r}: packing must be one of {PACKING_MODES} (got {packing!r})")
        if packing == "lm" and len(output_features) != 1:
            raise ValueError(f"task {name!r}: packing='lm' needs exactly one output feature "
                             f"(got {sorted(output_features)})")
        if postprocess_fn is not None and not callable(postprocess_fn):
            raise TypeError(f"task {name!r}: postprocess_fn must be callable or None (got {postprocess_fn!r})")
        self._source = source if self.sources is None else None
        self.split = None  # the split whose source ``_source`` is (``for_split``); None: every split's
        self.output_features = dict(output_features)
        self.preprocessors = tuple(preprocessors)
        self.packing = packing
        self.postprocess_fn = postprocess_fn
        self.metric_fns = _checked_metric_fns(name, metric_fns)

    @property
    def source(self) -> Source:
        """The Source the task reads: its only one, or the split's of a task
        returned by ``for_split``.

        Raises:
          ValueError: a task with a source per split, not resolved by ``for_split``.
        """
        if self._source is None:
            raise ValueError(f"task {self.name!r} has a source per split ({', '.join(self.sources)}); "
                             "read it through task.for_split(split) or task.source_for(split)")
        return self._source

    @source.setter
    def source(self, value: Source) -> None:
        self._source = value

    @property
    def splits(self) -> tuple[str, ...] | None:
        """The split names of a task with a source per split, in the order
        given; None for a task whose one source serves every split."""
        return None if self.sources is None else tuple(self.sources)

    def source_for(self, split: str) -> Source:
        """The Source that the cache of ``split`` reads.

        Raises:
          ValueError: a task with a source per split has none for ``split``
            (one line, listing the task's splits).
        """
        if self.sources is None:
            return self.source
        if split not in self.sources:
            raise ValueError(f"task {self.name!r} has no split {split!r} (its splits: {', '.join(self.sources)})")
        return self.sources[split]

    def for_split(self, split: str) -> "Task":
        """The task as the cache of ``split`` sees it: itself for a task with
        one source; else a shallow copy whose ``source`` is the split's (so
        its ``fingerprint`` covers that source only).

        Raises:
          ValueError: as ``source_for``.
        """
        if self.sources is None:
            return self
        resolved = copy.copy(self)
        resolved._source, resolved.split = self.source_for(split), split
        return resolved

    @property
    def predict_metric_fns(self) -> tuple:
        """The metrics ``fn(targets, predictions)``, in ``metric_fns`` order."""
        return tuple(fn for fn in self.metric_fns if metric_kind(fn) == "predict")

    @property
    def score_metric_fns(self) -> tuple:
        """The metrics ``fn(targets, scores)``, in ``metric_fns`` order."""
        return tuple(fn for fn in self.metric_fns if metric_kind(fn) == "score")

    @property
    def pretokenized_features(self) -> tuple[str, ...]:
        """The features whose source text the task's cache keeps (as
        ``"<feature>_pretokenized"``): those of ``PRETOKENIZED_FEATURES`` the
        task has, when it has metrics and no packing; else none."""
        if not self.metric_fns or self.packing is not None:
            return ()
        return tuple(f for f in PRETOKENIZED_FEATURES if f in self.output_features)

    def evaluation(self) -> dict | None:
        """What the manifest records of the task's evaluation: ``{"metrics":
        [names], "postprocess_fn": name or None, "pretokenized": [stored text
        features]}``, or None for a task without metrics or postprocess_fn."""
        if not self.metric_fns and self.postprocess_fn is None:
            return None
        return {"metrics": function_names(self.metric_fns),
                "postprocess_fn": function_names([self.postprocess_fn])[0] if self.postprocess_fn else None,
                "pretokenized": [f + PRETOKENIZED_SUFFIX for f in self.pretokenized_features]}

    def fingerprint(self, *, seed: int, sequence_length: Mapping[str, int] | None,
                    files: Sequence[SourceFile] | None = None) -> dict:
        """JSON-able identity of the task's cache content for this seed and length.

        Keys: name, source (its fingerprint, with the file list), preprocessors
        (list of [name, params]), features ({name: vocabulary fingerprint, add_eos,
        required, dtype}), packing, seed, sequence_length; and, for a task
        with metrics or a postprocess_fn only (so other fingerprints are
        unchanged), evaluation (``evaluation()``). ``files``: the
        source's ``list_files()`` when the caller has just listed them (the
        same value, without a second listing).
        """
        evaluation = self.evaluation()
        return {
            "name": self.name,
            "source": self.source.fingerprint() if files is None else self.source.fingerprint_of_files(files),
            "preprocessors": [[p.name, p.params()] for p in self.preprocessors],
            "features": {k: f.fingerprint() for k, f in sorted(self.output_features.items())},
            "packing": self.packing,
            "seed": int(seed),
            "sequence_length": dict(sorted(sequence_length.items())) if sequence_length else None,
            **({"evaluation": evaluation} if evaluation is not None else {}),
        }

    def preprocess_batch(self, records: Sequence[SourceRecord], keys: Sequence[bytes], *, seed: int,
                         sequence_length: Mapping[str, int] | None,
                         skipped: list | None = None) -> list[tuple[int, dict[str, np.ndarray]]]:
        """Runs the preprocessors on a batch of records.

        Args:
          records: source records.
          keys: one shuffle key (bytes) per record; seeds the per-example RNG.
          seed: the task seed.
          sequence_length: feature name -> length in tokens, or None.
          skipped: when given and the source's ``on_error`` skips ``bad_value``,
            examples failing the checks below are left out and ``(index,
            message)`` is appended here instead (the pipeline quarantines them).

        Returns:
          (index into ``records``, example) pairs in input order; an example holds
          exactly the output features as 1-D arrays of the feature dtype, plus
          ``"<feature>_pretokenized"`` (uint8 UTF-8 bytes) for each of
          ``pretokenized_features``, plus
          ``"_truncated_tokens"`` (int) if a trimming preprocessor ran. Dropped
          examples and records a source skipped are absent.

        Raises:
          ValueError: ``len(keys) != len(records)``; a required feature is missing,
            null, still a string (no ``tokenize``), not a 1-D sequence of integers,
            or holds an id outside its vocabulary; the message names the record,
            the feature and the value.
        """
        return self.preprocess_columns(records, keys, seed=seed, sequence_length=sequence_length,
                                       skipped=skipped).examples()

    def preprocess_columns(self, records: Sequence[SourceRecord], keys: Sequence[bytes], *, seed: int,
                           sequence_length: Mapping[str, int] | None,
                           skipped: list | None = None) -> ExampleBatch:
        """``preprocess_batch``, returning the examples as columns (an ``ExampleBatch``:
        per feature one array of every example's tokens and their offsets), which
        the pipeline encodes without a loop over examples. Same arguments, the same
        examples in the same order, and the same errors as ``preprocess_batch``."""
        if len(keys) != len(records):
            raise ValueError(f"task {self.name!r}: got {len(keys)} keys for {len(records)} records")
        # A batch with columns (the pipeline's ``LiveRecords``) holds no skipped record.
        live = range(len(records)) if getattr(records, "text_values", None) is not None else \
            [i for i, r in enumerate(records) if r.issue is None or not is_error_record(r)]
        keys = list(keys) if len(live) == len(keys) else [keys[i] for i in live]
        ctx = PreprocessContext(output_features=self.output_features, sequence_length=sequence_length,
                                seed=int(seed), keys=keys, keep_pretokenized=self.pretokenized_features)
        try:
            batch = run_columns(self.preprocessors, ExampleBatch.from_records(records, live), ctx)
        except PreprocessorError as e:
            if e.index is None:
                raise ValueError(f"task {self.name!r}, a batch of {len(live)} records: {e}") from None
            raise ValueError(f"task {self.name!r}, {self.record_label(records[live[e.index]])}: {e}") from None
        index = batch.index if len(live) == len(records) else np.asarray(live, dtype=np.int64)[batch.index]
        return self._finish(batch, records, index, skipped)

    def _finish(self, batch: ExampleBatch, records: Sequence[SourceRecord], index: np.ndarray,
                skipped: list | None) -> ExampleBatch:
        """The output features of ``batch`` in their dtypes, checked once per
        feature and batch: present, 1-D integer ids inside the vocabulary. The first bad example raises,
        naming its record, or (``skipped`` given and the source skipping
        ``bad_value``) every bad one is left out and listed in ``skipped``.
        ``index``: the record of each example."""
        problems: dict[int, str] = {}  # example -> its first problem
        columns, ranges = {}, {}
        for name, feature in self.output_features.items():
            size = feature.vocabulary.vocab_size
            if name in batch.columns:
                values, offsets = batch.columns[name]
            else:
                arrays = []
                for k, value in enumerate(batch.field(name)):
                    try:
                        arrays.append(_checked_ids(name, feature, value, lambda: batch.dicts()[k]))
                    except ValueError as e:
                        problems.setdefault(k, str(e))
                        arrays.append(_EMPTY_INT32)
                values = np.concatenate(arrays, dtype=feature.dtype, casting="unsafe") if arrays else \
                    np.zeros(0, feature.dtype)
                offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
                np.cumsum([a.size for a in arrays], out=offsets[1:])
            if values.size and values.dtype.kind not in "iu":  # a preprocessor's column of floats, say
                for k in np.flatnonzero(np.diff(offsets)).tolist():
                    problems.setdefault(k, f"feature {name!r} holds {values.dtype} values; "
                                           "expected a 1-D sequence of integer token ids")
                values = np.zeros(0, feature.dtype)
                offsets = np.zeros(len(batch) + 1, np.int64)
            lo_hi = _ranges({name: (values, offsets)})
            ranges.update(lo_hi)
            if name in lo_hi and _outside(name, size, *lo_hi[name]):
                bounds = offsets.tolist()
                for k in range(len(batch)):
                    ids = values[bounds[k]:bounds[k + 1]]
                    problem = ids.size and _outside(name, size, int(ids.min()), int(ids.max()))
                    if problem:
                        problems.setdefault(k, problem)
            columns[name] = (values.astype(feature.dtype, copy=False), offsets)
        for name in self.pretokenized_features:
            columns[name + PRETOKENIZED_SUFFIX] = _text_column(batch.field(name + PRETOKENIZED_SUFFIX))
        out = ExampleBatch(index, columns, batch.truncated, batch.has_truncated, ranges)
        if problems:
            if skipped is None or self.source.on_error.action("bad_value") != "skip":
                k = min(problems)
                where = f"task {self.name!r}, {self.record_label(records[index[k]])}"
                raise BadInputError(f"{where}: {problems[k]}; {error_hint('bad_value')}")
            for k in sorted(problems):
                i = int(index[k])
                skipped.append((i, f"task {self.name!r}, {self.record_label(records[i])}: {problems[k]}"))
            out = out.take(~np.isin(np.arange(len(out)), list(problems)))
            out.ranges = _ranges(out.columns)
        return out

    def record_label(self, record: SourceRecord) -> str:
        """The record in words that do not depend on how the file was split
        (they go into quarantine.jsonl): ``"line at byte 17 of file 0"``,
        ``"row 3 of file 1"``, ``"record 5 of file 0"``, ``"file 2"``
        (``describe_record(..., stable=True)``)."""
        locator = getattr(self.source, "locator", "record")
        if locator == "file":
            return f"file {record.file_index}"
        return f"{describe_record('', locator, record.record_number, stable=True)} of file {record.file_index}"

    def __repr__(self) -> str:
        metrics = f", metric_fns={function_names(self.metric_fns)}" if self.metric_fns else ""
        source = self._source.describe() if self._source is not None else \
            {split: s.describe() for split, s in self.sources.items()}
        return (f"Task({self.name!r}, source={source!r}, features={sorted(self.output_features)}, "
                f"preprocessors={[p.name for p in self.preprocessors]}, packing={self.packing!r}{metrics})")
