"""The per-batch build path gives the bytes of the per-example one: record
encoding, shard assignment, ragged reordering, EOS and trimming, finalising."""

import hashlib
import os

import numpy as np
import pytest

from seqcache import format as fmt
from seqcache import tasks
from seqcache.pipelines import shuffle, spill, transforms
from seqcache.tasks import SourceRecord
from seqcache.tasks import preprocessors as P


def _columns(examples, names):
    out = {}
    for name in names:
        values = [np.asarray(e[name]) for e in examples]
        offsets = np.concatenate([[0], np.cumsum([v.size for v in values])]).astype(np.int64)
        out[name] = (np.concatenate(values) if values else np.zeros(0, np.int32), offsets)
    return out


@pytest.mark.parametrize("length", [12, 300])  # short pieces (an index per byte) and long ones (a slice each)
@pytest.mark.parametrize("dtypes", [["uint16"], ["uint16", "int32", "uint8"], ["int64", "float32"]])
def test_encode_batch_equals_encode_example(dtypes, length):
    rng = np.random.default_rng(len(dtypes))
    specs = [fmt.FeatureSpec(f"f{k}", d) for k, d in enumerate(dtypes)]
    examples = [{s.name: rng.integers(0, 200, rng.integers(0, length)).astype(np.int32 if s.dtype != "float32" else
                                                                         np.float32) for s in specs}
                for _ in range(257)]
    examples[3] = {s.name: np.zeros(0, np.int32 if s.dtype != "float32" else np.float32) for s in specs}
    data, offsets = fmt.encode_batch(specs, _columns(examples, [s.name for s in specs]))
    got = [data[offsets[i]:offsets[i + 1]].tobytes() for i in range(len(examples))]
    assert got == [fmt.encode_example(specs, e) for e in examples]


def test_encode_batch_range_check_names_the_feature():
    specs = [fmt.FeatureSpec("targets", "uint16")]
    with pytest.raises(ValueError, match=r"feature 'targets': values in \[0, 70000\] do not fit uint16"):
        fmt.encode_batch(specs, _columns([{"targets": [1, 2]}, {"targets": [0, 70000]}], ["targets"]))
    with pytest.raises(KeyError, match="no feature 'targets'"):
        fmt.encode_batch(specs, {})


def test_encode_provenance_batch_equals_encode_provenance():
    files = np.array([0, 3, 2**32 - 1], dtype=np.uint32)
    records = np.array([0, 17, 2**64 - 1], dtype=np.uint64)
    got = fmt.encode_provenance_batch(files, records)
    assert got == [fmt.encode_provenance([(int(f), int(r), 0)]) for f, r in zip(files, records)]
    with pytest.raises(ValueError, match="source_index"):
        fmt.encode_provenance_batch(np.array([-1]), np.array([0]))


@pytest.mark.parametrize("num_shards", [1, 3, 64, 1000, 2**31 - 1, 2**31])
def test_shard_of_keys_equals_shard_of(num_shards):
    key = shuffle.seed_key(5)
    keys = [shuffle.record_key(str(i).encode(), key) for i in range(2000)]
    keys += [b"\xff" * 16, b"\x00" * 16]
    got = transforms.shard_of_keys(b"".join(keys), num_shards).tolist()
    assert got == [shuffle.shard_of(k, num_shards) for k in keys]


def test_ragged_take():
    data = np.frombuffer(b"aabbbcdddd", dtype=np.uint8)
    offsets = np.array([0, 2, 5, 6, 10])
    out, new = transforms.ragged_take(data, offsets, np.array([3, 0, 2, 1]))
    assert out.tobytes() == b"ddddaacbbb" and new.tolist() == [0, 4, 6, 7, 10]


@pytest.mark.parametrize("mean", [3, spill._JOIN_PIECE_BYTES, 2000])
def test_ragged_take_both_ways_equal_piece_by_piece(mean):
    """Short pieces go through the byte gather, long ones through the join:
    each gives the pieces in ``order``, empty pieces and a sliced (offset)
    data array included."""
    rng = np.random.default_rng(mean)
    sizes = rng.integers(0, 2 * mean + 1, size=300)
    sizes[::7] = 0
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    data = rng.integers(0, 256, size=int(offsets[-1]) + 5, dtype=np.uint8)[5:]
    order = rng.permutation(len(sizes))
    out, new = transforms.ragged_take(data, offsets, order)
    want = [data[offsets[i]:offsets[i + 1]].tobytes() for i in order]
    assert out.dtype == np.uint8 and out.tobytes() == b"".join(want)
    assert new.tolist() == np.concatenate([[0], np.cumsum([len(w) for w in want])]).tolist()


