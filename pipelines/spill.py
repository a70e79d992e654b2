"""Spill files: how preprocessed examples travel from the read step to the shard
writers without passing through the runner's shuffle.

The read step appends each example to an in-memory buffer of its shard and, when
the buffers of a bundle pass ``SPILL_BYTES`` (and at the end of every bundle),
writes every non-empty buffer to a new file ``_tmp/spill/<shard>/<unique>.bin``
and emits only ``(shard, path)``. The runner then shuffles a few small elements;
each shard writer reads its own files, sorts and writes the shard. Memory per
worker is one shard (to sort it) plus the spill buffers, whatever the corpus size;
on the DirectRunner, which keeps shuffled data in memory, this is the difference
between memory that grows with the corpus and memory that does not.

Retries are safe: a bundle that fails has its outputs discarded by the runner, so
the files it wrote are never named to a writer; the driver deletes ``_tmp`` at the
end of the build.

A spill file is a sequence of entries, all little-endian::

    key            16 bytes   the record's shuffle key
    sub_index      uint32     which example of the record (a record may give several)
    file_index     uint32     source file (index into the source file table)
    record_number  uint64     record in that file
    truncated      uint32     tokens trimmed away by preprocessing
    data_length    uint32     length of the encoded example
    lengths        uint32 x F element count of each of the F features
    data           data_length bytes: the example, encoded (seqcache.format)

Spill files are build-internal and never part of a cache.
"""

from __future__ import annotations

import struct
from typing import Iterator, Sequence

_HEAD = struct.Struct("<16sIIQII")

SPILL_BYTES = 64 << 20


def encode_entry(key: bytes, sub_index: int, file_index: int, record_number: int, truncated: int,
                 data: bytes, lengths: Sequence[int]) -> bytes:
    """One spill entry (see the module docstring)."""
    return b"".join((
        _HEAD.pack(key, sub_index, file_index, record_number, truncated, len(data)),
        struct.pack(f"<{len(lengths)}I", *lengths),
        data,
    ))


def decode_entries(buf: bytes, num_features: int, *, where: str = "spill file") -> Iterator[tuple]:
    """Yields ``(key, sub_index, data, file_index, record_number, truncated,
    lengths)`` for every entry of ``buf``.

    Raises:
      ValueError: the buffer ends inside an entry (a truncated spill file).
    """
    lengths_fmt = struct.Struct(f"<{num_features}I")
    offset, size = 0, len(buf)
    view = memoryview(buf)
    while offset < size:
        if offset + _HEAD.size + lengths_fmt.size > size:
            raise ValueError(f"{where}: truncated entry at byte {offset} of {size}")
        key, sub, fi, rn, trunc, n = _HEAD.unpack_from(buf, offset)
        offset += _HEAD.size
        lengths = lengths_fmt.unpack_from(buf, offset)
        offset += lengths_fmt.size
        if offset + n > size:
            raise ValueError(f"{where}: truncated entry data at byte {offset} of {size}")
        yield key, sub, bytes(view[offset:offset + n]), fi, rn, trunc, lengths
        offset += n
