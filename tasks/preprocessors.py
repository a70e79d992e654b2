"""Preprocessors: small, named, parameterised steps that turn records into examples.

A preprocessor works on a batch of examples (dicts) at a time and returns one
output per input: a dict, or None to drop the example. Its ``name`` and
``params()`` are part of the task fingerprint, so a changed parameter gives a
different cache. The pipeline calls ``process_batch`` with batches of a few
hundred records; tokenisation runs once per batch and feature (the fast path).

Randomness comes only from ``PreprocessContext.rng(i)``, seeded by the task seed
and the example's shuffle key (the keyed hash of its raw record): the draws for a
record are the same whatever batch, worker or position it lands in.

Names follow seqio: ``rekey``, ``tokenize``, ``append_eos``,
``append_eos_after_trim``, ``trim`` (seqio's ``trim_output_features``) and
``filter_empty``.
"""

from __future__ import annotations

import dataclasses
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
    """

    output_features: Mapping[str, Any]
    sequence_length: Mapping[str, int] | None
    seed: int
    keys: list[bytes]

    def rng(self, i: int, salt: str = "") -> np.random.Generator:
        """A generator for example ``i``, seeded only by (seed, keys[i], salt).

        Use a distinct ``salt`` (e.g. the preprocessor's name) when two
        preprocessors of one task draw random numbers, so their draws differ.
        """
        entropy = [int(self.seed), int.from_bytes(self.keys[i], "little"), len(self.keys[i])]
        if salt:
            entropy.append(int.from_bytes(salt.encode("utf-8"), "little"))
        return np.random.default_rng(np.random.SeedSequence(entropy))

    def example(self, i: int) -> "PreprocessContext":
        """The context of example ``i`` alone (its ``rng(0)`` equals ``self.rng(i)``)."""
        return dataclasses.replace(self, keys=[self.keys[i]])


class Preprocessor:
    """Base class of preprocessors.

    Subclasses set ``name``, return their parameters from ``params()`` (JSON-able)
    and implement either ``__call__(example, ctx) -> dict | None`` (per example;
    ``ctx`` is the example's own context, so use ``ctx.rng(0)``) or
    ``process_batch(examples, ctx)`` (per batch, the fast path).
    """

    name: str = "preprocessor"

    def params(self) -> dict:
        """JSON-able parameters; part of the task fingerprint."""
        return {}

    def process_batch(self, examples: list[dict], ctx: PreprocessContext) -> list[dict | None]:
        """One output per input example: the new example, or None to drop it."""
        return [self(ex, ctx.example(i)) for i, ex in enumerate(examples)]

    def __call__(self, example: dict, ctx: PreprocessContext) -> dict | None:
        raise TypeError(f"preprocessor {self.name!r} implements neither __call__ nor process_batch")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{self.name}({args})"


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

    def process_batch(self, examples, ctx):
        # rekey draws no randomness: no per-example context needed (the fast path).
        items = tuple(self.key_map.items())
        if all(old for _, old in items):
            try:
                if len(items) == 1:
                    ((new, old),) = items
                    out = [{new: ex[old]} for ex in examples]
                else:
                    out = [{new: ex[old] for new, old in items} for ex in examples]
            except KeyError:
                return [self(ex, ctx) for ex in examples]  # names the missing key
            if any(TRUNCATED_TOKENS_KEY in ex for ex in examples):
                for ex, new_ex in zip(examples, out):
                    if TRUNCATED_TOKENS_KEY in ex:
                        new_ex[TRUNCATED_TOKENS_KEY] = ex[TRUNCATED_TOKENS_KEY]
            return out
        return [self(ex, ctx) for ex in examples]

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


class tokenize(Preprocessor):  # noqa: N801
    """Tokenizes every output feature whose value is a ``str``.

    One ``encode_batch`` call per feature for the whole batch. Values become 1-D
    int32 arrays. With ``copy_pretokenized`` the text is kept under
    ``"<feature>_pretokenized"`` (dropped from the final example).
    """

    name = "tokenize"

    def __init__(self, *, copy_pretokenized: bool = False):
        self.copy_pretokenized = bool(copy_pretokenized)

    def params(self) -> dict:
        return {"copy_pretokenized": self.copy_pretokenized}

    def process_batch(self, examples, ctx):
        out = [dict(ex) for ex in examples]
        for name, feature in ctx.output_features.items():
            idx = [i for i, ex in enumerate(out) if isinstance(ex.get(name), str)]
            if not idx:
                continue
            texts = [out[i][name] for i in idx]
            ids = feature.vocabulary.encode_batch(texts)
            for i, text, arr in zip(idx, texts, ids):
                if self.copy_pretokenized:
                    out[i][f"{name}_pretokenized"] = text
                out[i][name] = arr
        return out


def _is_tokens(value) -> bool:
    return isinstance(value, (np.ndarray, list, tuple))


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """int64 ``(n + 1,)`` offsets of consecutive pieces of ``lengths``."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _append_to_each(arrays: Sequence[np.ndarray], keep: np.ndarray | None, eos: int | None) -> list[np.ndarray]:
    """Every 1-D array of ``arrays`` cast to int32, cut to its first ``keep[i]``
    elements (all when ``keep`` is None) and followed by ``eos`` (nothing when
    None), in one pass over the batch's tokens: the results are views of one
    new int32 array. The Python work is per example (slicing the views), never
    per token."""
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    flat = np.concatenate(arrays, dtype=np.int32, casting="unsafe") if arrays else np.zeros(0, np.int32)
    if keep is not None:
        kept = np.minimum(lengths, keep)
        if (kept != lengths).any():
            starts = _offsets(lengths)[:-1]
            position = np.arange(flat.size, dtype=np.int64) - np.repeat(starts, lengths)
            flat = flat[position < np.repeat(kept, lengths)]
            lengths = kept
    extra = 0 if eos is None else 1
    offsets = _offsets(lengths + extra)
    if extra:
        out = np.empty(offsets[-1], dtype=np.int32)
        ends = offsets[1:] - 1
        out[ends] = eos
        mask = np.ones(out.size, dtype=bool)
        mask[ends] = False
        out[mask] = flat
    else:
        out = flat
    bounds = offsets.tolist()
    return [out[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


class append_eos(Preprocessor):  # noqa: N801
    """Appends the vocabulary's EOS id to every token feature with ``add_eos=True``.

    Token values become int32 arrays. One numpy pass over the batch's tokens
    per feature (the results are views of one array), not one per example.
    """

    name = "append_eos"

    def process_batch(self, examples, ctx):
        out = [dict(ex) for ex in examples]
        for name, feature in ctx.output_features.items():
            if not feature.add_eos:
                continue
            where, arrays = [], []
            ndarray = np.ndarray
            for i, ex in enumerate(out):
                value = ex.get(name)
                if type(value) is ndarray:
                    ids = value
                elif _is_tokens(value):
                    ids = np.asarray(value)
                else:
                    continue
                if ids.ndim == 1 and (ids.dtype.kind in "iu" or ids.size == 0):
                    where.append(i)
                    arrays.append(ids)
                # Anything else (strings, floats, nested lists) is left as it is
                # for the task to reject, naming the record.
            if where:
                for i, ids in zip(where, _append_to_each(arrays, None, int(feature.vocabulary.eos_id))):
                    out[i][name] = ids
        return out


def _lengths(feature_lengths, ctx) -> Mapping[str, int] | None:
    return feature_lengths if feature_lengths is not None else ctx.sequence_length


def _add_truncated(example: dict, n: int) -> None:
    example[TRUNCATED_TOKENS_KEY] = int(example.get(TRUNCATED_TOKENS_KEY, 0)) + int(n)


class trim(Preprocessor):  # noqa: N801
    """Trims token features to their length (seqio's ``trim_output_features``).

    Lengths come from ``feature_lengths`` or else ``ctx.sequence_length``; with
    neither, or for a feature without a length, nothing is trimmed. The number of
    removed tokens (summed over features) is added to
    ``example["_truncated_tokens"]`` (an int, 0 when nothing was cut).
    """

    name = "trim"

    def __init__(self, feature_lengths: Mapping[str, int] | None = None):
        self.feature_lengths = dict(feature_lengths) if feature_lengths is not None else None

    def params(self) -> dict:
        return {"feature_lengths": dict(sorted(self.feature_lengths.items())) if self.feature_lengths else None}

    def process_batch(self, examples, ctx):
        lengths = _lengths(self.feature_lengths, ctx) or {}
        out = []
        for ex in examples:
            ex = dict(ex)
            cut = 0
            for name, length in lengths.items():
                if name in ctx.output_features and _is_tokens(ex.get(name)) and len(ex[name]) > length:
                    cut += len(ex[name]) - int(length)
                    ex[name] = ex[name][: int(length)]
            _add_truncated(ex, cut)
            out.append(ex)
        return out


class append_eos_after_trim(trim):  # noqa: N801
    """Trims to length - 1 and then appends EOS, for features with ``add_eos=True``.

    Unlike ``trim`` followed by ``append_eos`` the EOS is never cut off. Features
    with ``add_eos=False`` are trimmed to their full length. Removed tokens are
    counted in ``example["_truncated_tokens"]`` as in ``trim``. Same parameters
    as ``trim``.
    """

    name = "append_eos_after_trim"

    def process_batch(self, examples, ctx):
        lengths = _lengths(self.feature_lengths, ctx) or {}
        out = [dict(ex) for ex in examples]
        cut = np.zeros(len(out), dtype=np.int64)
        for name, feature in ctx.output_features.items():
            where, arrays = [], []
            for i, ex in enumerate(out):
                if _is_tokens(ex.get(name)):
                    where.append(i)
                    arrays.append(np.asarray(ex[name], dtype=np.int32))
            if not where:
                continue
            length = lengths.get(name)
            keep = None if length is None else int(length) - (1 if feature.add_eos else 0)
            if (keep is not None and keep < 0) or any(a.ndim != 1 for a in arrays):
                # Not 1-D (an error), or a length of 0 with EOS: example by example, as it always was.
                return self._each(examples, ctx)
            eos = int(feature.vocabulary.eos_id) if feature.add_eos else None
            keep_each = None
            if keep is not None:
                sizes = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
                cut[where] += np.maximum(sizes - keep, 0)
                keep_each = np.full(len(arrays), keep, dtype=np.int64)
            for i, tokens in zip(where, _append_to_each(arrays, keep_each, eos)):
                out[i][name] = tokens
        for ex, n in zip(out, cut.tolist()):
            _add_truncated(ex, n)
        return out

    def _each(self, examples, ctx):
        lengths = _lengths(self.feature_lengths, ctx) or {}
        out = []
        for ex in examples:
            ex = dict(ex)
            cut = 0
            for name, feature in ctx.output_features.items():
                if not _is_tokens(ex.get(name)):
                    continue
                tokens = np.asarray(ex[name], dtype=np.int32)
                length = lengths.get(name)
                keep = None if length is None else int(length) - (1 if feature.add_eos else 0)
                if keep is not None and len(tokens) > keep:
                    cut += len(tokens) - keep
                    tokens = tokens[:keep]
                if feature.add_eos:
                    tokens = np.concatenate([tokens, np.asarray([feature.vocabulary.eos_id], dtype=np.int32)])
                ex[name] = tokens
            _add_truncated(ex, cut)
            out.append(ex)
        return out


class filter_empty(Preprocessor):  # noqa: N801
    """Drops examples in which any token feature (an output feature) is empty.

    Run it after ``tokenize`` and before ``append_eos``. Output features that are
    not present or not yet tokenized are ignored.
    """

    name = "filter_empty"

    def process_batch(self, examples, ctx):
        out = []
        for ex in examples:
            empty = any(_is_tokens(ex.get(name)) and len(ex[name]) == 0 for name in ctx.output_features)
            out.append(None if empty else ex)
        return out


class FunctionPreprocessor(Preprocessor):
    """Wraps a user function as a preprocessor.

    ``fn(example, ctx) -> dict | None`` (per example, ``ctx.rng(0)`` is the
    example's generator) or, with ``batched=True``, ``fn(examples, ctx) -> list``.
    The function must be deterministic given its inputs and picklable (module
    level). seqcache cannot see its code: change ``name`` or ``params`` whenever
    its behaviour changes, or a stale cache is reused.

    Args:
      fn: the function.
      name: name in the task fingerprint.
      params: JSON-able parameters in the task fingerprint (e.g. a version).
      batched: whether ``fn`` takes the whole batch.
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
            out = list(self.fn(examples, ctx))
            if len(out) != len(examples):
                raise ValueError(f"preprocessor {self.name!r} returned {len(out)} outputs for {len(examples)} examples")
            return out
        return [self.fn(ex, ctx.example(i)) for i, ex in enumerate(examples)]


class PreprocessorError(ValueError):
    """A preprocessor raised. ``index`` is the input index (into the examples
    given to ``run_preprocessors``) of the first example that fails on its own,
    or None when no single example does."""

    def __init__(self, message: str, index: int | None):
        super().__init__(message)
        self.index = index


def _failure(p: Preprocessor, error: Exception, examples: list[dict], ctx: PreprocessContext,
             alive: list[int]) -> PreprocessorError:
    """The error of preprocessor ``p`` on a batch, with the first example that
    fails alone (each is retried on its own, on this error path only) and the
    place in the code that raised."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    message = f"preprocessor {p.name!r} raised {type(error).__name__}: {error}{where}"
    for j, example in enumerate(examples):
        try:
            p.process_batch([example], dataclasses.replace(ctx, keys=ctx.keys[j:j + 1]))
        except Exception:
            return PreprocessorError(message, alive[j])
    return PreprocessorError(message, None)


def run_preprocessors(preprocessors: Sequence[Preprocessor], examples: list[dict],
                      ctx: PreprocessContext) -> list[tuple[int, dict]]:
    """Runs ``preprocessors`` in order; returns (input index, example) of survivors.

    Raises:
      PreprocessorError: a preprocessor raised (any exception); names it, the
        exception and where it was raised, with the input index of the example.
      ValueError: a preprocessor returned a different number of outputs than inputs.
    """
    alive = list(range(len(examples)))
    keys = list(ctx.keys)
    for p in preprocessors:
        if not examples:
            break
        step_ctx = dataclasses.replace(ctx, keys=keys)
        try:
            out = p.process_batch(examples, step_ctx)
        except Exception as e:
            raise _failure(p, e, examples, step_ctx, alive) from None
        if len(out) != len(examples):
            raise ValueError(f"preprocessor {p.name!r} returned {len(out)} outputs for {len(examples)} examples")
        keep = [j for j, ex in enumerate(out) if ex is not None]
        examples = [out[j] for j in keep]
        alive = [alive[j] for j in keep]
        keys = [keys[j] for j in keep]
    return list(zip(alive, examples))
