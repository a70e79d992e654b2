"""LM packing: round trip, segment ids, positions and provenance offsets.

The packers produce no positions: the feeder derives them from the segment ids
(``positions_from_segment_ids``), so the positions checked here are the ones a
batch carries."""

import struct

import numpy as np
import pytest

from seqcache import format as fmt
from seqcache.feeders import positions_from_segment_ids
from seqcache.tasks import pack_lm
from seqcache.tasks.packing import pack_lm_encoded


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


# ------------------------------------------- LM packing of encoded examples
#
# ``pack_lm_encoded`` must give, byte for byte, what the writer made of
# ``pack_lm``'s chunks: ``encode_example`` of the row, ``encode_provenance`` of
# its segments, and ``ShardStats.add(row, segments)``'s counts.


def _encoded_examples(lengths, dtype="uint16", seed=0):
    """``(records, file_index, record_number, lengths)`` of examples with these
    token counts, random tokens of ``dtype`` and random provenance."""
    rng = np.random.default_rng(seed)
    spec = [fmt.FeatureSpec("targets", dtype)]
    top = min(int(np.iinfo(fmt.DTYPES[dtype]).max), 1 << 30)
    records = [fmt.encode_example(spec, {"targets": rng.integers(0, top, int(n)).astype(fmt.DTYPES[dtype])})
               for n in lengths]
    file_index = rng.integers(0, 1 << 32, len(lengths), dtype=np.uint64).astype(np.uint32)
    record_number = rng.integers(0, 1 << 63, len(lengths), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    return records, file_index, record_number, np.asarray(lengths, dtype=np.uint32)


def _reference(examples, sequence_length, dtype="uint16", segment_dtype="uint16"):
    """(rows, provenance records, tokens per row, segments per row) as the
    writer encoded ``pack_lm``'s chunks of the decoded examples."""
    records, file_index, record_number, _ = examples
    specs_in = [fmt.FeatureSpec("targets", dtype)]
    specs_out = specs_in + [fmt.FeatureSpec("targets_segment_ids", segment_dtype)]
    decoded = ((fmt.decode_example(specs_in, r), (int(f), int(n)))
               for r, f, n in zip(records, file_index, record_number))
    out = ([], [], [], [])
    for row, segments in pack_lm(decoded, sequence_length=sequence_length):
        out[0].append(fmt.encode_example(specs_out, row))
        out[1].append(fmt.encode_provenance([(f, n, offset) for (f, n), offset in segments]))
        out[2].append(len(row["targets"]))
        out[3].append(len(segments))
    return out


def _packed(examples, cuts, sequence_length, **options):
    """``pack_lm_encoded`` on ``examples`` cut into batches at ``cuts``, flattened as ``_reference``."""
    bounds = [0, *cuts, len(examples[0])]
    batches = [tuple(column[a:b] for column in examples) for a, b in zip(bounds[:-1], bounds[1:])]
    out = ([], [], [], [])
    for rows in pack_lm_encoded(batches, sequence_length=sequence_length, **options):
        assert len(rows.records) == len(rows.provenances) == len(rows.lengths) == len(rows.segments) > 0
        out[0].extend(rows.records)
        out[1].extend(rows.provenances)
        out[2].extend(rows.lengths.tolist())
        out[3].extend(rows.segments.tolist())
    return out


def test_encoded_rows_written_out():
    # Two examples of 3 and 4 tokens, rows of 5: the bytes a reader sees.
    examples = ([fmt.encode_example([fmt.FeatureSpec("targets", "uint16")], {"targets": np.array(t)})
                 for t in ([7, 8, 9], [1, 2, 3, 4])], np.array([3, 5], np.uint32), np.array([10, 2**40], np.uint64),
                np.array([3, 4], np.uint32))
    rows, provenances, lengths, segments = _packed(examples, [], 5, dtype="uint16")
    assert rows == [struct.pack("<I5HI5H", 5, 7, 8, 9, 1, 2, 5, 1, 1, 1, 2, 2),
                    struct.pack("<I2HI2H", 2, 3, 4, 2, 1, 1)]
    assert provenances == [struct.pack("<I2II2QI2I", 2, 3, 5, 2, 10, 2**40, 2, 0, 0),
                           struct.pack("<IIIQII", 1, 5, 1, 2**40, 1, 2)]
    assert (lengths, segments) == ([5, 2], [2, 1])


# Empty examples, examples of exactly one row, longer than several rows, a last partial row.
EDGE_LENGTHS = [0, 5, 16, 16, 0, 40, 1, 15, 17, 0, 3, 33, 2, 0, 64, 7]


@pytest.mark.parametrize("rows_per_batch", [1, 2, 4096])
def test_encoded_rows_are_pack_lm_s_at_every_batch_boundary(rows_per_batch):
    examples = _encoded_examples(EDGE_LENGTHS)
    want = _reference(examples, 16)
    assert len(want[0]) == -(-sum(EDGE_LENGTHS) // 16) and want[2][-1] == sum(EDGE_LENGTHS) % 16
    n = len(EDGE_LENGTHS)
    for cut in range(n + 1):  # one boundary, at every position (empty batches at the ends)
        assert _packed(examples, [cut], 16, dtype="uint16", rows_per_batch=rows_per_batch) == want, cut
    for size in range(1, n + 1):  # batches of every size
        cuts = list(range(size, n, size))
        assert _packed(examples, cuts, 16, dtype="uint16", rows_per_batch=rows_per_batch) == want, size


@pytest.mark.parametrize("dtype, segment_dtype", [("uint16", "uint16"), ("int32", "uint16"), ("int32", "int32"),
                                                  ("uint8", "uint16"), ("int64", "int32")])
def test_encoded_rows_are_pack_lm_s_on_random_examples(dtype, segment_dtype):
    rng = np.random.default_rng(1)
    for trial in range(60):
        length = int(rng.integers(1, 24))
        choices = [0, 0, 1, length - 1, length, length + 1, 3 * length + 2, int(rng.integers(0, 60))]
        lengths = rng.choice(choices, size=int(rng.integers(0, 40)))
        examples = _encoded_examples(lengths, dtype, seed=trial)
        cuts = sorted(rng.integers(0, len(lengths) + 1, int(rng.integers(0, 6))).tolist())
        got = _packed(examples, cuts, length, dtype=dtype, segment_dtype=segment_dtype,
                      rows_per_batch=int(rng.integers(1, 5)))
        assert got == _reference(examples, length, dtype, segment_dtype), (trial, length, lengths.tolist(), cuts)


def test_a_long_example_is_encoded_a_few_rows_at_a_time():
    examples = _encoded_examples([10 * 8 + 3, 2])
    sizes = [len(rows.records) for rows in pack_lm_encoded([examples], sequence_length=8, dtype="uint16",
                                                           rows_per_batch=3)]
    assert sizes == [3, 3, 3, 1, 1]  # 10 full rows in parts of 3, then the last partial row
    assert _packed(examples, [], 8, dtype="uint16", rows_per_batch=3) == _reference(examples, 8)


def test_no_examples_or_only_empty_ones_give_no_rows():
    assert list(pack_lm_encoded([], sequence_length=4, dtype="uint16")) == []
    assert _packed(_encoded_examples([0, 0, 0]), [1], 4, dtype="uint16") == ([], [], [], [])


def test_encoded_packing_errors_name_the_record():
    records, files, numbers, lengths = _encoded_examples([3, 4])
    files[1], numbers[1] = 6, 99
    with pytest.raises(ValueError, match=r"source file 6, record 99: its example has 12 bytes, expected 14"):
        list(pack_lm_encoded([(records, files, numbers, [3, 5])], sequence_length=4, dtype="uint16"))
    lying = [records[0], struct.pack("<I", 3) + records[1][4:]]  # the count says 3, the bytes hold 4 tokens
    with pytest.raises(ValueError, match=r"source file 6, record 99: its example counts 3 tokens, expected 4"):
        list(pack_lm_encoded([(lying, files, numbers, lengths)], sequence_length=4, dtype="uint16"))
    with pytest.raises(ValueError, match="sequence_length must be >= 1"):
        list(pack_lm_encoded([], sequence_length=0, dtype="uint16"))
    with pytest.raises(ValueError, match="uint8 cannot number the segments of a row of 300 tokens"):
        list(pack_lm_encoded([], sequence_length=300, dtype="uint16", segment_dtype="uint8"))
    with pytest.raises(ValueError, match=r"file index values in \[-1, 0\] do not fit uint32"):
        list(pack_lm_encoded([(records, [-1, 0], numbers, lengths)], sequence_length=4, dtype="uint16"))
