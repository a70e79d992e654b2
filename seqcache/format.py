"""The on-disk cache format, version 2, as the rest of seqcache uses it
(``from seqcache import format as fmt``): every name of ``seqcache.codec``
(names and versions, errors, feature specs, the record codec, the shard table,
``Manifest``), re-exported here, and the reading of a cache's metadata:
``read_manifest`` / ``parse_manifest`` (checked against the field definitions
of ``seqcache.manifest``), ``check_shard_files``, ``read_shard_checksums`` /
``shard_checksums_json`` and ``iter_json_lines``.

It stands on the other core modules and none of them imports it:
``seqcache.codec`` <- ``seqcache.manifest`` and ``seqcache.layout`` <- this
module (docs/architecture.md, "Dependency rules"). It imports neither Beam
nor JAX; its readers go through ``seqcache.fs``, so they read local paths and
URLs (``gs://``, ``s3://``) alike, and import Beam only when given a URL.

The byte layout is documented in docs/cache-format.md; changing it needs a
``FORMAT_VERSION`` bump. The manifest's fields are defined once, in
``seqcache.manifest``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Sequence

from seqcache import bounded_json, fs, layout
from seqcache import manifest as schema
from seqcache.codec import (  # noqa: F401  the codec's names, as fmt.<name>
    FORMAT_NAME, FORMAT_VERSION, READ_FORMAT_VERSIONS, RECORD_FORMAT_VERSION, MANIFEST_NAME, DATA_PREFIX,
    PROVENANCE_PREFIX, QUARANTINE_NAME, SHARD_CHECKSUMS_NAME, INT_COLUMN_ENCODING, WRITER_OPTIONS,
    CHUNK_TARGET_BYTES, MAX_GROUP_SIZE, PROVENANCE_GROUP_SIZE, group_size_for, writer_options, CacheError,
    IncompleteCacheError, FeatureSpec, PROVENANCE_FEATURES, shard_name, encode_example, check_fits,
    encode_batch, encode_provenance, encode_provenance_batch, decode_example, file_sha256, canonical_json,
    fingerprint_of, ShardInfo, encode_int_column, decode_int_column, decode_base64, ShardTable,
    is_plain_file_name, Manifest, _DTYPES, _INT_FIELDS, _SHA256_RE, _require,
)


def shard_checksums_json(sha256: Sequence[str], provenance_sha256: Sequence[str]) -> bytes:
    """The bytes of ``SHARD_CHECKSUMS_NAME`` (format version 2): one JSON object
    ``{"num_shards": S, "sha256": [...], "provenance_sha256": [...]}`` (hex
    sha256 of data shard i and of provenance shard i at position i), UTF-8, one
    line and a newline. A function of the checksums alone, so the file is as
    deterministic as the shards.

    Raises:
      ValueError: the two lists differ in length or hold something other than
        64 hex digits.
    """
    sha256, provenance_sha256 = list(sha256), list(provenance_sha256)
    if len(sha256) != len(provenance_sha256):
        raise ValueError(f"{len(sha256)} data shard checksums but {len(provenance_sha256)} provenance ones")
    for key, values in (("sha256", sha256), ("provenance_sha256", provenance_sha256)):
        for i, v in enumerate(values):
            if not (isinstance(v, str) and _SHA256_RE.fullmatch(v)):
                raise ValueError(f"shard {i}: {key} is {v!r}, expected 64 hex digits")

    obj = schema.assemble_object(schema.SHARD_CHECKSUMS_FIELDS, {
        "num_shards": len(sha256), "sha256": sha256, "provenance_sha256": provenance_sha256}, what=SHARD_CHECKSUMS_NAME)
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode("utf-8")


def read_shard_checksums(cache_dir: str, manifest: "Manifest") -> tuple[list[str], list[str]]:
    """Every shard's recorded checksums: (sha256 of each data shard, sha256 of
    each provenance shard), hex, one per shard in shard order.

    Version 2 reads them from ``SHARD_CHECKSUMS_NAME`` (a local path or a URL),
    after checking that file's byte size and sha256 against the manifest's
    ``shards.checksums``; version 1 takes them from the manifest's entries.
    Only ``seqcache verify`` (and whatever else compares checksums) needs them:
    opening a cache never reads this file.

    Raises:
      CacheError: the checksum file is missing, has another size or sha256 than
        the manifest records, or is not a checksum list of this cache's shards;
        naming the file, the expected and the actual value. (Version 1) an entry
        without hex checksums.
      seqcache.fs.FileSystemError: (URLs) the object store cannot be reached.
    """
    table = manifest.shards
    if table.version == 1:
        infos = list(table)
        return [s.sha256 for s in infos], [s.provenance_sha256 for s in infos]
    recorded = table.checksums

    path = layout.cache_file(cache_dir, recorded["file"], what="shard checksum file")
    if not fs.exists(path):
        raise CacheError(f"{path}: shard checksum file is missing (the manifest lists it with "
                         f"{recorded['num_bytes']} bytes)")
    data = fs.read_bytes(path)
    if len(data) != recorded["num_bytes"]:
        raise CacheError(f"{path}: shard checksum file has {len(data)} bytes, the manifest expects "
                         f"{recorded['num_bytes']}")
    actual = hashlib.sha256(data).hexdigest()
    if actual != recorded["sha256"]:
        raise CacheError(f"{path}: shard checksum file has sha256 {actual}, the manifest expects {recorded['sha256']}")

    obj = bounded_json.loads(data, path=path, error=CacheError, what="shard checksum file")
    try:
        sha, prov = obj["sha256"], obj["provenance_sha256"]
        shard_checksums_json(sha, prov)  # the same checks as when it was written
    except (KeyError, TypeError, ValueError) as e:
        raise CacheError(f"{path}: not a shard checksum file: {bounded_json.short(e)}") from None
    if obj.get("num_shards") != len(sha):
        raise CacheError(f"{path}: num_shards = {bounded_json.short(obj.get('num_shards'))}, but it lists "
                         f"{len(sha)} shard checksums")
    if len(sha) != len(table):
        raise CacheError(f"{path}: {len(sha)} shard checksums, the manifest has {len(table)} shards")
    return sha, prov


def parse_manifest(raw: dict, *, path: str = MANIFEST_NAME, check_shards: bool = True) -> Manifest:
    """Validates a manifest dict and returns a ``Manifest``.

    Every field is checked against its definition in ``seqcache.manifest``
    (``MANIFEST_FIELDS``: its JSON type, and for some fields their values).
    Reads format versions 1 and 2 (``READ_FORMAT_VERSIONS``). Cost: O(number
    of shards) in list and numpy operations, no Python object per shard
    (``ShardTable``). Version 2: the shard columns are decoded and checked
    whole here (a few numpy operations over base64 text). Version 1: the shard
    names and record counts are always checked here; every shard's other fields
    too with ``check_shards=True`` (the default), else when the shard's
    ``ShardInfo`` is first built (at its first read: what ``read_manifest`` does).

    Raises:
      CacheError: wrong format name or version, missing fields, a field of the
        wrong JSON type or value, a shard layout
        that is not the version's, or a shard name
        that is not a plain file name of this cache (for instance one that leads
        outside the cache folder), a bad record count; with ``check_shards``, any
        bad shard entry.
    """

    decoded = schema.check_manifest(raw, path=path, check_shards=check_shards)
    return Manifest(
        task=raw["task"],
        split=raw["split"],
        fingerprint=raw["fingerprint"],
        features=decoded["features"],
        shards=decoded["shards"],
        raw=raw,
    )


def _split_folders(folder: str) -> list[str]:
    """The names of ``folder``'s subfolders that hold a manifest (local folders
    only; none for a URL), sorted."""
    if fs.is_url(folder):
        return []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [n for n in names if os.path.isfile(os.path.join(folder, n, MANIFEST_NAME))]


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
            splits = _split_folders(cache_dir)
            if splits:
                raise IncompleteCacheError(
                    f"{cache_dir}: no {MANIFEST_NAME} here; this is a task folder (CACHE_DIR/<task>) holding the "
                    f"split cache(s) {', '.join(splits)}: give one, e.g. {fs.join(cache_dir, splits[0])}"
                )
            raise IncompleteCacheError(
                f"{cache_dir}: no {MANIFEST_NAME}: the cache is incomplete (an unfinished or failed build) "
                "or this is not a cache folder; re-run the build"
            )
        raise IncompleteCacheError(f"{cache_dir}: no such cache folder")

    raw = bounded_json.read_file(path, error=CacheError, what="manifest")
    return parse_manifest(raw, path=path, check_shards=False)


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
            p = layout.cache_file(cache_dir, name, what="shard file")
            actual = fs.size(p) if listed is None else listed.get(name)
            if actual is None:
                raise CacheError(f"{p}: shard file is missing (the manifest lists it with {size} bytes)")
            if actual != size:
                raise CacheError(f"{p}: shard file has {actual} bytes, the manifest expects {size}")


def iter_json_lines(path: str) -> Iterable[dict]:
    """The JSON objects of a JSON-lines file (local path or URL), streaming;
    blank lines are skipped.

    Raises:
      CacheError: a line that is not JSON within ``seqcache.bounded_json``'s bounds.
    """

    with fs.open_read(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield bounded_json.loads(line, path=f"{path}: line {number}", error=CacheError, what="line")
