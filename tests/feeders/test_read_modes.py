"""The ways CacheReader reads a shard ("batched", "one_by_one", "auto") return
the same records, fail the same way on a damaged shard, and "auto" turns to
batched reads when reading one by one is slow."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from seqcache import format as fmt
from seqcache.feeders import reader as reader_mod
from seqcache.feeders.reader import READ_MODES, CacheReader

N = 300


@pytest.fixture
def caches(tmp_path, fx):
    """A cache of long records (a chunk each) and one of short ones (several per chunk)."""
    root = tmp_path
    fx.write_fixture_cache(root / "long", n=N, num_shards=4, length=lambda i: 150 + i % 7)
    fx.write_fixture_cache(root / "short", n=N, num_shards=3, length=lambda i: 1 + i % 5)
    return {name: str(root / name) for name in ("long", "short")}


@pytest.mark.parametrize("name", ["long", "short"])
def test_every_mode_returns_the_same_records(caches, name):
    rng = np.random.default_rng(1)
    asks = [rng.integers(0, N, 64), np.arange(N), np.arange(N)[::-1], np.array([5, 5, 5, 0, 299, 5])]
    got = {}
    for mode in READ_MODES:
        r = CacheReader(caches[name], read_mode=mode)
        got[mode] = [r.read(idx) for idx in asks]
        sorted_records, order = r.read_sorted(asks[0])
        assert [sorted_records[j] for j in np.argsort(order)] == got[mode][0]
        r.close()
    assert got["one_by_one"] == got["batched"] == got["auto"]
    r = CacheReader(caches[name], read_mode="batched")
    for idx, records in zip(asks, got["batched"]):  # each record is the example at its index
        assert [int(r.decode(rec, int(i))["targets"][0]) for rec, i in zip(records, idx)] == (idx + 1).tolist()


def test_an_unknown_mode_is_refused(caches):
    with pytest.raises(ValueError, match="read_mode must be one of"):
        CacheReader(caches["long"], read_mode="mmap")


def test_threads_reading_one_by_one_from_one_shard_get_their_own_records(caches):
    """seek and read share a reader's position: without the shard's lock, a
    thread's read would return the record another thread sought."""
    r = CacheReader(caches["long"], read_mode="one_by_one")
    expected = r.read(np.arange(N))
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(40):
            idx = rng.integers(0, N // 4, 32)  # all in shard 0
            if r.read(idx) != [expected[i] for i in idx]:
                errors.append(seed)
                return

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns between a seek and its read
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    r.close()
    assert errors == []


def _damage(cache_dir: str, shard: int) -> tuple[str, int]:
    """Overwrites 64 bytes of data shard ``shard``'s records (its size kept: the
    middle of the first 64 KiB block, the file being padded after its
    records); returns the file and the shard's first cache index."""
    m = fmt.read_manifest(cache_dir)
    path = os.path.join(cache_dir, m.shards[shard].file)
    with open(path, "r+b") as f:
        f.seek(min(os.path.getsize(path) // 2, 30_000))
        f.write(b"\xff" * 64)
    return path, int(m.shard_starts[shard])


@pytest.mark.parametrize("mode", READ_MODES)
def test_a_damaged_shard_fails_on_its_damaged_records_alone(tmp_path, fx, mode):
    fx.write_fixture_cache(tmp_path / "c", n=N, num_shards=3, length=lambda i: 150 + i % 7)
    intact = CacheReader(str(tmp_path / "c"), read_mode="batched").read(np.arange(N))
    path, first = _damage(str(tmp_path / "c"), 1)
    r = CacheReader(str(tmp_path / "c"), read_mode=mode)
    bad = []
    for i in range(first, first + N // 3):
        try:
            assert r.read([i]) == [intact[i]]
        except fmt.CacheError as e:
            assert path in str(e) and "seqcache verify" in str(e)
            bad.append(i)
    assert 1 <= len(bad) <= 2, bad  # the chunk the damage fell in; every other record still reads
    assert r.read(np.arange(first)) == intact[:first]  # other shards are untouched
    r.close()


def test_auto_reads_batched_after_a_slow_read_then_tries_again(caches, monkeypatch):
    calls = {"one": 0, "batched": 0}
    read_at = reader_mod._read_at

    def counted(reader, offset):
        calls["one"] += 1
        return read_at(reader, offset)

    monkeypatch.setattr(reader_mod, "_read_at", counted)
    monkeypatch.setattr(reader_mod, "BATCHED_AFTER_SLOW", 3)
    r = CacheReader(caches["long"], read_mode="auto")
    original = r._read_shard

    def shard_read(table, shard, name, reader, offsets):
        before = calls["one"]
        out = original(table, shard, name, reader, offsets)
        if calls["one"] == before:
            calls["batched"] += 1
        return out

    r._read_shard = shard_read
    idx = np.arange(10)  # shard 0 alone: one shard read per call
    expected = CacheReader(caches["long"], read_mode="batched").read(idx)
    assert r.read(idx) == expected and calls == {"one": 10, "batched": 0}  # fast: one by one
    monkeypatch.setattr(reader_mod, "SLOW_RECORD_S", 0.0)  # every read now counts as slow
    assert r.read(idx) == expected and calls == {"one": 20, "batched": 0}
    for _ in range(3):
        assert r.read(idx) == expected
    assert calls == {"one": 20, "batched": 3}
    monkeypatch.setattr(reader_mod, "SLOW_RECORD_S", 1.0)
    assert r.read(idx) == expected and calls == {"one": 30, "batched": 3}  # tried again, fast
    assert r.read(idx) == expected and calls == {"one": 40, "batched": 3}
    r.close()
