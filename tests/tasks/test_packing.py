"""LM packing: round trip, segment ids, positions and provenance offsets.

The packers produce no positions: the feeder derives them from the segment ids
(``positions_from_segment_ids``), so the positions checked here are the ones a
batch carries."""

import numpy as np
import pytest

from seqcache.feeders import positions_from_segment_ids
from seqcache.tasks import pack_lm


def _positions(chunk, feature="targets"):
    """The positions the feeder gives a row of these segment ids."""
    return positions_from_segment_ids(chunk[f"{feature}_segment_ids"][None, :])[0].tolist()


def _examples(lengths, start=10):
    out, next_token = [], start
    for i, n in enumerate(lengths):
        out.append(({"targets": np.arange(next_token, next_token + n, dtype=np.int32)}, f"doc{i}"))
        next_token += n
    return out


def test_round_trip_and_shapes():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 40, 200).tolist()
    examples = _examples(lengths)
    chunks = list(pack_lm(iter(examples), sequence_length=32))
    stream = np.concatenate([e["targets"] for e, _ in examples])
    np.testing.assert_array_equal(np.concatenate([c["targets"] for c, _ in chunks]), stream)
    assert all(len(c["targets"]) == 32 for c, _ in chunks[:-1])
    assert len(chunks) == -(-len(stream) // 32)
    assert len(chunks[-1][0]["targets"]) == len(stream) - 32 * (len(chunks) - 1)
    for chunk, segments in chunks:
        assert set(chunk) == {"targets", "targets_segment_ids"}
        assert all(a.dtype == np.int32 and a.shape == chunk["targets"].shape for a in chunk.values())
        assert chunk["targets_segment_ids"][0] == 1
        assert chunk["targets_segment_ids"].max() == len(segments)
        assert np.all(np.diff(chunk["targets_segment_ids"]) >= 0)
    # Every non-empty document appears in some segment list; empty ones never do.
    seen = {p for _, segs in chunks for p, _ in segs}
    assert seen == {f"doc{i}" for i, n in enumerate(lengths) if n}


def test_segments_positions_exact():
    examples = _examples([3, 0, 4, 2])  # tokens 10..18; doc1 is empty
    chunks = list(pack_lm(examples, sequence_length=5))
    assert len(chunks) == 2
    (c0, s0), (c1, s1) = chunks
    assert c0["targets"].tolist() == [10, 11, 12, 13, 14]
    assert c0["targets_segment_ids"].tolist() == [1, 1, 1, 2, 2]
    assert _positions(c0) == [0, 1, 2, 0, 1]
    assert s0 == [("doc0", 0), ("doc2", 0)]
    assert c1["targets"].tolist() == [15, 16, 17, 18]  # last chunk is not padded
    assert c1["targets_segment_ids"].tolist() == [1, 1, 2, 2]
    assert _positions(c1) == [0, 1, 0, 1]
    assert s1 == [("doc2", 2), ("doc3", 0)]


def test_document_over_three_chunks():
    examples = _examples([2, 20, 1])
    chunks = list(pack_lm(examples, sequence_length=8))
    assert [segs for _, segs in chunks] == [
        [("doc0", 0), ("doc1", 0)], [("doc1", 6)], [("doc1", 14), ("doc2", 0)]]
    assert chunks[1][0]["targets_segment_ids"].tolist() == [1] * 8
    assert _positions(chunks[1][0]) == list(range(8))
    assert _positions(chunks[2][0]) == [0, 1, 2, 3, 4, 5, 0]


def test_long_document_exact_multiple_and_offsets():
    L = 16
    examples = _examples([3 * L + 5, L])
    chunks = list(pack_lm(examples, feature="targets", sequence_length=L))
    assert [len(c["targets"]) for c, _ in chunks] == [16, 16, 16, 16, 5]
    assert [segs for _, segs in chunks] == [
        [("doc0", 0)], [("doc0", 16)], [("doc0", 32)], [("doc0", 48), ("doc1", 0)], [("doc1", 11)]]
    # The offsets locate each segment's tokens inside its example.
    docs = {p: e["targets"] for e, p in examples}
    for chunk, segs in chunks:
        for k, (prov, off) in enumerate(segs, start=1):
            piece = chunk["targets"][chunk["targets_segment_ids"] == k]
            np.testing.assert_array_equal(piece, docs[prov][off:off + len(piece)])


def test_other_feature_name_and_errors():
    chunks = list(pack_lm([({"text": np.array([5, 6, 1])}, 0)], feature="text", sequence_length=2))
    assert [sorted(c) for c, _ in chunks] == [["text", "text_segment_ids"]] * 2
    assert [_positions(c, "text") for c, _ in chunks] == [[0, 1], [0]]
    assert list(pack_lm([], sequence_length=4)) == []
    with pytest.raises(ValueError, match="sequence_length must be >= 1"):
        list(pack_lm([], sequence_length=0))
    with pytest.raises(ValueError, match="has no feature 'targets'"):
        list(pack_lm([({"inputs": np.array([1])}, "x")], sequence_length=4))


# ----------------------------------------------------------- first-fit packing

from seqcache.tasks import pack_first_fit  # noqa: E402


def _ex(n_in, n_tg, base=10):
    return {"inputs": np.arange(base, base + n_in, dtype=np.int32),
            "targets": np.arange(base, base + n_tg, dtype=np.int32) + 100}


def test_first_fit_places_each_example_in_the_first_row_with_room():
    lengths = {"inputs": 10, "targets": 4}
    examples = [(_ex(6, 2), "a"), (_ex(6, 1), "b"), (_ex(3, 2), "c"), (_ex(4, 3), "d"), (_ex(1, 1), "e")]
    rows = list(pack_first_fit(examples, sequence_length=lengths))
    # c fits beside a; d does not (targets full) but fits beside b; e fits nowhere.
    assert [[p for p, _ in segs] for _, segs, _ in rows] == [["a", "c"], ["b", "d"], ["e"]]
    row, segs, cut = rows[1]
    assert row["inputs"].tolist() == list(range(10, 16)) + [10, 11, 12, 13]
    assert row["inputs_segment_ids"].tolist() == [1] * 6 + [2] * 4
    assert sorted(row) == ["inputs", "inputs_segment_ids", "targets", "targets_segment_ids"]
    assert _positions(row, "inputs") == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert row["targets"].tolist() == [110, 110, 111, 112]
    assert row["targets_segment_ids"].tolist() == [1, 2, 2, 2]
    assert _positions(row, "targets") == [0, 0, 1, 2]
    assert cut == 0 and all(off == 0 for _, off in segs)


def test_first_fit_trims_and_counts_long_examples_never_drops():
    rows = list(pack_first_fit([(_ex(15, 2), "long"), (_ex(2, 9), "t")], sequence_length={"inputs": 10, "targets": 4}))
    assert [[p for p, _ in s] for _, s, _ in rows] == [["long"], ["t"]]
    assert sum(cut for *_, cut in rows) == 5 + 5
    assert len(rows[0][0]["inputs"]) == 10 and len(rows[1][0]["targets"]) == 4


def test_first_fit_is_deterministic_and_bounded():
    rng = np.random.default_rng(0)
    examples = [(_ex(int(a), int(b)), k) for k, (a, b) in enumerate(rng.integers(1, 40, size=(500, 2)))]
    lengths = {"inputs": 64, "targets": 64}
    a = list(pack_first_fit(examples, sequence_length=lengths, max_open_rows=4))
    b = list(pack_first_fit(examples, sequence_length=lengths, max_open_rows=4))
    assert [[p for p, _ in s] for _, s, _ in a] == [[p for p, _ in s] for _, s, _ in b]
    # Every example exactly once; rows within their lengths.
    assert sorted(p for _, s, _ in a for p, _ in s) == list(range(500))
    for row, segs, _ in a:
        assert len(row["inputs"]) <= 64 and len(row["targets"]) <= 64
        assert row["inputs_segment_ids"].max() == len(segs)
    wide = list(pack_first_fit(examples, sequence_length=lengths, max_open_rows=64))
    assert len(wide) <= len(a)
    with pytest.raises(ValueError, match="has no feature 'targets'"):
        list(pack_first_fit([({"inputs": np.arange(3)}, "x")], sequence_length=lengths))
