"""The on-disk cache format, version 3, as the rest of seqcache uses it
(``from seqcache import format as fmt``): every name of ``seqcache.codec``,
the manifest model of ``seqcache.manifest`` (``read_manifest`` =
``Manifest.read``, ``parse_manifest`` = ``Manifest.parse``), and
``check_shard_files`` and ``iter_json_lines``, which read local paths and URLs
alike through ``seqcache.fs``.

It stands on the other core modules and none of them imports it
(docs/architecture.md, "Dependency rules"). The byte layout is documented in
docs/cache-format.md; changing it needs a ``FORMAT_VERSION`` bump.
"""

from __future__ import annotations

from typing import Iterable

from seqcache import bounded_json, fs, layout
from seqcache.codec import (  # noqa: F401  the codec's names, as fmt.<name>
    FORMAT_NAME, FORMAT_VERSION, READ_FORMAT_VERSIONS, RECORD_FORMAT_VERSION, MANIFEST_NAME, DATA_PREFIX,
    PROVENANCE_PREFIX, QUARANTINE_NAME, SHARD_CHECKSUMS_NAME, SOURCE_TABLE_NAME, INT_COLUMN_ENCODING, WRITER_OPTIONS,
    CHUNK_TARGET_BYTES, MAX_GROUP_SIZE, PROVENANCE_GROUP_SIZE, group_size_for, writer_options, CacheError,
    IncompleteCacheError, FeatureSpec, PROVENANCE_FEATURES, shard_name, encode_example, check_fits,
    encode_batch, encode_provenance, encode_provenance_batch, decode_example, file_sha256, canonical_json,
    fingerprint_of, ShardInfo, encode_int_column, decode_int_column, decode_base64, ShardTable,
    is_plain_file_name, PRETOKENIZED_SUFFIX, TEXT_DTYPE, DTYPES, INT_FIELDS, SHA256_RE, is_count, require)
from seqcache.manifest import Manifest, read_shard_checksums, shard_checksums_json  # noqa: F401
from seqcache.source_table import SourceTable, read_source_table  # noqa: F401

read_manifest = Manifest.read
parse_manifest = Manifest.parse


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
