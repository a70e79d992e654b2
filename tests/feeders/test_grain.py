"""CacheDataSource under grain: DataLoader worker processes, host sharding, MapDataset.

Exact record sets: every cache index once per epoch where grain promises it,
and the records grain's sharded DataLoader loses pinned down (docs/feeder.md,
"grain"), with the ways that lose none.
"""

import collections

import numpy as np
import pytest

from seqcache.feeders import CacheDataSource

grain = pytest.importorskip("grain.python")

N = 9  # odd: two hosts cannot split it evenly
LENGTH = 4  # one length, so that grain's Batch can stack the examples


@pytest.fixture
def source(make_cache):
    src = CacheDataSource(make_cache(n=N, num_shards=2, length=LENGTH))
    yield src
    src.close()


@pytest.fixture
def absl_flags_parsed():
    """grain's worker processes read absl flags, which a program that does not
    run ``absl.app`` must mark as parsed (docs/feeder.md, "grain"); put back after."""
    from absl import flags

    if flags.FLAGS.is_parsed():
        yield
        return
    flags.FLAGS.mark_as_parsed()
    try:
        yield
    finally:
        flags.FLAGS.unparse_flags()


def _indices(elements) -> list[int]:
    """Cache index of each example, in order (fixture example i starts with i + 1)."""
    out = []
    for e in elements:
        firsts = np.asarray(e["targets"])[..., 0]
        out.extend((np.atleast_1d(firsts) - 1).tolist())
    return out


def _loader(src, *, worker_count, shard_options=None, num_epochs=1, batch_size=None):
    sampler = grain.IndexSampler(num_records=len(src), shard_options=shard_options or grain.NoSharding(),
                                 shuffle=True, num_epochs=num_epochs, seed=7)
    ops = [grain.Batch(batch_size=batch_size)] if batch_size else []
    return grain.DataLoader(data_source=src, sampler=sampler, operations=ops, worker_count=worker_count)


def test_data_loader_with_two_worker_processes_reads_every_example_once_per_epoch(source, absl_flags_parsed):
    # The sampler's order (one process, unbatched): each epoch a new permutation.
    order = _indices(_loader(source, worker_count=0, num_epochs=2))
    assert sorted(order[:N]) == list(range(N)) and sorted(order[N:]) == list(range(N))
    assert order[:N] != order[N:]
    # Two worker processes (the source is pickled and reopens its shard readers in
    # each): worker w reads every other record of the sampler's order, from w, and
    # batches its own records; the loader takes one batch from each in turn. So every
    # example is read exactly once per epoch, but a batch may hold two epochs' records.
    got = _indices(_loader(source, worker_count=2, num_epochs=2, batch_size=3))
    per_worker = [[order[w::2][k:k + 3] for k in range(0, N, 3)] for w in range(2)]
    assert got == [i for pair in zip(*per_worker) for batch in pair for i in batch]
    assert sorted(collections.Counter(got).items()) == [(i, 2) for i in range(N)]


def test_sharded_data_loader_loses_the_remainder_and_slices_do_not(source):
    # grain 0.2.18: the DataLoader of shard h of H reads len(sampler) // H records, so
    # when H does not divide the count the shards together lose N mod H records per
    # epoch, with drop_remainder=True (the same last records of the cache, every
    # epoch) and with drop_remainder=False alike. docs/feeder.md says so; when a grain
    # release reads them all, this test fails and the docs change with it.
    for drop in (True, False):
        counts = collections.Counter()
        for h in range(2):
            shard = grain.ShardOptions(shard_index=h, shard_count=2, drop_remainder=drop)
            counts.update(_indices(_loader(source, worker_count=0, shard_options=shard)))
        assert sum(counts.values()) == N - N % 2, drop
        assert len(set(counts)) == N - N % 2 and max(counts.values()) == 1, drop
    # Over two epochs, drop_remainder=False reads 2 * N records, but not each twice:
    # each host's loader wraps around its own slice of the cache.
    counts = collections.Counter()
    for h in range(2):
        shard = grain.ShardOptions(shard_index=h, shard_count=2, drop_remainder=False)
        counts.update(_indices(_loader(source, worker_count=0, shard_options=shard, num_epochs=2)))
    assert sum(counts.values()) == 2 * N and set(counts) == set(range(N))
    assert sorted(counts.values()) != [2] * N
    # The way that loses none: each host reads its slice of the cache, unsharded.
    counts = collections.Counter()
    for h in range(2):
        part = grain.MapDataset.source(source)[h::2]
        counts.update(_indices(_loader(part, worker_count=0)))
    assert sorted(counts.elements()) == list(range(N))


def test_map_dataset_shuffle_repeat_slice_batch_reads_every_example_once_per_epoch(source):
    epochs, hosts = 2, 2
    streams = []
    for h in range(hosts):
        ds = grain.MapDataset.source(source).shuffle(seed=3).repeat(epochs)[h::hosts].batch(4)
        streams.append(_indices(ds))
    # Host h's j-th example is global position h + hosts * j; position p is in epoch p // N.
    per_epoch = collections.defaultdict(list)
    for h, got in enumerate(streams):
        assert len(got) == len(range(h, epochs * N, hosts))
        for j, i in enumerate(got):
            per_epoch[(h + hosts * j) // N].append(i)
    assert {e: sorted(v) for e, v in per_epoch.items()} == {e: list(range(N)) for e in range(epochs)}
    assert per_epoch[0] != per_epoch[1]
    # Iterated as an IterDataset, the same elements in the same order.
    again = grain.MapDataset.source(source).shuffle(seed=3).repeat(epochs)[0::hosts].batch(4).to_iter_dataset()
    assert _indices(again) == streams[0]
