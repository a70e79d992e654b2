"""Feeder batches: layout, exactly once (G3), elastic hosts (G5), mixtures, threads."""

import hashlib
import threading
import time

import numpy as np
import pytest

from seqcache.feeders import Feeder, positions_from_segment_ids, rate_num_examples
from seqcache.feeders.feeder import Prefetcher
from seqcache.lengths import SequenceLengthError

KEYS = ("targets", "targets_segment_ids", "targets_positions", "targets_loss_weights", "task_index",
        "cache_index", "epoch")


def _digest(batches) -> str:
    h = hashlib.sha256()
    for b in batches:
        for k in sorted(b):
            h.update(k.encode())
            h.update(np.ascontiguousarray(b[k]).tobytes())
    return h.hexdigest()


def _global(path_or_mixture, *, B, H, steps, L=8, **kw):
    """Global batches for steps 0..steps-1, concatenated from H hosts' batches."""
    src = {"cache": path_or_mixture} if isinstance(path_or_mixture, str) else {"mixture": path_or_mixture}
    feeders = [Feeder(**src, global_batch_size=B, sequence_length=L, host_index=h, host_count=H, **kw)
               for h in range(H)]
    try:
        return [{k: np.concatenate([f.get_batch(s)[k] for f in feeders]) for k in KEYS} for s in range(steps)]
    finally:
        for f in feeders:
            f.close()


def test_batch_layout_and_values(make_cache, fx):
    path = make_cache(n=50, length=lambda i: 3 + i % 7)
    with Feeder(cache=path, global_batch_size=8, sequence_length=6, host_index=0, host_count=1) as f:
        b = f.get_batch(0)
        assert set(b) == set(KEYS)
        for k, dt in (("targets", np.int32), ("targets_segment_ids", np.int32), ("targets_positions", np.int32),
                      ("targets_loss_weights", np.float32)):
            assert b[k].dtype == dt and b[k].shape == (8, 6), k
        assert b["task_index"].dtype == np.int32 and b["task_index"].shape == (8,)
        assert b["cache_index"].dtype == np.int64 and b["epoch"].dtype == np.int64
        for r in range(8):
            i = int(b["cache_index"][r])
            n = min(3 + i % 7, 6)
            want = np.zeros(6, np.int32)
            want[:n] = fx.example_tokens(i, 3 + i % 7)[:n]  # truncated to L, 0-padded
            assert np.array_equal(b["targets"][r], want)
            assert b["targets_segment_ids"][r].tolist() == [1] * n + [0] * (6 - n)
            assert b["targets_positions"][r].tolist() == list(range(n)) + [0] * (6 - n)
            assert b["targets_loss_weights"][r].tolist() == [1.0] * n + [0.0] * (6 - n)
        assert b["epoch"].tolist() == [0] * 8 and b["task_index"].tolist() == [0] * 8
        # Batches are read-only (constant arrays are shared between batches).
        for k in KEYS:
            with pytest.raises(ValueError, match="read-only"):
                b[k][0] = 0