def _task(preprocessors, **feature):
    source = tasks.TextLineSource("unused-*.txt")
    return tasks.Task("t", source=source, output_features={"targets": tasks.Feature(tasks.ByteVocabulary(), **feature)},
                      preprocessors=preprocessors)


def _records(texts):
    return [SourceRecord(0, n, {"text": t}, t.encode()) for n, t in enumerate(texts)]


def _keys(records):
    return [hashlib.blake2b(r.raw, digest_size=16).digest() for r in records]


@pytest.mark.parametrize("length", [None, 1, 3, 8])
@pytest.mark.parametrize("add_eos", [True, False])
def test_batch_eos_and_trim_equal_example_by_example(length, add_eos):
    texts = ["", "a", "abc", "abcdefghij", "xy"]
    records = _records(texts)
    seq = {"targets": length} if length else None
    for pre in (P.append_eos(), P.append_eos_after_trim()):
        task = _task([P.rekey({"targets": "text"}), P.tokenize(), pre], add_eos=add_eos)
        batch = task.preprocess_batch(records, _keys(records), seed=0, sequence_length=seq)
        alone = [task.preprocess_batch([r], _keys([r]), seed=0, sequence_length=seq)[0][1] for r in records]
        assert [i for i, _ in batch] == list(range(len(texts)))
        for (_, got), want in zip(batch, alone):
            assert set(got) == set(want)
            assert got["targets"].dtype == want["targets"].dtype == np.int32
            assert got["targets"].tolist() == want["targets"].tolist()
            assert got.get("_truncated_tokens") == want.get("_truncated_tokens")
        if isinstance(pre, P.append_eos_after_trim):
            ids = [b + 3 for b in b"abcdefghij"]
            keep = len(ids) if length is None else length - (1 if add_eos else 0)
            assert batch[3][1]["targets"].tolist() == ids[:keep] + ([1] if add_eos else [])
            assert batch[3][1]["_truncated_tokens"] == len(ids) - keep


def test_columns_fall_back_to_the_first_bad_record():
    def fn(ex, ctx):
        return {"targets": [5, 6] if ex["text"] != "bad" else [5, 300]}

    task = _task([P.FunctionPreprocessor(fn, "f")])
    records = _records(["ok", "bad", "ok2"])
    with pytest.raises(ValueError, match=r"line at byte 1 of file 0: feature 'targets' has token id 300"):
        task.preprocess_columns(records, _keys(records), seed=0, sequence_length=None)
    ok = _records(["a", "b"])
    batch = task.preprocess_columns(ok, _keys(ok), seed=0, sequence_length=None)
    values, offsets = batch.columns["targets"]
    assert values.dtype == np.int32 and values.tolist() == [5, 6, 5, 6] and offsets.tolist() == [0, 2, 4]
    assert batch.ranges == {"targets": (5, 6)} and batch.index.tolist() == [0, 1]


def test_rekey_batch_equals_example_by_example():
    examples = [{"q": "a", "a": "b", "_truncated_tokens": 2}, {"q": "c", "a": "d"}]
    for key_map in ({"targets": "a"}, {"inputs": "q", "targets": "a"}, {"inputs": None, "targets": "a"}):
        p = P.rekey(key_map)
        assert p.process_batch(examples, None) == [p(ex, None) for ex in examples]
    assert P.rekey({"targets": "a"}).process_batch(examples, None)[0] == {"targets": "b", "_truncated_tokens": 2}


@pytest.mark.parametrize("chain", ["eos", "filter_eos", "after_trim", "after_trim_explicit", "none"])
@pytest.mark.parametrize("add_eos", [True, False])
def test_language_model_columns_equal_the_general_path(chain, add_eos):
    """The columnar fast path of the plain LM chain gives the examples of the
    preprocessors run one by one (the general path, forced with a no-op step)."""
    steps = {"eos": [P.append_eos()], "filter_eos": [P.filter_empty(), P.append_eos()],
             "after_trim": [P.append_eos_after_trim()], "after_trim_explicit": [P.append_eos_after_trim({"targets": 2})],
             "none": []}[chain]
    texts = ["", "a", "abc", "abcdefghij", "xy", ""]
    records = _records(texts)
    fast = _task([P.rekey({"targets": "text"}), P.tokenize(), *steps], add_eos=add_eos)
    noop = P.FunctionPreprocessor(lambda ex, ctx: ex, "noop")
    general = _task([P.rekey({"targets": "text"}), P.tokenize(), *steps, noop], add_eos=add_eos)
    for seq in (None, {"targets": 3}):
        a = fast.preprocess_batch(records, _keys(records), seed=0, sequence_length=seq)
        b = general.preprocess_batch(records, _keys(records), seed=0, sequence_length=seq)
        assert [i for i, _ in a] == [i for i, _ in b]
        for (_, x), (_, y) in zip(a, b):
            assert x.keys() == y.keys() and x["targets"].dtype == y["targets"].dtype
            assert x["targets"].tolist() == y["targets"].tolist()
            assert x.get("_truncated_tokens") == y.get("_truncated_tokens")


