"""Writing cache shards, and replacing a cache.

A shard is written under a temporary name and moved into place only when
complete; the driver then writes the shard checksum file and, last, the
manifest (``Manifest.write``). A folder without manifest.json is never read as
a cache (G7). On object stores, ArrayRecord writes a local temporary file that
is then copied to its destination.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import hashlib
import itertools
import os
from typing import Any, Iterable, Iterator, Mapping, Sequence

from array_record.python.array_record_module import ArrayRecordWriter

from seqcache import format as fmt
from seqcache.fs import (  # noqa: F401  (open_read, open_write: re-exported, the writer's file-system calls)
    atomic_path, exists, is_local, join, local_path, makedirs, open_read, open_write, read_bytes, remove_tree, rename,
    sizes_in, write_bytes_atomic,
)
from seqcache.manifest import Manifest

TMP_DIR_NAME = "_tmp"

# Replacing a cache (--overwrite): the new one is built in the hidden sibling
# ``<task>/.<split>.staging`` and published only once complete (manifest
# written), so the old cache stays intact and readable until then. Publishing
# never writes into a file of the old cache: its files are only unlinked (a
# reader holding one open reads its old bytes to the end); a reader of the old
# cache that opens a shard after the publish is refused at that open
# (``seqcache.feeders.reader.CacheRebuiltError``; docs/cache-format.md,
# "Readers and rebuilds").


def staging_path(cache_dir: str) -> str:
    """``<task>/.<split>.staging``: where a replacement of ``cache_dir`` is built."""
    return _sibling(cache_dir, ".staging")


def replaced_path(cache_dir: str) -> str:
    """``<task>/.<split>.replaced``: the old cache during a two-rename publish."""
    return _sibling(cache_dir, ".replaced")


def _sibling(cache_dir: str, suffix: str) -> str:
    parent, _, name = cache_dir.rstrip("/").rpartition("/")
    if is_local(cache_dir):
        parent, name = os.path.split(os.path.normpath(local_path(cache_dir)))
    return join(parent, f".{name}{suffix}")


def remove_cache_tree(path: str) -> None:
    """Removes a cache folder, its manifest first (an interrupted removal never looks complete)."""
    manifest = join(path, fmt.MANIFEST_NAME)
    if exists(manifest):
        if is_local(manifest):
            os.unlink(local_path(manifest))
        else:
            remove_tree(manifest)
    remove_tree(path)


def _exchange(a: str, b: str) -> bool:
    """Swaps two local folders atomically (renameat2 with RENAME_EXCHANGE);
    False where the C library or the file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV, errno.EPERM):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def publish_dir(staging: str, cache_dir: str) -> None:
    """Puts the complete cache built in ``staging`` (manifest included) at
    ``cache_dir``, replacing the cache there, and removes the old one.

    Local folders: one atomic exchange (renameat2 with ``RENAME_EXCHANGE``,
    Linux) where supported, so a reader always finds the old or the new
    complete cache; otherwise two renames through ``replaced_path(cache_dir)``,
    between which there is no folder at ``cache_dir`` (a reader never sees a
    mix; a build killed there is undone by ``recover_publish``).

    Object stores (gs://, s3://, hdfs://): the old manifest is deleted first,
    then the old files; the new files are renamed (copied) into place and the
    manifest is written last. Until then there is no readable cache at
    ``cache_dir``; a build killed there leaves a folder without a manifest,
    which the next build rebuilds.
    """
    if is_local(cache_dir):
        src, dst = local_path(staging), local_path(cache_dir)
        if not os.path.exists(dst):
            os.rename(src, dst)
            return
        if _exchange(src, dst):
            remove_cache_tree(src)  # now the old cache
            return
        old = local_path(replaced_path(cache_dir))
        remove_cache_tree(old)
        os.rename(dst, old)
        os.rename(src, dst)
        remove_cache_tree(old)
        return
    manifest = read_bytes(join(staging, fmt.MANIFEST_NAME))
    remove_cache_tree(cache_dir)
    names = sorted(n for n in sizes_in(staging) if n != fmt.MANIFEST_NAME)
    rename([join(staging, n) for n in names], [join(cache_dir, n) for n in names])
    write_bytes_atomic(join(cache_dir, fmt.MANIFEST_NAME), manifest)
    remove_tree(staging)


def recover_publish(cache_dir: str, *, keep_staging: bool = False) -> None:
    """Cleans up after a build killed while replacing ``cache_dir``: an old cache
    caught between the two renames of ``publish_dir`` is put back, and staging
    and old-cache leftovers are removed (the staging folder is kept with
    ``keep_staging``: a rerun of the same build resumes it). Call it holding
    the cache's build lock."""
    old = replaced_path(cache_dir)
    if is_local(cache_dir) and not exists(cache_dir) and exists(join(old, fmt.MANIFEST_NAME)):
        os.rename(local_path(old), local_path(cache_dir))
    for leftover in ((old,) if keep_staging else (staging_path(cache_dir), old)):
        remove_cache_tree(leftover)  # nothing to do when absent (object stores: no such prefix)


class EncodedChunks:
    """Examples for ``write_shard`` that are already encoded, in chunks:
    ``chunks`` yields ``(records, provenances)``, two equally long lists of
    ``bytes`` (``seqcache.format.encode_batch`` / ``encode_provenance_batch``),
    in cache order."""

    def __init__(self, chunks: Iterable[tuple[Sequence[bytes], Sequence[bytes]]]):
        self.chunks = chunks


