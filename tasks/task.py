"""Features and tasks (seqio's vocabulary, rebuilt for deterministic caches).

A ``Task`` names a source, the output features (each with a vocabulary) and the
preprocessors that turn the source's records into examples; optionally packing.
``Task.fingerprint`` is the identity of everything that shapes the cache's
content; ``Task.preprocess_batch`` is what pipeline workers run.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

import numpy as np

from seqcache.tasks.preprocessors import (
    TRUNCATED_TOKENS_KEY,
    PreprocessContext,
    Preprocessor,
    PreprocessorError,
    run_preprocessors,
)
from seqcache.tasks.sources import Source, SourceRecord, describe_record, error_hint, is_error_record
from seqcache.tasks.vocabularies import Vocabulary

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float32")
PACKING_MODES = (None, "lm", "first_fit")
_EMPTY_INT32 = np.zeros((0,), dtype=np.int32)


def _a(noun: str) -> str:
    """``"an int"``, ``"a list"``."""
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


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

    def fingerprint(self) -> dict:
        return {"vocabulary": self.vocabulary.fingerprint(), "add_eos": self.add_eos,
                "required": self.required, "dtype": self.dtype}


class Task:
    """A source, output features and preprocessors: one cache per (task, split).

    Args:
      name: task name; letters, digits, ``_ . -`` (it names a cache folder).
      source: where the records come from.
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
      ValueError / TypeError: a bad name, no output features, a preprocessor that
        is not a Preprocessor, or an unknown packing mode.
    """

    def __init__(self, name: str, *, source: Source, output_features: Mapping[str, Feature],
                 preprocessors: Sequence[Preprocessor] = (), packing: str | None = None):
        self.name = check_name(name, "task")
        if not isinstance(source, Source):
            raise TypeError(f"task {name!r}: source must be a Source (got {type(source).__name__})")
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
        self.source = source
        self.output_features = dict(output_features)
        self.preprocessors = tuple(preprocessors)
        self.packing = packing

    @property
    def packing_feature(self) -> str | None:
        """The feature that ``packing="lm"`` packs (the only output feature), else None."""
        return next(iter(self.output_features)) if self.packing == "lm" else None

    def fingerprint(self, *, seed: int, sequence_length: Mapping[str, int] | None) -> dict:
        """JSON-able identity of the task's cache content for this seed and length.

        Keys: name, source (its fingerprint, with the file list), preprocessors
        (list of [name, params]), features ({name: vocabulary fingerprint, add_eos,
        required, dtype}), packing, seed, sequence_length.
        """
        return {
            "name": self.name,
            "source": self.source.fingerprint(),
            "preprocessors": [[p.name, p.params()] for p in self.preprocessors],
            "features": {k: f.fingerprint() for k, f in sorted(self.output_features.items())},
            "packing": self.packing,
            "seed": int(seed),
            "sequence_length": dict(sorted(sequence_length.items())) if sequence_length else None,
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

        Returns:
          (index into ``records``, example) pairs in input order, where the example
          holds exactly the output features as 1-D arrays of the feature dtype,
          plus ``"_truncated_tokens"`` (int) if a trimming preprocessor ran.
          Dropped examples and records a source skipped (``record.issue.action ==
          "skipped"``) are absent; a repaired record is preprocessed like any other.

          skipped: when given and the source's ``on_error`` skips ``bad_value``, examples
            that fail the checks below are left out and ``(index, message)`` is
            appended here instead of raising (the pipeline quarantines them).

        Raises:
          ValueError: ``len(keys) != len(records)``; a required feature is missing,
            null, still a string (no ``tokenize``), not a 1-D sequence of integers,
            or holds an id outside its vocabulary; the message names the record
            (file_index, record_number), the feature and the value.
        """
        return self.preprocess_columns(records, keys, seed=seed, sequence_length=sequence_length,
                                       skipped=skipped).examples()

    def preprocess_columns(self, records: Sequence[SourceRecord], keys: Sequence[bytes], *, seed: int,
                           sequence_length: Mapping[str, int] | None,
                           skipped: list | None = None) -> "ExampleBatch":
        """``preprocess_batch``, returning the examples as columns (an ``ExampleBatch``:
        per feature one array of every example's tokens and their offsets), which
        the pipeline encodes without a loop over examples. Same arguments, the same
        examples in the same order, and the same errors as ``preprocess_batch``."""
        if len(keys) != len(records):
            raise ValueError(f"task {self.name!r}: got {len(keys)} keys for {len(records)} records")
        # A batch with columns (the pipeline's ``LiveRecords``) holds no skipped record.
        text_values = getattr(records, "text_values", None)
        live = list(range(len(records))) if text_values is not None else \
            [i for i, r in enumerate(records) if not is_error_record(r)]
        fast = self._language_model_columns(records, live, sequence_length, text_values)
        if fast is not None:
            return fast
        ctx = PreprocessContext(output_features=self.output_features, sequence_length=sequence_length,
                                seed=int(seed), keys=[bytes(keys[i]) for i in live])
        inputs = [dict(records[i].data) for i in live]
        try:
            survivors = run_preprocessors(self.preprocessors, inputs, ctx)
        except PreprocessorError as e:
            if e.index is None:
                raise ValueError(f"task {self.name!r}, a batch of {len(inputs)} records: {e}") from None
            r = records[live[e.index]]
            raise ValueError(f"task {self.name!r}, {self.record_label(r)}: {e}") from None
        index = [live[j] for j, _ in survivors]
        examples = [ex for _, ex in survivors]
        batch = self._finalize_batch(index, examples)
        if batch is not None:
            return batch
        # Slow path (values that are not 1-D integer arrays, or a failed check):
        # example by example, so that errors and skips name the first bad record.
        out_index, out = [], []
        for i, ex in zip(index, examples):
            try:
                out.append(self._finalize(ex, records[i]))
                out_index.append(i)
            except ValueError as e:
                if skipped is None or self.source.on_error.action("bad_value") != "skip":
                    raise ValueError(f"{e}; {error_hint('bad_value')}") from None
                skipped.append((i, str(e)))
        return ExampleBatch.from_examples(out_index, out, self.output_features)

    def _language_model_chain(self):
        """``(key, feature name, filter, eos step)`` when the preprocessors are the
        plain language-model chain ``rekey({feature: key})``, ``tokenize()``, an
        optional ``filter_empty()`` and an optional ``append_eos()`` or
        ``append_eos_after_trim()``, for one output feature; else None."""
        from seqcache.tasks import preprocessors as P

        chain = list(self.preprocessors)
        if len(self.output_features) != 1 or len(chain) < 2:
            return None
        first, second, rest = chain[0], chain[1], chain[2:]
        if type(first) is not P.rekey or len(first.key_map) != 1 or type(second) is not P.tokenize \
                or second.copy_pretokenized:
            return None
        ((name, key),) = first.key_map.items()
        if name not in self.output_features or not key:
            return None
        keep_empty = True
        if rest and type(rest[0]) is P.filter_empty:
            keep_empty, rest = False, rest[1:]
        if len(rest) > 1 or (rest and type(rest[0]) not in (P.append_eos, P.append_eos_after_trim)):
            return None
        return key, name, keep_empty, rest[0] if rest else None

    def _language_model_columns(self, records: Sequence[SourceRecord], live: list[int],
                                sequence_length: Mapping[str, int] | None,
                                text_values=None) -> "ExampleBatch | None":
        """The plain language-model chain (``_language_model_chain``) on whole
        columns: one ``encode_batch`` call, then EOS and trimming on the
        concatenated tokens, with no example dicts. The same examples as running
        the preprocessors one by one; None (the general path) for anything else,
        and for any batch holding a value that is not text, or ids outside the
        vocabulary, so that errors keep naming the record."""
        chain = self._language_model_chain()
        if chain is None:
            return None
        key, name, keep_empty, eos_step = chain
        texts = text_values(key, live) if text_values is not None else None
        if texts is None:
            texts = []
            for i in live:
                data = records[i].data
                value = data.get(key)
                if type(value) is not str or TRUNCATED_TOKENS_KEY in data:
                    return None
                texts.append(value)
        feature = self.output_features[name]
        try:
            flat, lengths = feature.vocabulary.encode_batch_flat(texts)
        except Exception:  # the general path reports it, naming the record
            return None
        index = np.asarray(live, dtype=np.int64)
        if not keep_empty:
            kept = lengths > 0
            if not kept.all():
                flat = flat[np.repeat(kept, lengths)]
                lengths, index = lengths[kept], index[kept]
        n = len(index)
        truncated = np.zeros(n, dtype=np.int64)
        has_truncated = np.zeros(n, dtype=bool)
        from seqcache.tasks import preprocessors as P

        if isinstance(eos_step, P.append_eos_after_trim):
            seq = eos_step.feature_lengths if eos_step.feature_lengths is not None else sequence_length
            length = (seq or {}).get(name)
            keep = None if length is None else int(length) - (1 if feature.add_eos else 0)
            if keep is not None and keep < 0:
                return None
            has_truncated[:] = True
            if keep is not None and (lengths > keep).any():
                starts = np.zeros(n + 1, dtype=np.int64)
                np.cumsum(lengths, out=starts[1:])
                position = np.arange(flat.size, dtype=np.int64) - np.repeat(starts[:-1], lengths)
                flat = flat[position < keep]
                truncated = np.maximum(lengths - keep, 0)
                lengths = np.minimum(lengths, keep)
        if eos_step is not None and feature.add_eos:
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths + 1, out=offsets[1:])
            out = np.empty(int(offsets[-1]), dtype=np.int32)
            ends = offsets[1:] - 1
            out[ends] = int(feature.vocabulary.eos_id)
            mask = np.ones(out.size, dtype=bool)
            mask[ends] = False
            out[mask] = flat
            flat = out
        else:
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
        ranges = {}
        if flat.size:
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= feature.vocabulary.vocab_size:
                return None
            ranges[name] = (lo, hi)
        columns = {name: (flat.astype(feature.dtype, copy=False), offsets)}
        return ExampleBatch(index, columns, truncated, has_truncated, ranges)

    def _finalize_batch(self, index: list[int], examples: list[dict]) -> "ExampleBatch | None":
        """The fast path of finalising a batch: every output feature of every
        example is a 1-D integer numpy array (or an absent optional feature) with
        ids inside its vocabulary; one concatenation and one range check per
        feature and batch. None when anything else is seen (the caller then
        takes the example-by-example path, which reports the first bad record)."""
        n = len(examples)
        columns, ranges = {}, {}
        for name, feature in self.output_features.items():
            values = []
            for ex in examples:
                v = ex.get(name)
                if type(v) is not np.ndarray or v.ndim != 1 or (v.dtype.kind not in "iu" and v.size):
                    if v is None and not feature.required:
                        v = _EMPTY_INT32  # an absent optional feature is stored empty
                    else:
                        return None
                values.append(v)
            lengths = np.fromiter((v.size for v in values), dtype=np.int64, count=n)
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            kinds = {v.dtype for v in values if v.size}
            if len(kinds) > 1 and any(k.kind == "u" and k.itemsize == 8 for k in kinds):
                return None  # uint64 with signed ids would concatenate to float64
            flat = np.concatenate(values) if values else np.zeros(0, np.int32)
            if flat.size:
                if flat.dtype.kind not in "iu":
                    return None
                lo, hi = int(flat.min()), int(flat.max())
                if lo < 0 or hi >= feature.vocabulary.vocab_size:
                    return None
                ranges[name] = (lo, hi)
            columns[name] = (flat.astype(feature.dtype, copy=False), offsets)
        truncated = np.fromiter((int(ex.get(TRUNCATED_TOKENS_KEY, 0)) for ex in examples), dtype=np.int64, count=n)
        has_truncated = np.fromiter((TRUNCATED_TOKENS_KEY in ex for ex in examples), dtype=bool, count=n)
        return ExampleBatch(np.asarray(index, dtype=np.int64), columns, truncated, has_truncated, ranges)

    def record_label(self, record: SourceRecord) -> str:
        """The record in words that do not depend on how the file was split
        (they go into quarantine.jsonl): ``"line at byte 17 of file 0"``,
        ``"row 3 of file 1"``, ``"record 5 of file 0"``, ``"file 2"``
        (``describe_record(..., stable=True)``)."""
        locator = getattr(self.source, "locator", "record")
        if locator == "file":
            return f"file {record.file_index}"
        return f"{describe_record('', locator, record.record_number, stable=True)} of file {record.file_index}"

    def _finalize(self, ex: dict, record: SourceRecord) -> dict[str, np.ndarray]:
        where = f"task {self.name!r}, {self.record_label(record)}"
        result = {}
        for name, feature in self.output_features.items():
            value = ex.get(name)
            if value is None:
                if feature.required:
                    if name in ex:
                        raise ValueError(f"{where}: feature {name!r} is null (expected text or token ids)")
                    raise ValueError(f"{where}: required feature {name!r} is missing (example keys: {sorted(ex)})")
                result[name] = np.zeros((0,), dtype=feature.dtype)
                continue
            if isinstance(value, (str, bytes)):
                raise ValueError(f"{where}: feature {name!r} is still text; add the tokenize() preprocessor")
            try:
                arr = np.asarray(value)
            except ValueError:  # ragged nesting
                arr = np.asarray(None)
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                shown = repr(value)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise ValueError(
                    f"{where}: feature {name!r} is {_a(type(value).__name__)} ({shown}); "
                    "expected text (a string) or a 1-D sequence of integer token ids"
                )
            if arr.size:
                lo, hi = int(arr.min()), int(arr.max())
                size = feature.vocabulary.vocab_size
                if lo < 0 or hi >= size:
                    bad = lo if lo < 0 else hi
                    raise ValueError(
                        f"{where}: feature {name!r} has token id {bad}, outside its vocabulary [0, {size})"
                    )
            result[name] = arr.astype(feature.dtype, copy=False)
        if TRUNCATED_TOKENS_KEY in ex:
            result[TRUNCATED_TOKENS_KEY] = int(ex[TRUNCATED_TOKENS_KEY])
        return result

    def __repr__(self) -> str:
        return (f"Task({self.name!r}, source={self.source.describe()!r}, features={sorted(self.output_features)}, "
                f"preprocessors={[p.name for p in self.preprocessors]}, packing={self.packing!r})")


