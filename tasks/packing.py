"""Packing: for language modelling (concatenate, then split to the sequence
length) and first-fit packing of multi-feature examples (``pack_first_fit``).

This is the "concatenate and split" packing of T5's LM pre-training (Raffel et al.
2020, arXiv 1910.10683; seqio's ``reduce_concat_tokens`` + ``split_tokens``), with
segment ids kept so that attention and positions can be reset at document
boundaries. Positions are not produced: they restart at 0 with every segment, so
they follow from the segment ids, and the feeder derives them when it reads a
batch (``seqcache.feeders.positions_from_segment_ids``; docs/cache-format.md,
"Positions"). The pipeline runs the packers on each shard after the shard's
examples are sorted by key, so their output is deterministic.

Vocabulary used below: the *stream* is the concatenation of the examples' tokens;
a *chunk* is a slice of exactly ``sequence_length`` tokens of the stream (the last
one may be shorter); a *segment* is the part of one example inside one chunk.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np


def pack_lm(examples: Iterable[tuple[dict[str, np.ndarray], Any]], *, feature: str = "targets",
            sequence_length: int) -> Iterator[tuple[dict[str, np.ndarray], list[tuple[Any, int]]]]:
    """Concatenates the examples' ``feature`` tokens and splits them into chunks.

    Args:
      examples: (example, provenance) pairs in stream order; ``example[feature]``
        is a 1-D integer array (already ending with EOS if the feature adds it);
        ``provenance`` is passed through untouched. Empty examples add nothing.
      feature: the feature to pack.
      sequence_length: tokens per chunk (>= 1).

    Yields:
      (chunk, segments) per chunk, where ``chunk`` holds two int32 arrays of the
      same length n (n == sequence_length except possibly for the last chunk,
      which is not padded):

      - ``feature``: the tokens, shape (n,);
      - ``f"{feature}_segment_ids"``: 1, 2, ... per segment, restarting at 1 in
        every chunk, shape (n,); a segment starts where an example starts or
        continues from the previous chunk, and its positions (0, 1, ...) are
        derived from these ids by the feeder;

      and ``segments`` lists, per segment in order, ``(provenance, offset)``:
      the provenance of the segment's example and the token offset within that
      example where the segment starts.

    Memory is O(sequence_length + one example): chunks hold views of the examples'
    arrays until they are emitted.

    Raises:
      ValueError: sequence_length < 1, or an example's feature is missing or not 1-D.
    """
    if sequence_length < 1:
        raise ValueError(f"sequence_length must be >= 1 (got {sequence_length=})")
    pieces: list[np.ndarray] = []
    segments: list[tuple[Any, int]] = []
    filled = 0
    for example, provenance in examples:
        if feature not in example:
            raise ValueError(f"pack_lm: example {provenance!r} has no feature {feature!r} (keys: {sorted(example)})")
        tokens = np.asarray(example[feature])
        if tokens.ndim != 1:
            raise ValueError(f"pack_lm: feature {feature!r} of example {provenance!r} must be 1-D (got {tokens.shape})")
        offset = 0
        n = len(tokens)
        while offset < n:
            take = min(sequence_length - filled, n - offset)
            pieces.append(tokens[offset:offset + take])
            segments.append((provenance, offset))
            filled += take
            offset += take
            if filled == sequence_length:
                yield _emit(pieces, segments, feature)
                pieces, segments, filled = [], [], 0
    if filled:
        yield _emit(pieces, segments, feature)


def _emit(pieces, segments, feature):
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    tokens = np.concatenate(pieces).astype(np.int32, copy=False)
    segment_ids = np.repeat(np.arange(1, len(pieces) + 1, dtype=np.int32), lengths)
    return {feature: tokens, f"{feature}_segment_ids": segment_ids}, list(segments)


def pack_first_fit(examples: Iterable[tuple[dict[str, np.ndarray], Any]], *, sequence_length: dict[str, int],
                   max_open_rows: int = 64) -> Iterator[tuple[dict[str, np.ndarray], list[tuple[Any, int]], int]]:
    """First-fit packing of multi-feature examples into rows (T5's
    ``pack_dataset``; t5x/seqio ``trim_and_pack_dataset``), deterministic in the
    input order.

    Every example is first trimmed to ``sequence_length[f]`` per feature (the
    cut tokens are counted, the example is kept); it then goes into the first
    open row where *every* feature still has room, or opens a new row. At most
    ``max_open_rows`` rows are open: opening one more emits the oldest, so
    memory is O(max_open_rows x row) whatever the shard size; the rest are
    emitted at the end, in the order they were opened.

    Args:
      examples: (example, provenance) pairs in stream order; ``example[f]`` is a
        1-D integer array for each feature ``f`` of ``sequence_length``.
      sequence_length: feature -> row length in tokens (>= 1).
      max_open_rows: rows searched for room (>= 1).

    Yields:
      ``(row, segments, truncated)`` per row: ``row`` holds, per feature ``f``,
      ``f`` (int32 tokens, shape (n_f,), n_f <= sequence_length[f], not padded)
      and ``f"{f}_segment_ids"`` (int32, shape (n_f,); positions are derived
      from them by the feeder); example j of the row has segment id j + 1 in
      every feature, so the
      decoder's segment k attends to the encoder's segment k. ``segments``
      lists ``(provenance, 0)`` per example in segment order; ``truncated`` is
      the number of tokens trimmed from the row's examples.

    Raises:
      ValueError: a bad length or ``max_open_rows``; an example lacking a
        feature, or one that is not 1-D.
    """
    names = list(sequence_length)
    if not names or any(int(n) < 1 for n in sequence_length.values()):
        raise ValueError(f"pack_first_fit needs a length >= 1 per feature (got {sequence_length=})")
    if max_open_rows < 1:
        raise ValueError(f"max_open_rows must be >= 1 (got {max_open_rows=})")
    limits = np.asarray([int(sequence_length[f]) for f in names], dtype=np.int64)
    open_rows: list[dict] = []  # {"used": array (F,), "pieces": [[arrays] per feature], "segments": [], "cut": int}
    for example, provenance in examples:
        pieces, cut = [], 0
        for f, limit in zip(names, limits):
            if f not in example:
                raise ValueError(f"pack_first_fit: example {provenance!r} has no feature {f!r} "
                                 f"(keys: {sorted(example)})")
            tokens = np.asarray(example[f])
            if tokens.ndim != 1:
                raise ValueError(f"pack_first_fit: feature {f!r} of example {provenance!r} must be 1-D "
                                 f"(got {tokens.shape})")
            if len(tokens) > limit:
                cut += len(tokens) - int(limit)
                tokens = tokens[:limit]
            pieces.append(tokens)
        need = np.asarray([len(p) for p in pieces], dtype=np.int64)
        row = next((r for r in open_rows if np.all(r["used"] + need <= limits)), None)
        if row is None:
            if len(open_rows) == max_open_rows:
                yield _emit_row(open_rows.pop(0), names)
            row = {"used": np.zeros(len(names), dtype=np.int64), "pieces": [[] for _ in names], "segments": [],
                   "cut": 0}
            open_rows.append(row)
        row["used"] += need
        for k, p in enumerate(pieces):
            row["pieces"][k].append(p)
        row["segments"].append((provenance, 0))
        row["cut"] += cut
    for row in open_rows:
        yield _emit_row(row, names)


def _emit_row(row, names):
    out = {}
    for f, pieces in zip(names, row["pieces"]):
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        tokens = np.concatenate(pieces).astype(np.int32, copy=False) if pieces else np.zeros(0, np.int32)
        out[f] = tokens
        out[f"{f}_segment_ids"] = np.repeat(np.arange(1, len(pieces) + 1, dtype=np.int32), lengths)
    return out, list(row["segments"]), int(row["cut"])
