"""Random access to the examples of one cache, by cache index, in batches.

Cache index ``i`` (0-based, in cache order) lives in shard ``s`` at offset
``i - starts[s]`` where ``starts`` is the cumulative record count of the shards
(``Manifest.shard_starts``). Reads are grouped by shard and issued as one
``ArrayRecordReader.read(offsets)`` call per shard, never one record per call.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from seqcache import format as fmt

# readahead_buffer_size:0 — random access: read exactly the requested records.
READER_OPTIONS = "readahead_buffer_size:0"


class CacheReader:
    """Opens a cache folder (manifest + shards) for batched random access.

    Opening reads and validates manifest.json and checks that every shard file
    exists with the size the manifest records (cheap: no data is read). Shard
    readers are opened lazily and kept open until ``close()``.

    Raises:
      IncompleteCacheError: no manifest (an unfinished build).
      CacheError: invalid manifest, a missing shard or a shard of the wrong size.
    """

    def __init__(self, cache_dir: str):
        self.cache_dir = cache_dir
        self.manifest = fmt.read_manifest(cache_dir)
        fmt.check_shard_files(cache_dir, self.manifest)
        self.starts = self.manifest.shard_starts
        self._readers: dict[tuple[str, int], object] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def features(self) -> tuple[fmt.FeatureSpec, ...]:
        return self.manifest.features

    def _reader(self, kind: str, shard: int):
        key = (kind, shard)
        reader = self._readers.get(key)
        if reader is None:
            from array_record.python.array_record_module import ArrayRecordReader

            info = self.manifest.shards[shard]
            name = info.file if kind == fmt.DATA_PREFIX else info.provenance_file
            path = os.path.join(self.cache_dir, name)
            try:
                reader = ArrayRecordReader(path, READER_OPTIONS)
            except Exception as e:
                raise fmt.CacheError(f"{path}: cannot open shard: {e}") from None
            if reader.num_records() != info.num_records:
                n = reader.num_records()
                reader.close()
                raise fmt.CacheError(f"{path}: shard holds {n} records, the manifest expects {info.num_records}")
            self._readers[key] = reader
        return reader

    def locate(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(shard, offset) int64 arrays for cache indices.

        Raises:
          IndexError: an index outside [0, len(self)).
        """
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = int(idx[(idx < 0) | (idx >= len(self))][0])
            raise IndexError(f"{self.cache_dir}: cache index {bad} out of range [0, {len(self)})")
        shard = np.searchsorted(self.starts, idx, side="right") - 1
        return shard, idx - self.starts[shard]

    def read_records(self, indices: Sequence[int], *, kind: str = fmt.DATA_PREFIX) -> list[bytes]:
        """Raw record bytes for cache indices, in the order given (one read per shard)."""
        shard, offset = self.locate(indices)
        out: list[bytes | None] = [None] * len(shard)
        for s in np.unique(shard):
            where = np.nonzero(shard == s)[0]
            records = self._reader(kind, int(s)).read([int(o) for o in offset[where]])
            for w, r in zip(where, records):
                out[int(w)] = r
        return out  # type: ignore[return-value]

    def read(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Decoded examples (feature -> 1-D array view) for cache indices."""
        return [
            fmt.decode_example(self.features, r, where=f"{self.cache_dir} index {i}")
            for i, r in zip(indices, self.read_records(indices))
        ]

    def read_provenance(self, indices: Sequence[int]) -> list[list[dict]]:
        """Per example, one dict per segment: source path, record number, token offset."""
        sources = self.manifest.sources
        out = []
        for i, r in zip(indices, self.read_records(indices, kind=fmt.PROVENANCE_PREFIX)):
            p = fmt.decode_example(fmt.PROVENANCE_FEATURES, r, where=f"{self.cache_dir} provenance {i}")
            segs = []
            for src, rec, off in zip(p["source_index"], p["record_number"], p["token_offset"]):
                path = sources[int(src)]["path"] if int(src) < len(sources) else None
                segs.append({"source_index": int(src), "path": path, "record_number": int(rec), "token_offset": int(off)})
            out.append(segs)
        return out

    def vocabulary(self, feature: str):
        """The vocabulary of ``feature`` rebuilt from the manifest (and the model
        file stored in the cache), or None when the manifest has none."""
        desc = self.manifest.vocabularies.get(feature)
        if not desc:
            return None
        from seqcache.tasks import vocabulary_from_json

        return vocabulary_from_json(desc, self.cache_dir)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