def test_language_model_columns_leave_bad_values_to_the_general_path():
    task = _task([P.rekey({"targets": "text"}), P.tokenize(), P.append_eos()])
    records = [SourceRecord(0, 0, {"text": "ok"}, b"ok"), SourceRecord(0, 9, {"text": None}, b"null")]
    with pytest.raises(ValueError, match="line at byte 9 of file 0: feature 'targets' is null"):
        task.preprocess_batch(records, _keys(records), seed=0, sequence_length=None)


def test_record_keys_equal_one_keyed_hash_per_record():
    # Empty, one block, exactly one block, several blocks, non-ASCII.
    raws = [b"", b"a", b"x" * 127, b"y" * 128, b"z" * 129, b"w" * 1000, "Grüße".encode()] + \
        [str(i).encode() for i in range(100)]
    for seed in (0, 1, 2**64 - 1):
        key = shuffle.seed_key(seed)
        assert shuffle.record_keys(raws, key) == [shuffle.record_key(r, key) for r in raws]
    assert shuffle.record_keys([], shuffle.seed_key(0)) == []


@pytest.mark.parametrize("distinct", [1, 7, 1000, 10**9])
def test_shard_sort_order_equals_a_five_key_lexsort(distinct):
    from seqcache.pipelines import spill

    rng = np.random.default_rng(distinct)
    n = 5000
    hi = rng.integers(0, distinct, n, dtype=np.uint64)
    lo = rng.integers(0, 3, n, dtype=np.uint64)
    sub = rng.integers(0, 2, n).astype(np.uint32)
    files = rng.integers(0, 3, n).astype(np.uint32)
    recs = rng.permutation(n).astype(np.uint64)
    expect = np.lexsort((recs, files, sub, lo, hi))
    assert np.array_equal(spill.sort_order(hi, lo, sub, files, recs), expect)


def test_shard_entries_chunk_bounds_cover_the_shard_within_the_limits():
    from seqcache.pipelines import spill

    sizes = np.array([5, 1, 30, 2, 2, 2, 9, 0, 4], dtype=np.int64)
    end = np.cumsum(sizes)
    n = len(sizes)
    u4 = np.zeros(n, np.uint32)
    entries = spill.ShardEntries(u4, u4, np.arange(n, dtype=np.uint64), u4, np.zeros((n, 1), np.uint32),
                                 np.zeros(n, np.int32), end - sizes, end, [bytes(range(int(end[-1])))])
    bounds = list(entries.chunk_bounds(chunk=3, max_bytes=8))
    # Contiguous, in order, every entry once; at most 3 entries and 8 bytes a
    # range, except the 30- and 9-byte examples, each a range of its own.
    assert bounds == [(0, 2), (2, 3), (3, 6), (6, 7), (7, 9)]
    assert list(entries.chunk_bounds(chunk=100, max_bytes=1000)) == [(0, n)]
    assert entries.mean_example_bytes(2) == 3.0 and entries.mean_example_bytes() == sizes.mean()
    records = [r for data, _ in entries.record_chunks(chunk=2) for r in data]
    assert records == [bytes(range(int(a), int(b))) for a, b in zip(end - sizes, end)]
    assert all(type(r) is bytes for r in records)


@pytest.mark.parametrize("given", [None, "3"])
def test_driver_encoding_threads_reach_the_read_step(monkeypatch, given):
    """A driver's $SEQCACHE_ENCODING_THREADS goes to every worker's read step
    (a distributed runner's workers do not inherit the driver's environment),
    and the read step sets it there; without it each worker keeps its own."""
    import pickle

    from seqcache.tasks.vocabularies import ENCODING_THREADS_ENV

    monkeypatch.delenv(ENCODING_THREADS_ENV, raising=False)
    if given is not None:
        monkeypatch.setenv(ENCODING_THREADS_ENV, given)
    threads = transforms.driver_encoding_threads()
    assert threads == (None if given is None else 3)
    unit = pickle.loads(pickle.dumps(transforms.ReadUnit(
        None, paths=[], spill_dir="unused", exchange="spill", encoding_threads=threads)))
    monkeypatch.delenv(ENCODING_THREADS_ENV, raising=False)  # a worker: the driver's environment is not here
    list(unit((0, ())))  # a work unit of no ranges
    assert os.environ.get(ENCODING_THREADS_ENV) == (None if given is None else "3")
