"""Batched decoding of cache records into fixed-shape arrays.

A batch of records of the cache format v1 layout (each feature, in manifest
order, a little-endian uint32 element count then the elements) is decoded with
a constant number of numpy operations, where ``seqcache.format.decode_example``
would cost a Python call per record:

1. The records side by side in one (rows, W) uint8 matrix (one copy, zero-filled
   on the right), a scratch buffer reused per thread.
2. Each feature's count gathered from every row at once, which gives every
   row's offset of the next feature.
3. A feature's elements copied out as one strided block when it starts at the
   same byte offset in every row (the first feature, and every feature of
   packed caches), else gathered per element.

Malformed records are reported by ``decode_example``, so the error names the
record as the single-record decoder would.
"""

from __future__ import annotations

import threading
from typing import Mapping, Sequence

import numpy as np

from seqcache import format as fmt


_scratch = threading.local()


def _record_matrix(records: Sequence[bytes], width: int) -> np.ndarray:
    """The records side by side in a (rows, width) uint8 matrix, zero-filled on
    the right. The matrix is a per-thread scratch buffer reused by the next call
    in the same thread (no allocation per batch): callers copy what they keep."""
    n = len(records)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n * width:
        buf = _scratch.buf = np.empty(max(n * width, 1 << 16), np.uint8)
    mat = buf[: n * width].view(f"S{width}")
    mat[...] = records  # one copy; numpy zero-fills records shorter than width
    return buf[: n * width].reshape(n, width)


def _gather_u32(mat: np.ndarray, offsets: np.ndarray, uniform: int | None) -> np.ndarray:
    """uint32 (rows,) read at byte ``offsets`` of each row."""
    if uniform is not None:
        return mat[:, uniform : uniform + 4].copy().view("<u4")[:, 0].astype(np.int64)
    idx = offsets[:, None] + np.arange(4)
    return np.take_along_axis(mat, idx, axis=1).copy().view("<u4")[:, 0].astype(np.int64)


def decode_batch(
    specs: Sequence[fmt.FeatureSpec],
    records: Sequence[bytes],
    *,
    length: int,
    outputs: Mapping[str, np.dtype],
    where: Sequence[str] | None = None,
    rows: np.ndarray | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Decodes records into (rows, length) arrays, truncated or zero-padded.

    Args:
      specs: the cache's features, in manifest order.
      records: the record bytes, one per output row (in that order unless ``rows``).
      length: the sequence length L of the outputs.
      outputs: feature name -> output dtype, for the features wanted.
      where: optional per-record descriptions (cache, shard, record) used in errors.
      rows: optional int array (n,), a permutation of [0, n): output row r
        holds record ``records[rows[r]]`` (the reordering is part of the copy
        out of the record matrix, so records can be decoded in the order they
        were read).

    Returns:
      (values, counts): ``values[name]`` has shape (rows, length) and the requested
      dtype, holding the first min(count, L) elements of the feature and zeros
      after; ``counts[name]`` is int64 (rows,), the feature's element count in the
      record before truncation.

    Raises:
      seqcache.format.CacheError: a record is truncated or has trailing bytes
        (raised by ``decode_example`` for the first bad record).
      KeyError: an output feature is not in ``specs``.
    """
    names = [s.name for s in specs]
    for name in outputs:
        if name not in names:
            raise KeyError(f"feature {name!r} is not in the cache (features: {names})")
    n = len(records)
    values: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    if n == 0:
        for name, dt in outputs.items():
            values[name] = np.zeros((0, length), dtype=dt)
            counts[name] = np.zeros((0,), np.int64)
        return values, counts
    lens = np.fromiter(map(len, records), dtype=np.int64, count=len(records))
    mat = _record_matrix(records, max(8, (int(lens.max()) + 7) // 8 * 8))  # rows of 8-byte multiples

    def fail(bad: np.ndarray):
        i = int(np.flatnonzero(bad)[0])
        label = where[i] if where is not None else f"record {i} of the batch"
        fmt.decode_example(specs, records[i], where=label)  # raises with the precise reason
        raise fmt.CacheError(f"{label}: record does not match the manifest's features {names}")

    pos = np.zeros(n, np.int64)  # byte offset of the next feature's count, per row
    uniform: int | None = 0  # that offset when it is the same in every row
    for spec in specs:
        if (pos + 4 > lens).any():
            fail(pos + 4 > lens)
        cnt = _gather_u32(mat, pos, uniform)
        start = pos + 4
        start_u = None if uniform is None else uniform + 4
        isz = spec.np_dtype.itemsize
        end = start + cnt * isz
        if (end > lens).any():
            fail(end > lens)
        if spec.name in outputs:
            values[spec.name] = _extract(mat, spec, start, start_u, cnt, length, outputs[spec.name], records, rows)
            counts[spec.name] = cnt if rows is None else cnt[rows]
        pos = end
        if uniform is not None:
            first = int(cnt[0])
            uniform = start_u + first * isz if (cnt == first).all() else None
    if (pos != lens).any():
        fail(pos != lens)
    return values, counts


def _extract(mat, spec, start, start_u, cnt, length, out_dtype, records, rows) -> np.ndarray:
    """The (n, length) values of feature ``spec`` (record order, or output row r
    = record rows[r] when ``rows`` is given); never a view of ``mat``."""
    n = mat.shape[0]
    isz = spec.np_dtype.itemsize
    keep = np.minimum(cnt, length)
    m = int(keep.max())
    short = bool((keep < m).any())
    if start_u is not None:
        block = mat[:, start_u : start_u + m * isz].view(spec.np_dtype)  # (n, m), strided
        if rows is not None:  # the gather is the copy out of the scratch matrix
            block, keep, rows = block[rows], keep[rows], None
            out = block.astype(out_dtype, copy=False) if m == length else None
        else:
            out = block.astype(out_dtype) if m == length else None
        if out is None:
            out = np.zeros((n, length), dtype=out_dtype)
            out[:, :m] = block
    elif (start % isz == 0).all():
        elems = mat.view(spec.np_dtype)  # (n, width / isz): rows stay aligned, width % 8 == 0
        col = start // isz
        idx = np.minimum(col[:, None] + np.arange(m), elems.shape[1] - 1)
        out = np.zeros((n, length), dtype=out_dtype)
        out[:, :m] = np.take_along_axis(elems, idx, axis=1)
        short = True  # the gather read past short rows: always mask
    else:
        # Elements not aligned to their size within the record (an 8-byte feature
        # after an odd number of 4-byte ones): decode record by record.
        out = np.zeros((n, length), dtype=out_dtype)
        for i, rec in enumerate(records):
            at = int(start[i]) - 4
            arr = fmt.decode_example((spec,), rec[at:at + 4 + int(cnt[i]) * isz])[spec.name]
            out[i, : keep[i]] = arr[: keep[i]]
        return out if rows is None else out[rows]
    if short:
        out[np.arange(length)[None, :] >= keep[:, None]] = 0
    return out if rows is None else out[rows]

