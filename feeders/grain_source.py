"""A grain ``RandomAccessDataSource`` view of one task cache, for pipelines built
on grain (``grain.python.DataLoader`` or ``grain.MapDataset``) rather than on
``Feeder``.

``CacheDataSource(cache_dir)`` has ``__len__`` (the number of examples),
``__getitem__(cache_index)`` (the decoded example: feature name -> 1-D numpy
array, read-only views over the record bytes) and the batched
``_getitems(indices)`` of grain's ``MapDataset.source`` (one ArrayRecord read
per shard), also as ``__getitems__`` (PyTorch's and ArrayRecord's name). It is
thread-safe and picklable: shard readers reopen lazily in each worker, each
checked against the manifest the source was made with (a rebuilt cache raises
``CacheRebuiltError``). It satisfies grain's protocol without importing grain.

grain's samplers decide the order; the exactly-once, elastic and O(1)-resume
guarantees (docs/feeder.md) are the Feeder's. grain 0.2.18's ``DataLoader``
sharded over H hosts (``ShardOptions``, ``ShardByJaxProcess``) loses records
when H does not divide the N examples, with or without ``drop_remainder``;
give each host ``MapDataset.source(src)[h::H]`` with ``NoSharding()`` instead
(docs/feeder.md, "Interop"). Its worker processes (``worker_count`` > 0) need
``absl.flags.FLAGS.mark_as_parsed()`` in a program that does not run absl's app.
"""

from __future__ import annotations

from typing import Sequence, SupportsIndex

import numpy as np

from seqcache.feeders.reader import CacheReader


class CacheDataSource:
    """Random access to the decoded examples of one task cache, by cache index.

    Args:
      cache_dir: the cache folder (``CACHE_DIR/<task>/<split>``).

    Raises:
      seqcache.format.CacheError: the cache is missing, incomplete or inconsistent;
        from reads, ``seqcache.feeders.reader.CacheRebuiltError`` (a CacheError)
        when a worker's copy opens a shard of a cache rebuilt since this
        source was made.
    """

    def __init__(self, cache_dir: str):
        self._reader = CacheReader(cache_dir)

    @property
    def cache_dir(self) -> str:
        return self._reader.cache_dir

    @property
    def manifest(self):
        return self._reader.manifest

    def __len__(self) -> int:
        return self._reader.num_examples

    def _check(self, index) -> int:
        i = int(index)
        if not 0 <= i < self._reader.num_examples:
            raise IndexError(f"{self.cache_dir}: cache index {i} out of range [0, {self._reader.num_examples})")
        return i

    def __getitem__(self, record_key: SupportsIndex) -> dict[str, np.ndarray]:
        i = self._check(record_key)
        return self._reader.decode(self._reader.read([i])[0], i)

    def _getitems(self, record_keys: Sequence[SupportsIndex]) -> list[dict[str, np.ndarray]]:
        idx = [self._check(k) for k in record_keys]
        return [self._reader.decode(r, i) for r, i in zip(self._reader.read(idx), idx)]

    __getitems__ = _getitems

    def close(self) -> None:
        self._reader.close()

    def __repr__(self) -> str:
        # grain logs data sources by repr; keep it short and stable.
        return f"CacheDataSource({self.cache_dir!r}, fingerprint={self._reader.fingerprint[:16]})"
