"""The on-disk cache format, version 1: record encoding and the manifest.

This module is shared by the writer (``seqcache.pipelines``) and the readers
(``seqcache.feeders``, the CLI). It imports neither Beam nor JAX; its
cache-reading helpers go through ``seqcache.fs``, so they read local paths and
URLs (``gs://``, ``s3://``) alike, and import Beam only when given a URL.

Layout of one cache (one task, one split)::

    CACHE_DIR/<task>/<split>/
        manifest.json                                 written last, atomically
        data.array_record-00000-of-00004              examples, in cache order
        provenance.array_record-00000-of-00004        one record per example
        quarantine.jsonl                              skipped and repaired source records (if any)

Record encoding (``encode_example`` / ``decode_example``): the features of the
record, in manifest order, each as a little-endian ``uint32`` element count
followed by that many elements of the feature's dtype, little-endian. There is no
padding and no per-record header; the manifest says which features, in which order,
with which dtypes. Decoding is ``numpy.frombuffer`` over the record bytes, without
copying. No pickle anywhere.

The byte layout is documented in docs/cache-format.md; changing it needs a
``FORMAT_VERSION`` bump.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import struct
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from seqcache import fs

FORMAT_NAME = "seqcache"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DATA_PREFIX = "data"
PROVENANCE_PREFIX = "provenance"
QUARANTINE_NAME = "quarantine.jsonl"

# ArrayRecord writer options, pinned: group_size:1 makes every record its own
# chunk so that random access reads exactly one record's bytes. Token records are
# incompressible enough at chunk size 1 that compression costs more CPU than it
# saves bytes; see benchmarks/ for the measurement.
WRITER_OPTIONS = "group_size:1,uncompressed"

_DTYPES = {
    "int8": "<i1",
    "uint8": "<u1",
    "int16": "<i2",
    "uint16": "<u2",
    "int32": "<i4",
    "uint32": "<u4",
    "int64": "<i8",
    "uint64": "<u8",
    "float32": "<f4",
}

_LEN = np.dtype("<u4")
_SHARD_RE = re.compile(r"^(?P<prefix>[a-z_]+)\.array_record-(?P<index>\d{5})-of-(?P<count>\d{5})$")


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
        if self.dtype not in _DTYPES:
            raise ValueError(f"feature {self.name!r}: unsupported dtype {self.dtype!r} (expected one of {sorted(_DTYPES)})")

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(_DTYPES[self.dtype])


# Provenance sidecar: one record per example, one element per segment.
#   source_index:  index into manifest["sources"] (the source file table)
#   record_number: 0-based record number inside that file (line, JSON line, row)
#   token_offset:  offset, in tokens of the primary feature after preprocessing,
#                  at which this segment starts inside its source record (non-zero
#                  when language-model packing split a long document)
PROVENANCE_FEATURES = (
    FeatureSpec("source_index", "uint32"),
    FeatureSpec("record_number", "uint64"),
    FeatureSpec("token_offset", "uint32"),
)


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
                info = np.iinfo(target)
                lo, hi = int(arr.min()), int(arr.max())
                if lo < info.min or hi > info.max:
                    raise ValueError(
                        f"feature {spec.name!r}: values in [{lo}, {hi}] do not fit {spec.dtype}"
                    )
            arr = arr.astype(target)
        parts.append(_pack_len(arr.size))
        parts.append(arr.tobytes())
    return b"".join(parts)


_pack_len = struct.Struct("<I").pack


def check_fits(name: str, dtype: str, lo: int, hi: int) -> None:
    """The dtype range check of ``encode_example`` for values in ``[lo, hi]``.

    Raises:
      ValueError: ``lo`` or ``hi`` is outside the range of integer ``dtype``.
    """
    info = np.iinfo(np.dtype(_DTYPES[dtype]))
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
      ``data[record_offsets[i]:record_offsets[i + 1]]``.

    One range check per feature and batch (not per example), and no Python loop
    over examples or tokens: the records are laid out with numpy index
    arithmetic.

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
            # Byte j of this feature's payload of example i goes to start[i] + 4 + (j - first byte of example i).
            src_start = np.zeros(n, dtype=np.int64)
            np.cumsum(nbytes[:-1], out=src_start[1:])
            data[np.repeat(start + 4 - src_start, nbytes) + np.arange(payload.size, dtype=np.int64)] = payload
        start += 4 + nbytes
    if is_payload is not None:
        data[is_payload] = payloads[0]
    return data, record_offsets


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
        return b"".join((
            _pack_len(n), struct.pack(f"<{n}I", *cols[0]),
            _pack_len(n), struct.pack(f"<{n}Q", *cols[1]),
            _pack_len(n), struct.pack(f"<{n}I", *cols[2]),
        ))
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
    blob = rows.tobytes()
    return [blob[k:k + 28] for k in range(0, len(blob), 28)]


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
            raise CacheError(
                f"{where}: truncated record: feature {spec.name!r} needs {nbytes} bytes at byte {offset}, record has {size}"
            )
        out[spec.name] = np.frombuffer(record, dtype=spec.np_dtype, count=int(n), offset=offset)
        offset += nbytes
    if offset != size:
        raise CacheError(f"{where}: {size - offset} trailing bytes after the last feature")
    return out


def file_sha256(path: str, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a local file, read in chunks (memory does not grow with size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def canonical_json(obj: Any) -> bytes:
    """JSON with sorted keys and no whitespace: the input of every fingerprint."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def fingerprint_of(obj: Any) -> str:
    """sha256 (hex) of the canonical JSON of ``obj``."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One shard file as the manifest records it."""

    file: str
    num_records: int
    num_bytes: int
    sha256: str
    provenance_file: str
    provenance_num_bytes: int
    provenance_sha256: str


