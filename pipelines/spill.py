"""Spill files and batches: how preprocessed examples travel from the read step
to the shard writers.

The read step gathers the examples of its work unit in one in-memory
``SpillBuffer`` per shard. When the buffers pass the flush size, and at the end
of the unit, it hands them on in one of two ways (``exchange``, runner.py):

- ``"runner"``: each shard's buffer becomes one element ``(shard, batch
  bytes)`` of the runner's own shuffle (GroupByKey).
- ``"spill"`` (Beam's local engine, whose shuffle holds every element in the
  driver's memory): the buffers are written to **one file per flush holding
  every shard's section**, ``_tmp/spill/<unit>-<unique>-<flush>.bin``, and only
  ``(shard, (path, offset, length))`` goes through the shuffle.

Every section is sorted in cache order when it is written, so the shard
writer sorts only the shard's columns (44 + 4F bytes an example) and reads
the example bytes of spill sections front to back, a window at a time
(``ShardEntries``: a k-way merge of sorted runs). Memory per worker is the
shard's columns, the windows (``READ_BYTES``) and the flush buffers
(``SPILL_BYTES``); batches from the runner's shuffle are held whole.

Spill files are build-internal, never part of a cache. Retries are safe: a
unit that fails has its outputs discarded by the runner, so the files it wrote
are never named to a writer; the driver deletes ``_tmp`` at the end of the build.

A batch (one shard's section) is columnar and sorted, so that a writer loads
its columns with ``numpy.frombuffer`` and sorts a shard with one ``numpy``
sort. All integers are little-endian; ``n`` entries, ``F`` features::

    n               uint64
    F               uint32
    keys            n x 16 bytes    shuffle keys
    sub_index       n x uint32      which example of its record (a record may give several)
    file_index      n x uint32      source file (index into the source file table)
    record_number   n x uint64      record locator in that file
    truncated       n x uint32      tokens trimmed away by preprocessing
    lengths         n x F x uint32  element count of each feature
    data_offsets    (n + 1) x uint64
    data            the encoded examples (seqcache.format), back to back

A flush file is its sections back to back, then an index of them (per
section shard uint32, offset uint64, length uint64), then the section count
(uint32) and the magic ``b"SQSPILL1"``, so that a file describes itself; the
writers use the offsets they were sent.

Quarantine chunks travel the same way. The read step writes the records its
source skipped or repaired (``on_error``) or that it excluded for overlapping
a benchmark to ``_tmp/spill/quarantine-<unique>.txt``, sorted, a chunk per
``QUARANTINE_BYTES`` of entries and at the end of every unit, and emits only the
chunk's path; ``merge_quarantine`` merges the chunks into the cache's
``quarantine.jsonl``, so memory never grows with the skipped records. A chunk
line is::

    <file_index, 10 digits>\t<record_number, 20 digits>\t<action>\t<quarantine.jsonl line>\n

so that sorting the lines as bytes sorts them by (file index, record number,
action, entry): the merged file is the same whatever the bundles were. A failed
attempt's chunks are never named by an output, exactly as for spill files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import heapq
import io
import json
import os
import struct
from typing import BinaryIO, Callable, Iterable, Iterator, Sequence

import numpy as np

from seqcache import format as fmt
from seqcache.pipelines import shuffle

# Buffered bytes at which the read step flushes (``transforms.ReadUnit``): to
# a spill file (smaller: its buffers are the read step's largest memory), or as
# one element per shard to the runner's shuffle (larger: a distributed shuffle
# pays per element).
SPILL_BYTES = 16 << 20
RUNNER_FLUSH_BYTES = 64 << 20
# Memory counted against the flush size besides example bytes: per buffered
# entry (its columns), and per batch of a shard (the object and its nine arrays).
ENTRY_OVERHEAD = 48
BATCH_OVERHEAD = 1300
_HEAD = struct.Struct("<QI")
HEAD_SIZE = _HEAD.size  # a section's first bytes: entry count (uint64), feature count (uint32)
# Example bytes a shard writer copies out of its sections at a time
# (``ShardEntries.chunk_bounds``).
CHUNK_BYTES = 4 << 20
# What a shard writer reads of its spill sections on disk ahead of the range it
# copies: this budget divided among the sections, at least MIN_READ_BYTES a read.
READ_BYTES = 8 << 20
MIN_READ_BYTES = 64 << 10
# Mean piece size (bytes) from which ``ragged_take`` joins views of whole
# pieces (about 0.2 us a piece) instead of one gather (an index per word).
_JOIN_PIECE_BYTES = 64
# Words ``ragged_take`` gathers at a time: its index arrays stay a few MiB
# (reused below the allocator's mmap threshold, ``process.tune_allocator``)
# whatever the size of the data.
_GATHER_WORDS = 1 << 20


def ragged_take(data: np.ndarray, offsets: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pieces ``order`` of a ragged uint8 array (``data`` with int64 ``offsets``,
    piece i is ``data[offsets[i]:offsets[i + 1]]``), one after the other: the
    new data (uint8, ``(sum of the pieces' sizes,)``) and offsets (int64,
    ``(len(order) + 1,)``). ``data`` itself when ``order`` is the identity;
    read-only data when the pieces are long (``_JOIN_PIECE_BYTES``)."""
    sizes = np.diff(offsets)[order]
    new = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(sizes, out=new[1:])
    if np.array_equal(order, np.arange(len(order))):
        return data, offsets
    if new[-1] >= _JOIN_PIECE_BYTES * len(order):
        view = memoryview(np.ascontiguousarray(data, dtype=np.uint8))
        starts = offsets[:-1][order]
        pieces = [view[a:b] for a, b in zip(starts.tolist(), (starts + sizes).tolist())]
        return np.frombuffer(b"".join(pieces), dtype=np.uint8), new
    return _gather(np.ascontiguousarray(data, dtype=np.uint8)[:int(offsets[-1])], offsets, order, sizes, new), new