def test_packed_cache_keeps_segments_and_positions(tmp_path, fx):
    fx.write_packed_cache(tmp_path / "p", n=20, sequence_length=12)
    with Feeder(cache=str(tmp_path / "p"), global_batch_size=4, sequence_length=12, host_index=0, host_count=1) as f:
        b = f.get_batch(1)
        for r in range(4):
            i = int(b["cache_index"][r])
            a, pad = 3 + i % 4, i % 3
            seg = [1] * a + [2] * (12 - a - pad) + [0] * pad
            assert b["targets_segment_ids"][r].tolist() == seg
            assert b["targets_positions"][r].tolist() == list(range(a)) + list(range(12 - a - pad)) + [0] * pad
            assert b["targets_loss_weights"][r].tolist() == [float(s > 0) for s in seg]
            assert b["targets"][r, 0] == i + 1
    # The cache's own length is the default; a shorter one cuts the packed rows; a longer one is refused.
    with Feeder(cache=str(tmp_path / "p"), global_batch_size=4, host_index=0, host_count=1) as whole, \
            Feeder(cache=str(tmp_path / "p"), global_batch_size=4, sequence_length={"targets": 8}, host_index=0,
                   host_count=1) as cut:
        # The sequence length is {feature: tokens}, whether given as an int, a mapping or not at all.
        assert (whole.sequence_length, cut.sequence_length) == ({"targets": 12}, {"targets": 8})
        assert cut.sequence_length[cut.feature] == 8 and cut.state()["sequence_length"] == {"targets": 8}
        full, short = whole.get_batch(1), cut.get_batch(1)
        for key in ("targets", "targets_segment_ids", "targets_positions", "targets_loss_weights"):
            assert short[key].shape == (4, 8)
            assert np.array_equal(short[key], full[key][:, :8]), key
    with Feeder(cache=str(tmp_path / "p"), global_batch_size=4, sequence_length=8, host_index=0,
                host_count=1) as given_int:
        assert given_int.sequence_length == {"targets": 8}
        assert np.array_equal(given_int.get_batch(1)["targets"], short["targets"])
    with pytest.raises(SequenceLengthError) as e:
        Feeder(cache=str(tmp_path / "p"), global_batch_size=4, sequence_length=13, host_index=0, host_count=1)
    assert str(e.value) == (f"{tmp_path / 'p'}: sequence length 13 for feature 'targets' is longer than the cache's, "
                            "12 tokens; leave sequence_length out to read rows of 12, or give at most 12")


def test_a_malformed_length_is_refused_before_the_caches_are_opened(tmp_path):
    for bad in (0, 2.5, {"inputs": 8}):
        with pytest.raises(ValueError, match="sequence") as e:
            Feeder(cache=str(tmp_path / "missing"), global_batch_size=2, sequence_length=bad, host_index=0,
                   host_count=1)
        assert not isinstance(e.value, SequenceLengthError)


def test_a_cache_without_a_recorded_length_needs_one(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "u", n=6, length=5)
    with pytest.raises(SequenceLengthError, match="the cache records no sequence length for feature 'targets'"):
        Feeder(cache=str(tmp_path / "u"), global_batch_size=2, host_index=0, host_count=1)
    with Feeder(cache=str(tmp_path / "u"), global_batch_size=2, sequence_length=9, host_index=0, host_count=1) as f:
        assert f.get_batch(0)["targets_loss_weights"].sum(axis=1).tolist() == [5.0, 5.0]


def test_positions_from_segment_ids():
    seg = np.array([[1, 1, 2, 2, 2, 0], [1, 2, 3, 3, 0, 0]])
    assert positions_from_segment_ids(seg).tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 0, 0]]
    # A row starts a segment even when the id continues from the previous row;
    # padding inside a row and empty inputs.
    seg = np.array([[1, 1, 1], [1, 1, 0], [0, 3, 3], [2, 2, 2]], np.uint16)
    assert positions_from_segment_ids(seg).tolist() == [[0, 1, 2], [0, 1, 0], [0, 0, 1], [0, 1, 2]]
    assert positions_from_segment_ids(seg).dtype == np.int32
    assert positions_from_segment_ids(np.zeros((0, 4), np.int32)).shape == (0, 4)


def test_golden_order(make_cache):
    # Changing these cache indices changes every user's data order and breaks the
    # reproducibility of their runs: it needs a STATE_VERSION bump
    # (seqcache.feeders.state) and a note in docs/feeder.md.
    path = make_cache(n=100, num_shards=4)
    with Feeder(cache=path, global_batch_size=8, sequence_length=4, host_index=0, host_count=1, seed=0) as f:
        # The order is keyed by the cache fingerprint; this one is fixed by the fixture.
        assert f.readers[0].fingerprint == GOLDEN_FINGERPRINT
        first = np.concatenate([f.get_batch(s)["cache_index"] for s in range(2)]).tolist()
    assert first == GOLDEN_FIRST_16


GOLDEN_FINGERPRINT = "80387f22d6502afc6c716fba871423254bfcae20499662c49b98d3a2799a31b1"
GOLDEN_FIRST_16 = [88, 33, 13, 97, 59, 24, 62, 48, 39, 8, 4, 77, 75, 17, 68, 41]


