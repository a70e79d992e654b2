"""The cache format's building blocks, version 2: names and versions, the
errors, feature specs, the record codec and the shard table. The lowest module
of the format (numpy and the standard library only): ``seqcache.layout``,
``seqcache.manifest`` and ``seqcache.format`` stand on it. Code imports these
names through ``seqcache.format`` (``from seqcache import format as fmt``).

Layout of one cache (one task, one split)::

    CACHE_DIR/<task>/<split>/
        manifest.json                                 written last, atomically
        shard-checksums.json                          every shard file's sha256 (version 2)
        data.array_record-00000-of-00004              examples, in cache order
        provenance.array_record-00000-of-00004        one record per example
        quarantine.jsonl                              skipped and repaired source records (if any)

Record encoding (``encode_example`` / ``decode_example``): the features of the
record, in manifest order, each as a little-endian ``uint32`` element count
followed by that many elements of the feature's dtype, little-endian; no
padding, no per-record header, no pickle. Decoding is ``numpy.frombuffer``
over the record bytes, without copying.

The byte layout is documented in docs/cache-format.md; changing it needs a
``FORMAT_VERSION`` bump.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import os
import re
import struct
import sys
from typing import Any, Mapping, Sequence

import msgspec
import numpy as np

FORMAT_NAME = "seqcache"
# The version of a cache as a whole, the manifest's ``format_version``: what a
# reader must understand. Version 2: the shard table as columns, the checksums
# in ``SHARD_CHECKSUMS_NAME``; version 1 is refused (CHANGELOG.md, 0.2.0).
# Version 3: the per-file source table (``sources``, ``statistics.source_files``
# and the fingerprint's file list) in ``SOURCE_TABLE_NAME``, so that the
# manifest's size does not grow with the file count; version 2 is still read.
FORMAT_VERSION = 3
READ_FORMAT_VERSIONS = (2, 3)
# The version of what the shard files hold and of which example sits at which
# cache index. Fingerprints and feeder states record this one, so that a change
# of the manifest alone neither changes fingerprints nor invalidates states.
RECORD_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DATA_PREFIX = "data"
PROVENANCE_PREFIX = "provenance"
QUARANTINE_NAME = "quarantine.jsonl"
SHARD_CHECKSUMS_NAME = "shard-checksums.json"
SOURCE_TABLE_NAME = "source-table.json"
# A stored feature "<feature>_pretokenized" holds the source's text of <feature>
# (uint8, its UTF-8 bytes): an evaluation cache's, no token ids (docs/cache-format.md).
PRETOKENIZED_SUFFIX = "_pretokenized"
TEXT_DTYPE = "uint8"
# The encoding of the manifest's integer shard columns (format version 2), for humans.
INT_COLUMN_ENCODING = "base64 of little-endian int64, one per shard"

# ArrayRecord writer options, as the manifest records them. Uncompressed (token
# ids compress poorly in small chunks; decompression would sit on the feeder's
# hot path). A random read decodes one chunk, so long records keep a chunk each
# while short ones share chunks of about CHUNK_TARGET_BYTES (``group_size_for``;
# benchmarks/README.md, "ArrayRecord group size"); each file's header records it.
WRITER_OPTIONS = "group_size:auto,uncompressed"
CHUNK_TARGET_BYTES = 1024
MAX_GROUP_SIZE = 64
# Provenance records (28 bytes for one segment) are read by look-ups only.
PROVENANCE_GROUP_SIZE = 64


def group_size_for(mean_record_bytes: float) -> int:
    """The group size of a data file whose records hold ``mean_record_bytes``
    bytes on average: the largest power of two ``g <= MAX_GROUP_SIZE`` with
    ``g * mean_record_bytes <= CHUNK_TARGET_BYTES``, at least 1. Examples: 1 for
    records of 512 bytes or more, 16 for records of 36 bytes."""
    if not mean_record_bytes > 0:
        return MAX_GROUP_SIZE
    g = 1
    while g * 2 <= MAX_GROUP_SIZE and g * 2 * mean_record_bytes <= CHUNK_TARGET_BYTES:
        g *= 2
    return g


def writer_options(group_size: int) -> str:
    """The ArrayRecord writer options of one file: ``"group_size:G,uncompressed"``."""
    return f"group_size:{int(group_size)},uncompressed"


# Feature dtype name -> its little-endian NumPy dtype string: the dtypes a cache
# may store (docs/cache-format.md).
DTYPES = {"int8": "<i1", "uint8": "<u1", "int16": "<i2", "uint16": "<u2", "int32": "<i4", "uint32": "<u4",
          "int64": "<i8", "uint64": "<u8", "float32": "<f4"}

_LEN = np.dtype("<u4")


class CacheError(Exception):
    """A cache on disk is missing, incomplete, corrupt or does not match."""


class IncompleteCacheError(CacheError):
    """The cache folder has no manifest: a build did not finish."""


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """One feature of a cached record.

    Attributes:
      name: feature name, e.g. ``"targets"`` or ``"targets_segment_ids"``.
      dtype: one of int8, uint8, int16, uint16, int32, uint32, int64, uint64, float32.
    """

    name: str
    dtype: str

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"feature {self.name!r}: unsupported dtype {self.dtype!r} (expected one of {sorted(DTYPES)})")

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])


# Provenance sidecar: one record per example, one element per segment.
#   source_index:  index into the source table (source-table.json; manifest["sources"] in format 2)
#   record_number: 0-based record number inside that file (line, JSON line, row)
#   token_offset:  offset, in tokens of the primary feature after preprocessing,
#                  at which this segment starts inside its source record (non-zero
#                  when language-model packing split a long document)
PROVENANCE_FEATURES = (FeatureSpec("source_index", "uint32"), FeatureSpec("record_number", "uint64"),
                       FeatureSpec("token_offset", "uint32"))


def shard_name(prefix: str, index: int, count: int) -> str:
    """``data.array_record-00003-of-00064`` for prefix ``data``, index 3, count 64."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} out of range for {count} shards")
    return f"{prefix}.array_record-{index:05d}-of-{count:05d}"