def _gather(data: np.ndarray, offsets: np.ndarray, order: np.ndarray, sizes: np.ndarray,
            new: np.ndarray) -> np.ndarray:
    """``ragged_take``'s data for short pieces (uint8): one gather, in words
    of the largest size (8, 4, 2 or 1 bytes) that divides every offset (the
    encoded examples are whole elements of their features, and their length
    fields 4 bytes), ``_GATHER_WORDS`` words at a time, with int32 indices
    where they fit: an index per word, not an int64 per byte."""
    bits = int(np.bitwise_or.reduce(offsets))
    w = next(w for w in (8, 4, 2, 1) if bits % w == 0)
    words = data.view(f"<u{w}") if w > 1 else data
    index = np.int32 if len(words) < 1 << 31 else np.int64
    shift = ((offsets[:-1][order] - new[:-1]) // w).astype(index)  # source word - destination word, per piece
    sizes, ends = sizes // w, new[1:] // w
    out = np.empty(int(new[-1]) // w, dtype=words.dtype)
    lo = 0
    while lo < len(order):
        start = int(new[lo]) // w
        hi = max(lo + 1, int(np.searchsorted(ends, start + _GATHER_WORDS, side="right")))
        stop = int(ends[hi - 1])
        source = np.repeat(shift[lo:hi], sizes[lo:hi])
        source += np.arange(start, stop, dtype=index)
        np.take(words, source, out=out[start:stop])
        lo = hi
    return out.view(np.uint8)


def batch_bytes(batch) -> int:
    """The memory a buffered batch of entries is counted for (bytes)."""
    return int(batch.data.size) + ENTRY_OVERHEAD * len(batch) + BATCH_OVERHEAD


class SpillBuffer:
    """The entries of one shard gathered by one bundle, before they are written,
    in batches of columns (``transforms.EncodedExamples`` of this shard: key
    ``V16``, sub_index, file_index, record_number, truncated, lengths ``(n,
    F)``, data uint8 and offsets ``(n + 1,)``)."""

    __slots__ = ("batches", "nbytes")

    def __init__(self):
        self.batches, self.nbytes = [], 0

    def add_batch(self, batch) -> None:
        """Adds a batch of entries (not copied)."""
        self.batches.append(batch)
        self.nbytes += batch_bytes(batch)

    def __len__(self) -> int:
        return sum(len(b) for b in self.batches)

    def to_bytes(self, num_features: int) -> bytes:
        """The buffer in the spill file format (see ``load_shard``), its
        entries sorted in cache order (``sort_order``), so that a shard writer
        can merge the sections of a shard reading each one front to back."""
        return b"".join(self._pieces(num_features))

    def write_to(self, f: BinaryIO, num_features: int) -> int:
        """Writes ``to_bytes`` to ``f`` a column at a time and drops the
        buffer's batches; returns the bytes written."""
        written = 0
        for piece in self._pieces(num_features, release=True):
            view = memoryview(piece)
            f.write(view)
            written += view.nbytes
        return written

    def _pieces(self, num_features: int, release: bool = False) -> Iterator:
        """The section's bytes, a column at a time (a buffer holds at least one batch)."""
        bs = self.batches
        if release:
            self.batches, self.nbytes = [], 0
        n = sum(len(b) for b in bs)

        def column(name, dtype):
            return np.concatenate([np.asarray(getattr(b, name), dtype=dtype) for b in bs])

        keys = np.concatenate([np.ascontiguousarray(b.key) for b in bs])
        sub, files, recs = column("sub_index", "<u4"), column("file_index", "<u4"), column("record_number", "<u8")
        hi_lo = keys.view(">u8").reshape(-1, 2)
        order = sort_order(hi_lo[:, 0].astype(np.uint64), hi_lo[:, 1].astype(np.uint64), sub, files, recs)
        del hi_lo
        yield _HEAD.pack(n, num_features)
        for values in (keys, sub, files, recs):
            yield values[order]
        del keys, sub, files, recs
        yield column("truncated", "<u4")[order]
        yield np.concatenate([np.asarray(b.lengths, dtype="<u4").reshape(len(b), num_features) for b in bs])[order]
        if len(bs) == 1:
            data, offsets = np.asarray(bs[0].data, dtype=np.uint8), np.asarray(bs[0].offsets, dtype=np.int64)
        else:
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(np.concatenate([np.diff(b.offsets) for b in bs]), out=offsets[1:])
            data = column("data", np.uint8)
        del bs
        data, offsets = ragged_take(data, offsets, order)
        yield offsets.astype("<u8")
        del offsets
        yield np.ascontiguousarray(data)


FLUSH_MAGIC = b"SQSPILL1"
_SECTION = struct.Struct("<IQQ")
_TRAILER = struct.Struct("<I8s")  # the section count, then FLUSH_MAGIC: a flush file's last 12 bytes


class FlushWriter:
    """Writes one flush file to ``f`` a section at a time, in increasing shard
    order, hashing every byte it writes (sha256): a unit's checkpoint in the
    build's work folder (work.py) records the file's size and digest, and a
    later build reads it only if both still match. ``close`` writes the index
    and the trailer and returns the sections ``(shard, offset, length)``."""

    __slots__ = ("f", "num_features", "index", "num_bytes", "digest")

    def __init__(self, f: BinaryIO, num_features: int):
        self.f, self.num_features = f, int(num_features)
        self.index: list[tuple[int, int, int]] = []
        self.num_bytes = 0
        self.digest = hashlib.sha256()

    def write(self, data) -> None:
        """Writes ``data`` (bytes or a contiguous array), counting and hashing it."""
        view = memoryview(data)
        if not view.c_contiguous:
            view = memoryview(bytes(view))
        self.f.write(view)
        self.digest.update(view)
        self.num_bytes += view.nbytes

    def add(self, shard: int, buffer: "SpillBuffer") -> int:
        """Writes ``buffer`` (emptied) as the section of ``shard``; returns its length in bytes."""
        start = self.num_bytes
        for piece in buffer._pieces(self.num_features, release=True):
            self.write(piece)
        self.index.append((int(shard), start, self.num_bytes - start))
        return self.num_bytes - start

    def add_bytes(self, shard: int, section: bytes) -> None:
        """Writes a section already in the spill format (``SpillBuffer.to_bytes``)."""
        self.index.append((int(shard), self.num_bytes, len(section)))
        self.write(section)

    def close(self) -> list[tuple[int, int, int]]:
        """Writes the index of the sections and the trailer; returns the sections."""
        self.write(b"".join(_SECTION.pack(*s) for s in self.index) + _TRAILER.pack(len(self.index), FLUSH_MAGIC))
        return list(self.index)

    def sha256(self) -> str:
        return self.digest.hexdigest()


def write_flush(f: BinaryIO, buffers: dict, num_features: int) -> list[tuple[int, int, int]]:
    """Writes one flush file of ``buffers`` (shard -> ``SpillBuffer``, emptied
    as written) to ``f``; returns its sections as ``(shard, offset, length)``,
    in shard order."""
    out = FlushWriter(f, num_features)
    for shard in sorted(buffers):
        out.add(shard, buffers.pop(shard))
    return out.close()


def flush_bytes(buffers: dict, num_features: int) -> tuple[bytes, list[tuple[int, int, int]]]:
    """``write_flush`` into memory: the flush file's bytes and its sections
    (``buffers`` is left as it is)."""
    out = io.BytesIO()
    index = write_flush(out, dict(buffers), num_features)
    return out.getvalue(), index


def read_flush_index(read: Callable[[int, int], bytes], size: int, where: str) -> list[tuple[int, int, int]]:
    """The sections ``(shard, offset, length)`` of a flush file of ``size``
    bytes, from its index (``read(begin, end)`` reads its bytes).

    Raises:
      ValueError: not a flush file, or a truncated one (``where`` names it).
    """
    if size < _TRAILER.size:
        raise ValueError(f"{where}: {size} bytes is too short for a spill file")
    count, magic = _TRAILER.unpack(read(size - _TRAILER.size, size))
    index_start = size - _TRAILER.size - count * _SECTION.size
    if magic != FLUSH_MAGIC or index_start < 0:
        raise ValueError(f"{where}: not a spill file (no {FLUSH_MAGIC!r} trailer)")
    raw = read(index_start, size - _TRAILER.size)
    sections = [_SECTION.unpack_from(raw, k * _SECTION.size) for k in range(count)]
    end = 0
    for shard, offset, length in sections:
        if offset != end:
            raise ValueError(f"{where}: spill file index names a section at byte {offset}, expected {end}")
        end = offset + length
    if end != index_start:
        raise ValueError(f"{where}: spill file sections end at byte {end}, its index starts at {index_start}")
    return sections


def section_keys(read: Callable[[int, int], bytes], where: str) -> np.ndarray:
    """The shuffle keys (``V16`` (n,)) of one section, sorted (``read(begin,
    end)`` reads the section's bytes, from its first byte)."""
    head = read(0, _HEAD.size)
    if len(head) < _HEAD.size:
        raise ValueError(f"{where}: truncated spill file ({len(head)} bytes)")
    n, _ = _HEAD.unpack(head)
    return np.frombuffer(read(_HEAD.size, _HEAD.size + 16 * n), dtype="V16")


def row_ranges(keys: np.ndarray, num_shards: int, shard_of_keys: Callable) -> list[tuple[int, int, int]]:
    """``(shard, lo, hi)``: the contiguous rows of sorted ``keys`` (``V16``)
    that fall in each shard of ``num_shards`` (``shard_of_keys(bytes, S)``),
    in shard order: a section written for one shard count, cut for another."""
    if not len(keys):
        return []
    shards = shard_of_keys(np.ascontiguousarray(keys).tobytes(), num_shards)
    cuts = np.flatnonzero(np.diff(shards)) + 1
    starts = [0, *cuts.tolist()]
    stops = [*cuts.tolist(), len(shards)]
    return [(int(shards[a]), a, b) for a, b in zip(starts, stops)]


def slice_section(buf: bytes, num_features: int, lo: int, hi: int, where: str) -> bytes:
    """Rows ``lo`` to ``hi`` of a whole section (its bytes), as a section of
    their own (the same order: still sorted)."""
    cols = _parse(buf, num_features, where)
    offsets = cols["offsets"][lo:hi + 1].astype(np.int64)
    data = memoryview(cols["data"])[cols["base"] + int(offsets[0]):cols["base"] + int(offsets[-1])]
    pieces = [_HEAD.pack(hi - lo, num_features)]
    pieces += [np.ascontiguousarray(cols[name][lo:hi]) for name, _, _ in _COLUMNS]
    pieces += [(offsets - offsets[0]).astype("<u8"), data]
    return b"".join(memoryview(p) if not isinstance(p, bytes) else p for p in pieces)


@dataclasses.dataclass
class ShardEntries:
    """Every entry of one shard, in columns, sorted by (key, sub_index,
    file_index, record_number).

    That order equals the documented total order (key, sub-index, example bytes,
    provenance): two entries with the same key and sub-index come from identical
    raw records (a 128-bit hash collision aside), and preprocessing is a function
    of the raw record and its key, so their example bytes are identical too.
    """

    sub_index: np.ndarray      # uint32 (n,)
    file_index: np.ndarray     # uint32 (n,)
    record_number: np.ndarray  # uint64 (n,)
    truncated: np.ndarray      # uint32 (n,)
    lengths: np.ndarray        # uint32 (n, F)
    part: np.ndarray           # int32 (n,): record i is parts[part[i]][begin[i]:end[i]]
    begin: np.ndarray          # int64 (n,)
    end: np.ndarray            # int64 (n,)
    parts: list                # the spill files' bytes (not copied); begin/end count from their start
    closers: list = dataclasses.field(default_factory=list)  # called by close(): the files parts read from
    key: np.ndarray | None = None  # V16 (n,): the shuffle keys (``load_shard`` keeps them)

    def __len__(self) -> int:
        return len(self.sub_index)

    def close(self) -> None:
        """Releases what the sections on disk read from (their open files)."""
        while self.closers:
            self.closers.pop()()

    def take(self, rows: np.ndarray) -> "ShardEntries":
        """The entries at ``rows`` (int, increasing), over the same parts: their
        sections may then have gaps, which ``items`` and ``record_chunks`` skip.
        The result closes nothing; close this one."""
        rows = np.asarray(rows, dtype=np.int64)
        columns = {f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)
                   if f.name not in ("parts", "closers") and getattr(self, f.name) is not None}
        return dataclasses.replace(self, **columns, closers=[])

    def example_bytes(self, rows: Sequence[int]) -> list[bytes]:
        """The encoded examples at ``rows``, one read each (for a few entries:
        ``items`` streams them all)."""
        out = []
        for i in np.asarray(rows, dtype=np.int64).tolist():
            part, begin, end = self.parts[int(self.part[i])], int(self.begin[i]), int(self.end[i])
            out.append(part.read(begin, end) if isinstance(part, SectionOnDisk) else bytes(part[begin:end]))
        return out

    def chunk_bounds(self, chunk: int = 1 << 16, max_bytes: int | None = None) -> Iterator[tuple[int, int]]:
        """``(lo, hi)`` ranges of the sorted entries, in order, covering them all:
        each of at most ``chunk`` entries and at most ``max_bytes`` of example
        bytes (default ``CHUNK_BYTES``; a single larger example is a range of
        its own)."""
        max_bytes = CHUNK_BYTES if max_bytes is None else max_bytes
        ends = np.cumsum(self.end - self.begin, dtype=np.int64)  # example bytes up to and including entry i
        lo, n = 0, len(ends)
        while lo < n:
            before = int(ends[lo - 1]) if lo else 0
            hi = int(np.searchsorted(ends, before + max_bytes, side="right"))
            hi = min(max(hi, lo + 1), lo + chunk, n)
            yield lo, hi
            lo = hi

    def mean_example_bytes(self, count: int = 1 << 16) -> float:
        """The mean size (bytes) of the first ``count`` encoded examples in
        sorted order; 0.0 for no entries."""
        sizes = (self.end[:count] - self.begin[:count]).tolist()
        return sum(sizes) / len(sizes) if sizes else 0.0

    def _chunks(self, chunk: int) -> Iterator[tuple[int, int, list[bytes]]]:
        """``(lo, hi, the encoded examples lo..hi)`` over ``chunk_bounds``, in
        order. Sections on disk are sorted, so each is read front to back
        through a window of its bytes, refilled by reads of ``READ_BYTES``
        divided among the sections (at least ``MIN_READ_BYTES``): memory about
        twice that budget plus a range's copies. A section may have gaps (entries
        left out by ``take``): its window skips nothing, but is read in order."""
        parts = self.parts
        on_disk = [k for k, p in enumerate(parts) if isinstance(p, SectionOnDisk)]
        cursor = np.zeros(len(parts), dtype=np.int64)  # where each section's next unread example starts
        window_start = np.zeros(len(parts), dtype=np.int64)
        windows = list(parts)  # in-memory sections are their own window, from byte 0
        for k in on_disk:
            cursor[k] = window_start[k] = parts[k].data_start
            windows[k] = parts[k].initial
            parts[k].initial = b""  # held by the window only, dropped once read past
        read_ahead = max(MIN_READ_BYTES, READ_BYTES // max(1, len(on_disk)))
        for lo, hi in self.chunk_bounds(chunk):
            part = self.part[lo:hi]
            begin, end = self.begin[lo:hi], self.end[lo:hi]
            if on_disk:
                last = cursor.copy()  # where each section's entries of this range end
                np.maximum.at(last, part, end)
                outside = begin < cursor[part]
                if outside.any():
                    bad = parts[int(part[np.flatnonzero(outside)[0]])]
                    raise ValueError(f"{bad.where}: spill section not in sorted order")
                for k in on_disk:
                    need = int(last[k])
                    have = int(window_start[k]) + len(windows[k])
                    if need > have:
                        section = parts[k]
                        stop = min(section.length, max(need, int(cursor[k]) + read_ahead))
                        keep = windows[k][int(cursor[k] - window_start[k]):]
                        more = section.read(have, stop)
                        windows[k] = keep + more if keep else more
                        window_start[k] = cursor[k]
                cursor[on_disk] = last[on_disk]
                begin, end = begin - window_start[part], end - window_start[part]
            yield lo, hi, [windows[p][x:y] for p, x, y in zip(part.tolist(), begin.tolist(), end.tolist())]

    def example_chunks(self, chunk: int = 1 << 16) -> Iterator[tuple[int, int, list[bytes]]]:
        """``(lo, hi, the encoded examples lo..hi)`` in sorted order, a chunk at
        a time (``chunk_bounds``), read as ``items`` reads them: for callers
        that take the entries' columns ``[lo:hi]`` beside the bytes."""
        return self._chunks(chunk)

    def items(self, chunk: int = 1 << 16) -> Iterable[tuple[bytes, tuple[int, int]]]:
        """(encoded example, (file_index, record_number)) in sorted order, a
        chunk at a time (``chunk_bounds``)."""
        for lo, hi, data in self._chunks(chunk):
            yield from zip(data, zip(self.file_index[lo:hi].tolist(), self.record_number[lo:hi].tolist()))

    def record_chunks(self, chunk: int = 1 << 16) -> Iterable[tuple[list[bytes], list[bytes]]]:
        """(encoded examples, encoded provenance records) in sorted order, a
        chunk at a time (``chunk_bounds``), for a shard written as it is (no
        packing: one segment per record, token offset 0)."""
        for lo, hi, data in self._chunks(chunk):
            yield data, fmt.encode_provenance_batch(self.file_index[lo:hi], self.record_number[lo:hi])


@dataclasses.dataclass
class SectionOnDisk:
    """One shard's section of a flush file whose example bytes stay in the
    file until a shard writer reads them (``ShardEntries``).

    Attributes:
      where: the section's name in errors (file and byte offset).
      read: ``read(begin, end) -> bytes``: bytes ``begin`` to ``end`` of the
        section (from its first byte).
      data_start: where the section's example bytes begin (bytes from its first byte).
      length: the section's size in bytes (its example bytes end there).
      initial: the first example bytes, already read (from ``data_start``).
    """

    where: str
    read: Callable[[int, int], bytes]
    data_start: int
    length: int
    initial: bytes = b""


_COLUMNS = (("keys", "V16", 1), ("sub_index", "<u4", 1), ("file_index", "<u4", 1), ("record_number", "<u8", 1),
            ("truncated", "<u4", 1), ("lengths", "<u4", None))


def _columns(head: bytes, where: str) -> Iterator[tuple[str, str, int]]:
    """``(name, dtype, element count)`` of each column of the section whose
    first bytes are ``head``, in file order, the data offsets last.

    Raises:
      ValueError: fewer bytes than a head (``where`` names the section).
    """
    if len(head) < _HEAD.size:
        raise ValueError(f"{where}: truncated spill file ({len(head)} bytes)")
    n, f = _HEAD.unpack_from(head, 0)
    for name, dtype, count in _COLUMNS:
        yield name, dtype, n * (f if count is None else count)
    yield "offsets", "<u8", n + 1


def section_head_bytes(head: bytes, where: str) -> int:
    """How many bytes of a section come before its example bytes (its head and
    columns, ``_parse``'s part), from the section's first ``HEAD_SIZE`` bytes.

    Raises:
      ValueError: fewer bytes than a head (``where`` names the section).
    """
    return _HEAD.size + sum(np.dtype(dtype).itemsize * count for _, dtype, count in _columns(head, where))


def _parse(buf: bytes, num_features: int, where: str, *, section_length: int | None = None) -> dict:
    """The columns of one section. ``buf`` is the whole section, or (with
    ``section_length``, the section's size) only its head and columns, the
    example bytes left on disk."""
    columns = list(_columns(buf, where))
    n, f = _HEAD.unpack_from(buf, 0)
    if f != num_features:
        raise ValueError(f"{where}: spill file has {f} features, expected {num_features}")
    pos = _HEAD.size
    cols = {}
    for name, dtype, count in columns:
        size = np.dtype(dtype).itemsize * count
        if pos + size > len(buf):
            raise ValueError(f"{where}: truncated spill file: column {name} ends at byte {pos + size} of {len(buf)}")
        cols[name] = np.frombuffer(buf, dtype=dtype, count=count, offset=pos)
        pos += size
    cols["lengths"] = cols["lengths"].reshape(n, f)
    total = len(buf) if section_length is None else section_length
    if pos + int(cols["offsets"][-1]) != total:
        raise ValueError(f"{where}: spill file data has {total - pos} bytes, offsets say {int(cols['offsets'][-1])}")
    # Records are sliced out of the buffer itself (a bytes slice is one copy, 3x
    # cheaper than bytes() of a memoryview slice): offsets count from ``base``.
    cols["data"] = buf if isinstance(buf, bytes) else bytes(buf)
    cols["base"] = pos
    return cols


def _select(cols: dict, where: str, rows: tuple[int, int] | None, files: np.ndarray | None) -> dict:
    """``cols`` (``_parse``) restricted to the rows ``[lo, hi)`` of ``rows``
    (None: all), with each file index ``i`` read as ``files[i]`` (None: as
    it is): a section written with the file indices of its work unit.

    Raises:
      ValueError: rows outside the section, or a file index outside ``files``.
    """
    n = len(cols["sub_index"])
    if rows is not None:
        lo, hi = rows
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"{where}: rows [{lo}, {hi}) of a section of {n} rows")
        for name, _, _ in _COLUMNS:
            cols[name] = cols[name][lo:hi]
        cols["offsets"] = cols["offsets"][lo:hi + 1]
    if files is not None:
        local = cols["file_index"]
        if len(local) and int(local.max()) >= len(files):
            raise ValueError(f"{where}: file index {int(local.max())} of a work unit of {len(files)} files")
        cols["file_index"] = np.asarray(files, dtype="<u4")[local]
    return cols


def parse_section(buf: bytes, num_features: int, where: str, *, rows: tuple[int, int] | None = None,
                  files: np.ndarray | None = None) -> dict:
    """The columns of a whole section in memory (its bytes), for ``load_shard``:
    the rows ``[lo, hi)`` of ``rows`` (None: all), file indices read through
    ``files`` (``_select``).

    Raises:
      ValueError: a truncated or inconsistent section (``where`` names it).
    """
    return _select(_parse(buf, num_features, where), where, rows, files)


def load_section(read: Callable[[int, int], bytes], where: str, length: int, num_features: int, *,
                 rows: tuple[int, int] | None = None, files: np.ndarray | None = None) -> dict:
    """The columns of a section on disk, for ``load_shard``: one read of
    ``MIN_READ_BYTES`` (the head, the columns, the first example bytes), a
    second when the columns are longer; the example bytes stay on disk
    (``SectionOnDisk``), read from the first row wanted. ``read(begin, end)``
    reads the section's bytes (from its first byte); ``length``: its size in
    bytes; ``rows`` and ``files`` as ``parse_section``.

    Raises:
      ValueError: a truncated or inconsistent section (``where`` names it).
    """
    first = read(0, min(length, MIN_READ_BYTES))
    head_bytes = section_head_bytes(first, where)
    if head_bytes > length:
        raise ValueError(f"{where}: truncated spill file: its columns end at byte {head_bytes} of {length}")
    head = first[:head_bytes] if head_bytes <= len(first) else first + read(len(first), head_bytes)
    cols = _select(_parse(head, num_features, where, section_length=length), where, rows, files)
    data_start = head_bytes + int(cols["offsets"][0])
    initial = first[data_start:] if data_start < len(first) else b""
    cols["data"] = SectionOnDisk(where, read, data_start, length, initial)
    return cols


def sort_order(hi: np.ndarray, lo: np.ndarray, sub: np.ndarray, files: np.ndarray,
               recs: np.ndarray) -> np.ndarray:
    """int64 (n,): ``np.lexsort((recs, files, sub, lo, hi))``, the order by (key's
    high 64 bits, low 64 bits, sub-index, file index, record number), computed
    as one sort on ``hi`` and a full sort of only the entries whose ``hi`` is
    not unique (identical raw records, or a 64-bit collision): the same order,
    several times faster than sorting on five keys. The sort is stable (equal
    entries keep their order), and costs less on input made of sorted runs
    (the sections of a shard)."""
    order = np.argsort(hi, kind="stable")
    ranked = hi[order]
    tied = np.flatnonzero(ranked[1:] == ranked[:-1])
    if len(tied):
        mark = np.zeros(len(order), dtype=bool)
        mark[tied] = mark[tied + 1] = True
        at = np.flatnonzero(mark)  # positions (in sorted order) of every tied entry, without a sort
        group = order[at]
        order[at] = group[np.lexsort((recs[group], files[group], sub[group], lo[group], hi[group]))]
    return order


def load_shard(buffers: Iterable[tuple[str, "bytes | dict"]], num_features: int, *,
               drop_copies: bool = False) -> ShardEntries:
    """Loads the sections of one shard and sorts its entries.

    Args:
      buffers: ``(where, section)`` pairs: a whole section's bytes, or its
        columns already loaded (``parse_section``, ``load_section``).
      drop_copies: leave out the entries that ``shuffle.copy_ranks`` ranks
        k >= 1 (copies of an earlier entry, moved by the copies step): the
        same entries as ``take`` of the others, with no second copy of the
        columns.

    Each column is gathered in sorted order once, and its unsorted copy
    dropped before the next: memory holds the shard's columns and one
    column more, not two copies of them.

    Raises:
      ValueError: a truncated or inconsistent spill file (named).
    """
    parts = [buf if isinstance(buf, dict) else _parse(buf, num_features, where) for where, buf in buffers]
    if not parts:
        empty = np.zeros(0, dtype=np.uint32)
        none = np.zeros(0, np.int64)
        return ShardEntries(empty, empty, np.zeros(0, np.uint64), empty, np.zeros((0, num_features), np.uint32),
                            np.zeros(0, np.int32), none, none, [], key=np.zeros(0, "V16"))
    columns = {name: np.concatenate([p[name] for p in parts]) for name, _, _ in _COLUMNS}
    keys = columns.pop("keys")
    hi_lo = keys.view(">u8").reshape(-1, 2)
    order = sort_order(hi_lo[:, 0].astype(np.uint64), hi_lo[:, 1].astype(np.uint64), columns["sub_index"],
                       columns["file_index"], columns["record_number"])
    del hi_lo
    key, sub = keys[order], columns.pop("sub_index")[order]
    del keys
    if drop_copies:
        first = shuffle.copy_ranks(key, sub) == 0
        if not first.all():
            order, key, sub = order[first], key[first], sub[first]
    sorted_columns = {"sub_index": sub, "key": key}
    for name in ("file_index", "record_number", "truncated", "lengths"):
        sorted_columns[name] = columns.pop(name)[order]
    sorted_columns["part"] = np.concatenate([np.full(len(p["sub_index"]), k, dtype=np.int32)
                                             for k, p in enumerate(parts)])[order]
    for name, at in (("begin", slice(None, -1)), ("end", slice(1, None))):
        sorted_columns[name] = np.concatenate([p["offsets"][at].astype(np.int64) + p["base"] for p in parts])[order]
    return ShardEntries(**sorted_columns, parts=[p["data"] for p in parts])


# Quarantine chunks. Entries a bundle holds in memory before it writes them to a chunk file (bytes).
QUARANTINE_BYTES = 4 << 20
# Chunk files open at once while merging; more are merged in rounds.
MERGE_FAN_IN = 64
QUARANTINE_PREFIX = "quarantine-"
# How many skipped records a build's zero-example error quotes.
FIRST_SKIPPED = 5
# What happened to a quarantined record: skipped or repaired under its source's
# on_error policy, or excluded for overlapping a benchmark (``build --exclude-benchmark``).
QUARANTINE_ACTIONS = ("skipped", "replaced", "excluded")
# The action of a chunk line that is a note, never a line of quarantine.jsonl (``QuarantineBuffer.add_note``).
NOTE_ACTION = b"kept"
# A chunk line's first bytes that name its record: file index and record number (``QuarantineBuffer.add``).
_RECORD_PREFIX = 32
# How the entry of a record skipped as a copy names its kind (``transforms.SpreadCopies``, near.py;
# JSON escapes quotes in values, so no message holds these bytes).
_COPY_KINDS = (b'"kind": "duplicate"', b'"kind": "near_duplicate"')


# json.dumps(..., ensure_ascii=False) without making an encoder per entry.
_JSON = json.JSONEncoder(ensure_ascii=False)


class QuarantineBuffer:
    """The quarantine entries gathered by one bundle, before they are written as
    one sorted chunk (see the module docstring for the line format)."""

    __slots__ = ("lines", "nbytes")

    def __init__(self):
        self.lines: list[bytes] = []
        self.nbytes = 0

    def add(self, file_index: int, record_number: int, action: str, path: str, message: str,
            kind: str | None = None, extra: dict | None = None) -> None:
        """Adds one line of quarantine.jsonl: a JSON object with
        ``source_index``, ``path``, ``record_number``, ``action`` (``"skipped"``,
        ``"replaced"`` or ``"excluded"``), ``error`` and ``kind``: the kind of bad
        input, a key of ``seqcache.tasks.ERROR_KINDS`` (for a repaired record, the
        kinds repaired, comma-separated; ``"benchmark"`` for a record excluded for
        overlapping a benchmark, whose entry adds the fields of ``extra``:
        ``benchmarks``, ``benchmark``, ``item`` and ``ngram``, see
        ``seqcache.pipelines.transforms.ReadPreprocess``). A message that starts
        with the file's path (``"<path>: line 3 (record 2) is empty"``) loses that
        prefix: the path is already in ``path``.

        Raises:
          ValueError: an action not in ``QUARANTINE_ACTIONS``."""
        if action not in QUARANTINE_ACTIONS:
            raise ValueError(f"quarantine action must be one of {', '.join(QUARANTINE_ACTIONS)} (got {action!r})")
        if message.startswith(f"{path}: "):
            message = message[len(path) + 2:]
        entry = {"source_index": int(file_index), "path": path, "record_number": int(record_number),
                 "action": action, "error": message, **({"kind": kind} if kind is not None else {}), **(extra or {})}
        entry = _JSON.encode(entry).encode("utf-8")
        line = b"%010d\t%020d\t%s\t%s\n" % (file_index, record_number, action.encode(), entry)
        self.lines.append(line)
        self.nbytes += len(line) + 64  # the list slot and the bytes object's header

    def add_note(self, file_index: int, record_number: int, kept: Sequence[str]) -> None:
        """Adds a note that is no line of quarantine.jsonl: record ``record_number``
        of file ``file_index`` holds the kinds ``kept`` of bad input that its
        policy keeps (counted in ``statistics.bad_input_records.kept`` by the
        read step). Written only under ``duplicate=skip`` or
        ``near_duplicate=skip``: when the record is then skipped as a copy
        (exact or near), ``merge_quarantine`` takes it off those counts,
        so that the copy counts once, as skipped."""
        entry = json.dumps({"source_index": int(file_index), "record_number": int(record_number),
                            "kept": list(kept)}).encode("utf-8")
        line = b"%010d\t%020d\t%s\t%s\n" % (file_index, record_number, NOTE_ACTION, entry)
        self.lines.append(line)
        self.nbytes += len(line) + 64

    def __len__(self) -> int:
        return len(self.lines)

    def to_bytes(self) -> bytes:
        return b"".join(sorted(self.lines))


@dataclasses.dataclass
class QuarantineSummary:
    """What ``merge_quarantine`` wrote: counts by action (records), the file's
    size (bytes) and sha256, the first ``FIRST_SKIPPED`` skipped entries,
    ``excluded_by_benchmark``: benchmark name -> excluded records that overlap
    it (a record that overlaps several benchmarks counts for each), and
    ``uncounted``: what the read step counted of the records later skipped as
    copies of another (``duplicate=skip``), to be taken off
    ``statistics.bad_input_records`` (``BadInputCounts`` JSON: kinds kept,
    noted by ``QuarantineBuffer.add_note``, and kinds repaired, whose
    ``replaced`` lines are left out of the file): a skipped copy counts once,
    as skipped."""

    skipped_records: int = 0
    replaced_records: int = 0
    num_bytes: int = 0
    sha256: str = hashlib.sha256(b"").hexdigest()
    first_skipped: list = dataclasses.field(default_factory=list)
    excluded_records: int = 0
    excluded_by_benchmark: dict = dataclasses.field(default_factory=dict)
    uncounted: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _records(lines: Iterable[bytes]) -> Iterator[list[bytes]]:
    """The merged chunk lines, one list per record (the lines of a record are
    consecutive: they sort by file index and record number first)."""
    group: list[bytes] = []
    for line in lines:
        if group and line[:_RECORD_PREFIX] != group[0][:_RECORD_PREFIX]:
            yield group
            group = []
        group.append(line)
    if group:
        yield group


def _written_lines(group: list[bytes], uncounted: dict) -> list[bytes]:
    """The lines of one record's group that belong in quarantine.jsonl: notes
    never; a ``replaced`` line not when the record is also skipped as a copy,
    exact or near (its kinds then go to ``uncounted``, with those of a note)."""
    if len(group) == 1:
        return group if group[0].split(b"\t", 3)[2] != NOTE_ACTION else []
    copy = any(line.split(b"\t", 3)[2] == b"skipped" and any(k in line for k in _COPY_KINDS) for line in group)
    out = []
    for line in group:
        action, entry = line.split(b"\t", 3)[2:]
        if action == NOTE_ACTION:
            if copy:
                _uncount(uncounted, "kept", json.loads(entry)["kept"])
        elif action == b"replaced" and copy:
            _uncount(uncounted, "replaced", json.loads(entry).get("kind", "").split(","))
        else:
            out.append(line)
    return out


def _uncount(uncounted: dict, action: str, kinds: Sequence[str]) -> None:
    """Adds one record of ``action`` with ``kinds`` to ``uncounted`` (``BadInputCounts`` JSON)."""
    per_kind = uncounted.setdefault(action, {})
    for kind in dict.fromkeys(k for k in kinds if k):
        per_kind[kind] = per_kind.get(kind, 0) + 1
    records = uncounted.setdefault("records", {})
    records[action] = records.get(action, 0) + 1


def _merged_lines(paths: Sequence[str], open_read) -> Iterator[bytes]:
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open_read(p)) for p in paths]
        yield from heapq.merge(*files)