@pytest.mark.parametrize("num_epochs", [None, 2])
def test_elastic_hosts_give_identical_global_batches(make_cache, num_epochs):
    path = make_cache(n=37, num_shards=3)
    steps = 10  # 80 positions: crosses both epoch boundaries (37, 74) and the end of the finite run
    ref = _global(path, B=8, H=1, steps=steps, num_epochs=num_epochs, seed=3)
    for H in (2, 4, 8):
        got = _global(path, B=8, H=H, steps=steps, num_epochs=num_epochs, seed=3)
        assert _digest(got) == _digest(ref), H


def test_elastic_hosts_for_a_finite_mixture(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "a", n=9, num_shards=2, task="a")
    fx.write_fixture_cache(tmp_path / "b", n=14, num_shards=3, task="b")
    mixture = [(str(tmp_path / "a"), 1.0), (str(tmp_path / "b"), 2.0)]
    ref = _global(mixture, B=8, H=1, steps=4, num_epochs=1, seed=6)  # the whole run
    assert (np.concatenate([b["cache_index"] for b in ref]) == -1).any()  # padding rows are included
    for H in (2, 4, 8):
        assert _digest(_global(mixture, B=8, H=H, steps=4, num_epochs=1, seed=6)) == _digest(ref), H


def test_two_epochs_exactly_once_per_epoch(make_cache, fx):
    n, B = 13, 4
    path = make_cache(n=n, num_shards=2)
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1,
                num_epochs=2, seed=11) as f:
        assert f.num_steps == 7  # ceil(26 / 4)
        batches = list(f)
        assert len(batches) == 7 and f.step == 7
    ids = np.concatenate([fx.example_ids(b) for b in batches])
    epochs = np.concatenate([b["epoch"] for b in batches])
    assert ids.size == 28
    # Positions 0..12 are epoch 0, 13..25 epoch 1: each a permutation of the cache.
    assert sorted(ids[:13].tolist()) == list(range(n)) and set(epochs[:13].tolist()) == {0}
    assert sorted(ids[13:26].tolist()) == list(range(n)) and set(epochs[13:26].tolist()) == {1}
    assert ids[:13].tolist() != ids[13:26].tolist()  # a new order per epoch
    # The last two rows are padding: no tokens, zero loss weight, marked -1.
    last = batches[-1]
    assert ids[26:].tolist() == [-1, -1]
    assert not last["targets"][2:].any() and not last["targets_loss_weights"][2:].any()
    assert last["cache_index"][2:].tolist() == [-1, -1] and last["task_index"][2:].tolist() == [-1, -1]


def test_finite_evaluation_over_hosts_reads_every_example_once(make_cache, fx):
    # 10 examples, global batch 4 over 2 hosts: 3 steps, 2 padding rows at the end.
    path = make_cache(n=10, num_shards=3, length=lambda i: 1 + i % 5)
    seen = []
    for h in range(2):
        with Feeder(cache=path, global_batch_size=4, sequence_length=5, host_index=h, host_count=2,
                    num_epochs=1) as f:
            assert f.num_steps == 3
            for b in f:
                assert b["targets"].shape == (2, 5)
                seen.extend(fx.example_ids(b).tolist())
                pad = b["cache_index"] < 0
                assert not b["targets_loss_weights"][pad].any()
    assert sorted(x for x in seen if x >= 0) == list(range(10))
    assert seen.count(-1) == 2


def test_finite_mixture_reads_every_example_exactly_num_epochs_times(tmp_path, fx):
    a, b = tmp_path / "a", tmp_path / "b"
    fx.write_fixture_cache(a, n=7, num_shards=2, task="a")
    fx.write_fixture_cache(b, n=11, num_shards=3, task="b")
    mixture = {str(a): 1.0, str(b): 1.0}
    with Feeder(mixture=mixture, global_batch_size=4, sequence_length=3, host_index=0, host_count=1,
                num_epochs=2, seed=5) as f:
        batches = list(f)
        n_steps = f.num_steps
    assert len(batches) == n_steps
    task = np.concatenate([x["task_index"] for x in batches])
    ids = np.concatenate([fx.example_ids(x) for x in batches])
    for t, n in ((0, 7), (1, 11)):
        got = ids[task == t]
        assert np.array_equal(np.bincount(got, minlength=n), np.full(n, 2)), t
    # Rows after a task is exhausted are padding, never a third epoch.
    assert set(np.concatenate([x["epoch"] for x in batches]).tolist()) <= {-1, 0, 1}
    # The stream ends as soon as both tasks have finished: the last step has real rows.
    assert (batches[-1]["cache_index"] >= 0).any()


