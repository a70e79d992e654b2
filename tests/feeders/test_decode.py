"""Batched decoding agrees with seqcache.format.decode_example on every record."""

import numpy as np
import pytest

from seqcache import format as fmt
from seqcache.feeders.decode import decode_batch

SPECS = (
    fmt.FeatureSpec("inputs", "uint16"),
    fmt.FeatureSpec("targets", "int32"),
    fmt.FeatureSpec("ids", "int64"),
    fmt.FeatureSpec("targets_segment_ids", "int32"),
)


def _records(n, rng, *, fixed=None):
    out = []
    for _ in range(n):
        if fixed is None:
            la, lt, li = rng.integers(0, 9), rng.integers(0, 13), rng.integers(0, 4)
        else:
            la, lt, li = fixed
        ex = {
            "inputs": rng.integers(0, 60000, la),
            "targets": rng.integers(-5, 1000, lt),
            "ids": rng.integers(0, 2**40, li),
            "targets_segment_ids": rng.integers(0, 3, lt),
        }
        out.append((ex, fmt.encode_example(SPECS, ex)))
    return out


@pytest.mark.parametrize("fixed", [None, (3, 10, 2)])
@pytest.mark.parametrize("length", [1, 6, 10, 20])
def test_matches_decode_example(fixed, length):
    rng = np.random.default_rng(length)
    recs = _records(64, rng, fixed=fixed)
    wanted = {"inputs": np.int32, "targets": np.int32, "ids": np.int64, "targets_segment_ids": np.int32}
    values, counts = decode_batch(SPECS, [r for _, r in recs], length=length, outputs=wanted)
    for row, (_, rec) in enumerate(recs):
        ref = fmt.decode_example(SPECS, rec)
        for name, dt in wanted.items():
            want = np.zeros(length, dt)
            k = min(length, ref[name].size)
            want[:k] = ref[name][:k]
            assert values[name].dtype == dt
            assert np.array_equal(values[name][row], want), (name, row)
            assert counts[name][row] == ref[name].size


def test_empty_batch():
    values, counts = decode_batch(SPECS, [], length=4, outputs={"targets": np.int32})
    assert values["targets"].shape == (0, 4) and counts["targets"].shape == (0,)


def test_truncated_record_is_reported_like_decode_example():
    rng = np.random.default_rng(0)
    recs = [r for _, r in _records(5, rng, fixed=(2, 4, 1))]
    recs[3] = recs[3][:-2]
    with pytest.raises(fmt.CacheError, match="shard 7 record 3: truncated record"):
        decode_batch(SPECS, recs, length=4, outputs={"targets": np.int32},
                     where=[f"shard 7 record {i}" for i in range(5)])


def test_trailing_bytes_are_reported():
    rng = np.random.default_rng(0)
    recs = [r for _, r in _records(3, rng, fixed=(1, 1, 1))]
    recs[1] = recs[1] + b"\x00\x00\x00\x00"
    with pytest.raises(fmt.CacheError, match="trailing bytes"):
        decode_batch(SPECS, recs, length=4, outputs={"targets": np.int32})


def test_unknown_feature_is_refused():
    with pytest.raises(KeyError, match="'nope' is not in the cache"):
        decode_batch(SPECS, [], length=4, outputs={"nope": np.int32})


def test_outputs_do_not_alias_the_per_thread_scratch_buffer():
    rng = np.random.default_rng(3)
    first = [r for _, r in _records(16, rng, fixed=(2, 5, 1))]
    second = [r for _, r in _records(16, rng, fixed=(2, 5, 1))]
    a, _ = decode_batch(SPECS, first, length=5, outputs={"targets": np.int32})
    snapshot = a["targets"].copy()
    decode_batch(SPECS, second, length=5, outputs={"targets": np.int32})
    assert np.array_equal(a["targets"], snapshot)


def test_batches_of_other_record_widths_in_one_thread():
    # Each thread lays a batch out at its previous batch's width first: a wider,
    # narrower or ragged batch after it must decode as decode_example does.
    rng = np.random.default_rng(5)
    wanted = {"inputs": np.int32, "targets": np.int32, "ids": np.int64}
    for fixed in [(2, 5, 1), (8, 12, 3), (1, 1, 0), None, (8, 12, 3), (0, 0, 0)]:
        recs = _records(16, rng, fixed=fixed)
        values, counts = decode_batch(SPECS, [r for _, r in recs], length=12, outputs=wanted)
        for row, (_, rec) in enumerate(recs):
            ref = fmt.decode_example(SPECS, rec)
            for name in wanted:
                k = ref[name].size
                assert counts[name][row] == k
                assert np.array_equal(values[name][row, :k], ref[name]), (fixed, name, row)
                assert not values[name][row, k:].any()


@pytest.mark.parametrize("fixed", [None, (3, 10, 2), (2, 4, 1)])
@pytest.mark.parametrize("length", [3, 10, 16])
def test_rows_put_records_in_row_order(fixed, length):
    # decode_batch(records, rows=r): output row i is the decoding of records[r[i]],
    # in every layout (uniform or gathered offsets, truncated or padded rows).
    rng = np.random.default_rng(length)
    recs = [r for _, r in _records(40, rng, fixed=fixed)]
    rows = rng.permutation(len(recs))
    wanted = {"inputs": np.int32, "targets": np.int32, "ids": np.int64, "targets_segment_ids": np.int32}
    got, got_counts = decode_batch(SPECS, recs, length=length, outputs=wanted, rows=rows)
    want, want_counts = decode_batch(SPECS, [recs[i] for i in rows], length=length, outputs=wanted)
    for name in wanted:
        assert got[name].dtype == want[name].dtype and got[name].flags.c_contiguous
        assert np.array_equal(got[name], want[name]), name
        assert np.array_equal(got_counts[name], want_counts[name]), name
