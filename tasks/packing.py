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

import struct
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from seqcache import format as fmt


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


class PackedRows(NamedTuple):
    """Rows of ``pack_lm_encoded``, in stream order: ``records`` and
    ``provenances`` (``r`` encoded records each, ``bytes``), ``lengths`` and
    ``segments`` (int64 ``(r,)``: tokens and segments of each row)."""

    records: list
    provenances: list
    lengths: np.ndarray
    segments: np.ndarray


class _Segments(NamedTuple):
    """Segments back to back from position 0 of a stream, arrays ``(k,)``:
    source file (uint32), record number (uint64), token offset inside the
    example (int64), tokens (int64, >= 1)."""

    file: np.ndarray
    record: np.ndarray
    offset: np.ndarray
    size: np.ndarray


# Rows that ``pack_lm_encoded`` encodes at a time: a long example's rows are
# encoded in parts of this many (``writer.write_shard`` writes 4,096 at a time too).
ENCODED_ROWS = 4096
_FOUR = np.arange(4, dtype=np.int64)


def pack_lm_encoded(batches: Iterable[tuple[Sequence[bytes], np.ndarray, np.ndarray, np.ndarray]], *,
                    sequence_length: int, dtype: str, segment_dtype: str = "uint16",
                    rows_per_batch: int = ENCODED_ROWS) -> Iterator[PackedRows]:
    """``pack_lm`` from encoded examples to encoded rows, with array operations
    per batch of examples instead of Python loops per example or token (the
    concatenate-and-split packing of T5: seqio's ``reduce_concat_tokens`` and
    ``split_tokens``; see the module docstring, whose *chunks* are the rows here).

    The rows and provenance records have the bytes that ``seqcache.format``'s
    ``encode_example([FeatureSpec(f, dtype), FeatureSpec(f + "_segment_ids",
    segment_dtype)], chunk)`` and ``encode_provenance([(file, record, offset)
    per segment])`` give on each ``(chunk, segments)`` of ``pack_lm`` over the
    decoded examples, provenance ``(file, record)``. A row record is the uint32
    token count ``n``, ``n`` tokens of ``dtype``, ``n`` again, ``n`` segment ids
    of ``segment_dtype`` (1, 2, ... by segment), little-endian; a provenance
    record is ``k``, ``k`` source files (uint32), ``k``, ``k`` record numbers
    (uint64), ``k``, ``k`` token offsets (uint32), for the row's ``k`` segments.

    Args:
      batches: ``(records, file_index, record_number, lengths)`` per batch of
        ``n`` examples, in stream order: ``records``, the examples encoded with
        the one feature (``encode_example``: a uint32 count, then the tokens),
        a sequence of ``n`` ``bytes``; ``file_index`` ``(n,)`` (uint32 range),
        ``record_number`` ``(n,)`` (uint64 range), ``lengths`` ``(n,)`` their
        tokens. Empty examples add nothing.
      sequence_length: tokens per row (>= 1).
      dtype: the feature's dtype (a name of ``seqcache.format.DTYPES``), in
        the examples and in the rows: tokens are copied, never converted.
      segment_dtype: the dtype of the segment ids; it must hold ``sequence_length``.
      rows_per_batch: rows yielded at most at a time (>= 1).

    Yields:
      ``PackedRows`` in stream order: every row holds ``sequence_length``
      tokens but the last of all, which holds the rest (not padded).

    Memory: one batch of examples and its tokens, ``rows_per_batch`` encoded
    rows, and the partial row carried into the next batch (fewer than
    ``sequence_length`` tokens and their segments).

    Raises:
      ValueError: a bad ``sequence_length``, ``dtype``, ``segment_dtype`` or
        ``rows_per_batch``; a record whose size or count is not that of its
        ``lengths`` entry (naming its file index and record number); a file
        index or record number outside its dtype's range.
    """
    token, segment_type = _packing_dtypes(sequence_length, dtype, segment_dtype, rows_per_batch)
    size = token.itemsize
    carry_tokens = np.zeros(0, np.uint8)
    carry = _Segments(np.zeros(0, np.uint32), np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    for records, file_index, record_number, lengths in batches:
        file_index, record_number, lengths = _batch_columns(records, file_index, record_number, lengths)
        tokens = _tokens_of(records, lengths, size, file_index, record_number)
        keep = lengths > 0
        new = _Segments(file_index[keep], record_number[keep], np.zeros(int(keep.sum()), np.int64), lengths[keep])
        segments = _Segments(*(np.concatenate(pair) for pair in zip(carry, new)))
        stream = np.concatenate([carry_tokens, tokens]) if carry_tokens.size else tokens
        full = stream.size // size // sequence_length
        pieces, rows = _split_at_rows(segments, sequence_length)
        yield from _encoded_rows(stream, pieces, rows, (full, sequence_length, size), segment_type, rows_per_batch)
        cut = int(np.searchsorted(rows, full))
        carry = _Segments(*(p[cut:] for p in pieces))
        carry_tokens = stream[full * sequence_length * size:].copy()
    if carry_tokens.size:
        last = carry_tokens.size // size
        pieces, rows = _split_at_rows(carry, last)
        yield from _encoded_rows(carry_tokens, pieces, rows, (1, last, size), segment_type, rows_per_batch)


def _packing_dtypes(sequence_length: int, dtype: str, segment_dtype: str, rows_per_batch: int):
    """(token dtype, segment id dtype) of ``pack_lm_encoded``, its arguments checked."""
    if sequence_length < 1:
        raise ValueError(f"sequence_length must be >= 1 (got {sequence_length=})")
    if rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be >= 1 (got {rows_per_batch=})")
    for name in (dtype, segment_dtype):
        if name not in fmt.DTYPES:
            raise ValueError(f"dtype {name!r} is not one of {sorted(fmt.DTYPES)}")
    token, segment_type = np.dtype(fmt.DTYPES[dtype]), np.dtype(fmt.DTYPES[segment_dtype])
    if segment_type.kind not in "iu" or np.iinfo(segment_type).max < sequence_length:
        raise ValueError(f"segment ids of {segment_dtype} cannot number the segments of a row of "
                         f"{sequence_length} tokens (use int32)")
    return token, segment_type


def _batch_columns(records, file_index, record_number, lengths):
    """A batch's ``(file_index uint32, record_number uint64, lengths int64)``, checked."""
    columns = []
    for name, values, dtype in (("file index", file_index, "uint32"), ("record number", record_number, "uint64"),
                                ("length", lengths, "uint32")):
        values = np.asarray(values)
        if values.shape != (len(records),):
            raise ValueError(f"pack_lm_encoded: {len(records)} records but {name} values of shape {values.shape}")
        if values.size and values.dtype != np.dtype(dtype):
            lo, hi = int(values.min()), int(values.max())
            if lo < 0 or hi > np.iinfo(dtype).max:
                raise ValueError(f"pack_lm_encoded: {name} values in [{lo}, {hi}] do not fit {dtype}")
        columns.append(values.astype(dtype, copy=False))
    file_index, record_number, lengths = columns
    return file_index, record_number, lengths.astype(np.int64)


def _tokens_of(records: Sequence[bytes], lengths: np.ndarray, itemsize: int, file_index: np.ndarray,
               record_number: np.ndarray) -> np.ndarray:
    """The tokens of a batch's one-feature records, back to back, as uint8
    ``(sum(lengths) * itemsize,)``: the records joined, their counts left out.

    Raises:
      ValueError: a record whose size or count does not match ``lengths``.
    """
    data = np.frombuffer(b"".join(records), dtype=np.uint8)
    sizes = 4 + lengths * itemsize
    starts = np.cumsum(sizes) - sizes
    if data.size != int(sizes.sum()):
        actual = np.fromiter(map(len, records), dtype=np.int64, count=len(records))
        i = int(np.argmax(actual != sizes))
        raise ValueError(f"source file {int(file_index[i])}, record {int(record_number[i])}: its example has "
                         f"{int(actual[i])} bytes, expected {int(sizes[i])} (a count and {int(lengths[i])} tokens "
                         f"of {itemsize} bytes, one feature)")
    counts = data[(starts[:, None] + _FOUR).ravel()].view("<u4")
    if not np.array_equal(counts, lengths):
        i = int(np.argmax(counts != lengths))
        raise ValueError(f"source file {int(file_index[i])}, record {int(record_number[i])}: its example counts "
                         f"{int(counts[i])} tokens, expected {int(lengths[i])}")
    # The counts left out in units of the token size where it divides 4 (fewer, wider elements to move).
    unit = itemsize if 4 % itemsize == 0 else 1
    words = data.view(f"u{unit}")
    return np.delete(words, (starts[:, None] // unit + np.arange(4 // unit)).ravel()).view(np.uint8)


def _split_at_rows(segments: _Segments, length: int) -> tuple[_Segments, np.ndarray]:
    """``segments`` cut where rows of ``length`` tokens begin: the pieces, in
    stream order (offsets moved to where each piece starts inside its
    example), and the row of each piece (int64)."""
    size = segments.size
    start = np.zeros(len(size), dtype=np.int64)
    np.cumsum(size[:-1], out=start[1:])
    first = start // length
    count = (start + size - 1) // length - first + 1
    seg = np.repeat(np.arange(len(size)), count)
    row = first[seg] + np.arange(len(seg)) - np.repeat(np.cumsum(count) - count, count)
    begin = np.maximum(start[seg], row * length)
    end = np.minimum(start[seg] + size[seg], (row + 1) * length)
    return _Segments(segments.file[seg], segments.record[seg], segments.offset[seg] + begin - start[seg],
                     end - begin), row


def _encoded_rows(stream: np.ndarray, pieces: _Segments, rows: np.ndarray, shape: tuple[int, int, int],
                  segment_type: np.dtype, rows_per_batch: int) -> Iterator[PackedRows]:
    """The first ``count`` rows of ``length`` tokens of ``size`` bytes
    (``shape``) of ``stream`` (uint8, the tokens' bytes), ``rows_per_batch``
    at a time; ``pieces`` (``rows``: the row of each) are the stream's segments."""
    count, length, size = shape
    for a in range(0, count, rows_per_batch):
        b = min(count, a + rows_per_batch)
        p, q = np.searchsorted(rows, [a, b])
        per_row = np.bincount(rows[p:q] - a, minlength=b - a)
        rank = np.arange(q - p) - np.repeat(np.cumsum(per_row) - per_row, per_row)
        segment_ids = np.repeat((rank + 1).astype(segment_type), pieces.size[p:q])
        records = _encode_rows(stream[a * length * size:b * length * size], segment_ids, b - a)
        provenances = _encode_provenance_rows(per_row, pieces.file[p:q], pieces.record[p:q], pieces.offset[p:q])
        yield PackedRows(records, provenances, np.full(b - a, length, dtype=np.int64), per_row.astype(np.int64))


def _encode_rows(tokens: np.ndarray, segment_ids: np.ndarray, count: int) -> list[bytes]:
    """``count`` row records of equal length from their tokens' bytes (uint8)
    and segment ids (``(count * length,)``, little-endian)."""
    length = segment_ids.size // count
    head = np.frombuffer(struct.pack("<I", length), dtype=np.uint8)
    t, s = tokens.size // count, segment_ids.nbytes // count
    out = np.empty((count, 8 + t + s), dtype=np.uint8)
    out[:, :4] = head
    out[:, 4:4 + t] = tokens.reshape(count, t)
    out[:, 4 + t:8 + t] = head
    out[:, 8 + t:] = segment_ids.view(np.uint8).reshape(count, s)
    return [row.tobytes() for row in out]  # a copy each: cheaper than slicing one bytes object of them all


def _encode_provenance_rows(per_row: np.ndarray, file_index: np.ndarray, record_number: np.ndarray,
                            token_offset: np.ndarray) -> list[bytes]:
    """The provenance records of rows of ``per_row`` segments each (``(r,)``,
    >= 1), from the segments' columns in row order (``(sum(per_row),)``), in
    32-bit words: ``k``, ``k`` files, ``k``, ``2k`` words of record numbers, ``k``, ``k`` offsets."""
    bounds = np.zeros(len(per_row) + 1, dtype=np.int64)
    np.cumsum(3 + 4 * per_row, out=bounds[1:])
    words = np.empty(int(bounds[-1]), dtype="<u4")
    first = bounds[:-1]
    for at in (first, first + 1 + per_row, first + 2 + 3 * per_row):
        words[at] = per_row
    row = np.repeat(np.arange(len(per_row)), per_row)
    rank = np.arange(len(row)) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    base, k = first[row], per_row[row]
    words[base + 1 + rank] = file_index
    halves = np.ascontiguousarray(record_number, dtype="<u8").view("<u4").reshape(-1, 2)
    words[base + 2 + k + 2 * rank] = halves[:, 0]
    words[base + 3 + k + 2 * rank] = halves[:, 1]
    words[base + 3 + 3 * k + rank] = token_offset
    blob, ends = words.tobytes(), (4 * bounds).tolist()
    return [blob[x:y] for x, y in zip(ends[:-1], ends[1:])]