def test_mixture_proportions_follow_the_rates(tmp_path, fx):
    paths = []
    for name, n in (("x", 50), ("y", 30), ("z", 20)):
        fx.write_fixture_cache(tmp_path / name, n=n, num_shards=2, task=name)
        paths.append(str(tmp_path / name))
    mixture = [(paths[0], 0.5), (paths[1], 0.3), (paths[2], 0.2)]
    with Feeder(mixture=mixture, global_batch_size=20, sequence_length=2, host_index=0, host_count=1) as f:
        tasks = np.concatenate([f.get_batch(s)["task_index"] for s in range(50)])
        depth = f.stream.mixer.depth
    counts = np.zeros(3)
    for p, t in enumerate(tasks):
        counts[t] += 1
        # Within the mixing bound over every prefix (here depth <= 2).
        assert np.all(np.abs(counts - (p + 1) * np.array([0.5, 0.3, 0.2])) < np.array(depth) + 1e-6)


def test_rates_proportional_to_example_counts(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "big", n=90, task="big")
    fx.write_fixture_cache(tmp_path / "small", n=10, task="small")
    rate = rate_num_examples(temperature=1.0)
    with Feeder(mixture={str(tmp_path / "big"): rate, str(tmp_path / "small"): rate}, global_batch_size=10,
                sequence_length=2, host_index=0, host_count=1) as f:
        assert f.rates == [90.0, 10.0] and f.weights == [9, 1]
        tasks = np.concatenate([f.get_batch(s)["task_index"] for s in range(10)])
    assert np.bincount(tasks).tolist() == [90, 10]


def test_seqcache_tasks_mixture_resolves_caches_by_task_name(tmp_path, fx):
    tasks = pytest.importorskip("seqcache.tasks")
    fx.write_fixture_cache(tmp_path / "alpha" / "train", n=30, task="alpha")
    fx.write_fixture_cache(tmp_path / "beta" / "train", n=10, task="beta")
    fx.write_fixture_cache(tmp_path / "gamma" / "train", n=10, task="gamma")
    mix = tasks.Mixture("m", [("alpha", tasks.rate_num_examples(maximum=20)), ("beta", 5.0), ("gamma", 0.0)])
    with Feeder(mixture=mix, caches_root=str(tmp_path), split="train", global_batch_size=5, sequence_length=2,
                host_index=0, host_count=1) as f:
        assert f.paths == [str(tmp_path / "alpha" / "train"), str(tmp_path / "beta" / "train")]
        assert f.rates == [20.0, 5.0]  # gamma has rate 0: left out
        tasks_seen = np.concatenate([f.get_batch(s)["task_index"] for s in range(4)])
    assert np.bincount(tasks_seen).tolist() == [16, 4]
    with pytest.raises(ValueError, match="caches_root"):
        Feeder(mixture=mix, global_batch_size=5, sequence_length=2, host_index=0, host_count=1)


def _translation_cache(path, *, n: int, task: str):
    """An unpacked cache of ``n`` (inputs, targets) examples, as a translation task writes them."""
    from seqcache import format as fmt
    from seqcache.pipelines.writer import write_cache

    features = (fmt.FeatureSpec("inputs", "int32"), fmt.FeatureSpec("targets", "int32"))
    shard = [({"inputs": np.arange(1, 4, dtype=np.int32) + i, "targets": np.arange(5, 7, dtype=np.int32) + i},
              [(0, i, 0)]) for i in range(n)]
    write_cache(str(path), task=task, split="train", features=features, shards=[shard],
                fingerprint_inputs={"task": task, "n": n})
    return str(path)


