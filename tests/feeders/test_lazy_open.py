"""Opening a cache reads only its manifest; each shard is checked at its first read (G7).

A shard whose byte size or record count disagrees with the manifest is refused at
its first read, with the same message as an eager check, before any of its
records is returned; ``seqcache verify`` still checks every shard.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from seqcache import format as fmt
from seqcache.feeders import Feeder
from seqcache.feeders.reader import CacheReader

N, SHARDS, B = 40, 8, 4


def _open_shards(feeder) -> list[int]:
    return [s for s, r in enumerate(feeder.readers[0]._data) if r is not None]


def test_opening_a_cache_opens_no_shard_and_stats_no_file(make_cache, monkeypatch):
    path = make_cache(n=N, num_shards=SHARDS)
    calls = []
    real = os.path.getsize
    monkeypatch.setattr(os.path, "getsize", lambda p: calls.append(p) or real(p))
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, prefetch=0) as f:
        assert _open_shards(f) == [] and calls == []
        batch = f.get_batch(0)
        starts = f.readers[0].shard_starts
        touched = sorted({int(np.searchsorted(starts, i, side="right") - 1) for i in batch["cache_index"]})
        # The first batch opened (and checked) exactly the shards it read.
        assert _open_shards(f) == touched
        assert sorted(os.path.basename(c) for c in calls) == [fmt.read_manifest(path).shards[s].file for s in touched]


def _edit_count(path, shard, delta):
    mpath = os.path.join(path, fmt.MANIFEST_NAME)
    raw = json.load(open(mpath))
    n = raw["shards"][shard]["num_records"]
    raw["shards"][shard]["num_records"] = n + delta
    raw["num_examples"] += delta
    json.dump(raw, open(mpath, "w"))
    return n


def _steps_before_shard(path, shard):
    """The first step of a 1-epoch run that reads ``shard`` (located, not read)."""
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, num_epochs=1,
                prefetch=0) as f:
        starts = f.readers[0].shard_starts
        for s in range(f.num_steps):
            loc = f.stream.locate(s * B + np.arange(B))
            ci = loc.cache_index[loc.valid]
            if ((ci >= starts[shard]) & (ci < starts[shard + 1])).any():
                return s
    raise AssertionError


def test_a_shard_with_another_record_count_is_refused_at_its_first_read(make_cache):
    path = make_cache(n=N, num_shards=SHARDS)
    n = _edit_count(path, 5, -1)
    first = _steps_before_shard(path, 5)  # with the edited counts: the mapping the reader uses
    name = fmt.read_manifest(path).shards[5].file
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, num_epochs=1,
                prefetch=0) as f:
        got = [next(f) for _ in range(first)]  # batches before it are served
        assert len(got) == first
        with pytest.raises(fmt.CacheError, match=rf"{name}: shard has {n} records, the manifest expects {n - 1}"):
            next(f)
        assert f.step == first
    with CacheReader(path, open_shards=False) as r:
        lo = int(r.shard_starts[5])
        with pytest.raises(fmt.CacheError, match=rf"{name}: shard has {n} records"):
            r.read([0, lo])  # nothing of the batch is returned, not even record 0
    with pytest.raises(fmt.CacheError, match=rf"{name}: shard has {n} records"):
        CacheReader(path)  # the eager open still checks every shard


def test_a_resized_shard_is_refused_at_its_first_read_and_by_verify(make_cache):
    from seqcache.verify import verify_cache

    path = make_cache(n=N, num_shards=SHARDS)
    info = fmt.read_manifest(path).shards[3]
    shard = os.path.join(path, info.file)
    with open(shard, "ab") as f:
        f.write(b"x")
    with CacheReader(path, open_shards=False) as r:
        assert r.read_examples([0])[0]["targets"][0] == 1  # shard 0 reads
        with pytest.raises(fmt.CacheError) as e:
            r.read([int(r.shard_starts[3])])
        assert str(e.value).startswith(f"{shard}: shard file has {info.num_bytes + 1} bytes, the manifest expects "
                                       f"{info.num_bytes}")
        assert f"seqcache verify {path}" in str(e.value)
    report = verify_cache(path)
    assert any(info.file in p for p in report.problems)


def _edit_manifest(path, edit):
    mpath = os.path.join(path, fmt.MANIFEST_NAME)
    raw = json.load(open(mpath))
    edit(raw)
    json.dump(raw, open(mpath, "w"))
    return mpath


def test_the_manifest_keeps_record_counts_as_one_array_and_builds_shard_entries_on_access(make_cache):
    path = make_cache(n=N, num_shards=SHARDS)
    raw = json.load(open(os.path.join(path, fmt.MANIFEST_NAME)))
    m = fmt.read_manifest(path)
    assert m.shards.num_records.tolist() == [s["num_records"] for s in raw["shards"]]
    assert m.shard_starts.tolist() == np.concatenate([[0], np.cumsum(m.shards.num_records)]).tolist()
    assert m.num_examples == N and not m.shard_starts.flags.writeable
    assert m.shards._infos == [None] * SHARDS  # nothing built at open
    assert [s.file for s in m.shards] == [s["file"] for s in raw["shards"]] == m.shards.files
    assert m.shards[3] is m.shards[3] and m.shards[-1] == m.shards[SHARDS - 1]
    assert m.shards[2].sha256 == raw["shards"][2]["sha256"]


def test_a_bad_shard_entry_is_refused_at_that_shards_first_read_naming_it(make_cache):
    path = make_cache(n=N, num_shards=SHARDS)
    mpath = _edit_manifest(path, lambda raw: raw["shards"][6].update(num_bytes="12"))
    with CacheReader(path, open_shards=False) as r:
        assert r.read_examples([0])[0]["targets"][0] == 1  # shard 0 reads
        with pytest.raises(fmt.CacheError, match=rf"^{mpath}: shard 6: num_bytes is '12', expected an integer >= 0"):
            r.read([0, int(r.shard_starts[6])])
    with pytest.raises(fmt.CacheError, match="shard 6: num_bytes is '12'"):
        CacheReader(path)  # the eager open builds every entry
    with pytest.raises(fmt.CacheError, match="shard 6: num_bytes"):
        fmt.parse_manifest(json.load(open(mpath)))  # what a writer checks before writing


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw["shards"][4].update(num_records=2.5), r"shard 4: num_records is 2.5, expected an integer >= 0"),
    (lambda raw: raw["shards"][4].update(num_records=-1), r"shard 4: num_records is -1"),
    (lambda raw: raw["shards"][4].pop("file"), r"shard 4: bad entry: 'file'"),
    (lambda raw: raw["shards"][5].update(provenance_file="../x"), r"shard 5: file name '../x' is not a plain file name"),
    (lambda raw: raw["shards"].reverse(), r"shard 0: file name 'data.array_record-00007-of-00008', expected "
                                          r"'data.array_record-00000-of-00008'"),
])
def test_shard_names_and_record_counts_are_checked_at_open(make_cache, edit, message):
    path = make_cache(n=N, num_shards=SHARDS)
    mpath = _edit_manifest(path, edit)
    with pytest.raises(fmt.CacheError, match=rf"^{mpath}: {message}"):
        Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1)
