"""LM packing of a shard from its encoded examples (``packed_shard.pack_lm_shard``):
the same shard files (data and provenance, group size included) and the same
statistics as ``pack_lm`` over the decoded examples, each row encoded by the
writer, on made-up shards and on real builds."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from seqcache import format as fmt
from seqcache.pipelines import BuildConfig, build_task, packed_shard, spill, transforms, writer
from seqcache.pipelines import stats as stats_mod
from seqcache.tasks import pack_lm
from testsupport import lines_task


def _entries(lengths, dtype="uint16", seed=0) -> spill.ShardEntries:
    """A sorted shard of examples of these token counts (random tokens and
    provenance), its example bytes in memory."""
    rng = np.random.default_rng(seed)
    spec = [fmt.FeatureSpec("targets", dtype)]
    top = min(int(np.iinfo(fmt.DTYPES[dtype]).max), 1 << 30)
    records = [fmt.encode_example(spec, {"targets": rng.integers(0, top, int(n)).astype(fmt.DTYPES[dtype])})
               for n in lengths]
    n = len(records)
    sizes = np.array([len(r) for r in records], dtype=np.int64)
    ends = np.cumsum(sizes)
    zeros = np.zeros(n, dtype=np.uint32)
    return spill.ShardEntries(
        sub_index=zeros, file_index=rng.integers(0, 50, n).astype(np.uint32),
        record_number=rng.integers(0, 1 << 40, n).astype(np.uint64), truncated=zeros,
        lengths=np.asarray(lengths, dtype=np.uint32).reshape(n, 1), part=np.zeros(n, dtype=np.int32),
        begin=ends - sizes, end=ends, parts=[b"".join(records)])


def _features(dtype, sequence_length):
    segment_ids = "uint16" if sequence_length < 1 << 16 else "int32"
    features_in = [fmt.FeatureSpec("targets", dtype)]
    return features_in, features_in + [fmt.FeatureSpec("targets_segment_ids", segment_ids)]


def _write_reference(folder, entries, features_in, features_out, sequence_length):
    """The shard written as ``pack_lm`` packs it (the writer encodes each row): (entry, statistics)."""
    st = stats_mod.ShardStats(features_out)
    stream = ((fmt.decode_example(features_in, data), prov) for data, prov in entries.items())

    def rows():
        for row, segments in pack_lm(stream, feature="targets", sequence_length=sequence_length):
            st.add(row, len(segments))
            yield row, [(prov[0], prov[1], offset) for prov, offset in segments]

    entry = writer.write_shard(str(folder), index=0, num_shards=1, features=features_out, examples=rows())
    return entry, st.to_json()


def _write_encoded(folder, entries, features_in, features_out, sequence_length):
    """The shard written from ``pack_lm_shard``'s rows: (entry, statistics)."""
    st = stats_mod.ShardStats(features_out)
    chunks, group_size = packed_shard.pack_lm_shard(entries, features_in=features_in, features_out=features_out,
                                                    sequence_length=sequence_length, stats=st)
    entry = writer.write_shard(str(folder), index=0, num_shards=1, features=features_out, examples=chunks,
                               group_size=group_size)
    return entry, st.to_json()


def _compare(tmp_path, lengths, sequence_length, dtype="uint16", seed=0):
    """Writes the shard both ways; asserts equal entries (sha256 of both files) and statistics; returns the entry."""
    entries = _entries(lengths, dtype, seed)
    features = _features(dtype, sequence_length)
    (tmp_path / "reference").mkdir(exist_ok=True)
    (tmp_path / "encoded").mkdir(exist_ok=True)
    want = _write_reference(tmp_path / "reference", entries, *features, sequence_length)
    got = _write_encoded(tmp_path / "encoded", entries, *features, sequence_length)
    assert got == want
    return want[0]