def encode_example(specs: Sequence[FeatureSpec], example: Mapping[str, Any]) -> bytes:
    """Encodes one example as record bytes (see module docstring).

    Args:
      specs: the features, in manifest order.
      example: feature name -> 1-D array-like of that feature's elements.

    Raises:
      KeyError: a feature of ``specs`` is missing from ``example``.
      ValueError: a value is not 1-D or does not fit the feature's dtype.
    """
    parts = []
    for spec in specs:
        try:
            value = example[spec.name]
        except KeyError:
            raise KeyError(f"example has no feature {spec.name!r} (has {sorted(example)})") from None
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise ValueError(f"feature {spec.name!r} must be 1-D (got shape {arr.shape})")
        target = spec.np_dtype
        if arr.dtype != target:
            if arr.size and arr.dtype.kind in "iu" and target.kind in "iu":
                check_fits(spec.name, spec.dtype, int(arr.min()), int(arr.max()))
            arr = arr.astype(target)
        parts += (_pack_len(arr.size), arr.tobytes())
    return b"".join(parts)


_pack_len = struct.Struct("<I").pack
# Mean payload bytes of a feature per example from which ``encode_batch`` copies
# each example's piece as a slice (about 0.3 us) rather than by one index per byte.
_SLICE_BYTES = 64


def check_fits(name: str, dtype: str, lo: int, hi: int) -> None:
    """The dtype range check of ``encode_example`` for values in ``[lo, hi]``.

    Raises:
      ValueError: ``lo`` or ``hi`` is outside the range of integer ``dtype``.
    """
    info = np.iinfo(np.dtype(DTYPES[dtype]))
    if lo < info.min or hi > info.max:
        raise ValueError(f"feature {name!r}: values in [{lo}, {hi}] do not fit {dtype}")


