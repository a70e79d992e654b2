"""levanter's AsyncDataset over the Feeder's stream: index i is global position i.

For a cache, a mixture and a mixture schedule, finite and forever: the rows of
every index equal the Feeder's (tokens and cache index), whatever subset of
indices a process asks for; levanter's own DataLoader (on 8 CPU devices) and its
LmDataConfig with the documented configuration deliver the Feeder's batches,
also from a step on (its resume); the default configuration does not.

The tests of ``FeederRows`` (the index arithmetic and reads) need no levanter;
those that import levanter are skipped where it is not installed (this venv:
levanter's pins do not fit it) and run in levanter's own venv under ``make
test-trainers`` (tests/trainers/levanter/run.sh).
"""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys

import numpy as np
import pytest

from seqcache.feeders import Feeder
from seqcache.feeders.trainers.levanter import FeederRows, cache_dataset, next_token_loss_weight

B, L, SEED = 8, 12, 3
STEPS = 12  # crosses epoch boundaries of every fixture cache below


@pytest.fixture
def streams(tmp_path, fx):
    """Feeder arguments of a packed cache, a mixture and a mixture schedule."""
    packed = str(tmp_path / "packed")
    fx.write_packed_cache(packed, n=37, sequence_length=L, num_shards=3)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    fx.write_fixture_cache(a, n=30, num_shards=3, length=L, task="a")
    fx.write_fixture_cache(b, n=20, num_shards=2, length=lambda i: 5 + i % 8, task="b")
    return {
        "cache": dict(cache=packed),
        "mixture": dict(mixture={a: 2, b: 1}),
        "schedule": dict(mixture={0: {a: 1, b: 1}, 5: {a: 1, b: 3}, 9: {b: 1}}),
    }


def _feeder_batches(args, steps=STEPS, **kw):
    with Feeder(global_batch_size=B, sequence_length=L, seed=SEED, host_index=0, host_count=1, **args, **kw) as f:
        n = steps if f.num_steps is None else min(steps, f.num_steps)
        return [f.get_batch(s) for s in range(n)]


