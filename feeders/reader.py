"""Random access to one task cache: batched ArrayRecord reads by cache index.

Cache index i (0-based, in cache order) is record i - shard_starts[s] of shard s,
where shard_starts[s] <= i < shard_starts[s + 1]. ``CacheReader.read`` sorts a
batch of indices (grouping them by shard, ascending within each), reads each
shard's records in that order and returns them in the order asked for. Each
shard's reader is opened once, on first use, with ``READER_OPTIONS``, and shared
by all threads.

``read_mode`` says how a shard's records are read; the bytes are the same:

- ``"batched"``: one ``ArrayRecordReader.read(offsets)`` per shard, which
  releases the GIL and hands every chunk to ArrayRecord's pool of 64 threads:
  about 16 us of CPU per 2 KB record on 2 cores, mostly waking threads and
  setting up decoders.
- ``"one_by_one"``: ``seek`` then ``read`` per record on the calling thread,
  under a lock per shard: about 3.5 us per record in the page cache, 4-5x less
  CPU (benchmarks/feeder.py, "raw one by one"), but holding the GIL during a
  read from a disk or a mounted bucket.
- ``"auto"`` (the default): one by one while reads are fast; a shard read whose
  median sampled record takes over ``SLOW_RECORD_S`` (it waited on storage)
  switches to batched reads for the next ``BATCHED_AFTER_SLOW`` shard reads.

A damaged shard raises the same ``CacheError`` in every mode: a failed one-by-one
read leaves ArrayRecord's reader failed, so the shard is reopened and read
batched, which fails on the damaged record alone.

A reader is pinned to the manifest it opened: each shard file's first open checks
that ``manifest.json`` is still the same file (one ``os.stat``) or, when it is
not, that it holds the same fingerprint. A cache rebuilt since the reader opened
it is refused with ``CacheRebuiltError``; shards opened before keep reading the
old files (docs/cache-format.md, "Readers and rebuilds").

Memory: one int64 per shard, and inside ArrayRecord each opened shard's chunk
index (one entry per chunk of up to 64 records,
``seqcache.format.group_size_for``), kept in memory because the offloaded index
makes random reads about 30x slower (benchmarks/feeder.py).

Caches are read from local (or mounted) paths only (the feeder never imports
Beam): a URL is refused with ``seqcache.fs.require_local``'s error, which says to
mount the bucket or copy the cache; ``seqcache show`` reads URLs with a subclass
that downloads each shard it reads (``seqcache.cli.url_reader``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Iterable, Self, Sequence

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from seqcache import format as fmt
from seqcache import fs, layout

# No read-ahead (random access) and no read-ahead threads; a batched read still
# uses ArrayRecord's own pool. A few percent faster on 16 shards x 64 records a step.
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"

READ_MODES = ("auto", "batched", "one_by_one")
# "auto": a record slower than this (median of a shard read's sampled records)
# waited on storage: 5-10x a page-cache read, well under a disk's 100 us.
SLOW_RECORD_S = 25e-6
# "auto": shard reads done batched after a slow one-by-one read, before trying again.
BATCHED_AFTER_SLOW = 256
# "auto": records timed one at a time per shard read (the first ones).
_SAMPLED_RECORDS = 16
_SHARD_LOCKS = 64


class CacheRebuiltError(fmt.CacheError):
    """The cache a reader opened was rebuilt (or removed) since: its folder now
    holds another manifest, of another fingerprint, or none. Reopen the cache to
    read the new one; a feeder state saved before restores only on the old
    cache's fingerprint."""


# What ArrayRecord raises on a damaged file (a corrupted chunk or footer is a
# RuntimeError carrying Riegeli's status message); reported as CacheError.
_ARRAY_RECORD_ERRORS = (RuntimeError, OSError, ValueError)


