"""``UrlCacheReader``: a ``CacheReader`` for a cache at a URL (gs://, s3://),
for the CLI (``seqcache show``); the feeder reads local or mounted paths only.

ArrayRecord's C++ reader opens local files only, so this reader downloads each
shard file it reads, once, into a private temporary folder that ``close()``
removes: the local disk holds the shards that were read, never the whole cache.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Iterable

from seqcache import format as fmt
from seqcache import fs
from seqcache.feeders.reader import READER_OPTIONS, CacheReader


class UrlCacheReader(CacheReader):
    """``CacheReader`` over a local path or a URL; shards at a URL are
    downloaded on first read (see the module docstring). Shards are opened
    lazily (``open_shards=False``) unless asked otherwise: opening every shard
    of a remote cache would download all of it.

    Raises:
      Like ``CacheReader``; also seqcache.fs.FileSystemError when the object
      store cannot be reached or refuses a request.
    """

    _reads_urls = True

    def __init__(self, cache_dir: str, *, reader_options: str = READER_OPTIONS, open_shards: bool = False):
        cache_dir = os.fspath(cache_dir)
        self._tmp = tempfile.mkdtemp(prefix="seqcache-shards-") if fs.is_url(cache_dir) else None
        self._copies: dict[str, str] = {}
        try:
            super().__init__(cache_dir, reader_options=reader_options, open_shards=open_shards)
        except BaseException:
            self._remove_copies()
            raise

    def _local_file(self, path: str) -> str:
        if fs.is_local(path):
            return fs.local_path(path)
        local = self._copies.get(path)
        if local is None:
            local = os.path.join(self._tmp, path.rstrip("/").rpartition("/")[2])
            try:
                with fs.open_read(path) as src, fs.open_write_atomic(local, fsync=False) as out:
                    shutil.copyfileobj(src, out, length=1 << 22)
            except FileNotFoundError:
                raise fmt.CacheError(f"{path}: shard file is missing: it was deleted or moved after cache "
                                     f"{self.cache_dir} was opened; {self._verify_hint()}") from None
            self._copies[path] = local
        return local

    def check_record_counts(self, shards: Iterable[int]) -> None:
        """Like ``CacheReader.check_record_counts``; a shard that is not open
        yet is downloaded, checked and deleted again (reads download it anew).

        Raises:
          CacheError: a shard is missing, unreadable, or has another record count.
        """
        for shard in shards:
            if self._data[shard] is not None:
                continue
            self._open(self._data, shard, self.manifest.shards[shard].file)
            with self._lock:
                reader, self._data[shard] = self._data[shard], None
            reader.close()
            local = self._copies.pop(self._path(self.manifest.shards[shard].file), None)
            if local is not None and os.path.exists(local):
                os.unlink(local)

    def _remove_copies(self) -> None:
        self._copies.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def close(self) -> None:
        """Closes every opened shard reader and deletes the downloaded copies. Idempotent."""
        try:
            super().close()
        finally:
            self._remove_copies()

    def __getstate__(self):
        raise TypeError("UrlCacheReader holds downloaded files of this process; it is not picklable")