def test_a_mixture_of_caches_with_different_features_is_refused_naming_each(tmp_path, fx):
    tasks = pytest.importorskip("seqcache.tasks")
    lm = str(tmp_path / "wiki" / "train")
    fx.write_fixture_cache(lm, n=12, task="wiki")
    mt = _translation_cache(tmp_path / "wmt" / "train", n=6, task="wmt")
    kw = dict(global_batch_size=4, sequence_length=8, host_index=0, host_count=1)
    each = (f"task 'wiki' ({lm}) has ['targets']; task 'wmt' ({mt}) has ['inputs', 'targets']")
    # Every way of naming the mixture, also with the feature both caches have named.
    for how in ({"mixture": {lm: 1, mt: 1}}, {"mixture": {lm: 1, mt: 1}, "feature": "targets"},
                {"mixture": {0: {lm: 1}, 10: {lm: 1, mt: 1}}},
                {"mixture": tasks.Mixture("m", ["wiki", "wmt"], default_rate=1), "caches_root": str(tmp_path)}):
        with pytest.raises(ValueError) as e:
            Feeder(**how, **kw)
        msg = str(e.value)
        assert "different features" in msg and each in msg, msg
        assert "\n" not in msg
        # What would work: the mixtures of one shape, and the readers of each.
        assert "tasks with ['targets'] only (read with Feeder(feature='targets') or ConvertedFeeder(converter='lm'))" in msg
        assert "tasks with ['inputs', 'targets'] only (read with ConvertedFeeder(converter='encdec' or 'prefix_lm'))" in msg
        assert "build every task with the features they share, ['targets']" in msg
    # Caches of one shape mix, and each feature of them is fed.
    mt2 = _translation_cache(tmp_path / "wmt2" / "train", n=4, task="wmt2")
    with Feeder(mixture={mt: 1, mt2: 1}, feature="inputs", **kw) as f:
        assert f.get_batch(0)["inputs"].shape == (4, 8)


def test_iteration_threads_and_random_access_agree_byte_for_byte(make_cache):
    path = make_cache(n=41, num_shards=3, length=lambda i: 1 + i % 9)
    kw = dict(cache=path, global_batch_size=6, sequence_length=8, host_index=0, host_count=1, seed=9)
    with Feeder(**kw, num_threads=1, prefetch=0) as f:
        serial = [f.get_batch(s) for s in range(12)]
    with Feeder(**kw, num_threads=4, prefetch=3) as f:
        threaded = [next(f) for _ in range(12)]
        assert f.step == 12
    with Feeder(**kw, num_threads=2, start_step=5) as f:
        tail = [b for _, b in zip(range(7), f)]
    assert _digest(serial) == _digest(threaded)
    assert _digest(serial[5:]) == _digest(tail)


def test_repeat_forever_crosses_epochs_with_new_orders(make_cache, fx):
    path = make_cache(n=9, num_shards=2)
    with Feeder(cache=path, global_batch_size=3, sequence_length=2, host_index=0, host_count=1) as f:
        ids = np.concatenate([fx.example_ids(f.get_batch(s)) for s in range(9)])  # 3 epochs
    epochs = [ids[9 * e: 9 * e + 9].tolist() for e in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(9))
    assert len({tuple(e) for e in epochs}) == 3


@pytest.mark.parametrize("B,H,match", [(6, 4, "not divisible by host_count=4"), (4, 8, "larger than global_batch_size"),
                                       (0, 1, "global_batch_size must be"), (4, 0, "host_count must be")])
def test_bad_host_count_is_refused_in_the_constructor(make_cache, B, H, match):
    path = make_cache(n=10)
    with pytest.raises(ValueError, match=match):
        Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=H)


def test_other_bad_arguments(make_cache):
    path = make_cache(n=10)
    kw = dict(global_batch_size=4, sequence_length=4, host_count=2)
    with pytest.raises(ValueError, match=r"host_index must be in \[0, 2\)"):
        Feeder(cache=path, host_index=2, **kw)
    with pytest.raises(ValueError, match="no feature 'inputs'"):
        Feeder(cache=path, host_index=0, feature="inputs", **kw)
    with pytest.raises(ValueError, match="exactly one of"):
        Feeder(host_index=0, **kw)
    with pytest.raises(ValueError, match="num_epochs"):
        Feeder(cache=path, host_index=0, num_epochs=0, **kw)
    with pytest.raises(ValueError, match="more than once"):
        Feeder(mixture=[(path, 1.0), (path, 2.0)], host_index=0, **kw)
    with Feeder(cache=path, host_index=0, num_epochs=1, **kw) as f:
        with pytest.raises(ValueError, match=r"past the end of this finite run.*3 steps"):
            f.get_batch(3)