def _checked_lines(paths: Sequence[str], open_read) -> Iterator[bytes]:
    """``_merged_lines``, each checked to be ``<file>\\t<record>\\t<action>\\t<entry>``
    (``ValueError`` naming the chunks otherwise)."""
    for line in _merged_lines(paths, open_read):
        if line.count(b"\t") < 3:
            raise ValueError(f"quarantine chunk line {line[:80]!r} is not <file>\\t<record>\\t<action>\\t<entry> "
                             f"(chunks: {list(paths)[:4]})")
        yield line


def merge_quarantine(paths: Sequence[str], out: BinaryIO, *, scratch_dir: str, open_read, open_write,
                     join, fan_in: int | None = None) -> QuarantineSummary:
    """Merges sorted quarantine chunk files into quarantine.jsonl, streaming.

    Args:
      paths: the chunk files named by the read step's outputs (any order).
      out: the binary file quarantine.jsonl is written to.
      scratch_dir: where the rounds of a merge of more than ``fan_in`` chunks
        write their intermediate chunks.
      open_read, open_write, join: ``seqcache.fs``'s.
      fan_in: chunk files open at once (default ``MERGE_FAN_IN``).

    Returns:
      A ``QuarantineSummary``. Memory holds one line per open chunk (a k-way
      merge, ``heapq.merge``, in rounds of ``fan_in`` files: external merge
      sort, Knuth, TAOCP vol. 3, 5.4.1).

    Raises:
      ValueError: a chunk line that is not in the chunk format (the file is named).
    """
    fan_in = MERGE_FAN_IN if fan_in is None else fan_in
    if fan_in < 2:
        raise ValueError(f"fan_in must be >= 2 (got {fan_in})")
    paths = sorted(paths)
    token = os.urandom(6).hex()
    level = 0
    while len(paths) > fan_in:
        merged = []
        for i in range(0, len(paths), fan_in):
            target = join(scratch_dir, f"{QUARANTINE_PREFIX}merge-{token}-{level:02d}-{i // fan_in:05d}.txt")
            with open_write(target) as f:
                for line in _merged_lines(paths[i:i + fan_in], open_read):
                    f.write(line)
            merged.append(target)
        paths, level = merged, level + 1
    summary = QuarantineSummary()
    digest = hashlib.sha256()
    for line in (kept for group in _records(_checked_lines(paths, open_read))
                 for kept in _written_lines(group, summary.uncounted)):
        _, _, action, entry = line.split(b"\t", 3)
        if action == b"skipped":
            summary.skipped_records += 1
            if len(summary.first_skipped) < FIRST_SKIPPED:
                summary.first_skipped.append(json.loads(entry))
        elif action == b"excluded":
            summary.excluded_records += 1
            for name in json.loads(entry)["benchmarks"]:
                summary.excluded_by_benchmark[name] = summary.excluded_by_benchmark.get(name, 0) + 1
        else:
            summary.replaced_records += 1
        out.write(entry)
        digest.update(entry)
        summary.num_bytes += len(entry)
    summary.sha256 = digest.hexdigest()
    return summary
