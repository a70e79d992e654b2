"""Spill files and batches: how preprocessed examples travel from the read step
to the shard writers.

The read step gathers the examples of its work unit in one in-memory
``SpillBuffer`` per shard. When the buffers pass the flush size, and at the end
of the unit, it hands them on in one of two ways (``exchange``, runner.py):

- ``"runner"``: each shard's buffer becomes one element ``(shard, batch
  bytes)`` of the runner's own shuffle (GroupByKey): Dataflow Shuffle, Flink,
  Spark or Dask move the data, as they are built to.
- ``"spill"`` (Beam's local engine, whose shuffle holds every element in the
  driver's memory): the buffers are written to **one file per flush holding
  every shard's section**, ``_tmp/spill/<unit>-<unique>-<flush>.bin``, and only
  ``(shard, (path, offset, length))`` goes through the shuffle. The number of
  files grows with corpus / flush size, never with corpus x shards.

Each shard writer then loads its batches, sorts the shard and writes it.
Memory per worker is one shard (to sort it) plus the flush buffers, whatever
the corpus size.

Retries are safe: a unit that fails has its outputs discarded by the runner,
so the files it wrote are never named to a writer; the driver deletes ``_tmp``
at the end of the build.

A batch (one shard's section) is columnar, so that a writer loads it with
``numpy.frombuffer`` and sorts a whole shard with one ``numpy.lexsort``
(memory: the example bytes plus 44 bytes per example, not one Python object per
example). All integers are little-endian; ``n`` entries, ``F`` features::

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

A flush file is its sections back to back, then an index of them
(``FLUSH_INDEX``: per section shard uint32, offset uint64, length uint64), then
the section count (uint32) and the magic ``b"SQSPILL1"``, so that a file
describes itself; the writers use the offsets they were sent.

Spill files are build-internal and never part of a cache.

Quarantine chunks travel the same way. The read step writes the records that
its source skipped or repaired (``on_error``) to
``_tmp/spill/quarantine-<unique>.txt``, sorted, a chunk per ``QUARANTINE_BYTES``
of entries and at the end of every bundle, and emits only the chunk's path; the
quarantine writer merges the chunks (``merge_quarantine``) into the cache's
``quarantine.jsonl``. Memory therefore does not grow with the number of skipped
records, anywhere. A chunk line is::

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
import json
import os
import struct
from typing import BinaryIO, Iterable, Iterator, Sequence

import numpy as np

SPILL_BYTES = 64 << 20
# Memory of one buffered entry besides its example bytes (its columns in the
# batches' numpy arrays: key, four ints, lengths, offset): counted against
# SPILL_BYTES so that the buffers of a bundle stay near SPILL_BYTES of real memory.
ENTRY_OVERHEAD = 48
# ... and of one batch of a shard (the batch object and its nine small numpy
# arrays): a batch of records spread over many shards adds this per shard.
BATCH_OVERHEAD = 1300
_HEAD = struct.Struct("<QI")
# Example bytes a shard writer copies out of the loaded spill sections at a time
# (``ShardEntries.chunk_bounds``): the shard itself is held once, its copies in
# pieces of this size.
CHUNK_BYTES = 16 << 20


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
        self.batches = []
        self.nbytes = 0

    def add_batch(self, batch) -> None:
        """Adds a batch of entries (kept as they are, not copied)."""
        self.batches.append(batch)
        self.nbytes += batch_bytes(batch)

    def __len__(self) -> int:
        return sum(len(b) for b in self.batches)

    def to_bytes(self, num_features: int) -> bytes:
        """The buffer in the spill file format (see ``load_shard``)."""
        bs = self.batches
        n = len(self)
        offsets = np.zeros(n + 1, dtype="<u8")
        if bs:
            np.cumsum(np.concatenate([np.diff(b.offsets) for b in bs]), out=offsets[1:])

        def column(name, dtype):
            return b"".join(np.ascontiguousarray(getattr(b, name), dtype=dtype).tobytes() for b in bs)

        return b"".join((
            _HEAD.pack(n, num_features),
            b"".join(np.ascontiguousarray(b.key).tobytes() for b in bs),
            column("sub_index", "<u4"),
            column("file_index", "<u4"),
            column("record_number", "<u8"),
            column("truncated", "<u4"),
            b"".join(np.ascontiguousarray(b.lengths.reshape(len(b), num_features), dtype="<u4").tobytes()
                     for b in bs),
            offsets.tobytes(),
            b"".join(b.data.tobytes() for b in bs),
        ))


FLUSH_MAGIC = b"SQSPILL1"
_SECTION = struct.Struct("<IQQ")


def flush_bytes(buffers: dict, num_features: int) -> tuple[bytes, list[tuple[int, int, int]]]:
    """One flush file's bytes for ``buffers`` (shard -> ``SpillBuffer``), and its
    sections as ``(shard, offset, length)``, in shard order."""
    parts, index, pos = [], [], 0
    for shard in sorted(buffers):
        data = buffers[shard].to_bytes(num_features)
        parts.append(data)
        index.append((shard, pos, len(data)))
        pos += len(data)
    tail = b"".join(_SECTION.pack(*s) for s in index) + struct.pack("<I", len(index)) + FLUSH_MAGIC
    return b"".join(parts) + tail, index


def read_flush_index(data: bytes, where: str) -> list[tuple[int, int, int]]:
    """The ``(shard, offset, length)`` sections of a whole flush file.

    Raises:
      ValueError: not a flush file, or a truncated one (``where`` names it).
    """
    if len(data) < 12 or data[-8:] != FLUSH_MAGIC:
        raise ValueError(f"{where}: not a spill flush file (no {FLUSH_MAGIC!r} at its end)")
    (n,) = struct.unpack_from("<I", data, len(data) - 12)
    start = len(data) - 12 - n * _SECTION.size
    if start < 0:
        raise ValueError(f"{where}: truncated spill flush file ({n} sections in {len(data)} bytes)")
    return [_SECTION.unpack_from(data, start + k * _SECTION.size) for k in range(n)]


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

    def __len__(self) -> int:
        return len(self.sub_index)

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

    def _data(self, lo: int, hi: int) -> list[bytes]:
        parts = self.parts
        return [parts[p][x:y] for p, x, y in
                zip(self.part[lo:hi].tolist(), self.begin[lo:hi].tolist(), self.end[lo:hi].tolist())]

    def items(self, chunk: int = 1 << 16) -> Iterable[tuple[bytes, tuple[int, int]]]:
        """(encoded example, (file_index, record_number)) in sorted order; converted
        to Python objects a chunk at a time (``chunk_bounds``) so that memory
        stays near the arrays'."""
        for lo, hi in self.chunk_bounds(chunk):
            yield from zip(self._data(lo, hi),
                           zip(self.file_index[lo:hi].tolist(), self.record_number[lo:hi].tolist()))

    def record_chunks(self, chunk: int = 1 << 16) -> Iterable[tuple[list[bytes], list[bytes]]]:
        """(encoded examples, encoded provenance records) in sorted order, a
        chunk of entries at a time (``chunk_bounds``: at most ``chunk`` entries
        and ``CHUNK_BYTES`` of examples, so that the copies stay small beside
        the shard), for a shard that is written as it is (no packing: one
        segment per record, token offset 0)."""
        from seqcache import format as fmt

        for lo, hi in self.chunk_bounds(chunk):
            yield self._data(lo, hi), fmt.encode_provenance_batch(self.file_index[lo:hi], self.record_number[lo:hi])