def test_close_leaves_no_threads_and_refuses_use(make_cache):
    path = make_cache(n=30)
    before = set(threading.enumerate())
    with Feeder(cache=path, global_batch_size=4, sequence_length=4, host_index=0, host_count=1,
                num_threads=3, prefetch=4) as f:
        for _ in zip(range(5), f):
            pass
        assert any(t.name.startswith("seqcache-feeder") for t in threading.enumerate())
    assert set(threading.enumerate()) <= before
    assert not any(t.name.startswith("seqcache-feeder") for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        f.get_batch(0)
    f.close()  # idempotent


def test_a_damaged_shard_is_a_cache_error_naming_the_shard(tmp_path, fx):
    # One flipped byte inside a record's chunk: the shard keeps its size and record
    # count (so opening succeeds), and ArrayRecord's chunk hash check fails on read.
    from seqcache import format as fmt

    fx.write_fixture_cache(tmp_path / "c", n=30, num_shards=1, length=40)
    shard = tmp_path / "c" / "data.array_record-00000-of-00001"
    data = bytearray(shard.read_bytes())
    data[200] ^= 0xFF
    shard.write_bytes(bytes(data))
    with Feeder(cache=str(tmp_path / "c"), global_batch_size=30, sequence_length=8, host_index=0, host_count=1) as f:
        with pytest.raises(fmt.CacheError) as e:
            f.get_batch(0)
    msg = str(e.value)
    assert msg.startswith(f"{shard}: cannot read records 0..29 (30 records)")
    assert "hash mismatch" in msg and f"run `seqcache verify {tmp_path / 'c'}`" in msg


def test_a_shard_arrayrecord_cannot_open_is_a_cache_error(tmp_path, fx, monkeypatch):
    from seqcache import format as fmt
    from seqcache.feeders import reader as reader_mod

    fx.write_fixture_cache(tmp_path / "c", n=6, num_shards=2)

    def refuse(path, options):
        raise RuntimeError(f"Corrupted Riegeli/records file: footer hash mismatch; at byte 17 of {path}")

    monkeypatch.setattr(reader_mod, "ArrayRecordReader", refuse)
    with pytest.raises(fmt.CacheError) as e:
        reader_mod.CacheReader(str(tmp_path / "c"))
    assert str(e.value).startswith(f"{tmp_path / 'c' / 'data.array_record-00000-of-00002'}: cannot open the shard")
    assert f"run `seqcache verify {tmp_path / 'c'}`" in str(e.value)


def test_a_step_awaited_while_another_thread_closes_the_feeder_says_it_is_closed():
    """A caller waiting for a step that the close cancels gets the feeder's
    RuntimeError, as one arriving after the close does, not a CancelledError."""

    release = threading.Event()

    def compute(step):
        if step == 1:
            release.wait(10)  # keeps the one thread busy: steps 2.. wait in the queue
        return step

    prefetcher = Prefetcher(compute, num_threads=1, depth=2, num_steps=None)
    assert prefetcher.get(0) == 0
    raised = []

    def wait_for_step_2():
        try:
            prefetcher.get(2)
        except BaseException as e:  # noqa: BLE001 (the test reads which)
            raised.append(e)

    waiter = threading.Thread(target=wait_for_step_2)
    waiter.start()
    time.sleep(0.2)  # the waiter is in the queued step's result() (or, late, it finds the feeder closed)
    closer = threading.Thread(target=prefetcher.close)
    closer.start()
    waiter.join(10)
    release.set()
    closer.join(10)
    assert not waiter.is_alive() and not closer.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError), raised
    assert str(raised[0]) == "the feeder is closed"
