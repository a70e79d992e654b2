"""Packing for language modelling: concatenate, then split to the sequence length.

This is the "concatenate and split" packing of T5's LM pre-training (Raffel et al.
2020, arXiv 1910.10683; seqio's ``reduce_concat_tokens`` + ``split_tokens``), with
segment ids and positions kept so that attention and positions can be reset at
document boundaries. The pipeline runs it on each shard after the shard's
examples are sorted by key, so its output is deterministic.

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
      (chunk, segments) per chunk, where ``chunk`` holds three int32 arrays of the
      same length n (n == sequence_length except possibly for the last chunk,
      which is not padded):

      - ``feature``: the tokens, shape (n,);
      - ``f"{feature}_segment_ids"``: 1, 2, ... per segment, restarting at 1 in
        every chunk, shape (n,);
      - ``f"{feature}_positions"``: 0, 1, ... restarting at 0 at each segment
        start (also where an example continues from the previous chunk), shape (n,);

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
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = (np.arange(len(tokens), dtype=np.int64) - starts).astype(np.int32)
    chunk = {feature: tokens, f"{feature}_segment_ids": segment_ids, f"{feature}_positions": positions}
    return chunk, list(segments)