def _parse(buf: bytes, num_features: int, where: str) -> dict:
    if len(buf) < _HEAD.size:
        raise ValueError(f"{where}: truncated spill file ({len(buf)} bytes)")
    n, f = _HEAD.unpack_from(buf, 0)
    if f != num_features:
        raise ValueError(f"{where}: spill file has {f} features, expected {num_features}")
    pos = _HEAD.size
    cols = {}
    for name, dtype, count in (
        ("keys", "V16", n), ("sub_index", "<u4", n), ("file_index", "<u4", n), ("record_number", "<u8", n),
        ("truncated", "<u4", n), ("lengths", "<u4", n * f), ("offsets", "<u8", n + 1),
    ):
        size = np.dtype(dtype).itemsize * count
        if pos + size > len(buf):
            raise ValueError(f"{where}: truncated spill file: column {name} ends at byte {pos + size} of {len(buf)}")
        cols[name] = np.frombuffer(buf, dtype=dtype, count=count, offset=pos)
        pos += size
    cols["lengths"] = cols["lengths"].reshape(n, f)
    if pos + int(cols["offsets"][-1]) != len(buf):
        raise ValueError(f"{where}: spill file data has {len(buf) - pos} bytes, offsets say {int(cols['offsets'][-1])}")
    # Records are sliced out of the buffer itself (a bytes slice is one copy, 3x
    # cheaper than bytes() of a memoryview slice): offsets count from ``base``.
    cols["data"] = buf if isinstance(buf, bytes) else bytes(buf)
    cols["base"] = pos
    return cols


