"""Preprocessors: small, named, parameterised steps that turn records into examples.

A preprocessor maps a batch of examples held as columns (an ``ExampleBatch``)
to the new batch, less the examples it drops; per-example code implements
``__call__`` and the base class converts. ``name`` and ``params()`` are part of
the task fingerprint. Randomness comes only from ``PreprocessContext.rng(i)``,
seeded by the task seed and the example's shuffle key, so a record's draws do
not depend on its batch, worker or position. Names follow seqio (``trim`` is
seqio's ``trim_output_features``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import traceback
from typing import Any, Callable, Mapping, Sequence

import numpy as np

# Example key holding the number of tokens ``trim`` removed (an int); the
# pipeline sums it into the cache statistics.
TRUNCATED_TOKENS_KEY = "_truncated_tokens"


@dataclasses.dataclass
class PreprocessContext:
    """What a preprocessor may use besides the examples.

    Attributes:
      output_features: the task's output features (name -> Feature).
      sequence_length: feature name -> length in tokens, or None.
      seed: the task seed (non-negative int).
      keys: one shuffle key (bytes, 16 in the pipeline) per example of the batch.
      keep_pretokenized: features whose text ``tokenize`` keeps as
        ``"<feature>_pretokenized"`` whatever its ``copy_pretokenized`` (the
        task's ``pretokenized_features``: an evaluation cache stores it).
    """

    output_features: Mapping[str, Any]
    sequence_length: Mapping[str, int] | None
    seed: int
    keys: list[bytes]
    keep_pretokenized: tuple = ()

    def rng(self, i: int, salt: str = "") -> np.random.Generator:
        """A generator for example ``i``, seeded only by (seed, keys[i], salt); a
        distinct ``salt`` (e.g. the preprocessor's name) keeps two preprocessors'
        draws apart."""
        entropy = [int(self.seed), int.from_bytes(self.keys[i], "little"), len(self.keys[i])]
        if salt:
            entropy.append(int.from_bytes(salt.encode("utf-8"), "little"))
        return np.random.default_rng(np.random.SeedSequence(entropy))

    def example(self, i: int) -> "PreprocessContext":
        """The context of example ``i`` alone (its ``rng(0)`` equals ``self.rng(i)``)."""
        return PreprocessContext(self.output_features, self.sequence_length, self.seed, [self.keys[i]],
                                 self.keep_pretokenized)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """int64 ``(n + 1,)`` offsets of consecutive pieces of ``lengths``."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def cut_tokens(values: np.ndarray, offsets: np.ndarray, keep: int | None = None,
               eos: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every example of the ragged column ``(values, offsets)`` (1-D values;
    int64 ``(n + 1,)`` offsets from 0) cut to its first ``keep`` tokens (all
    when None) and followed by ``eos`` (nothing when None).

    Returns ``(values, offsets, cut)``: the new column, values of the input
    dtype, and int64 ``(n,)``, the tokens removed from each example.
    """
    lengths = offsets[1:] - offsets[:-1]
    cut = np.zeros(len(lengths), dtype=np.int64)
    if keep is not None and (lengths > keep).any():
        # One byte a value: -1 where a cut range starts, +1 where it ends; the running
        # sum is -1 inside a cut range (never int64 positions of every value: a 30 MB
        # line of bytes would take 720 MB).
        over = np.flatnonzero(lengths > keep)
        marks = np.zeros(values.size + 1, dtype=np.int8)
        marks[offsets[over] + keep] = -1
        marks[offsets[over + 1]] += 1
        values = values[np.cumsum(marks[:-1], dtype=np.int8) == 0]
        cut = np.maximum(lengths - keep, 0)
        lengths = lengths - cut
        offsets = _offsets(lengths)
    if eos is None:
        return values, offsets, cut
    offsets = _offsets(lengths + 1)
    out = np.empty(int(offsets[-1]), dtype=values.dtype)
    ends = offsets[1:] - 1
    out[ends] = eos
    mask = np.ones(out.size, dtype=bool)
    mask[ends] = False
    out[mask] = values
    return out, offsets, cut


def _fits(values: np.ndarray, dtype) -> bool:
    """Whether the integer ``values`` convert to ``dtype`` unchanged."""
    if not values.size or values.dtype == dtype:
        return True
    info = np.iinfo(dtype)
    return values.dtype.kind in "iu" and info.min <= int(values.min()) and int(values.max()) <= info.max


def _as_ids(value) -> np.ndarray | None:
    """``value`` as a 1-D integer array when it is one (an empty sequence too), else None."""
    if not isinstance(value, (np.ndarray, list, tuple)):
        return None
    try:
        ids = np.asarray(value)
    except ValueError:  # ragged nesting
        return None
    return ids if ids.ndim == 1 and (ids.dtype.kind in "iu" or not ids.size) else None


@dataclasses.dataclass
class ExampleBatch:
    """A batch of examples as columns.

    Attributes:
      index: int64 ``(n,)``: the input (example or record) of each example, in order.
      columns: feature name -> ``(values, offsets)``, the token features:
        ``values`` 1-D integers, ``offsets`` int64 ``(n + 1,)``: example ``i``
        is ``values[offsets[i]:offsets[i + 1]]``. When finished (what
        ``Task.preprocess_columns`` returns): the output features, in their dtypes.
      truncated: int64 ``(n,)``: tokens a trimming preprocessor removed.
      has_truncated: bool ``(n,)``: whether one ran (``"_truncated_tokens"`` in the dict).
      ranges: feature name -> ``(min, max)`` of its values, when finished: the
        vocabulary check's result, reused by the encoder.
      fields: key -> list of ``n`` values: every other value (text, anything a
        preprocessor adds); ``ABSENT`` where an example lacks the key.
    """

    ABSENT = object()

    index: np.ndarray
    columns: dict
    truncated: np.ndarray
    has_truncated: np.ndarray
    ranges: dict = dataclasses.field(default_factory=dict)
    fields: dict = dataclasses.field(default_factory=dict)
    # (records, live, their data or None): example i is records[live[index[i]]], read on demand.
    source: Any = dataclasses.field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.index)

    @classmethod
    def from_records(cls, records: Sequence, live: Sequence[int]) -> "ExampleBatch":
        """The records at ``live`` as a batch, their data read only when asked for."""
        n, datas = len(live), None
        if getattr(records, "text_values", None) is None:
            datas = list(map(operator.attrgetter("data"), records if n == len(records) else [records[i] for i in live]))
            if any(map(operator.contains, datas, itertools.repeat(TRUNCATED_TOKENS_KEY))):
                return cls.from_dicts([dict(d) for d in datas])
        return cls(np.arange(n, dtype=np.int64), {}, np.zeros(n, np.int64), np.zeros(n, bool),
                   source=(records, live, datas))

    @classmethod
    def from_dicts(cls, examples: Sequence[dict | None], index: np.ndarray | None = None,
                   token_names=None) -> "ExampleBatch":
        """A batch of example dicts (a None is left out); ``index`` defaults to
        the positions. Features of ``token_names`` that every example holds as
        a 1-D integer numpy array become columns."""
        kept = [j for j, ex in enumerate(examples) if ex is not None]
        index = np.arange(len(examples), dtype=np.int64) if index is None else np.asarray(index, dtype=np.int64)
        rows = [examples[j] for j in kept]
        truncated = np.asarray([int(ex.get(TRUNCATED_TOKENS_KEY, 0)) for ex in rows], dtype=np.int64)
        has_truncated = np.asarray([TRUNCATED_TOKENS_KEY in ex for ex in rows], dtype=bool)
        columns, fields = {}, {}
        for key in dict.fromkeys(k for ex in rows for k in ex if k != TRUNCATED_TOKENS_KEY):
            column = [ex.get(key, cls.ABSENT) for ex in rows]
            if key in (token_names or ()) and all(
                    type(v) is np.ndarray and v.ndim == 1 and (v.dtype.kind in "iu" or not v.size) for v in column):
                values = np.concatenate(column) if column else np.zeros(0, np.int32)
                if values.dtype.kind in "iu":  # not uint64 mixed with signed ids, nor only empty floats
                    columns[key] = (values, _offsets(np.fromiter(map(len, column), np.int64, len(column))))
                    continue
            fields[key] = column
        return cls(index[kept], columns, truncated, has_truncated, fields=fields)

    def copy(self, **changes) -> "ExampleBatch":
        """A batch whose dicts of columns a step may change, with ``changes``
        (``dataclasses.replace`` without its cost per call)."""
        out = object.__new__(ExampleBatch)
        out.__dict__.update(self.__dict__, **{"columns": dict(self.columns), "fields": dict(self.fields), **changes})
        return out

    def field(self, key: str, strict: bool = False) -> list:
        """The values of ``key``, one per example: ``ABSENT`` where an example
        lacks it, or with ``strict`` a KeyError."""
        if key in self.columns:
            values, offsets = self.columns[key]
            bounds = offsets.tolist()
            return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        if key in self.fields or self.source is None:
            column = self.fields.get(key) or [self.ABSENT] * len(self)
            if strict and any(map(operator.is_, column, itertools.repeat(self.ABSENT))):
                raise KeyError(key)
            return column
        records, live, datas = self.source
        at = None if len(live) == len(self) else self.index.tolist()
        if datas is None:
            at = live if at is None else [live[j] for j in at]
            texts = records.text_values(key, at)
            if texts is not None:
                return _Texts(texts)
            datas = [records[i].data for i in at]
        elif at is not None:
            datas = [datas[j] for j in at]
        return list(map(operator.itemgetter(key), datas)) if strict else [d.get(key, self.ABSENT) for d in datas]

    def dicts(self) -> list[dict]:
        """The examples as dicts (token features as views of the columns)."""
        if self.source is not None:
            records, live, _ = self.source
            out = [dict(records[live[j]].data) for j in self.index.tolist()]
        else:
            out = [{} for _ in range(len(self))]
        for key in [*self.fields, *self.columns]:
            for ex, value in zip(out, self.field(key)):
                if value is not self.ABSENT:
                    ex[key] = value
        for ex, has, n in zip(out, self.has_truncated.tolist(), self.truncated.tolist()):
            if has:
                ex[TRUNCATED_TOKENS_KEY] = n
        return out

    def examples(self) -> list[tuple[int, dict]]:
        """``(index, example)`` pairs, the examples as dicts of views (the form
        ``Task.preprocess_batch`` returns)."""
        return list(zip(self.index.tolist(), self.dicts()))

    def take(self, keep: np.ndarray) -> "ExampleBatch":
        """The examples where the bool ``(n,)`` mask ``keep`` is True."""
        columns = {}
        for key, (values, offsets) in self.columns.items():
            lengths = offsets[1:] - offsets[:-1]
            columns[key] = (values[np.repeat(keep, lengths)], _offsets(lengths[keep]))
        fields = {key: [v for v, k in zip(column, keep.tolist()) if k] for key, column in self.fields.items()}
        return self.copy(index=self.index[keep], columns=columns, truncated=self.truncated[keep],
                         has_truncated=self.has_truncated[keep], fields=fields)

    def lengths(self, names: Sequence[str]) -> np.ndarray:
        """int64 ``(n, len(names))``: every example's length in tokens per feature."""
        if not names:
            return np.zeros((len(self), 0), dtype=np.int64)
        return np.stack([np.diff(self.columns[name][1]) for name in names], axis=1)

    def cut(self, key: str, keep: int | None, eos: int | None, dtype=None) -> np.ndarray:
        """``cut_tokens`` of feature ``key`` in place (after a cast to ``dtype``
        when given), on the examples holding token ids; a value of any other
        kind is left as it is. Returns int64 ``(n,)``: the tokens removed."""
        if key in self.columns:
            where, column, (values, offsets) = None, None, self.columns[key]
        else:
            column = self.field(key)
            where = [j for j, v in enumerate(column) if _as_ids(v) is not None]
            if not where:
                return np.zeros(len(self), np.int64)
            arrays = [_as_ids(column[j]) for j in where]
            kinds = {a.dtype for a in arrays if a.size}
            values = np.concatenate(arrays, dtype=kinds.pop() if len(kinds) == 1 else np.int64, casting="unsafe")
            offsets = _offsets(np.fromiter(map(len, arrays), np.int64, len(arrays)))
        if dtype is not None and _fits(values, dtype):  # ids that do not fit keep their dtype: Task's check names them
            values = values.astype(dtype, copy=False)
        values, offsets, cut = cut_tokens(values, offsets, keep, eos)
        self.put(key, column, where, values, offsets)
        if where is None:
            return cut
        full = np.zeros(len(self), np.int64)
        full[where] = cut
        return full

    def put(self, key: str, column: list, where: list[int] | None, values: np.ndarray, offsets: np.ndarray):
        """Sets ``key`` of the examples at ``where`` (all when None) of ``column``
        to the ragged ``(values, offsets)``; in place."""
        if where is None or len(where) == len(self):
            self.columns[key] = (values, offsets)
            self.fields.pop(key, None)
            return
        column, bounds = list(column), offsets.tolist()
        for k, j in enumerate(where):
            column[j] = values[bounds[k]:bounds[k + 1]]
        self.fields[key] = column


class _Texts(list):
    """A column known to hold only ``str`` (a source's text column)."""


class Preprocessor:
    """Base class of preprocessors.

    Subclasses set ``name``, return their JSON-able parameters from ``params()``
    and implement one of: ``__call__(example, ctx) -> dict | None`` (``ctx`` is
    the example's own: use ``ctx.rng(0)``); ``process_batch(examples, ctx) ->
    list[dict | None]``; ``process_columns(batch, ctx) -> ExampleBatch``.
    """

    name: str = "preprocessor"

    def params(self) -> dict:
        """JSON-able parameters; part of the task fingerprint."""
        return {}

    def process_columns(self, batch: ExampleBatch, ctx: PreprocessContext) -> ExampleBatch:
        """The batch after this step, less the examples it drops (what the
        pipeline calls); by default the examples as dicts through ``process_batch``.

        Raises:
          ValueError: ``process_batch`` returned a different number of outputs than inputs.
        """
        examples = batch.dicts()
        out = _one_each(self, self.process_batch(examples, ctx), examples, OutputCountError)
        return ExampleBatch.from_dicts(out, batch.index, ctx.output_features)

    def process_batch(self, examples: list[dict], ctx: PreprocessContext) -> list[dict | None]:
        """One output per input example: the new example, or None to drop it."""
        if type(self).process_columns is not Preprocessor.process_columns:
            out = self.process_columns(ExampleBatch.from_dicts(examples, None, ctx and ctx.output_features), ctx)
            result: list = [None] * len(examples)
            for j, ex in out.examples():
                result[j] = ex
            return result
        return [self(ex, ctx.example(i)) for i, ex in enumerate(examples)]

    def __call__(self, example: dict, ctx: PreprocessContext) -> dict | None:
        raise TypeError(f"preprocessor {self.name!r} implements neither __call__ nor process_batch")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{self.name}({args})"


class OutputCountError(ValueError):
    """A preprocessor returned a different number of outputs than inputs."""


def _one_each(p: Preprocessor, out, examples: list, error: type = ValueError) -> list:
    out = list(out)
    if len(out) != len(examples):
        raise error(f"preprocessor {p.name!r} returned {len(out)} outputs for {len(examples)} examples")
    return out


class rekey(Preprocessor):  # noqa: N801 (seqio's name)
    """Renames keys: ``key_map`` maps new key -> old key; other keys are dropped.

    An old key of None or ``""`` gives an empty string (seqio semantics).

    Raises (per example):
      ValueError: an old key is missing (names it and the keys present).
    """

    name = "rekey"

    def __init__(self, key_map: Mapping[str, str | None]):
        self.key_map = dict(key_map)

    def params(self) -> dict:
        return {"key_map": dict(sorted(self.key_map.items()))}

    def process_columns(self, batch, ctx):
        columns, fields = {}, {}
        for new, old in self.key_map.items():
            if old in batch.columns:
                columns[new] = batch.columns[old]
                continue
            try:
                fields[new] = batch.field(old, strict=True) if old else [""] * len(batch)
            except KeyError:
                for ex in batch.dicts():
                    self(ex, ctx)  # names the first example without the key
                raise
        return batch.copy(columns=columns, fields=fields, source=None)

    def __call__(self, example, ctx):
        out = {}
        for new, old in self.key_map.items():
            if not old:
                out[new] = ""
            elif old in example:
                out[new] = example[old]
            else:
                raise ValueError(f"rekey: the example has no key {old!r} (keys: {sorted(example)})")
        if TRUNCATED_TOKENS_KEY in example:
            out[TRUNCATED_TOKENS_KEY] = example[TRUNCATED_TOKENS_KEY]
        return out


@functools.cache
def _own_flat(cls: type) -> bool:
    """Whether ``cls.encode_batch_flat`` is at least as derived as its ``encode_batch``."""
    batch, flat = (next(i for i, c in enumerate(cls.__mro__) if m in c.__dict__)
                   for m in ("encode_batch", "encode_batch_flat"))
    return batch >= flat


def _encode_flat(vocabulary, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``vocabulary.encode_batch_flat(texts)``, or ``encode_batch`` where a
    subclass overrides that alone."""
    if _own_flat(type(vocabulary)):
        return vocabulary.encode_batch_flat(texts)
    arrays = vocabulary.encode_batch(texts)
    flat = np.concatenate(arrays, dtype=np.int32, casting="unsafe") if arrays else np.zeros(0, np.int32)
    return flat, np.fromiter(map(len, arrays), np.int64, len(arrays))


class tokenize(Preprocessor):  # noqa: N801
    """Tokenizes every output feature whose value is a ``str`` into 1-D int32 ids,
    one ``encode_batch_flat`` call per feature and batch. With ``copy_pretokenized``
    the text is kept under ``"<feature>_pretokenized"`` (not in the final example,
    except for the features of ``ctx.keep_pretokenized``, whose text is kept
    either way: a task with metrics stores it).
    """

    name = "tokenize"

    def __init__(self, *, copy_pretokenized: bool = False):
        self.copy_pretokenized = bool(copy_pretokenized)

    def params(self) -> dict:
        return {"copy_pretokenized": self.copy_pretokenized}

    def process_columns(self, batch, ctx):
        batch = batch.copy()
        for name, feature in ctx.output_features.items():
            if name in batch.columns:
                continue
            column, texts, where = batch.field(name), None, None
            if type(column) is not _Texts and set(map(type, column)) != {str}:
                where = [j for j, v in enumerate(column) if isinstance(v, str)]
                if not where:
                    continue
                texts = [column[j] for j in where]
            flat, lengths = _encode_flat(feature.vocabulary, column if texts is None else texts)
            if self.copy_pretokenized or name in ctx.keep_pretokenized:
                absent = ExampleBatch.ABSENT
                batch.fields[f"{name}_pretokenized"] = [v if isinstance(v, str) else absent for v in column]
            batch.put(name, column, where, flat, _offsets(lengths))
        return batch


class append_eos(Preprocessor):  # noqa: N801
    """Appends the vocabulary's EOS id to every token feature with ``add_eos=True``
    (values become int32), one numpy pass per feature and batch."""

    name = "append_eos"

    def process_columns(self, batch, ctx):
        batch = batch.copy()
        for name, feature in ctx.output_features.items():
            if feature.add_eos:
                batch.cut(name, None, int(feature.vocabulary.eos_id), np.int32)
        return batch


class trim(Preprocessor):  # noqa: N801
    """Trims token features to their length (seqio's ``trim_output_features``):
    ``feature_lengths``, else ``ctx.sequence_length``; a feature without one is
    kept whole. The removed tokens (summed over features) are added to
    ``example["_truncated_tokens"]`` (an int, 0 when nothing was cut).
    """

    name = "trim"
    _eos = False

    def __init__(self, feature_lengths: Mapping[str, int] | None = None):
        self.feature_lengths = dict(feature_lengths) if feature_lengths is not None else None

    def params(self) -> dict:
        return {"feature_lengths": dict(sorted(self.feature_lengths.items())) if self.feature_lengths else None}

    def process_columns(self, batch, ctx):
        lengths = (self.feature_lengths if self.feature_lengths is not None else ctx.sequence_length) or {}
        batch = batch.copy()
        cut = np.zeros(len(batch), np.int64)
        for name, feature in ctx.output_features.items():
            eos = int(feature.vocabulary.eos_id) if self._eos and feature.add_eos else None
            length = lengths.get(name)
            if length is not None or self._eos:
                keep = None if length is None else max(int(length) - (eos is not None), 0)
                cut += batch.cut(name, keep, eos, np.int32 if self._eos else None)
        batch.truncated = batch.truncated + cut
        batch.has_truncated = np.ones(len(batch), bool)
        return batch


class append_eos_after_trim(trim):  # noqa: N801
    """Trims to length - 1 and then appends EOS, for features with ``add_eos=True``
    (so EOS is never cut off); other features are trimmed to their length.
    Parameters and ``"_truncated_tokens"`` as ``trim``'s.
    """

    name = "append_eos_after_trim"
    _eos = True


class filter_empty(Preprocessor):  # noqa: N801
    """Drops examples in which any output feature holds no tokens (features absent
    or not yet tokenized are ignored). Run it after ``tokenize``, before ``append_eos``.
    """

    name = "filter_empty"

    def _empty(self, batch, ctx) -> np.ndarray:
        empty = np.zeros(len(batch), bool)
        for name in ctx.output_features:
            if name in batch.columns:
                offsets = batch.columns[name][1]
                empty |= offsets[1:] == offsets[:-1]
            else:
                empty |= [isinstance(v, (np.ndarray, list, tuple)) and len(v) == 0 for v in batch.field(name)]
        return empty

    def process_columns(self, batch, ctx):
        empty = self._empty(batch, ctx)
        return batch.take(~empty) if empty.any() else batch

    def process_batch(self, examples, ctx):  # keeps the example objects
        empty = self._empty(ExampleBatch.from_dicts(examples, None, ctx.output_features), ctx)
        return [None if e else ex for ex, e in zip(examples, empty.tolist())]


class FunctionPreprocessor(Preprocessor):
    """Wraps ``fn(example, ctx) -> dict | None`` (``ctx.rng(0)`` is the
    example's generator) or, with ``batched=True``, ``fn(examples, ctx) -> list``
    (the batch's example dicts) as a preprocessor named ``name`` with JSON-able
    ``params`` (e.g. a version) in the task fingerprint.

    ``fn`` must be deterministic and picklable (module level). seqcache cannot
    see its code: change ``name`` or ``params`` when its behaviour changes, or a
    stale cache is reused.
    """

    def __init__(self, fn: Callable, name: str, params: Mapping[str, Any] | None = None, *, batched: bool = False):
        if not callable(fn):
            raise TypeError(f"FunctionPreprocessor {name!r}: fn must be callable")
        self.fn = fn
        self.name = name
        self._params = dict(params or {})
        self.batched = bool(batched)

    def params(self) -> dict:
        return dict(self._params)

    def process_batch(self, examples, ctx):
        if self.batched:
            return _one_each(self, self.fn(examples, ctx), examples)
        return [self.fn(ex, ctx.example(i)) for i, ex in enumerate(examples)]


class PreprocessorError(ValueError):
    """A preprocessor raised. ``index`` is the input index (into the examples
    given to ``run_preprocessors``) of the first example that fails on its own,
    or None when no single example does."""

    def __init__(self, message: str, index: int | None):
        super().__init__(message)
        self.index = index


def run_columns(preprocessors: Sequence[Preprocessor], batch: ExampleBatch, ctx: PreprocessContext) -> ExampleBatch:
    """Runs ``preprocessors`` in order on ``batch`` (``ctx.keys``: one per input,
    indexed by ``batch.index``); returns the survivors.

    Raises:
      PreprocessorError: a preprocessor raised (any exception); names it, the
        exception and where it was raised, with the input index of the first
        example that fails alone (each is retried on its own, on this error path only).
      OutputCountError: a ``process_batch`` returned a different number of outputs than inputs.
    """
    step, index = ctx, None
    for p in preprocessors:
        if not len(batch):
            break
        if batch.index is not index:  # a step dropped examples (the index only ever shrinks)
            index = batch.index
            if len(index) != len(ctx.keys):
                step = dataclasses.replace(ctx, keys=[ctx.keys[j] for j in index.tolist()])
        try:
            out = p.process_columns(batch, step)
        except OutputCountError:
            raise
        except Exception as e:
            frames = traceback.extract_tb(e.__traceback__)
            where = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
            message = f"preprocessor {p.name!r} raised {type(e).__name__}: {e}{where}"
            for j in range(len(batch)):
                alone = np.arange(len(batch)) == j
                try:
                    p.process_columns(batch.take(alone), step.example(j))
                except Exception:
                    raise PreprocessorError(message, int(batch.index[j])) from None
            raise PreprocessorError(message, None) from None
        if not isinstance(out, ExampleBatch):
            raise PreprocessorError(f"preprocessor {p.name!r}: process_columns returned {type(out).__name__}, "
                                    "expected an ExampleBatch", None)
        batch = out
    return batch


def run_preprocessors(preprocessors: Sequence[Preprocessor], examples: list[dict],
                      ctx: PreprocessContext) -> list[tuple[int, dict]]:
    """``run_columns`` on example dicts; returns (input index, example) of survivors.

    Raises:
      PreprocessorError: as ``run_columns``.
      OutputCountError: a preprocessor returned a different number of outputs than inputs.
    """
    return run_columns(preprocessors, ExampleBatch.from_dicts(examples, None, ctx.output_features), ctx).examples()