class ClosedOnExit:
    """``with obj:`` gives ``obj`` and calls its ``close()`` on leaving the block."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CacheReader(ClosedOnExit):
    """Batched random access to the records of one task cache.

    Args:
      cache_dir: the cache folder (``CACHE_DIR/<task>/<split>``, with manifest.json).
      reader_options: ArrayRecord reader options.
      read_mode: "auto" (the default), "batched" or "one_by_one": how a
        shard's records are read (see the module docstring); the records are
        the same bytes in every mode.
      open_shards: True (the default) opens every data shard now and checks every
        shard file's byte size and every data shard's record count against the
        manifest; False opens in O(1) of the number of shards (the manifest
        alone) and runs the same checks on each shard file at its first read,
        before any of its records are returned (what ``Feeder`` does).

    The checks, eager or lazy, raise the same errors: a missing or resized shard
    file, or a shard whose record count is not the manifest's. Checksums are
    ``seqcache verify``'s job.

    Raises:
      ValueError: ``cache_dir`` is a URL (gs://, s3://, ...): mount the bucket
        and pass the mounted path (the message says how).
      seqcache.format.IncompleteCacheError: no manifest.json (an unfinished build).
      seqcache.format.CacheError: an invalid manifest or (at open, or at a shard's
        first read with ``open_shards=False``) a missing or resized shard or one
        with another record count; also, from the reads, a shard that ArrayRecord
        cannot open or read (a damaged chunk, or a shard deleted after its first
        read: an opened shard stays readable). The message names the shard file
        and says to run ``seqcache verify CACHE``.
      CacheRebuiltError: (a CacheError) at a shard file's first open, the cache
        was rebuilt or removed since this reader read its manifest (module
        docstring); the message names the cache and both fingerprints.
    """

    # True in a subclass that fetches shard files at URLs itself (seqcache.cli.url_reader).
    _reads_urls = False

    def __init__(self, cache_dir: str, *, reader_options: str = READER_OPTIONS, open_shards: bool = True,
                 read_mode: str = "auto"):
        if read_mode not in READ_MODES:
            raise ValueError(f"read_mode must be one of {READ_MODES}, not {read_mode!r}")
        self.read_mode = read_mode
        self._batched_reads_left = 0  # "auto": shard reads still to do batched after a slow one
        self.cache_dir = os.fspath(cache_dir)
        if not self._reads_urls:
            self.cache_dir = fs.require_local(self.cache_dir, "the feeder (CacheReader)")
        # Taken before reading the manifest: one replaced in between is noticed at the first shard open.
        self._manifest_id = self._manifest_file_id()
        self.manifest = fmt.read_manifest(self.cache_dir)
        self._eager = bool(open_shards)
        if open_shards:
            try:
                fmt.check_shard_files(self.cache_dir, self.manifest)
            except fmt.CacheError as e:
                self.check_generation()  # rebuilt since its manifest was read a moment ago
                raise fmt.CacheError(f"{e}; {self._verify_hint()}") from None
        self.shard_starts = self.manifest.shard_starts  # int64 (num_shards + 1,)
        self.num_examples = int(self.shard_starts[-1])
        if self.num_examples == 0:
            raise fmt.CacheError(f"{self.cache_dir}: the cache has no examples")
        self.features = self.manifest.features
        self._options = reader_options
        self._lock = threading.Lock()
        self._shard_locks = [threading.Lock() for _ in range(_SHARD_LOCKS)]
        self._retired: list[ArrayRecordReader] = []  # replaced after a failed read; closed by close()
        self._data: list[ArrayRecordReader | None] = [None] * len(self.manifest.shards)
        self._prov: list[ArrayRecordReader | None] = [None] * len(self.manifest.shards)
        self._closed = False
        if open_shards:
            # Every data shard's record count checked now, not in the middle of a run.
            for shard, info in enumerate(self.manifest.shards):
                self._open(self._data, shard, info.file)

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    def _open(self, table: list, shard: int, name: str) -> ArrayRecordReader:
        reader = table[shard]
        if reader is not None:
            return reader
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.cache_dir}: reader is closed")
            reader = table[shard]
            if reader is None:
                path = layout.cache_file(self.cache_dir, name, what="shard file")
                try:
                    reader = self._open_checked(shard, name, path)
                except fmt.CacheError:
                    self.check_generation()  # a rebuild explains a missing or resized shard best
                    raise
                # The open file outlives its name: it is the reader's if the manifest still is.
                try:
                    self.check_generation()
                except BaseException:
                    _close_quietly(reader)
                    raise
                table[shard] = reader
        return reader

    def _open_checked(self, shard: int, name: str, path: str) -> ArrayRecordReader:
        """Opens shard file ``name`` (at ``path``) and checks its byte size and
        record count against the manifest."""
        local = self._local_file(path)
        self._check_size(shard, name, local, shown=path)
        try:
            reader = ArrayRecordReader(local, self._options)
        except _ARRAY_RECORD_ERRORS as e:
            raise self._open_failed(path, e) from e
        # A failed open does not raise: the reader is not ok() and its close() raises.
        error = None if reader.ok() else _failure_of(reader)
        if error is None:
            try:
                actual = reader.num_records()
            except _ARRAY_RECORD_ERRORS as e:
                _close_quietly(reader)
                error = e
        if error is not None:
            raise self._open_failed(path, error) from error
        expected = self.manifest.shards[shard].num_records
        if actual != expected:
            _close_quietly(reader)
            raise fmt.CacheError(
                f"{path}: shard has {actual} records, the manifest expects {expected}; "
                "the cache was modified after it was built: rebuild it"
            )
        return reader

    def _manifest_file_id(self) -> tuple | None:
        """(device, inode, size, mtime ns, ctime ns) of manifest.json now (a new
        manifest is always a new file); None at a URL or when there is none."""
        if not fs.is_local(self.cache_dir):
            return None
        try:
            st = os.stat(os.path.join(fs.local_path(self.cache_dir), fmt.MANIFEST_NAME))
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def check_generation(self) -> None:
        """Checks that the cache is still the one this reader opened: its
        manifest.json is the same file (one stat) or holds the same fingerprint
        (read again when the file changed; at a URL, every time).

        Raises:
          CacheRebuiltError: the manifest now has another fingerprint, or there
            is none (or none that can be read): the cache was rebuilt or
            removed since this reader opened it.
        """
        for _ in range(3):  # a manifest replaced while it is read again: read the newest
            before = self._manifest_file_id()
            if before is not None and before == self._manifest_id:
                return
            try:
                now = fmt.read_manifest(self.cache_dir)
            except fmt.IncompleteCacheError:
                raise self._rebuilt(None, f"it has no {fmt.MANIFEST_NAME}") from None
            except fmt.CacheError as e:
                raise self._rebuilt(None, f"its manifest: {str(e).splitlines()[0] if str(e) else 'unreadable'}") from None
            if now.fingerprint != self.manifest.fingerprint:
                raise self._rebuilt(now.fingerprint)
            if before is None or self._manifest_file_id() == before:
                self._manifest_id = before  # the same generation in a rewritten manifest file
                return
        raise self._rebuilt(None, "its manifest.json keeps changing")

    def _rebuilt(self, fingerprint: str | None, why: str = "") -> CacheRebuiltError:
        old = self.manifest.fingerprint[:12]
        if fingerprint is not None:
            return CacheRebuiltError(
                f"{self.cache_dir} was rebuilt since this reader opened it (fingerprint {old}… → "
                f"{fingerprint[:12]}…); reopen it to read the new cache"
            )
        return CacheRebuiltError(
            f"{self.cache_dir} was rebuilt or removed since this reader opened it (fingerprint {old}…; now: {why}); "
            "reopen it once its build is complete"
        )

    def _path(self, name: str) -> str:
        """The path of the cache's file ``name`` (what error messages name)."""
        return fs.join(self.cache_dir, name)

    def _local_file(self, path: str) -> str:
        """The local file ArrayRecord opens for ``path`` (a downloaded copy in ``UrlCacheReader``)."""
        return path

    def _check_size(self, shard: int, name: str, path: str, shown: str | None = None) -> None:
        """``check_shard_files``' size check of one shard file, before its first open (one stat)."""
        info = self.manifest.shards[shard]
        size = info.num_bytes if name == info.file else info.provenance_num_bytes
        shown = shown or path
        try:
            actual = os.path.getsize(path)
        except OSError as e:
            if self._eager:  # it was there when the cache was opened
                raise self._open_failed(shown, e) from None
            raise fmt.CacheError(
                f"{shown}: shard file is missing (the manifest lists it with {size} bytes); {self._verify_hint()}"
            ) from None
        if actual != size:
            raise fmt.CacheError(
                f"{shown}: shard file has {actual} bytes, the manifest expects {size}; {self._verify_hint()}"
            )

    def check_record_counts(self, shards: Iterable[int]) -> None:
        """Opens the data shards ``shards`` (if not open yet), which checks each
        one's record count against the manifest (making a lazy reader's map from
        index to shard exact up to the last shard checked).

        Raises:
          CacheError: a shard is missing, unreadable, or has another record count.
        """
        for shard in shards:
            self._open(self._data, shard, self.manifest.shards[shard].file)

    def _verify_hint(self) -> str:
        return (
            f"run `seqcache verify {self.cache_dir}` to check every shard against the manifest's checksums, "
            "then rebuild the cache (or restore the file)"
        )

    def _corrupt(self, path: str, what: str, error: BaseException) -> fmt.CacheError:
        """The CacheError for an ArrayRecord failure on shard file ``path``."""
        return fmt.CacheError(
            f"{path}: {what}, in cache {self.cache_dir}: {error}. The shard file is damaged or was "
            f"modified after the build; {self._verify_hint()}"
        )

    def _open_failed(self, path: str, error: BaseException) -> fmt.CacheError:
        """The CacheError for a shard file ArrayRecord cannot open: 'missing' or ``_corrupt``."""
        if not fs.exists(path):
            return fmt.CacheError(
                f"{path}: shard file is missing: it was deleted or moved after cache {self.cache_dir} was opened; "
                f"{self._verify_hint()}"
            )
        return self._corrupt(path, "cannot open the shard", error)

    def locate(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(shard int64, record offset in the shard int64) of each cache index."""
        idx = np.asarray(indices, dtype=np.int64)
        shard = np.searchsorted(self.shard_starts, idx, side="right") - 1
        return shard, idx - self.shard_starts[shard]

    def _read(self, table: list, names: Sequence[str], indices) -> list[bytes]:
        records, order = self._read_sorted(table, names, indices)
        if order is None:
            return records
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        return list(map(records.__getitem__, inverse.tolist()))

    def _read_sorted(self, table: list, names: Sequence[str], indices) -> tuple[list[bytes], np.ndarray | None]:
        """(records, order): the records at ``indices`` in ascending index order
        (records[j] is the record at indices[order[j]]); order None when the
        indices are already ascending (records[j] is at indices[j])."""
        idx = np.asarray(indices, dtype=np.int64).ravel()
        if idx.size == 0:
            return [], None
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]  # grouped by shard, ascending within each shard
        if sorted_idx[0] < 0 or sorted_idx[-1] >= self.num_examples:
            bad = np.unique(idx[(idx < 0) | (idx >= self.num_examples)])
            shown = ", ".join(map(str, bad[:5].tolist())) + (f" and {bad.size - 5} more" if bad.size > 5 else "")
            raise IndexError(f"{self.cache_dir}: cache index out of range [0, {self.num_examples}) (got {shown})")
        # O(n log S) for n indices and S shards: each index's shard, then the
        # runs of equal shards (not a pass over all S shards per read).
        shard_of = np.searchsorted(self.shard_starts, sorted_idx, side="right") - 1
        cuts = np.flatnonzero(shard_of[1:] != shard_of[:-1]) + 1
        bounds = [0, *cuts.tolist(), sorted_idx.size]
        offsets_all = (sorted_idx - self.shard_starts[shard_of]).tolist()
        shards = shard_of[bounds[:-1]].tolist()
        records: list[bytes] = []
        for s, lo, hi in zip(shards, bounds, bounds[1:]):
            reader = self._open(table, s, names[s])  # an open shard's reader, without the lock
            offsets = offsets_all[lo:hi]
            try:
                records.extend(self._read_shard(table, s, names[s], reader, offsets))
            except _ARRAY_RECORD_ERRORS as e:
                self.check_generation()  # a file gone with its cache's rebuild (a mounted bucket) says so
                what = f"cannot read records {offsets[0]}..{offsets[-1]} ({len(offsets)} records)"
                raise self._corrupt(self._path(names[s]), what, e) from e
        if (order[1:] > order[:-1]).all():  # asked for in ascending order
            return records, None
        return records, order

    def _read_shard(self, table: list, shard: int, name: str, reader: ArrayRecordReader,
                    offsets: list[int]) -> list[bytes]:
        """The records at ``offsets`` (ascending) of one shard, read as
        ``read_mode`` says (module docstring)."""
        mode = self.read_mode
        if mode == "auto" and self._batched_reads_left > 0:
            self._batched_reads_left -= 1  # a lost update between threads only shortens the wait
            mode = "batched"
        if mode == "batched":
            return reader.read(offsets)
        timed = mode == "auto"
        try:
            with self._shard_locks[shard % _SHARD_LOCKS]:  # seek and read share the reader's position
                if not timed:
                    return [_read_at(reader, off) for off in offsets]
                clock = time.perf_counter
                out, times = [], []
                for off in offsets[:_SAMPLED_RECORDS]:
                    t0 = clock()
                    out.append(_read_at(reader, off))
                    times.append(clock() - t0)
                out.extend(_read_at(reader, off) for off in offsets[_SAMPLED_RECORDS:])
        except (*_ARRAY_RECORD_ERRORS, IndexError):
            # The reader is failed now: a fresh one reads batched, failing on the damaged record alone.
            return self._reopen(table, shard, name, reader).read(offsets)
        times.sort()
        if times[len(times) // 2] > SLOW_RECORD_S:
            self._batched_reads_left = BATCHED_AFTER_SLOW
        return out

    def _reopen(self, table: list, shard: int, name: str, failed: ArrayRecordReader) -> ArrayRecordReader:
        """A new reader in place of ``failed`` (which ``close`` closes: other threads may hold it)."""
        with self._lock:
            if table[shard] is failed:
                table[shard] = None
                self._retired.append(failed)
        return self._open(table, shard, name)

    def read(self, indices) -> list[bytes]:
        """The data records at ``indices`` (cache indices, any order, repeats
        allowed), in that order. One ArrayRecord ``read`` call per shard touched."""
        return self._read(self._data, self.manifest.shards.files, indices)

    def read_sorted(self, indices) -> tuple[list[bytes], np.ndarray | None]:
        """(records, order): the data records at ``indices`` as read, in ascending
        index order: records[j] is at indices[order[j]] (order: int64 (n,), the
        stable argsort of indices; None when the indices are ascending)."""
        return self._read_sorted(self._data, self.manifest.shards.files, indices)

    def read_provenance_records(self, indices) -> list[bytes]:
        """The raw provenance records at ``indices`` (one batched read per shard)."""
        return self._read(self._prov, self.manifest.shards.provenance_files, indices)

    def read_provenance(self, indices) -> list[dict[str, np.ndarray]]:
        """The decoded provenance records (source_index, record_number,
        token_offset; one element per segment) at ``indices``."""
        recs = self.read_provenance_records(indices)
        return [
            fmt.decode_example(fmt.PROVENANCE_FEATURES, r, where=self.describe(int(i), provenance=True))
            for r, i in zip(recs, np.asarray(indices).ravel())
        ]

    def __len__(self) -> int:
        return self.num_examples

    def read_examples(self, indices) -> list[dict[str, np.ndarray]]:
        """The decoded examples (feature -> 1-D array view) at ``indices``."""
        idx = np.asarray(indices, dtype=np.int64).ravel()
        return [self.decode(r, int(i)) for r, i in zip(self.read(idx), idx)]

    @property
    def sources(self) -> "fmt.SourceTable":
        """The cache's per-file source table (``seqcache.format.SourceTable``: a
        sequence of ``{path, num_bytes, mtime_ns, locator}``, indexed by a
        provenance record's ``source_index``), read at the first use, not when
        the cache is opened (from its source table file, checked against the
        manifest, or from the manifest of an older cache).

        Raises:
          seqcache.format.CacheError: the source table file is missing or does
            not match the manifest (one line naming it).
        """
        return self.manifest.read_source_table(self.cache_dir)

    def read_sources(self, indices) -> list[list[dict]]:
        """Per example, one dict per segment: ``source_index``, ``path`` and
        ``locator`` (from the cache's source table, ``sources``: what ``record_number``
        counts, ``"record"`` for caches that do not say), ``record_number`` and
        ``token_offset``."""
        sources = self.sources
        return [[dict(zip(("source_index", "path", "locator", "record_number", "token_offset"),
                          (src, *source_of(sources, src), rec, off)))
                 for src, rec, off in zip(p["source_index"].tolist(), p["record_number"].tolist(),
                                          p["token_offset"].tolist())]
                for p in self.read_provenance(indices)]

    def vocabulary(self, feature: str):
        """The vocabulary of ``feature``, rebuilt from the manifest and the model
        file stored in the cache; None when the manifest describes none.

        Raises:
          ValueError: the stored model is missing or corrupt; its name is not a
            plain file name inside the cache, or it is a link out of the cache
            (``seqcache.layout.UnsafeCachePathError``).
          CacheRebuiltError: the model is missing or another because the cache
            was rebuilt since this reader opened it.
        """
        desc = self.manifest.vocabularies.get(feature)
        if desc is None:
            return None
        if desc.file is not None:
            layout.cache_file(self.cache_dir, desc.file, what=f"vocabulary model of feature {feature!r}")
        from seqcache.tasks import vocabulary_from_json  # the feeder imports numpy, array_record and msgspec only (trainers install seqcache --no-deps)

        try:
            return vocabulary_from_json(desc.to_json(), self.cache_dir)  # the model's sha256 is checked: a new one is refused
        except ValueError:
            self.check_generation()  # ... as a rebuild, when that is what it is
            raise

    def describe(self, index: int, *, provenance: bool = False) -> str:
        """'CACHE/data.array_record-00001-of-00004 record 17 (cache index 1041)'."""
        shard, offset = self.locate([index])
        info = self.manifest.shards[int(shard[0])]
        name = info.provenance_file if provenance else info.file
        return f"{self._path(name)} record {int(offset[0])} (cache index {index})"

    def decode(self, record: bytes, index: int) -> dict[str, np.ndarray]:
        """``decode_example`` of one data record, with errors naming it."""
        return fmt.decode_example(self.features, record, where=self.describe(index))

    def close(self) -> None:
        """Closes every opened shard reader. Idempotent."""
        with self._lock:
            self._closed = True
            for table in (self._data, self._prov):
                for i, r in enumerate(table):
                    if r is not None:
                        r.close()
                        table[i] = None
            for r in self._retired:
                _close_quietly(r)
            self._retired.clear()

    def __getstate__(self):
        # Picklable for multiprocess loaders: readers are reopened lazily.
        return dict(self.__dict__, _lock=None, _shard_locks=None, _retired=[], _data=[None] * len(self._data),
                    _prov=[None] * len(self._prov))

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._shard_locks = [threading.Lock() for _ in range(_SHARD_LOCKS)]


def source_of(sources: Sequence[dict], index: int) -> tuple[str | None, str]:
    """(path, locator) of entry ``index`` of a manifest's source table: the
    locator says what ``record_number`` counts (``"record"`` where the cache
    does not say); (None, "record") for an index outside the table."""
    entry = sources[index] if 0 <= index < len(sources) else {}
    return entry.get("path"), entry.get("locator") or "record"


def _read_at(reader: ArrayRecordReader, offset: int) -> bytes:
    reader.seek(offset)
    return reader.read()


def _failure_of(reader: ArrayRecordReader) -> BaseException:
    """The error of a reader that is not ok(): the status its close() raises."""
    try:
        reader.close()
    except _ARRAY_RECORD_ERRORS as e:
        return e
    return RuntimeError("ArrayRecord reader is not ok")


def _close_quietly(reader: ArrayRecordReader) -> None:
    """Closes a failed reader, dropping the failure its close() re-raises."""
    try:
        reader.close()
    except _ARRAY_RECORD_ERRORS:
        pass