@pytest.mark.parametrize("chunk_bytes", [1, 50, 301, 4 << 20])
@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_a_shard_s_files_and_statistics_are_pack_lm_s(tmp_path, monkeypatch, chunk_bytes, dtype):
    # Chunks of examples from one example (1 byte) to the whole shard: rows cross every kind of boundary.
    monkeypatch.setattr(spill, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(3)
    lengths = rng.choice([0, 1, 31, 32, 33, 100, int(rng.integers(0, 200))], size=300)
    entry = _compare(tmp_path, lengths, 32, dtype)
    assert entry["num_records"] == -(-int(lengths.sum()) // 32) > 100


@pytest.mark.parametrize("lengths, sequence_length, rows", [
    ([64, 64, 1], 64, 3),                 # a short last row in the first chunk: the mean record is smaller
    ([64 * 4095 + 1], 64, 4096),          # the writer's whole first chunk, its last row of 1 token
    ([4 * 4100 + 3], 4, 4101),            # the short last row after the first chunk
    ([0, 0, 0], 8, 0),                    # only empty examples: an empty shard
    ([], 8, 0),                           # no examples
    ([70000, 5, 0, 131072], 1 << 16, 4),  # int32 segment ids
])
def test_group_size_and_edges_are_the_writer_s(tmp_path, lengths, sequence_length, rows):
    entry = _compare(tmp_path, lengths, sequence_length)
    assert entry["num_records"] == rows


def test_group_size_follows_the_first_chunk_of_rows():
    features = _features("uint16", 64)[1]  # a full row: 8 + 64 * 4 bytes
    assert packed_shard.lm_group_size(0, sequence_length=64, features=features) is None
    assert packed_shard.lm_group_size(64 * 5, sequence_length=64, features=features) == fmt.group_size_for(264) == 2
    assert packed_shard.lm_group_size(64 * 2 + 1, sequence_length=64, features=features) == \
        fmt.group_size_for((2 * 264 + 12) / 3) == 4
    assert packed_shard.lm_group_size(64 * writer.FIRST_CHUNK + 1, sequence_length=64, features=features) == 2


def test_features_other_than_one_token_feature_are_refused():
    features_in, features_out = _features("uint16", 8)
    st = stats_mod.ShardStats(features_out)
    with pytest.raises(ValueError, match="lm packing needs one token feature"):
        packed_shard.pack_lm_shard(_entries([3]), features_in=features_in, features_out=features_in,
                                   sequence_length=8, stats=st)


# ------------------------------------------------------------- real builds

def _shard_write(self, shard, entries, examples, group_size, st):
    entry = writer.write_shard(self.out_dir, index=shard, num_shards=self.num_shards, features=self.features_out,
                               examples=examples, group_size=group_size)
    return {"kind": "shard", "shard": shard, "entry": entry, "statistics": st.to_json()}


def _source_stats(self, entries):
    st = stats_mod.ShardStats(self.features_out)
    st.source_examples = len(entries)
    st.truncated_tokens = int(entries.truncated.sum(dtype=np.int64))
    st.add_source_lengths(entries.lengths.reshape(len(entries), len(self.features_in)),
                          [f.name for f in self.features_in])
    return st


CALLS = {"reference": 0, "encoded": 0}


def _write_with_pack_lm(self, shard, entries):
    """``WriteGroup._write`` for ``lm`` packing as ``pack_lm`` packs (the writer encodes each row)."""
    CALLS["reference"] += 1
    st = _source_stats(self, entries)
    stream = ((fmt.decode_example(self.features_in, data), prov) for data, prov in entries.items())

    def rows():
        for row, segments in pack_lm(stream, feature=self.pack_feature, sequence_length=self.pack_length):
            st.add(row, len(segments))
            yield row, [(prov[0], prov[1], offset) for prov, offset in segments]

    return _shard_write(self, shard, entries, rows(), None, st)


def _write_with_pack_lm_shard(self, shard, entries):
    """``WriteGroup._write`` for ``lm`` packing from the encoded examples."""
    CALLS["encoded"] += 1
    st = _source_stats(self, entries)
    examples, group_size = packed_shard.pack_lm_shard(entries, features_in=self.features_in,
                                                      features_out=self.features_out,
                                                      sequence_length=self.pack_length, stats=st)
    return _shard_write(self, shard, entries, examples, group_size, st)


def _build(task, root, sequence_length, exchange):
    result = build_task(task, cache_dir=str(root), exchange=exchange,
                        config=BuildConfig(seed=3, num_shards=3, sequence_length={"targets": sequence_length}))
    names = [*result.manifest.shards.files, *result.manifest.shards.provenance_files]
    digests = [hashlib.sha256(open(os.path.join(result.cache_dir, n), "rb").read()).hexdigest() for n in names]
    data, provenance = fmt.read_shard_checksums(result.cache_dir, result.manifest)
    assert digests == [*data, *provenance]  # what the build recorded
    return digests, result.manifest.statistics.to_json(), result.manifest.shards.num_records.tolist()


@pytest.mark.parametrize("eos, sequence_length, exchange", [(True, 100, "spill"), (False, 16, "runner")])
def test_a_real_build_writes_the_same_shards(tmp_path, corpora, monkeypatch, eos, sequence_length, exchange):
    # tinyshakespeare's lines as bytes, empty lines kept: without EOS they are
    # empty examples; rows of 16 bytes cut most lines into several rows.
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "play.txt").write_text("\n".join(corpora.shakespeare_lines(6000)) + "\n", encoding="utf-8")
    task = lines_task(str(tmp_path / "in" / "*.txt"), "play", eos=eos, packing="lm")
    builds = {"as_is": _build(task, tmp_path / "as_is", sequence_length, exchange)}
    monkeypatch.setattr(transforms.WriteGroup, "_write", _write_with_pack_lm)
    before = dict(CALLS)
    builds["reference"] = _build(task, tmp_path / "reference", sequence_length, exchange)
    monkeypatch.setattr(transforms.WriteGroup, "_write", _write_with_pack_lm_shard)
    monkeypatch.setattr(spill, "CHUNK_BYTES", 2000)  # chunk boundaries all through each shard
    builds["encoded"] = _build(task, tmp_path / "encoded", sequence_length, exchange)
    assert CALLS["reference"] - before["reference"] == 3 and CALLS["encoded"] - before["encoded"] == 3
    digests, statistics, num_records = builds["reference"]
    assert min(num_records) > 300 and len(set(digests)) == 6
    assert statistics["segments"] > statistics["examples"]
    assert builds["encoded"] == builds["reference"]
    assert builds["as_is"] == builds["reference"]