@dataclasses.dataclass
class ExampleBatch:
    """The examples of one batch of records, as columns.

    Attributes:
      index: int64 ``(n,)``: the input record each example comes from (index
        into the records given to ``Task.preprocess_columns``), in input order.
      columns: feature name -> ``(values, offsets)``: ``values`` 1-D in the
        feature's dtype, every example's tokens one after the other; ``offsets``
        int64 ``(n + 1,)``: example ``i`` is ``values[offsets[i]:offsets[i + 1]]``.
      truncated: int64 ``(n,)``: tokens a trimming preprocessor removed (0 when
        none ran).
      has_truncated: bool ``(n,)``: whether a trimming preprocessor ran on the
        example (``"_truncated_tokens"`` in its dict).
      ranges: feature name -> ``(min, max)`` of its values (features with values
        only): the vocabulary check's result, reused by the encoder.
    """

    index: np.ndarray
    columns: dict
    truncated: np.ndarray
    has_truncated: np.ndarray
    ranges: dict

    def __len__(self) -> int:
        return len(self.index)

    def lengths(self, names: Sequence[str]) -> np.ndarray:
        """int64 ``(n, len(names))``: every example's length in tokens per feature."""
        if not names:
            return np.zeros((len(self), 0), dtype=np.int64)
        return np.stack([np.diff(self.columns[name][1]) for name in names], axis=1)

    def examples(self) -> list[tuple[int, dict[str, np.ndarray]]]:
        """``(index, example)`` pairs, the examples as dicts of views (the form
        ``Task.preprocess_batch`` returns)."""
        out = []
        per_feature = []
        for name, (values, offsets) in self.columns.items():
            bounds = offsets.tolist()
            per_feature.append((name, values, bounds))
        for k, i in enumerate(self.index.tolist()):
            ex = {name: values[bounds[k]:bounds[k + 1]] for name, values, bounds in per_feature}
            if self.has_truncated[k]:
                ex[TRUNCATED_TOKENS_KEY] = int(self.truncated[k])
            out.append((i, ex))
        return out

    @classmethod
    def from_examples(cls, index: Sequence[int], examples: Sequence[dict], output_features: Mapping[str, Feature]
                      ) -> "ExampleBatch":
        """Columns of finalised examples (dicts of 1-D arrays of the feature dtypes)."""
        n = len(examples)
        columns, ranges = {}, {}
        for name, feature in output_features.items():
            values = [ex[name] for ex in examples]
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum([v.size for v in values], out=offsets[1:])
            flat = np.concatenate(values).astype(feature.dtype, copy=False) if n else np.zeros(0, feature.dtype)
            columns[name] = (flat, offsets)
            if flat.size:
                ranges[name] = (int(flat.min()), int(flat.max()))
        truncated = np.asarray([int(ex.get(TRUNCATED_TOKENS_KEY, 0)) for ex in examples], dtype=np.int64)
        has_truncated = np.asarray([TRUNCATED_TOKENS_KEY in ex for ex in examples], dtype=bool)
        return cls(np.asarray(index, dtype=np.int64), columns, truncated, has_truncated, ranges)