def sort_order(hi: np.ndarray, lo: np.ndarray, sub: np.ndarray, files: np.ndarray,
               recs: np.ndarray) -> np.ndarray:
    """int64 (n,): ``np.lexsort((recs, files, sub, lo, hi))``, the order by (key's
    high 64 bits, low 64 bits, sub-index, file index, record number), computed
    as one sort on ``hi`` and a full sort of only the entries whose ``hi`` is
    not unique (identical raw records, or a 64-bit collision): the same order,
    several times faster than sorting on five keys."""
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


def load_shard(buffers: Iterable[tuple[str, bytes]], num_features: int) -> ShardEntries:
    """Loads the spill files of one shard (``(path, bytes)`` pairs) and sorts them.

    Raises:
      ValueError: a truncated or inconsistent spill file (named).
    """
    parts = [_parse(buf, num_features, path) for path, buf in buffers]
    if not parts:
        empty = np.zeros(0, dtype=np.uint32)
        none = np.zeros(0, np.int64)
        return ShardEntries(empty, empty, np.zeros(0, np.uint64), empty, np.zeros((0, num_features), np.uint32),
                            np.zeros(0, np.int32), none, none, [])
    keys = np.concatenate([p["keys"] for p in parts])
    sub = np.concatenate([p["sub_index"] for p in parts])
    files = np.concatenate([p["file_index"] for p in parts])
    recs = np.concatenate([p["record_number"] for p in parts])
    trunc = np.concatenate([p["truncated"] for p in parts])
    lengths = np.concatenate([p["lengths"] for p in parts])
    part = np.concatenate([np.full(len(p["sub_index"]), k, dtype=np.int32) for k, p in enumerate(parts)])
    begin = np.concatenate([p["offsets"][:-1].astype(np.int64) + p["base"] for p in parts])
    end = np.concatenate([p["offsets"][1:].astype(np.int64) + p["base"] for p in parts])
    hi_lo = keys.view(">u8").reshape(-1, 2) if len(keys) else np.zeros((0, 2), ">u8")
    order = sort_order(hi_lo[:, 0].astype(np.uint64), hi_lo[:, 1].astype(np.uint64), sub, files, recs)
    return ShardEntries(sub[order], files[order], recs[order], trunc[order], lengths[order],
                        part[order], begin[order], end[order], [p["data"] for p in parts])


# ---------------------------------------------------------------------------
# Quarantine chunks

# Entries a bundle holds in memory before it writes them to a chunk file (bytes).
QUARANTINE_BYTES = 4 << 20
# Chunk files open at once while merging; more are merged in rounds.
MERGE_FAN_IN = 64
QUARANTINE_PREFIX = "quarantine-"
# How many skipped records a build's zero-example error quotes.
FIRST_SKIPPED = 5