def _concat(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture
def levanter():
    return pytest.importorskip("levanter", reason="levanter is not installed here (make test-trainers runs these)")


@pytest.mark.parametrize("kind", ["cache", "mixture", "schedule"])
def test_index_i_is_row_i_of_the_feeders_stream(streams, kind):
    args = streams[kind]
    want = _concat(_feeder_batches(args))
    with_rows = FeederRows(global_batch_size=B, sequence_length=L, seed=SEED, **args)
    try:
        got = with_rows.rows(np.arange(STEPS * B))
    finally:
        with_rows.close()
    for key in ("targets", "targets_segment_ids", "cache_index", "task_index", "epoch"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    if kind != "cache":
        assert set(want["task_index"].tolist()) == {0, 1}


@pytest.mark.parametrize("kind", ["cache", "mixture", "schedule"])
@pytest.mark.parametrize("processes", [1, 2, 4, 8])
def test_every_process_count_reads_the_same_rows(streams, kind, processes):
    """Each process asks levanter's way (its own rows of each step, several
    steps in one call, a fresh reader per process, index 0 first as levanter's
    loader does), and the global batches are the Feeder's."""
    args = streams[kind]
    want = _concat(_feeder_batches(args))
    per = B // processes
    got = {}
    for p in range(processes):
        ds = FeederRows(global_batch_size=B, sequence_length=L, seed=SEED, **args)
        try:
            assert ds.rows([0])["cache_index"][0] == want["cache_index"][0]
            for first in range(0, STEPS, 5):  # calls of 5 steps, as levanter's prefetch asks
                idx = [s * B + p * per + r for s in range(first, min(first + 5, STEPS)) for r in range(per)]
                rows = ds.rows(idx)
                for j, i in enumerate(idx):
                    got[i] = (rows["targets"][j], rows["cache_index"][j])
        finally:
            ds.close()
    assert sorted(got) == list(range(STEPS * B))
    np.testing.assert_array_equal(np.stack([got[i][0] for i in range(STEPS * B)]), want["targets"])
    np.testing.assert_array_equal([got[i][1] for i in range(STEPS * B)], want["cache_index"])


def test_examples_carry_tokens_next_token_loss_weights_and_segment_ids(streams, levanter):
    ds = cache_dataset(global_batch_size=B, sequence_length=L, seed=SEED, **streams["cache"])
    try:
        idx = [5, 0, 17, 5]  # any order, repeats
        examples = _run(ds.get_batch(idx))
        rows = ds.rows(idx)
        one = _run(ds.getitem_async(17))
    finally:
        ds.close()
    for j, ex in enumerate(examples):
        seg = rows["targets_segment_ids"][j]
        assert ex.tokens.dtype == np.int32 and ex.tokens.shape == (L,)
        np.testing.assert_array_equal(ex.tokens, rows["targets"][j])
        assert ex.attn_mask.is_causal
        np.testing.assert_array_equal(ex.attn_mask.segment_ids[0], seg)
        for t in range(L - 1):
            assert ex.loss_weight[t] == float(seg[t] != 0 and seg[t + 1] == seg[t])
        assert ex.loss_weight[L - 1] == 0
        assert set(seg.tolist()) >= {1, 2}  # packed rows: two segments
    np.testing.assert_array_equal(one.tokens, examples[2].tokens)
    np.testing.assert_array_equal(examples[0].tokens, examples[3].tokens)


def test_next_token_loss_weight_values():
    seg = np.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    assert next_token_loss_weight(seg).tolist() == [[1, 1, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0]]


def test_finite_and_infinite_lengths(streams):
    packed = streams["cache"]
    with Feeder(global_batch_size=B, sequence_length=L, seed=SEED, num_epochs=2, host_index=0, host_count=1,
                **packed) as f:
        steps = f.num_steps
    finite = FeederRows(global_batch_size=B, sequence_length=L, seed=SEED, num_epochs=2, **packed)
    forever = FeederRows(global_batch_size=B, sequence_length=L, seed=SEED, **packed)
    try:
        assert finite.length == steps * B == 80  # 2 * 37 rows, then padding
        rows = finite.rows(np.arange(steps * B))
        valid = rows["cache_index"][rows["cache_index"] >= 0]
        assert np.bincount(valid).tolist() == [2] * 37  # every example exactly twice
        assert (rows["targets_loss_weights"][rows["cache_index"] < 0] == 0).all()
        with pytest.raises(IndexError, match=r"global position 80 is outside the stream \[0, 80\)"):
            finite.rows([3, 80])
        with pytest.raises(IndexError, match="global position -1"):
            forever.rows([-1])
        assert forever.length is None
        far = forever.rows([10**12])
        with Feeder(global_batch_size=B, sequence_length=L, seed=SEED, host_index=0, host_count=1, **packed) as f:
            assert far["cache_index"][0] == f.get_batch(10**12 // B)["cache_index"][10**12 % B]
        empty = forever.rows([])
        assert empty["targets"].shape == (0, L) and empty["cache_index"].dtype == np.int64
    finally:
        finite.close()
        forever.close()


def test_levanter_lengths_finite_and_forever(streams, levanter):
    finite = cache_dataset(global_batch_size=B, sequence_length=L, seed=SEED, num_epochs=2, **streams["cache"])
    forever = cache_dataset(global_batch_size=B, sequence_length=L, seed=SEED, **streams["cache"])
    try:
        assert isinstance(finite, levanter.data.AsyncDataset)
        assert finite.is_finite() and _run(finite.async_len()) == 80
        assert _run(finite.final_length_is_known())
        assert not forever.is_finite()
        with pytest.raises(ValueError, match="repeats forever"):
            _run(forever.async_len())
    finally:
        finite.close()
        forever.close()


def test_levanter_dataloader_on_eight_devices_and_from_a_step(streams, levanter):
    """levanter's own DataLoader (global indices per device, prefetching) yields
    the Feeder's global batches, and ``iter_from_step(k)`` on a fresh dataset
    (levanter's resume: the step, no data state) continues them."""
    import jax
    from levanter.data import DataLoader

    assert jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("data",))
    args = streams["mixture"]
    want = _feeder_batches(args)

    def loader():
        ds = cache_dataset(global_batch_size=B, sequence_length=L, seed=SEED, **args)
        return ds, DataLoader(ds, B, mesh=mesh, axis_resources={"batch": "data"}, prefetch_size=3)

    ds, dl = loader()
    it = iter(dl)
    for s in range(STEPS):
        batch = next(it)
        np.testing.assert_array_equal(np.asarray(batch.tokens), want[s]["targets"], err_msg=f"step {s}")
    del it
    ds.close()
    ds, dl = loader()
    it = dl.iter_from_step(7)
    for s in range(7, STEPS):
        np.testing.assert_array_equal(np.asarray(next(it).tokens), want[s]["targets"], err_msg=f"step {s}")
    del it
    ds.close()


def _lm_data_config(ds, **kw):
    from levanter.data.text import DirectDatasetComponent, LmDataConfig

    return LmDataConfig(tokenizer="passthrough", vocab_size=1000,
                        components={"seqcache": DirectDatasetComponent(datasets={"train": ds})}, **kw)


def _levanter_train_tokens(ds, n, **kw):
    import jax
    from haliax import Axis
    from levanter.schedule import BatchSchedule

    train = _lm_data_config(ds, **kw).train_set(Axis("position", L), BatchSchedule(B), key=jax.random.PRNGKey(0))
    return np.stack([np.asarray(ex.tokens.array) for ex in _run(train.get_batch(list(range(n))))])


def test_levanter_lm_data_config_keeps_the_order_only_as_documented(streams, levanter):
    """``LmDataConfig.train_set`` (levanter's mixture over the one component)
    with ``shuffle=False, mixture_block_size=1`` gives index i = Feeder row i;
    its default block size (2,048) permutes rows even with shuffling off, and
    its default shuffle refuses an infinite dataset and permutes a finite one."""
    args = streams["cache"]
    n = 8 * B
    want = _concat(_feeder_batches(args, steps=8))["targets"]
    ds = cache_dataset(global_batch_size=B, sequence_length=L, seed=SEED, **args)
    try:
        np.testing.assert_array_equal(_levanter_train_tokens(ds, n, shuffle=False, mixture_block_size=1), want)
        default_block = _levanter_train_tokens(ds, n, shuffle=False)
        assert (default_block != want).any(axis=1).sum() > n // 2
        with pytest.raises(ValueError, match="only supports finite"):  # levanter's default shuffle
            _levanter_train_tokens(ds, n, mixture_block_size=1)
    finally:
        ds.close()
    finite = cache_dataset(global_batch_size=B, sequence_length=L, seed=SEED, num_epochs=2, **args)
    try:
        np.testing.assert_array_equal(_levanter_train_tokens(finite, n, shuffle=False, mixture_block_size=1), want)
        shuffled = _levanter_train_tokens(finite, n, mixture_block_size=1)
        assert (shuffled != want).any(axis=1).sum() > n // 2
        # A finite run ends where the Feeder's does with stop_strategy="first_exhausted".
        import jax
        from haliax import Axis
        from levanter.schedule import BatchSchedule

        ended = _lm_data_config(finite, shuffle=False, mixture_block_size=1, stop_strategy="first_exhausted")
        train = ended.train_set(Axis("position", L), BatchSchedule(B), key=jax.random.PRNGKey(0))
        assert train.is_finite() and _run(train.async_len()) == _run(finite.async_len()) == 80
    finally:
        finite.close()


def test_pickles_and_reopens(streams):
    ds = FeederRows(global_batch_size=B, sequence_length=L, seed=SEED, **streams["schedule"])
    try:
        again = pickle.loads(pickle.dumps(ds))
        try:
            np.testing.assert_array_equal(again.rows(range(40))["cache_index"], ds.rows(range(40))["cache_index"])
        finally:
            again.close()
    finally:
        ds.close()


def test_bad_arguments_are_refused(streams):
    with pytest.raises(TypeError, match="host_count"):  # refused before levanter is imported
        cache_dataset(global_batch_size=B, sequence_length=L, host_count=2, **streams["cache"])
    with pytest.raises(ValueError, match="sequence_length"):
        FeederRows(global_batch_size=B, sequence_length=0, **streams["cache"])
    ds = FeederRows(global_batch_size=B, sequence_length=L, **streams["cache"])
    ds.close()
    with pytest.raises(RuntimeError, match="closed"):
        ds.rows([B * 3])


def test_importing_seqcache_imports_neither_levanter_nor_jax():
    code = ("import sys, seqcache, seqcache.feeders, seqcache.feeders.trainers.levanter as m; "
            "assert m.FeederRows; "
            "print(sorted(x for x in ('levanter', 'haliax', 'jax', 'equinox') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