@dataclasses.dataclass
class Manifest:
    """The parsed manifest.json of one cache. See docs/cache-format.md for fields."""

    task: str
    split: str
    fingerprint: str
    features: tuple[FeatureSpec, ...]
    shards: tuple[ShardInfo, ...]
    raw: dict

    @property
    def num_examples(self) -> int:
        return sum(s.num_records for s in self.shards)

    @property
    def shard_starts(self) -> np.ndarray:
        """int64 array (num_shards + 1,): global index of each shard's first record, then the total."""
        counts = np.array([s.num_records for s in self.shards], dtype=np.int64)
        return np.concatenate([[0], np.cumsum(counts)])

    @property
    def sources(self) -> list[dict]:
        return self.raw.get("sources", [])

    @property
    def vocabularies(self) -> dict:
        return self.raw.get("vocabularies", {})

    @property
    def sequence_length(self) -> dict | None:
        return self.raw.get("sequence_length")

    @property
    def statistics(self) -> dict:
        return self.raw.get("statistics", {})

    @property
    def quarantine(self) -> str | None:
        """The quarantine file's name (``QUARANTINE_NAME``) when the build skipped or
        repaired source records, else None."""
        return self.raw.get("quarantine")

    def to_json(self) -> str:
        return json.dumps(self.raw, indent=2, sort_keys=False, ensure_ascii=False) + "\n"


def _require(cond: bool, path: str, message: str):
    if not cond:
        raise CacheError(f"{path}: {message}")