def quarantine_entry(file_index: int, record_number: int, action: str, path: str, message: str,
                     kind: str | None = None) -> bytes:
    """One line of quarantine.jsonl, without its newline: a JSON object with
    ``source_index``, ``path``, ``record_number``, ``action`` (``"skipped"`` or
    ``"replaced"``), ``error`` and ``kind``: the kind of bad input, a key of
    ``seqcache.tasks.ERROR_KINDS`` (for a repaired record, the kinds repaired,
    comma-separated). A message that starts with the
    file's path (``"<path>: line 3 (record 2) is empty"``) loses that prefix: the
    path is already in ``path``."""
    prefix = f"{path}: "
    if message.startswith(prefix):
        message = message[len(prefix):]
    entry = {"source_index": int(file_index), "path": path, "record_number": int(record_number),
             "action": action, "error": message}
    if kind is not None:
        entry["kind"] = kind
    return json.dumps(entry, ensure_ascii=False).encode("utf-8")


class QuarantineBuffer:
    """The quarantine entries gathered by one bundle, before they are written as
    one sorted chunk (see the module docstring for the line format)."""

    __slots__ = ("lines", "nbytes")

    def __init__(self):
        self.lines: list[bytes] = []
        self.nbytes = 0

    def add(self, file_index: int, record_number: int, action: str, path: str, message: str,
            kind: str | None = None) -> None:
        if action not in ("skipped", "replaced"):
            raise ValueError(f"quarantine action must be 'skipped' or 'replaced' (got {action!r})")
        line = b"%010d\t%020d\t%s\t%s\n" % (file_index, record_number, action.encode(),
                                             quarantine_entry(file_index, record_number, action, path, message, kind))
        self.lines.append(line)
        self.nbytes += len(line) + 64  # the list slot and the bytes object's header

    def __len__(self) -> int:
        return len(self.lines)

    def to_bytes(self) -> bytes:
        return b"".join(sorted(self.lines))


@dataclasses.dataclass
class QuarantineSummary:
    """What ``merge_quarantine`` wrote: counts by action (records), the file's
    size (bytes) and sha256, and the first ``FIRST_SKIPPED`` skipped entries."""

    skipped_records: int = 0
    replaced_records: int = 0
    num_bytes: int = 0
    sha256: str = hashlib.sha256(b"").hexdigest()
    first_skipped: list = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _merged_lines(paths: Sequence[str], open_read) -> Iterator[bytes]:
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open_read(p)) for p in paths]
        yield from heapq.merge(*files)


def merge_quarantine(paths: Sequence[str], out: BinaryIO, *, scratch_dir: str, open_read, open_write,
                     join, fan_in: int | None = None) -> QuarantineSummary:
    """Merges sorted quarantine chunk files into quarantine.jsonl, streaming.

    Args:
      paths: the chunk files named by the read step's outputs (any order).
      out: the binary file quarantine.jsonl is written to.
      scratch_dir: where the rounds of a merge of more than ``fan_in`` chunks
        write their intermediate chunks (build-internal, like spill files).
      open_read, open_write: ``path -> context manager of a binary file``
        (``seqcache.pipelines.writer.open_read`` / ``open_write``).
      join: ``seqcache.pipelines.writer.join``.
      fan_in: chunk files open at once (default ``MERGE_FAN_IN``).

    Returns:
      A ``QuarantineSummary``. Memory holds one line per open chunk, whatever
      the number of entries (a k-way merge, ``heapq.merge``, in rounds of
      ``fan_in`` files: external merge sort, Knuth, TAOCP vol. 3, 5.4.1).

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
    for line in _merged_lines(paths, open_read):
        try:
            _, _, action, entry = line.split(b"\t", 3)
        except ValueError:
            raise ValueError(f"quarantine chunk line {line[:80]!r} is not <file>\\t<record>\\t<action>\\t<entry> "
                             f"(chunks: {list(paths)[:4]})") from None
        if action == b"skipped":
            summary.skipped_records += 1
            if len(summary.first_skipped) < FIRST_SKIPPED:
                summary.first_skipped.append(json.loads(entry))
        else:
            summary.replaced_records += 1
        out.write(entry)
        digest.update(entry)
        summary.num_bytes += len(entry)
    summary.sha256 = digest.hexdigest()
    return summary