def write_shard(
    cache_dir: str,
    *,
    index: int,
    num_shards: int,
    features: Sequence[fmt.FeatureSpec],
    examples: Iterable[tuple[Mapping[str, Any], Sequence[tuple[int, int, int]]]],
    group_size: int | None = None,
) -> dict:
    """Writes one data shard and its provenance sidecar into ``cache_dir``.

    Args:
      cache_dir: the cache folder (local or gs://...); it must exist.
      index, num_shards: which shard this is.
      features: the record features, in manifest order.
      examples: (example, provenance) pairs in cache order, or an
        ``EncodedChunks``. ``example`` maps feature name -> 1-D array, or is
        encoded record bytes; ``provenance`` is a list, one per segment, of
        (source_index, record_number, token_offset), or is encoded
        (``seqcache.format.encode_provenance``).
      group_size: the data file's ArrayRecord group size; None (the format's
        rule): ``fmt.group_size_for`` the mean size of the shard's first chunk
        of records. The provenance file's is ``fmt.PROVENANCE_GROUP_SIZE``.

    Returns:
      The shard's manifest entry (a dict, see ``seqcache.format.ShardInfo``).

    Raises:
      ValueError: a chunk whose records and provenance records differ in number.

    Both files are moved into place only when complete (``seqcache.fs.atomic_path``).
    """
    chunks, group_size = _chunks_and_group_size(features, examples, group_size)
    data_name = fmt.shard_name(fmt.DATA_PREFIX, index, num_shards)
    prov_name = fmt.shard_name(fmt.PROVENANCE_PREFIX, index, num_shards)
    with atomic_path(join(cache_dir, prov_name)) as prov_tmp, atomic_path(join(cache_dir, data_name)) as data_tmp:
        data = ArrayRecordWriter(data_tmp, fmt.writer_options(group_size))
        prov = ArrayRecordWriter(prov_tmp, fmt.writer_options(fmt.PROVENANCE_GROUP_SIZE))
        count = 0
        for records, provenances in chunks:
            if len(records) != len(provenances):
                raise ValueError(f"shard {index}: {len(records)} records but {len(provenances)} provenance records")
            collections.deque(map(data.write, records), maxlen=0)  # a loop in C: one call per record
            collections.deque(map(prov.write, provenances), maxlen=0)
            count += len(records)
        data.close()
        prov.close()
        return {"file": data_name, "num_records": count, "num_bytes": os.path.getsize(data_tmp),
                "sha256": fmt.file_sha256(data_tmp), "provenance_file": prov_name,
                "provenance_num_bytes": os.path.getsize(prov_tmp), "provenance_sha256": fmt.file_sha256(prov_tmp)}


def _chunks_and_group_size(features, examples, group_size: int | None):
    """(the chunks of ``write_shard``'s examples, the data file's group size):
    ``group_size``, or the format's rule on the first chunk's records."""
    chunks = iter(examples.chunks if isinstance(examples, EncodedChunks) else _encoded_chunks(features, examples))
    first = next(chunks, None)
    if first is None:
        return iter(()), group_size or 1
    if group_size is None:
        records = first[0]
        group_size = fmt.group_size_for(sum(map(len, records)) / len(records)) if len(records) else 1
    return itertools.chain([first], chunks), group_size


# Examples given one by one are encoded in chunks of this many (the first chunk
# also sets the data file's group size: the mean size of these first records).
FIRST_CHUNK = 4096


def _encoded_chunks(features, examples) -> Iterator[tuple[list[bytes], list[bytes]]]:
    """(records, provenance records) of ``examples`` (``write_shard``), encoded
    ``FIRST_CHUNK`` at a time."""
    records, provenances = [], []
    for example, provenance in examples:
        records.append(example if isinstance(example, bytes) else fmt.encode_example(features, example))
        provenances.append(provenance if isinstance(provenance, bytes) else fmt.encode_provenance(provenance))
        if len(records) >= FIRST_CHUNK:
            yield records, provenances
            records, provenances = [], []
    if records:
        yield records, provenances


def write_cache(
    cache_dir: str,
    *,
    task: str,
    split: str,
    features: Sequence[fmt.FeatureSpec],
    shards: Sequence[Sequence[tuple[Mapping[str, Any], Sequence[tuple[int, int, int]]]]],
    sources: Sequence[Mapping[str, Any]] = (),
    seed: int = 0,
    sequence_length: Mapping[str, int] | None = None,
    packing: str | None = None,
    vocabularies: Mapping[str, Any] | None = None,
    fingerprint_inputs: Mapping[str, Any] | None = None,
) -> fmt.Manifest:
    """Writes a whole cache from in-memory examples, already in cache order (small
    caches and tests). The fingerprint is the sha256 of ``fingerprint_inputs``
    (default: the task, split, seed and a hash of every record).
    """
    makedirs(cache_dir)
    entries = []
    digest = hashlib.sha256()
    for i, shard in enumerate(shards):
        shard = list(shard)
        for example, _ in shard:
            digest.update(fmt.encode_example(features, example))
        entries.append(write_shard(cache_dir, index=i, num_shards=len(shards), features=features, examples=shard))
    inputs = dict(fingerprint_inputs or {"task": task, "split": split, "seed": seed, "records": digest.hexdigest()})
    manifest = Manifest.create(
        task=task, split=split, fingerprint=fmt.fingerprint_of(inputs), fingerprint_inputs=inputs,
        features=[{"name": f.name, "dtype": f.dtype} for f in features], shards=entries, sources=list(sources),
        statistics={"num_examples": sum(e["num_records"] for e in entries)}, seed=seed,
        sequence_length=sequence_length, packing=packing, vocabularies=dict(vocabularies or {}),
    )
    manifest.write(cache_dir)
    return manifest