def parse_manifest(raw: dict, *, path: str = MANIFEST_NAME) -> Manifest:
    """Validates a manifest dict and returns a ``Manifest``.

    Raises:
      CacheError: wrong format name or version, missing fields, or a shard name
        that is not a plain file name of this cache (for instance one that leads
        outside the cache folder).
    """
    _require(isinstance(raw, dict), path, "manifest is not a JSON object")
    _require(raw.get("format") == FORMAT_NAME, path, f"format is {raw.get('format')!r}, expected {FORMAT_NAME!r}")
    version = raw.get("format_version")
    _require(
        version == FORMAT_VERSION,
        path,
        f"format_version is {version!r}, this seqcache reads version {FORMAT_VERSION}",
    )
    for key in ("task", "split", "fingerprint", "features", "shards"):
        _require(key in raw, path, f"missing field {key!r}")
    try:
        features = tuple(FeatureSpec(f["name"], f["dtype"]) for f in raw["features"])
    except (KeyError, TypeError, ValueError) as e:
        raise CacheError(f"{path}: bad features entry: {e}") from None
    shards = []
    count = len(raw["shards"])
    for i, s in enumerate(raw["shards"]):
        try:
            info = ShardInfo(
                file=s["file"],
                num_records=int(s["num_records"]),
                num_bytes=int(s["num_bytes"]),
                sha256=s["sha256"],
                provenance_file=s["provenance_file"],
                provenance_num_bytes=int(s["provenance_num_bytes"]),
                provenance_sha256=s["provenance_sha256"],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CacheError(f"{path}: shard {i}: bad entry: {e}") from None
        for name, prefix in ((info.file, DATA_PREFIX), (info.provenance_file, PROVENANCE_PREFIX)):
            _require(
                name == os.path.basename(name) and name not in (".", "..") and "/" not in name and "\\" not in name,
                path,
                f"shard {i}: file name {name!r} is not a plain file name inside the cache folder",
            )
            _require(
                name == shard_name(prefix, i, count),
                path,
                f"shard {i}: file name {name!r}, expected {shard_name(prefix, i, count)!r}",
            )
        _require(info.num_records >= 0, path, f"shard {i}: negative num_records {info.num_records}")
        shards.append(info)
    quarantine = raw.get("quarantine")
    _require(
        quarantine in (None, QUARANTINE_NAME),
        path,
        f"quarantine is {quarantine!r}, expected {QUARANTINE_NAME!r} or null (a plain file name inside the cache folder)",
    )
    # Optional (caches written before they were recorded have neither).
    if raw.get("quarantine_num_bytes") is not None:
        _require(isinstance(raw["quarantine_num_bytes"], int) and raw["quarantine_num_bytes"] >= 0, path,
                 f"quarantine_num_bytes is {raw['quarantine_num_bytes']!r}, expected a byte count")
    if raw.get("quarantine_sha256") is not None:
        _require(isinstance(raw["quarantine_sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", raw["quarantine_sha256"])
                 is not None, path, f"quarantine_sha256 is {raw['quarantine_sha256']!r}, expected 64 hex digits")
    return Manifest(
        task=raw["task"],
        split=raw["split"],
        fingerprint=raw["fingerprint"],
        features=features,
        shards=tuple(shards),
        raw=raw,
    )


def read_manifest(cache_dir: str) -> Manifest:
    """Reads and validates ``cache_dir/manifest.json`` (a local path or a URL).

    Raises:
      IncompleteCacheError: there is no manifest (an unfinished build, or not a cache).
      CacheError: the manifest is not valid JSON or not a valid manifest.
      seqcache.fs.FileSystemError: (URLs) the object store cannot be reached or
        refused the request.
    """
    path = fs.join(cache_dir, MANIFEST_NAME)
    if not fs.exists(path):
        if fs.isdir(cache_dir):
            raise IncompleteCacheError(
                f"{cache_dir}: no {MANIFEST_NAME}: the cache is incomplete (an unfinished or failed build) "
                "or this is not a cache folder; re-run the build"
            )
        raise IncompleteCacheError(f"{cache_dir}: no such cache folder")
    try:
        raw = json.loads(fs.read_text(path))
    except fs.FileSystemError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheError(f"{path}: cannot read manifest: {e}") from None
    return parse_manifest(raw, path=path)


def check_shard_files(cache_dir: str, manifest: Manifest) -> None:
    """Cheap integrity checks run whenever a cache is opened: every shard file
    exists and has the byte size the manifest records. Full checksums are
    ``verify_cache``'s job. On an object store the sizes come from one listing
    of the folder.

    Raises:
      CacheError: naming the file, the expected and the actual value.
      seqcache.fs.FileSystemError: (URLs) the listing failed.
    """
    listed = None if fs.is_local(cache_dir) else fs.sizes_in(cache_dir)
    for s in manifest.shards:
        for name, size in ((s.file, s.num_bytes), (s.provenance_file, s.provenance_num_bytes)):
            p = fs.join(cache_dir, name)
            actual = fs.size(p) if listed is None else listed.get(name)
            if actual is None:
                raise CacheError(f"{p}: shard file is missing (the manifest lists it with {size} bytes)")
            if actual != size:
                raise CacheError(f"{p}: shard file has {actual} bytes, the manifest expects {size}")


def iter_json_lines(path: str) -> Iterable[dict]:
    """The JSON objects of a JSON-lines file (local path or URL), streaming;
    blank lines are skipped."""
    with fs.open_read(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line.decode("utf-8"))