def encode_batch(specs: Sequence[FeatureSpec], columns: Mapping[str, tuple[np.ndarray, np.ndarray]], *,
                 ranges: Mapping[str, tuple[int, int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Encodes many examples at once; the same bytes as ``encode_example`` on each.

    Args:
      specs: the features, in manifest order.
      columns: feature name -> ``(values, offsets)``: ``values`` 1-D, every
        example's elements one after the other; ``offsets`` int64 ``(n + 1,)``,
        example ``i`` is ``values[offsets[i]:offsets[i + 1]]``. Every feature has
        the same number of examples ``n``.
      ranges: optional feature name -> ``(min, max)`` of its values, when the
        caller already knows them (one check per batch, not two).

    Returns:
      ``(data, record_offsets)``: uint8 ``(total bytes,)`` holding the records
      one after the other, and int64 ``(n + 1,)``: record ``i`` is
      ``data[record_offsets[i]:record_offsets[i + 1]]``. One range check per
      feature and batch, no Python loop over examples or tokens.

    Raises:
      KeyError: a feature of ``specs`` is missing from ``columns``.
      ValueError: a feature's values do not fit its dtype, or the offsets do not
        describe the same number of examples for every feature.
    """
    lengths, payloads = [], []
    n = None
    for spec in specs:
        try:
            values, offsets = columns[spec.name]
        except KeyError:
            raise KeyError(f"examples have no feature {spec.name!r} (have {sorted(columns)})") from None
        values = np.asarray(values)
        offsets = np.asarray(offsets, dtype=np.int64)
        if values.ndim != 1 or offsets.ndim != 1 or offsets.size < 1 or offsets[-1] != values.size:
            raise ValueError(f"feature {spec.name!r}: offsets do not describe its {values.size} values")
        if n is None:
            n = offsets.size - 1
        elif offsets.size - 1 != n:
            raise ValueError(f"feature {spec.name!r} has {offsets.size - 1} examples, the others have {n}")
        target = spec.np_dtype
        if values.dtype != target:
            if values.size and values.dtype.kind in "iu" and target.kind in "iu":
                known = (ranges or {}).get(spec.name)
                lo, hi = known if known is not None else (int(values.min()), int(values.max()))
                check_fits(spec.name, spec.dtype, lo, hi)
            values = values.astype(target)
        lengths.append(np.diff(offsets))
        payloads.append(values.view(np.uint8))
    if n is None:
        return np.zeros(0, np.uint8), np.zeros(1, np.int64)
    sizes = np.zeros(n, dtype=np.int64)
    for spec, count in zip(specs, lengths):
        sizes += 4 + count * spec.np_dtype.itemsize
    record_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=record_offsets[1:])
    data = np.empty(int(record_offsets[-1]), dtype=np.uint8)
    if n == 0:
        return data, record_offsets
    # Start of each feature's length field inside the records, feature by feature.
    start = record_offsets[:-1].copy()
    four = np.arange(4, dtype=np.int64)
    is_payload = np.ones(data.size, dtype=bool) if len(specs) == 1 else None
    for spec, count, payload in zip(specs, lengths, payloads):
        where = (start[:, None] + four).ravel()
        data[where] = count.astype(_LEN).view(np.uint8)
        nbytes = count * spec.np_dtype.itemsize
        if is_payload is not None:
            is_payload[where] = False
        elif payload.size:
            _scatter(data, payload, start + 4, nbytes)
        start += 4 + nbytes
    if is_payload is not None:
        data[is_payload] = payloads[0]
    return data, record_offsets


def _scatter(data: np.ndarray, payload: np.ndarray, to: np.ndarray, nbytes: np.ndarray) -> None:
    """Copies example i's piece of ``payload`` (uint8, the examples' bytes one
    after the other, ``nbytes[i]`` each) to ``data[to[i]:to[i] + nbytes[i]]``."""
    src_start = np.zeros(len(nbytes), dtype=np.int64)
    np.cumsum(nbytes[:-1], out=src_start[1:])
    if payload.size >= _SLICE_BYTES * len(nbytes):  # long pieces: one slice copy each, not an index per byte
        out, piece = memoryview(data), memoryview(np.ascontiguousarray(payload))
        for at_to, at, size in zip(to.tolist(), src_start.tolist(), nbytes.tolist()):
            out[at_to:at_to + size] = piece[at:at + size]
    else:  # byte j of example i's payload goes to to[i] + (j - first byte of example i)
        data[np.repeat(to - src_start, nbytes) + np.arange(payload.size, dtype=np.int64)] = payload


def encode_provenance(segments: Sequence[tuple[int, int, int]]) -> bytes:
    """Encodes a provenance record (``PROVENANCE_FEATURES``) from a list of
    (source_index, record_number, token_offset) segments. Equivalent to
    ``encode_example(PROVENANCE_FEATURES, ...)``, without numpy overhead."""
    n = len(segments)
    try:
        if n == 1:
            (a, b, c), = segments
            return _PROV_ONE(1, a, 1, b, 1, c)
        cols = tuple(zip(*segments)) if n else ((), (), ())
        return struct.pack(f"<I{n}II{n}QI{n}I", n, *cols[0], n, *cols[1], n, *cols[2])
    except struct.error as e:
        raise ValueError(f"provenance {list(segments)[:4]}: {e}") from None


_PROV_ONE = struct.Struct("<IIIQII").pack
_PROV_ONE_DTYPE = np.dtype([("n0", "<u4"), ("source_index", "<u4"), ("n1", "<u4"), ("record_number", "<u8"),
                            ("n2", "<u4"), ("token_offset", "<u4")])  # packed: 28 bytes, as _PROV_ONE


def encode_provenance_batch(source_index: np.ndarray, record_number: np.ndarray,
                            token_offset: np.ndarray | int = 0) -> list[bytes]:
    """Provenance records of n single-segment examples at once: the same bytes as
    ``encode_provenance([(source_index[i], record_number[i], token_offset[i])])``.

    Args:
      source_index: ``(n,)`` integers in the uint32 range.
      record_number: ``(n,)`` integers in the uint64 range.
      token_offset: ``(n,)`` or a scalar, in the uint32 range.

    Returns:
      n ``bytes`` objects of 28 bytes each.

    Raises:
      ValueError: a value outside its dtype's range.
    """
    n = len(source_index)
    rows = np.empty(n, dtype=_PROV_ONE_DTYPE)
    for name, values, dtype in (("source_index", source_index, "uint32"), ("record_number", record_number, "uint64"),
                                ("token_offset", np.broadcast_to(token_offset, (n,)), "uint32")):
        values = np.asarray(values)
        if n and values.dtype != np.dtype(dtype):
            lo, hi = int(values.min()), int(values.max())
            if lo < 0 or hi > np.iinfo(dtype).max:
                raise ValueError(f"provenance {name} values in [{lo}, {hi}] do not fit {dtype}")
        rows[name] = values
    rows["n0"] = rows["n1"] = rows["n2"] = 1
    return rows.view("V28").tolist()  # one bytes object per row, made in C


def decode_example(specs: Sequence[FeatureSpec], record: bytes, *, where: str = "record") -> dict[str, np.ndarray]:
    """Decodes record bytes into read-only numpy views (no copy).

    Args:
      specs: the features, in manifest order.
      record: the record bytes.
      where: a description of the record for error messages (file and index).

    Returns:
      feature name -> 1-D array of the feature's dtype.

    Raises:
      CacheError: the record is truncated or has trailing bytes.
    """
    out = {}
    offset = 0
    size = len(record)
    for spec in specs:
        if offset + 4 > size:
            raise CacheError(f"{where}: truncated record: no length for feature {spec.name!r} at byte {offset} of {size}")
        (n,) = np.frombuffer(record, dtype=_LEN, count=1, offset=offset)
        offset += 4
        nbytes = int(n) * spec.np_dtype.itemsize
        if offset + nbytes > size:
            raise CacheError(f"{where}: truncated record: feature {spec.name!r} needs {nbytes} bytes at byte "
                             f"{offset}, record has {size}")
        out[spec.name] = np.frombuffer(record, dtype=spec.np_dtype, count=int(n), offset=offset)
        offset += nbytes
    if offset != size:
        raise CacheError(f"{where}: {size - offset} trailing bytes after the last feature")
    return out


def file_sha256(path: str) -> str:
    """Hex sha256 of a local file, read in chunks (memory does not grow with size)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def canonical_json(obj: Any) -> bytes:
    """JSON with sorted keys and no whitespace, UTF-8 (``json.dumps`` with
    ``sort_keys``, compact separators, ``ensure_ascii=False``): the input of
    every fingerprint. A long list of objects of integers, strings and nulls
    (a fingerprint's 50,000 files) is encoded by msgspec, whose bytes for
    these values are ``json.dumps``'s (only floats are written otherwise), in
    a fifth of the time, and spliced in."""
    spliced: dict[bytes, bytes] = {}
    nonce = os.urandom(8).hex()

    def swap(value):
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if not isinstance(value, list) or not value:
            return value
        if len(value) < _SPLICE_ROWS:
            return [swap(v) for v in value]
        try:
            msgspec.convert(value, _FLAT_ROWS, strict=True)
        except msgspec.ValidationError:
            return value
        token = f"\0{nonce}:{len(spliced)}"
        spliced[json.dumps(token).encode("ascii")] = msgspec.json.encode(value, order="sorted")
        return token

    text = json.dumps(swap(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    for token, data in spliced.items():
        text = text.replace(token, data, 1)
    return text


# ``canonical_json``: lists of at least this many objects of these values are encoded by msgspec.
_SPLICE_ROWS = 1024
_FLAT_ROWS = list[dict[str, int | str | None]]


def fingerprint_of(obj: Any) -> str:
    """sha256 (hex) of the canonical JSON of ``obj``."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One shard file as the manifest records it (its checksums are in the
    shard checksum file: ``seqcache.manifest.read_shard_checksums``)."""

    file: str
    num_records: int
    num_bytes: int
    provenance_file: str
    provenance_num_bytes: int


# The integer columns of the manifest's shard table (``ShardInfo`` fields), in order.
INT_FIELDS = ("num_records", "num_bytes", "provenance_num_bytes")
_INT_COLUMN = np.dtype("<i8")
# A SHA-256 checksum as the manifest writes it: 64 lowercase hex digits.
SHA256_RE = re.compile(r"[0-9a-f]{64}")
_STRICT_BASE64 = sys.version_info >= (3, 11)


def is_count(value) -> bool:
    """Whether ``value`` is a JSON count: an ``int`` (not a ``bool``) >= 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def encode_int_column(values: Sequence[int]) -> str:
    """A manifest integer shard column (format version 2): base64 of the values
    as little-endian int64 (``INT_COLUMN_ENCODING``)."""
    return base64.b64encode(np.asarray(values, dtype=_INT_COLUMN).tobytes()).decode("ascii")


def decode_int_column(text: str) -> np.ndarray:
    """The int64 array (num_shards,) of a manifest integer shard column.

    Raises:
      ValueError: ``text`` is not base64 of a whole number of int64 values.
    """
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a base64 string")
    data = decode_base64(text)
    if len(data) % _INT_COLUMN.itemsize:
        raise ValueError(f"{len(data)} bytes is not a whole number of int64 values")
    return np.frombuffer(data, dtype=_INT_COLUMN)


def decode_base64(text: str) -> bytes:
    """Standard base64 (RFC 4648, padded), strictly: any other character raises.

    Raises:
      ValueError: (``binascii.Error``) not strict base64.
    """
    if _STRICT_BASE64:  # Python >= 3.11: validates in C, about twice as fast as b64decode(validate=True)
        return binascii.a2b_base64(text, strict_mode=True)
    return base64.b64decode(text, validate=True)


class _ShardNames(Sequence[str]):
    """``shard_name(prefix, i, count)`` for i in [0, count), computed on access."""

    def __init__(self, prefix: str, count: int):
        self._prefix, self._count = prefix, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        if not -self._count <= i < self._count:
            raise IndexError(f"shard {i} out of range for {self._count} shards")
        return shard_name(self._prefix, i % self._count, self._count)

    def __eq__(self, other):  # equal to the list of the names (a manifest compared with its JSON's)
        if isinstance(other, (list, tuple, _ShardNames)):
            return len(other) == self._count and list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"_ShardNames({self._prefix!r}, {self._count})"


class ShardTable(Sequence[ShardInfo]):
    """The manifest's shard entries, held as columns so that opening a cache costs
    what parsing its JSON costs, with no Python object built per shard.

    The layout (format version 2, docs/cache-format.md): ``num_shards``; the
    integer columns ``num_records``, ``num_bytes``, ``provenance_num_bytes``
    (``encode_int_column``); ``checksums``, the checksum file ``{file,
    num_bytes, sha256}``. Shard i of S is named ``shard_name(prefix, i, S)``.
    ``num_records`` and the checksum file are checked when the table is built,
    the byte-size columns' lengths too; a shard's byte sizes are decoded (its
    own 8 bytes of each column) and checked when its ``ShardInfo`` is first
    built; ``check_all`` decodes and checks the columns whole.

    Attributes:
      files: the data shard names, one per shard (a sequence of str).
      provenance_files: the provenance shard names, one per shard.
      num_records: int64 array (num_shards,): records per shard.
      starts: int64 array (num_shards + 1,): the cache index of each shard's first
        record, then the total (the cumulative sum of ``num_records``).
      checksums: the checksum file's ``{file, num_bytes, sha256}``.

    Indexing and iteration give ``ShardInfo`` objects, built on first access.

    Raises:
      CacheError: naming the manifest and the shard: (when built) a bad column
        or checksum file entry; (``table[i]``) a bad byte size of shard i.
    """

    def __init__(self, entries, *, path: str = MANIFEST_NAME):
        self._path = path
        require(isinstance(entries, dict), path,
                 f"shards is {type(entries).__name__}, expected a JSON object (format version 2)")
        count = entries.get("num_shards")
        require(is_count(count), path, f"shards.num_shards is {count!r}, expected an integer >= 0")
        self._count = count
        self._raw_columns, self._columns = {}, {}
        for key in INT_FIELDS:
            require(key in entries, path, f"shards: missing column {key!r}")
            text = entries[key]
            # The byte sizes are decoded at their first use; their length is checked now.
            if not (isinstance(text, str) and len(text) == 4 * -(-8 * count // 3)):
                self._decode_column(key, text)  # raises, naming what is wrong
            self._raw_columns[key] = text
        self.num_records = self._column("num_records")
        checksums = entries.get("checksums")
        require(isinstance(checksums, dict), path,
                 f"shards.checksums is {checksums!r}, expected {{file, num_bytes, sha256}} of {SHARD_CHECKSUMS_NAME!r}")
        name = checksums.get("file")
        require(is_plain_file_name(name), path,
                 f"shards.checksums: file name {name!r} is not a plain file name inside the cache folder")
        require(name == SHARD_CHECKSUMS_NAME, path,
                 f"shards.checksums: file name {name!r}, expected {SHARD_CHECKSUMS_NAME!r}")
        require(is_count(checksums.get("num_bytes")), path,
                 f"shards.checksums: num_bytes is {checksums.get('num_bytes')!r}, expected a byte count")
        sha = checksums.get("sha256")
        require(isinstance(sha, str) and SHA256_RE.fullmatch(sha) is not None, path,
                 f"shards.checksums: sha256 is {sha!r}, expected 64 hex digits")
        self.checksums = checksums
        self.num_records.flags.writeable = False
        self.starts = np.zeros(count + 1, np.int64)
        np.cumsum(self.num_records, out=self.starts[1:])
        self.starts.flags.writeable = False
        self.files = _ShardNames(DATA_PREFIX, count)
        self.provenance_files = _ShardNames(PROVENANCE_PREFIX, count)
        self._infos: list[ShardInfo | None] = [None] * count

    def _decode_column(self, key: str, text) -> np.ndarray:
        path, count = self._path, self._count
        try:
            column = decode_int_column(text)
        except (ValueError, TypeError) as e:
            raise CacheError(f"{path}: shards.{key} is not {INT_COLUMN_ENCODING}: {e}") from None
        require(column.size == count, path,
                 f"shards.{key} has {column.size} values, expected {count} (shards.num_shards)")
        if count and int(column.min()) < 0:
            i = int(np.argmax(column < 0))
            raise CacheError(f"{path}: shard {i}: {key} is {int(column[i])}, expected an integer >= 0")
        return column

    def _column(self, key: str) -> np.ndarray:
        """The int64 column ``key``, decoded and checked whole."""
        column = self._columns.get(key)
        if column is None:
            column = self._columns[key] = self._decode_column(key, self._raw_columns[key])
        return column

    def _value(self, key: str, i: int) -> int:
        """Shard i's value in column ``key``, decoding only the base64
        quanta (4 characters per 3 bytes) that hold its 8 bytes: O(1)."""
        column = self._columns.get(key)
        if column is not None:
            return int(column[i])
        first, last = 8 * i // 3, (8 * i + 7) // 3
        text = self._raw_columns[key][4 * first:4 * (last + 1)]
        try:
            data = decode_base64(text)
        except ValueError as e:
            raise CacheError(f"{self._path}: shards.{key} is not {INT_COLUMN_ENCODING}: shard {i}: {e}") from None
        skip = 8 * i - 3 * first
        value = int(np.frombuffer(data, dtype=_INT_COLUMN, count=1, offset=skip)[0])
        if value < 0:
            raise CacheError(f"{self._path}: shard {i}: {key} is {value}, expected an integer >= 0")
        return value

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"ShardTable({self._count} shards, {int(self.starts[-1])} records)"

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        info = self._infos[i]
        if info is None:
            i %= self._count
            info = self._infos[i] = ShardInfo(
                file=self.files[i], num_records=int(self.num_records[i]), num_bytes=self._value("num_bytes", i),
                provenance_file=self.provenance_files[i], provenance_num_bytes=self._value("provenance_num_bytes", i))
        return info

    def check_all(self) -> None:
        """Checks every shard's entry now: decodes and checks the byte-size columns.

        Raises:
          CacheError: the first bad column, as ``table[i]`` would.
        """
        for key in INT_FIELDS:
            self._column(key)


def is_plain_file_name(name: Any) -> bool:
    """True for a non-empty file name with no folder part: no ``/`` or ``\\``,
    not ``.`` or ``..``, no NUL, no drive (``C:``). Every file a manifest names
    must be one (``seqcache.layout.cache_file`` adds the link check)."""
    return (isinstance(name, str) and bool(name) and name not in (".", "..")
            and not any(c in name for c in "/\\\x00") and not (len(name) >= 2 and name[1] == ":"))


def require(cond: bool, path: str, message: str):
    """Checks one condition of a file being read.

    Raises:
      CacheError: ``"PATH: MESSAGE"`` when ``cond`` is false.
    """
    if not cond:
        raise CacheError(f"{path}: {message}")
